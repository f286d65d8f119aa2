"""The sections of REPORT.md, one per suite, and the formatting they share: pure
functions from a suite's figures to markdown lines (:mod:`bench.report` assembles them).

Each section is the suite's table, its plot, how it was measured and the policy it ran
with, so a reader can check a figure without opening the code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from bench.figures import (
    PEER_DISK_COLUMNS,
    PEER_FIO,
    PEER_LOADER,
    PEER_TMPFS_COLUMNS,
    CapsResult,
    EnvelopeResult,
    FairshareResult,
    IsolationResult,
    LiveChangeResult,
    LoaderResult,
    MetadataResult,
    OverheadResult,
    PeerResult,
    PrioritiesResult,
    StorageResult,
)

MiB = float(1 << 20)
Plots = Mapping[str, str]  # plot name -> its file, for the plots drawn in this run

# DESIGN §4 targets
MACHINERY_MIN = 0.95  # policy / no-qos throughput: the QoS machinery costs <= 5%
CAP_LONG_PCT, CAP_1S_PCT = 2.0, 10.0
ISO_THROUGHPUT, ISO_P99 = 0.90, 1.20
LIVE_MS = 100.0
CTL_STATUS_MS = 60.0  # issue 38: `qosfs ctl status`, the whole command, median of 10
SHARE_PCT = 10.0  # fair share and priorities: the 1 s cap tolerance, applied to shares


def mib(v: float | None) -> str:
    return "—" if v is None else f"{v / MiB:,.0f} MiB/s" if v >= 100 * MiB else \
        f"{v / MiB:.1f} MiB/s"


def ops(v: float | None) -> str:
    return "—" if v is None else f"{v / 1e3:.1f}k ops/s" if v >= 1e4 else f"{v:,.0f} ops/s"


def us(v: float | None) -> str:
    return "—" if v is None else f"{v / 1e3:.2f} ms" if v >= 1e3 else f"{v:.0f} µs"


def ratio(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}×"


def pct(v: float | None, signed: bool = True) -> str:
    return "—" if v is None else f"{v:+.1f}%" if signed else f"{v:.0f}%"


def verdict(ok: bool | None, miss: str = "") -> str:
    if ok is None:
        return "—"
    return "pass" if ok else f"**MISS**{' ' + miss if miss else ''}"


def _num(v: float | None, fmt: str) -> str:
    return "—" if v is None else fmt.format(v)


def _share(v: float | None, of: float | None) -> str:
    """*v* as a ratio to *of* ("—" when either is unknown)."""
    return ratio(v / of if v is not None and of else None)


def _value(metric: str, v: float | None) -> str:
    return mib(v) if metric == "bw" else ops(v)


def table(header: list[str], rows: list[list[str]], align: str = "") -> list[str]:
    """A markdown table; *align* is the separator row (default: first column left, the
    rest right)."""
    spec = align or "|".join(["---"] + ["---:"] * (len(header) - 1))
    return ["| " + " | ".join(header) + " |", f"|{spec}|",
            *("| " + " | ".join(r) + " |" for r in rows)]


def plot(plots: Plots, name: str, alt: str) -> list[str]:
    return [f"![{alt}]({plots[name]})", ""] if name in plots else []


def _policy_block(text: str) -> list[str]:
    return ["<details><summary>policy</summary>", "", "```toml", text, "```", "",
            "</details>", ""]


def section_overhead(plots: Plots, r: OverheadResult) -> list[str]:
    rows = []
    for s in r.summary:
        rt = s.ratio_to_native
        if s.error:
            rows.append([s.label, f"error: {s.error}", *[""] * 8])
            continue
        rows.append([
            s.label, *(_value(s.metric, s.side(k)) for k in ("native", "no-qos", "policy")),
            ratio(rt.get("no-qos")), ratio(rt.get("policy")), ratio(s.machinery),
            " / ".join(us(s.side(k, "clat_p99_us")) for k in ("native", "no-qos", "policy")),
            " / ".join(pct(s.side(k, "daemon_cpu_pct"), False) for k in ("no-qos", "policy"))])
    reps = max((s.sides["native"].reps for s in r.summary if "native" in s.sides), default=0)
    return [
        "## 1. Overhead: native vs qosfs `--no-qos` vs qosfs with a policy", "",
        *plot(plots, "overhead", "overhead ratios"),
        *table(["workload", "native", "no-qos", "policy", "no-qos / native",
                 "policy / native", "policy / no-qos", "p99 native / no-qos / policy",
                 "daemon CPU no-qos / policy"], rows),
        "",
        f"Median of {reps} repetition(s) per side after one discarded warm-up run per side, "
        "sides in rotating order, caches dropped before every run. `native` is the scratch "
        "directory itself (tmpfs: a memory-speed baseline, so the ratios are the "
        "pass-through's whole cost; disk: what a real device leaves of it). "
        "`policy / no-qos` is the cost of the QoS machinery: every class capped far above "
        "demand, so each request is charged at every level and none waits (target ≥ "
        f"{MACHINERY_MIN}). Daemon CPU: its CPU time / wall time (100% = one core). "
        "MiB/s = 2^20 bytes/s.", "",
        *_policy_block(r.policy),
    ]


def section_caps(plots: Plots, r: CapsResult) -> list[str]:
    rows = []
    for w in r.workloads:
        show = mib if w.key.endswith("bandwidth") else ops
        for lv in w.levels:
            if not lv.windows or lv.worst_long_pct is None or lv.worst_1s_pct is None:
                rows.append([f"`{w.key}`", w.label, lv.level, show(w.demand),
                             "no steady windows", "", "", "", "", "—"])
                continue
            ok = abs(lv.worst_long_pct) <= CAP_LONG_PCT and \
                abs(lv.worst_1s_pct) <= CAP_1S_PCT
            rows.append([f"`{w.key}`", w.label, lv.level, show(w.demand),
                         show(lv.achieved),
                         f"{pct(lv.worst_long_pct)} ({lv.long_window_s or 0:.0f} s)",
                         pct(lv.worst_1s_pct),
                         f"{lv.windows} ({lv.idle_windows})",
                         show(lv.fio_rate),
                         verdict(ok) if lv.has_demand else "no demand: uncapped rate "
                         "< 1.1× cap"])
    return [
        "## 2. Cap accuracy: achieved vs configured", "",
        *plot(plots, "caps", "per-second rate / cap"),
        *table(["limit", "workload", "cap", "uncapped demand", "achieved (steady)",
                 "worst long window", "worst 1 s", "1 s windows (none waited)",
                 "fio average", "result"], rows),
        "",
        f"Each workload runs first uncapped (its demand, this run's baseline) then at each "
        f"cap, set live with `qosfs ctl set`, {r.runtime_s} s per run. Achieved = the "
        "class's admitted bytes or ops from the daemon's counters, polled every second; the "
        "first window of each run is **discarded** (it holds the bucket's burst, 100 ms of "
        "the cap by default) and so is the last (the job ends inside it). Long window = "
        "every run of consecutive windows lasting 10 s (shorter in quick mode, as shown); "
        f"targets ±{CAP_LONG_PCT:.0f}% over 10 s, ±{CAP_1S_PCT:.0f}% per 1 s. \"None "
        "waited\": windows in which no request waited for tokens, so the class had no "
        "excess demand there (its clients left gaps: a busy machine); they are counted in "
        "the worst figures all the same. fio average: the client's view over the whole "
        "run, burst included.", "",
        *_policy_block(r.policy),
    ]


def section_isolation(plots: Plots, r: IsolationResult) -> list[str]:
    rows = []
    for s in r.summary:
        capped = s.scenario.startswith("storm cap")
        ok = None
        if capped and s.bw_bytes_ratio is not None and s.clat_p99_us_ratio is not None:
            ok = s.bw_bytes_ratio >= ISO_THROUGHPUT and s.clat_p99_us_ratio <= ISO_P99
        rows.append([s.scenario + (" **(headline)**" if s.scenario ==
                                      f"storm cap {r.headline_cap}" else ""),
                     mib(s.bw_bytes), pct(None if s.bw_bytes_ratio is None
                                             else 100 * s.bw_bytes_ratio, False),
                     us(s.clat_p50_us), us(s.clat_p99_us), ratio(s.clat_p99_us_ratio),
                     us(s.clat_p999_us), mib(s.storm_bw),
                     pct(s.daemon_cpu_pct, False), pct(s.machine_busy_pct, False),
                     verdict(ok) if capped else "baseline" if s.scenario.startswith("solo")
                     else "contrast"])
    cost = [[c.cap or "none (64GiB/s)", mib(c.storm_bw),
             pct(c.daemon_cpu_pct, False), f"{c.daemon_ms_per_mib:.2f} ms"]
            for c in r.write_cost]
    out = [
        "## 3. Isolation: a dataset reader next to a checkpoint storm", "",
        *plot(plots, "isolation", "reader throughput and p99 vs solo"),
        *table(["scenario", "reader", "of solo", "p50", "p99", "p99 / solo", "p99.9",
                "checkpoint writers", "daemon CPU", "machine busy", "result"], rows),
        "",
        f"Reader: dataset.fio, {r.reader_env['NUMJOBS']} jobs at queue depth 1, random "
        f"4 KiB–1 MiB O_DIRECT reads over {r.reader_env['NRFILES']} files, "
        f"{r.reader_env['RUNTIME']} s. Storm: checkpoint-storm.fio, "
        f"{r.storm_env['NUMJOBS']} writers, 1 MiB sequential, fsync at the end, started "
        "1 s before the reader and ending after it. Each scenario is compared with the solo "
        "reader on the same kind of mount (`solo no-qos` or `solo policy`); medians over "
        "repetitions. Targets (DESIGN §4.3): ≥ "
        f"{100 * ISO_THROUGHPUT:.0f}% of solo throughput, p99 ≤ {ISO_P99}× solo. Headline "
        f"cap {r.headline_cap}, chosen for this 2-CPU machine before the run: the daemon "
        "is one Python thread that both classes share, so the checkpoints may only have "
        "what the solo reader leaves of it" + _budget(r) + "; the sweep "
        f"({', '.join(r.sweep)}) shows the trade-off. Daemon CPU: 100% = one core; "
        "machine busy: both CPUs, 100% = all.", "",
    ]
    if cost:
        out += ["What a checkpoint MiB costs the daemon (the storm alone, same mount):", "",
                *table(["checkpoints cap", "written", "daemon CPU", "daemon CPU per MiB"],
                       cost), ""]
    out += ["### Through periodic checkpoint bursts (mixed.fio)", "",
            *plot(plots, "isolation-burst", "class rates through checkpoint bursts")]
    brow = []
    for b in r.bursts:
        d, q = b.reader_during, b.reader_between
        brow.append([b.cap or "no cap (classes only)", mib(q), mib(d),
                     pct(None if d is None or not q else 100 * d / q, False),
                     us(b.reader.clat_p99_us), mib(b.checkpoint.bw_bytes)])
    out += [*table(["checkpoints cap", "reader between bursts", "reader during bursts",
                     "during / between", "reader p99 (whole run)",
                     "checkpoint average"], brow), "",
            "Rates of both classes from the daemon's counters every 0.5 s; \"during\" = "
            "windows in which checkpoints moved data.", "", *_policy_block(r.policy)]
    return out


def _budget(r: IsolationResult) -> str:
    """This run's figures behind the headline cap, as a clause."""
    solo = next((s for s in r.summary if s.scenario == "solo policy"), None)
    cost = next((c for c in r.write_cost if c.cap == r.headline_cap), None)
    if not solo or not cost or solo.daemon_cpu_pct is None:
        return ""
    return (f" (in this run the solo reader kept the daemon {solo.daemon_cpu_pct:.0f}% "
            f"busy, and a MiB admitted at {r.headline_cap} cost it "
            f"{cost.daemon_ms_per_mib:.1f} ms of CPU)")


def section_live(plots: Plots, r: LiveChangeResult) -> list[str]:
    rows = [[m, str(s.n), f"{s.median_delay_ms:.1f} ms", f"{s.max_delay_ms:.1f} ms"]
            for m, s in r.summary.items()]
    step = r.step
    srows = [[f"{c.at_s:.1f} s", f"{c.from_} → {c.to}",
              "never" if c.settle_ms is None else f"{c.settle_ms:.0f} ms",
              verdict(c.settle_ms is not None and c.settle_ms < LIVE_MS)]
             for c in step.changes]
    return [
        "## 4. Live change: `qosfs ctl set` in force", "",
        *plot(plots, "live-change", "writer rate around ctl set"),
        *table(["method", "n", "median delay", "max delay"], rows), "",
        f"Parked writer: cap {r.low} (a 1 MiB write waits ~1 s), raised to {r.high}; "
        "delay = from sending the request until the parked write completes. `cli-set` "
        "counts from the start of a `qosfs ctl set` process, as a shell starts it: "
        "starting Python and the client are in it. Like an operator's command it starts "
        "after seconds in which this process idled (the writer parked); the `ctl status` "
        "runs below are back to back (on a busy VM a start after idling was the slower)."
        + ("" if r.all_parked else " **Some repetitions found no parked write.**"), "",
        *_ctl_status(r),
        *table(["at", "change", "new rate holds after", f"< {LIVE_MS:.0f} ms"], srows), "",
        f"Step: one writer, {step.block >> 10} KiB writes, cap stepped by `set` (burst "
        "1 MiB); \"holds\" = from sending the change until the first write after which the "
        "next 0.5 s moves the new cap within ±10%. Rates in the plot: "
        f"{1000 * step.bin_s:.0f} ms bins of the writer's own completions.", "",
    ]


def _ctl_status(r: LiveChangeResult) -> list[str]:
    st = r.ctl_status
    if st is None:
        return []
    return [f"`qosfs ctl status` against the same mount, the whole command (start to exit), "
            f"{st.n} runs: median {st.median_ms:.1f} ms, max {st.max_ms:.1f} ms "
            f"(≤ {CTL_STATUS_MS:.0f} ms: {verdict(st.median_ms <= CTL_STATUS_MS)}); the "
            f"interpreter alone (`python -c pass`), interleaved with them: median "
            f"{st.python_median_ms:.1f} ms; the machine was {st.busy_before_pct:.0f}% busy "
            "just before. Both run as the installed launcher runs qosfs (`python -P -m "
            "qosfs`), bytecode compiled; `cli-set` too, each after waiting (at most "
            "`--quiet-wait` s) for the machine to be quiet.", ""]


def section_fair(plots: Plots, r: FairshareResult) -> list[str]:
    rows = []
    for p in r.phases:
        rows.append([str(p.phase), ", ".join(str(u) for u in p.active), mib(p.share),
                     ", ".join(mib(v) for v in p.achieved.values()), pct(p.worst_pct),
                     mib(p.total)])
    return [
        "## 5. Fair share: three users in a `per_user = \"fair\"` class", "",
        *plot(plots, "fairshare", "per-user rates"),
        *table(["phase", "active uids", "equal share", "achieved per uid", "worst error",
                 "class total"], rows), "",
        f"Class capped at {r.cap}; each uid runs one 1 MiB sequential writer as itself "
        f"(setpriv), phases of {r.phase_s} s. Per-uid rates from the daemon's per-user "
        "levels every 0.5 s; the first second of each phase is discarded (a newcomer's fio "
        "start-up), and after a departure the first "
        f"{r.idle_after_s + 1:.0f} s: a user who stops keeps its share until idle for "
        f"`idle_after` = {r.idle_after_s:.0f} s, by design.", "",
        *_policy_block(r.policy),
    ]


def machinery_share(r: MetadataResult) -> dict[str, float]:
    """Per operation: 1 - (what the policy adds in-process, bench.machinery) x (the rate
    of the --no-qos mount), i.e. the policy / no-qos throughput that cost alone leaves."""
    rates = {s.key: s.side("no-qos") for s in r.summary}
    out = {}
    for op, fig in (r.in_process.ops if r.in_process else {}).items():
        rate = rates.get(op)
        if rate:
            out[op] = 1.0 - fig.added_us * 1e-6 * rate
    return out


def section_meta(plots: Plots, r: MetadataResult) -> list[str]:
    rows = []
    share = machinery_share(r)
    for s in r.summary:
        rt = s.ratio_to_native
        rows.append([s.label, *(ops(s.side(k)) for k in ("native", "no-qos", "policy",
                                                          "meta-cap")),
                     ratio(rt.get("no-qos")), ratio(s.over("no-qos-2", "no-qos")),
                     ratio(s.machinery), ratio(share.get(s.key)),
                     ratio(s.over("meta-cap", "no-qos"))])
    inproc = r.in_process
    mrows = [[op, f"{f.no_qos_us:.1f} µs", f"{f.policy_us:.1f} µs",
              f"{f.added_us:+.1f} µs"] for op, f in (inproc.ops if inproc else {}).items()]
    return [
        "## 6. Metadata: create / stat / open / unlink", "",
        *plot(plots, "metadata", "metadata ops/s"),
        *table(["operation", "native", "no-qos", "policy", f"meta_iops={r.meta_cap}",
                 "no-qos / native", "no-qos again / no-qos", "policy / no-qos",
                 "policy / no-qos from in-process cost", "capped / no-qos"], rows), "",
        "`no-qos again`: a second `--no-qos` mount, the same pass-through: how far two "
        "identical mounts differ in this run. Where that is more than 5%, `policy / no-qos` "
        "of mount rates cannot show a 5% cost; `from in-process cost` can: the handler "
        "time the policy adds per operation (below) times the `--no-qos` rate.", "",
        *table(["operation (FUSE requests)", "no-qos", "policy", "added by the policy"],
               mrows), "",
        f"In-process (`bench/machinery.py`): the filesystem's handlers called directly on "
        f"the scratch tmpfs, {inproc.files if inproc else '?'} files per operation, median of "
        f"{inproc.rounds if inproc else '?'} alternating rounds; create = lookup + create + "
        "release, stat = lookup, open = lookup + open + read + release, unlink = lookup + "
        "unlink.", "",
        f"meta.fio, {r.nrfiles} files of 4 KiB, one job, each operation cold (fio sleeps "
        "1.5 s after its set-up so the kernel's 1 s attribute cache has expired). fio counts "
        "files per second; one file operation is one to three FUSE metadata requests "
        "(lookup, create, open, unlink...), each of which costs a `meta_iops` token, so "
        "the capped column shows what a cap means per operation (short runs: the bucket's "
        "burst, 100 ms of the cap, adds to it). Whether the cap holds is in §2 "
        "(`meta_iops` rows).", "",
        *_policy_block(r.policy),
    ]


def section_prio(plots: Plots, r: PrioritiesResult) -> list[str]:
    rows = []
    for sc in r.scenarios:
        for c in sc.classes:
            ok = None if c.error_backend_pct is None else \
                abs(c.error_backend_pct) <= SHARE_PCT
            rows.append([sc.name, f"{c.class_} (weight {r.weights[c.class_]})",
                         mib(c.expected), mib(c.achieved), pct(c.error_pct),
                         pct(c.error_backend_pct), verdict(ok)])
    return [
        "## 7. Priorities and minimums on a declared backend", "",
        *plot(plots, "priorities", "achieved vs expected shares"),
        *table(["scenario", "class", "expected", "achieved", "error", "error, % of backend",
                 "result"], rows), "",
        f"`[backend] write_bandwidth = \"{r.backend}\"`; each class runs {r.writers} 1 MiB "
        f"sequential writers for {r.runtime_s} s (each class alone could exceed the "
        "backend). Expected = max(minimum, weighted share), shared again among the others "
        "when a minimum binds. Achieved: the classes' admitted bytes over the steady windows "
        "of the backend level (first and last second discarded).", "",
        *_policy_block(r.policy),
    ]


def section_loader(plots: Plots, r: LoaderResult) -> list[str]:
    sm = r.summary
    rows = []
    for kind, what in (("cold", "data loader, cold"), ("cached", "data loader, cached")):
        for side in ("native", "no-qos", "policy"):
            f = sm[side][kind]
            rows.append([what, side, _num(f.samples_per_s, "{:,.0f}"), f"{f.mb_per_s:,.0f}",
                         _num(f.p50_ms, "{:.2f} ms"), _num(f.p99_ms, "{:.2f} ms"),
                         _share(f.samples_per_s, sm["native"][kind].samples_per_s)])
    for side in ("native", "no-qos", "policy"):
        f = sm[side]["reread"]
        rows.append([f"cached re-read of {r.big_mib} MiB", side, "—",
                     f"{f.mb_per_s:,.0f}", "—", "—",
                     _share(f.mb_per_s, sm["native"]["reread"].mb_per_s)])
    return [
        "## Data loader: samples through the mount", "",
        *table(["workload", "side", "samples/s", "MB/s", "p50 per sample", "p99",
                "of native"], rows), "",
        f"An epoch: {r.workers} processes open, read whole and close each of "
        f"{r.samples} samples of 64-512 KiB under `data/` once, in a shuffled order; "
        f"median of {r.reps} rotating repetitions. `cold`: the first epoch after caches "
        "were dropped (the native tmpfs keeps its pages, the mounts do not); `cached`: the "
        "next epoch. `policy` is the embedded default policy (datasets trust names and "
        "attributes for 60 s).", "",
    ]


def section_storage(plots: Plots, r: StorageResult) -> list[str]:
    rows = []
    for side, f in r.sides.items():
        alone, mixed = f.alone, f.with_storm
        rows.append([side, f"{alone.mb_per_s:,.0f}", f"{alone.p99_ms:.2f} ms",
                     f"{mixed.mb_per_s:,.0f}", f"{mixed.p99_ms:.2f} ms",
                     ratio(mixed.mb_per_s / alone.mb_per_s),
                     ratio(mixed.p99_ms / alone.p99_ms),
                     f"{f.storm.mb_per_s:,.0f}", f"{f.storm_alone.mb_per_s:,.0f}"])
    return [
        "## Storage-bound: reader and storm on one disk", "",
        *table(["side", "reader alone MB/s", "p99", "with storm MB/s", "p99",
                "kept", "p99 × alone", "storm MB/s (with reader)", "storm alone"], rows), "",
        "dataset.fio (2 jobs, O_DIRECT random 4 KiB-1 MiB reads) and checkpoint-storm.fio "
        "(4 writers, 1 MiB, fsync at the end) on the disk area; `bare` is the directory "
        f"itself. Targets for `policy`: kept ≥ {r.reader_keeps_target}, p99 ≤ "
        f"{r.p99_target}× alone, and more than `bare` under the storm.", "",
    ]


def section_envelope(plots: Plots, r: EnvelopeResult) -> list[str]:
    sm = r.summary
    labels = {"randread_4k_1job_iops": "4 KiB random reads, QD1 (IOPS)",
              "randread_4k_4job_iops": "4 KiB random reads, 4 jobs (IOPS)",
              "read_1m_2job_gb_per_s": "1 MiB direct reads, 2 jobs (GB/s)",
              "create_per_s": "create (per s)", "stat_per_s": "stat (per s)",
              "delete_per_s": "unlink (per s)"}

    def cell(side: str, key: str) -> str:
        values = sm.get(side, {}).get(key)
        if not values:
            return "—"
        fmt = "{:.2f}" if key.endswith("gb_per_s") else "{:,.0f}"
        return " / ".join(fmt.format(v) for v in values)

    rows = [[label, cell("policy", k), cell("no-qos", k), cell("null", k)]
            for k, label in labels.items()]
    return [
        "## Envelope: what one mount carries", "",
        *table(["what", "default policy", "--no-qos", "do-nothing pyfuse3"], rows), "",
        f"tmpfs source; fio, {r.seconds} s per figure, {r.reps} repetitions shown "
        f"apart; meta.fio with {r.files} files. The do-nothing pyfuse3 filesystem is "
        "the floor: what pyfuse3's request loop and the kernel cost without any work.", "",
    ]


PEER_COLUMNS = {"native": "native", "hp-single": "passthrough_hp 1 thread",
                "hp-multi": "passthrough_hp, libfuse's threads",
                "hp-passthrough": "passthrough_hp 1 thread, kernel passthrough",
                "no-qos": "qosfs --no-qos", "policy": "qosfs default policy (datasets)"}
PEER_ROWS = {"randread_4k_qd1_iops": "4 KiB random read, QD1 (IOPS)",
             "randread_4k_4jobs_iops": "4 KiB random read, 4 jobs (IOPS)",
             "randread_128k_qd1_mb_s": "128 KiB random read, QD1 (MB/s)",
             "read_1m_direct_mb_s": "1 MiB sequential O_DIRECT (MB/s)",
             "loader_cold_files_s": "small-file loader, cold (files/s)",
             "loader_warm_files_s": "small-file loader, warm (files/s)"}


def peer_ratio(table: dict[str, dict[str, float]], key: str, column: str,
               base: str = "native") -> float | None:
    """*column*'s figure for *key* over *base*'s, when both were measured."""
    got, of = table.get(column, {}).get(key), table.get(base, {}).get(key)
    return got / of if got is not None and of else None


def _peer_figure(key: str, v: float) -> str:
    if key.endswith("_mb_s"):
        return f"{v:,.0f}"
    return f"{v / 1e3:,.0f}k" if v >= 1e5 else f"{v / 1e3:.1f}k" if v >= 1e4 else f"{v:,.0f}"


def _peer_table(figures: dict[str, dict[str, float]], columns: tuple[str, ...],
                keys: tuple[str, ...], base_label: str, busy: dict[str, float]) -> list[str]:
    rows = []
    for key in keys:
        cells = [PEER_ROWS[key]]
        for column in columns:
            v = figures.get(column, {}).get(key)
            r = peer_ratio(figures, key, column)
            cells.append("—" if v is None else _peer_figure(key, v) if column == "native"
                         or r is None else f"{_peer_figure(key, v)} ({r:.2f}×)")
        rows.append(cells)
    if busy:
        rows.append(["machine busy before the column (other tenants)"] +
                    [pct(busy.get(c), signed=False) for c in columns])
    header = ["workload", *(base_label if c == "native" else PEER_COLUMNS[c] for c in columns)]
    return table(header, rows)


def section_peer(plots: Plots, r: PeerResult) -> list[str]:
    notes = []
    if r.peer is None:
        notes.append(f"passthrough_hp was not measured: {r.peer_missing}.")
    elif r.peer_passthrough is not None:
        notes.append("passthrough_hp's kernel passthrough column: "
                     + ("its daemon served no reads (passed through)." if r.peer_passthrough
                        else "its reads still reached the daemon (passthrough refused or "
                        "not negotiated)."))
    notes += [f"Not measured, {where}: {why}." for where, why in r.errors.items()]
    if r.qosfs_passthrough is None:
        notes.append("qosfs's `ctl status` has no `passthrough` entry: every qosfs read "
                     "went through the daemon.")
    else:
        notes += [f"qosfs `ctl status` passthrough, {where}: `{json.dumps(entry)}`"
                  for where, entry in sorted(r.qosfs_passthrough.items())]
    return [
        "## A peer: libfuse's passthrough_hp beside native and qosfs", "",
        f"tmpfs source; fio psync, O_DIRECT, {r.seconds} s per job, on one file under "
        f"`data/`; small-file loader: {r.tmpfs_workers} processes reading "
        f"{r.tmpfs_files:,} × {r.tmpfs_file_kib} KiB files. In brackets: the ratio to "
        "native.", "",
        *_peer_table(r.tmpfs, PEER_TMPFS_COLUMNS, PEER_FIO + PEER_LOADER, "native",
                     r.busy_pct.get("tmpfs", {})), "",
        f"Disk ({r.disk or 'no disk area'}; the run's --disk-dir): {r.disk_files:,} × "
        f"{r.disk_file_kib} KiB files, {r.disk_workers} reader processes, page cache "
        "dropped before the cold pass. In brackets: the ratio to bare.", "",
        *_peer_table(r.disk_figures, PEER_DISK_COLUMNS, PEER_LOADER, "bare",
                     r.busy_pct.get("disk", {})), "",
        "Each column is mounted fresh over the same files and measured once, after waiting "
        "(up to --quiet-wait s) for the machine to be idle; \"machine busy\" is every "
        "CPU's busy share over the last 0.25 s of that wait (100% = all CPUs), nothing of "
        "the suite's running: a column that ran while other tenants were busy shows it. "
        "`cold`: the "
        "first pass after the daemon started and caches were dropped; `warm`: the next. "
        f"passthrough_hp ({r.peer or 'not built'}) is libfuse's C++ example, built from "
        "the same source as the library pyfuse3 is linked to (`make passthrough-hp`); "
        "without kernel passthrough it runs `--nopassthrough`.", "",
        *(f"- {n}" for n in notes), "",
    ]
