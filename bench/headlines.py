"""The headline rows of REPORT.md, per suite: each guarantee's figure against its
target (DESIGN §4), as (what, figure, target, result). Pure functions of a suite's
figures; the training suite's rows live with its section (bench/training_report.py).
"""

from __future__ import annotations

from bench.figures import (
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
from bench.sections import (
    CAP_1S_PCT,
    CAP_LONG_PCT,
    CTL_STATUS_MS,
    ISO_P99,
    ISO_THROUGHPUT,
    LIVE_MS,
    MACHINERY_MIN,
    SHARE_PCT,
    machinery_share,
    pct,
    peer_ratio,
    ratio,
    verdict,
)

Rows = list[list[str]]


def overhead(ov: OverheadResult) -> Rows:
    rows = [[f"pass-through cost, {s.label}: no-qos / native",
             ratio(s.ratio_to_native.get("no-qos")), "—", ""]
            for s in ov.summary if s.key in ("dataset", "disk-dataset", "checkpoint")]
    mach = [s.machinery for s in ov.summary if s.machinery is not None]
    if mach:
        worst = min(mach)
        rows.append(["QoS machinery: policy (caps far above demand) / no-qos, worst workload",
                     ratio(worst), f"≥ {MACHINERY_MIN}",
                     verdict(worst >= MACHINERY_MIN,
                             f"by {100 * (MACHINERY_MIN - worst):.1f} points")])
    return rows


def caps(r: CapsResult) -> Rows:
    levels = [lv for w in r.workloads for lv in w.levels if lv.windows and lv.has_demand]
    longs = [lv.worst_long_pct for lv in levels if lv.worst_long_pct is not None]
    ones = [lv.worst_1s_pct for lv in levels if lv.worst_1s_pct is not None]
    spans = [lv.long_window_s for lv in levels if lv.long_window_s is not None]
    if not longs or not ones or not spans:
        return []
    long, one = max(longs, key=abs), max(ones, key=abs)
    return [[f"cap accuracy, worst {min(spans):.0f} s window ({len(levels)} caps)", pct(long),
             f"±{CAP_LONG_PCT:.0f}% over 10 s", verdict(abs(long) <= CAP_LONG_PCT)],
            ["cap accuracy, worst 1 s window", pct(one), f"±{CAP_1S_PCT:.0f}%",
             verdict(abs(one) <= CAP_1S_PCT)]]


def isolation(iso: IsolationResult) -> Rows:
    rows: Rows = []
    head, free = iso.row(f"storm cap {iso.headline_cap}"), iso.row("storm no-qos")
    if head and head.bw_bytes_ratio is not None:
        tp, p99 = head.bw_bytes_ratio, head.clat_p99_us_ratio
        rows.append([f"isolation, checkpoints capped at {iso.headline_cap}: reader "
                     "throughput vs solo", pct(100 * tp, False), f"≥ {100 * ISO_THROUGHPUT:.0f}%",
                     verdict(tp >= ISO_THROUGHPUT,
                             f"by {100 * (ISO_THROUGHPUT - tp):.0f} points")])
        rows.append(["isolation, same: reader p99 vs solo", ratio(p99), f"≤ {ISO_P99}×",
                     verdict(p99 is not None and p99 <= ISO_P99)])
    if free and free.bw_bytes_ratio is not None:
        rows.append(["isolation without QoS (--no-qos): reader throughput, p99",
                     f"{100 * free.bw_bytes_ratio:.0f}%, {ratio(free.clat_p99_us_ratio)}",
                     "(contrast)", ""])
    return rows


def live_change(live: LiveChangeResult) -> Rows:
    rows: Rows = []
    s = live.summary.get("set")
    if s:
        rows.append(["live change: parked write released after `set`, worst",
                     f"{s.max_delay_ms:.1f} ms", f"< {LIVE_MS:.0f} ms",
                     verdict(s.max_delay_ms < LIVE_MS)])
    cli = live.summary.get("cli-set")
    if cli:
        rows.append(["live change: `qosfs ctl set` from its start to the parked write "
                     "released, worst", f"{cli.max_delay_ms:.0f} ms (median "
                     f"{cli.median_delay_ms:.0f})", f"< {LIVE_MS:.0f} ms",
                     verdict(cli.max_delay_ms < LIVE_MS)])
    st = live.ctl_status
    if st:
        rows.append([f"`qosfs ctl status`, the whole command, median of {st.n}",
                     f"{st.median_ms:.0f} ms (python alone {st.python_median_ms:.0f})",
                     f"≤ {CTL_STATUS_MS:.0f} ms", verdict(st.median_ms <= CTL_STATUS_MS)])
    settles = [c.settle_ms for c in live.step.changes]
    worst = None if None in settles else max(s for s in settles if s is not None)
    rows.append(["live change: new rate holds (±10% over 0.5 s) after `set`, worst",
                 "never" if worst is None else f"{worst:.0f} ms", f"< {LIVE_MS:.0f} ms",
                 verdict(worst is not None and worst < LIVE_MS)])
    return rows


def fairshare(fair: FairshareResult) -> Rows:
    errs = [p.worst_pct for p in fair.phases if p.worst_pct is not None]
    if not errs:
        return []
    w = max(errs, key=abs)
    return [["fair share, 3 uids: worst per-user error vs equal split", pct(w),
             f"±{SHARE_PCT:.0f}%", verdict(abs(w) <= SHARE_PCT)]]


def metadata(meta: MetadataResult) -> Rows:
    nat = {s.key: s.ratio_to_native.get("no-qos") for s in meta.summary}
    rows = [["metadata, no-qos / native (create, stat, open, unlink)",
             ", ".join(ratio(nat.get(k)) for k in ("create", "stat", "open", "unlink")),
             "—", ""]]
    mach = [s.machinery for s in meta.summary if s.machinery is not None]
    twins = [s.over("no-qos-2", "no-qos") for s in meta.summary]
    spread = max((abs(t - 1.0) for t in twins if t is not None), default=None)
    if mach:
        worst = min(mach)
        ok: bool | None = worst >= MACHINERY_MIN
        if not ok and spread is not None and spread > 1.0 - MACHINERY_MIN:
            ok = None  # two identical mounts differ by more than the margin
        rows.append(["QoS machinery on metadata, mount rates: policy (every request "
                     "charged to meta_iops) / no-qos, worst operation"
                     + (f" (two identical no-qos mounts differ by up to "
                        f"{100 * spread:.0f}%)" if spread is not None else ""),
                     ratio(worst), f"≥ {MACHINERY_MIN}",
                     verdict(ok) if ok is not None else "inconclusive"])
    share = machinery_share(meta)
    if share:
        worst_op = min(share, key=lambda k: share[k])
        rows.append(["QoS machinery on metadata, in-process: 1 − added handler time × "
                     f"no-qos rate, worst operation ({worst_op})", ratio(share[worst_op]),
                     f"≥ {MACHINERY_MIN}", verdict(share[worst_op] >= MACHINERY_MIN)])
    return rows


def priorities(prio: PrioritiesResult) -> Rows:
    errs = [c.error_backend_pct for sc in prio.scenarios for c in sc.classes
            if c.error_backend_pct is not None]
    if not errs:
        return []
    w = max(errs, key=abs)
    return [[f"priorities/minimums, backend {prio.backend}: worst error vs expected "
             "share, in % of the backend", pct(w), f"±{SHARE_PCT:.0f}%",
             verdict(abs(w) <= SHARE_PCT)]]


LOADER_GAIN = 2.0  # issue targets against the figures before keep_cache / timeouts
RE_READ_MIN = 0.9


def loader(r: LoaderResult) -> Rows:
    sm = r.summary
    rows = []
    for kind in ("cold", "cached"):
        got, native = sm["policy"][kind].samples_per_s, sm["native"][kind].samples_per_s
        rows.append([f"data loader {kind}, default policy: samples/s (native "
                     f"{native or 0:,.0f})", f"{got or 0:,.0f}", "—", ""])
    re_read = sm["policy"]["reread"].mb_per_s / sm["native"]["reread"].mb_per_s
    rows.append(["cached re-read, default policy / native", ratio(re_read),
                 f"≥ {RE_READ_MIN}", verdict(re_read >= RE_READ_MIN)])
    return rows


def storage(r: StorageResult) -> Rows:
    """None: its targets are in its section, measured against the bare directory."""
    return []


def envelope(r: EnvelopeResult) -> Rows:
    """None: what one mount carries is a capacity figure, not a guarantee."""
    return []


PEER_NATIVE_MIN = 0.8  # issue 30: the passthrough class reaches 0.8x native on tmpfs


def peer(r: PeerResult) -> Rows:
    """qosfs against native and against libfuse's single-threaded passthrough_hp."""
    qd1 = peer_ratio(r.tmpfs, "randread_4k_qd1_iops", "policy")
    rows = [["peer (tmpfs): qosfs default policy / native, 4 KiB random read QD1",
             ratio(qd1), f"≥ {PEER_NATIVE_MIN}",
             verdict(None if qd1 is None else qd1 >= PEER_NATIVE_MIN)]]
    for where, table in (("tmpfs", r.tmpfs), ("disk", r.disk_figures)):
        cold = peer_ratio(table, "loader_cold_files_s", "policy", "hp-single")
        rows.append([f"peer ({where}): qosfs default policy / passthrough_hp 1 thread, "
                     "small-file loader cold", ratio(cold), "≥ 1",
                     verdict(None if cold is None else cold >= 1.0)])
    return rows
