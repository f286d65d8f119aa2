"""Isolation: does a dataset reader keep its throughput and tail latency while four ranks
dump a checkpoint next to it? (DESIGN §4.3: >= 90% of its solo throughput, p99 <= 1.2x.)

The reader is dataset.fio (random 4 KiB-1 MiB reads, O_DIRECT, queue depth 1 per job);
the storm is checkpoint-storm.fio (4 writers, 1 MiB sequential, fsync at the end), started
a second before the reader and ending after it, so the reader sees the storm throughout
and never the storm's bucket burst. Scenarios, each against the solo reader on the same
kind of mount:

* ``--no-qos``: the storm runs free;
* the bench policy with the checkpoints class capped at each level of :data:`SWEEP`. The
  headline level is :data:`HEADLINE_CAP`: the daemon is one Python thread, and every
  MiB/s a checkpoint is allowed costs that thread time the reader needs, so on this
  2-CPU machine the cap has to fit in what the reader leaves; the sweep shows the
  trade-off around it, and ``write_cost`` what a MiB costs the daemon.

Then a time series through periodic checkpoint bursts (mixed.fio): both classes' rates
from the daemon's counters every 0.5 s, with the same classes uncapped and capped.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.core.context import Mounted, Run
from bench.core.fio import JOBS_DIR, FioMetrics, parse_fio_json, run_job
from bench.core.plotting import bars, save
from bench.core.sampler import Series, StatusSampler, windows
from bench.core.storm import with_storm
from bench.core.system import CpuWatch, drop_caches, wait_quiet
from bench.core.tables import Plots, Rows, mib, pct, plot, policy_block, ratio, table, us, verdict
from bench.core.typed import Json, Record
from qosfs.control.ctl import call

MiB = 1 << 20
ISO_THROUGHPUT, ISO_P99 = 0.90, 1.20  # DESIGN §4.3 targets, against the solo reader
SWEEP = ("25MiB/s", "50MiB/s", "100MiB/s", "200MiB/s")
# The storm alone costs the daemon ~2 ms of CPU per MiB admitted under a cap (the
# write_cost figures), so 50 MiB/s is ~10% of a core: what the solo reader, which keeps
# the daemon ~65% busy, leaves free. Higher levels are in the sweep.
HEADLINE_CAP = "50MiB/s"
READER_JOBS = "2"  # several readers, but no more than this machine's CPUs
STORM_JOBS = "4"
# cache = "direct-writes": fio opens its files read-write, so `auto` (which bypasses the
# page cache only for write-only opens, what checkpoint writers such as torch.save do)
# would leave the storm's pages in the cache; this is the setting for such writers.
POLICY = """
[classes.checkpoints]
paths = ["**/*.distcp"]
cache = "direct-writes"
{cap}

[classes.datasets]
paths = ["**/*.tfrecord"]
priority = "high"

[classes.default]
"""


@dataclass(frozen=True, kw_only=True)
class IsolationRow(Record):
    """A scenario's reader (medians) and its ratios to the solo reader of its kind."""

    scenario: str
    baseline: str
    reps: int
    storm_bw: float | None
    bw_bytes: float | None
    bw_bytes_ratio: float | None
    clat_p50_us: float | None
    clat_p50_us_ratio: float | None
    clat_p99_us: float | None
    clat_p99_us_ratio: float | None
    clat_p999_us: float | None
    clat_p999_us_ratio: float | None
    daemon_cpu_pct: float | None = None
    machine_busy_pct: float | None = None


@dataclass(frozen=True, kw_only=True)
class WriteCost(Record):
    cap: str | None
    storm_bw: float
    daemon_cpu_pct: float | None
    daemon_ms_per_mib: float
    wall_s: float | None = None
    machine_busy_pct: float | None = None


@dataclass(frozen=True, kw_only=True)
class Burst(Record):
    cap: str | None
    series: dict[str, Series]
    reader_during: float | None
    reader_between: float | None
    reader: FioMetrics
    checkpoint: FioMetrics
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class IsolationResult(Record):
    headline_cap: str
    sweep: list[str]
    policy: str
    reader_env: dict[str, str]
    storm_env: dict[str, str]
    summary: list[IsolationRow]
    bursts: list[Burst]
    write_cost: list[WriteCost] = field(default_factory=list)
    runs: Json = None  # per scenario, every repetition's fio figures

    def row(self, scenario: str) -> IsolationRow | None:
        return next((r for r in self.summary if r.scenario == scenario), None)


def policy(cap: str | None) -> str:
    return POLICY.format(cap=f'write_bandwidth = "{cap}"' if cap else "")


class Isolation:
    def __init__(self, run: Run, src: Path) -> None:
        self.run = run
        self.src = src
        runtime = int(run.pick(10, 4))
        self.reader_env = {"SIZE": "512m" if not run.quick else "256m", "NRFILES": "64",
                           "NUMJOBS": READER_JOBS, "RUNTIME": str(runtime)}
        self.storm_env = {"SIZE": "256m", "NUMJOBS": STORM_JOBS, "RUNTIME": str(runtime + 2)}
        self.runs: dict[str, list[dict[str, Any]]] = {}

    def _prepare(self) -> None:
        drop_caches()
        wait_quiet(self.run.quiet_wait)

    def solo(self, m: Mounted, label: str) -> None:
        self._prepare()
        cpu = CpuWatch(m.mount)
        reader, _, _ = run_job(self.run.fio, JOBS_DIR / "dataset.fio", str(m.path),
                               self.reader_env, cwd=str(self.run.work))
        assert reader is not None
        self._keep(label, reader, None, cpu.figures())

    def storm(self, m: Mounted, label: str) -> None:
        self._prepare()
        cpu = CpuWatch(m.mount)
        reader, storm = with_storm(self.run.fio, str(m.path), str(m.path), self.reader_env,
                                   self.storm_env, cwd=str(self.run.work))
        self._keep(label, reader, storm, cpu.figures())

    def _keep(self, label: str, reader: FioMetrics, storm: FioMetrics | None,
              cpu: dict[str, float | None]) -> None:
        rec = {"reader": reader.to_dict(), "storm": storm.to_dict() if storm else None,
               **cpu}
        self.runs.setdefault(label, []).append(rec)
        self.run.log(f"  {label:18s} reader {reader.bw_bytes / MiB:6.0f} MiB/s  "
                     f"p99 {reader.clat_p99_us / 1e3:6.2f} ms"
                     + (f"  storm {storm.bw_bytes / MiB:5.0f} MiB/s" if storm else "")
                     + f"  daemon {cpu['daemon_cpu_pct'] or 0:.0f}% CPU, machine "
                       f"{cpu['machine_busy_pct']:.0f}% busy")

    def write_cost(self, m: Mounted, cap: str | None) -> dict[str, Any]:
        """The storm alone, its class capped at *cap* (None: far above demand): daemon CPU
        milliseconds per MiB written. A parked write's cost shows here."""
        call(m.socket, {"cmd": "set", "target": "class", "name": "checkpoints",
                        "changes": {"write_bandwidth": cap or "64GiB/s"}})
        self._prepare()
        cpu = CpuWatch(m.mount)
        storm, _, _ = run_job(self.run.fio, JOBS_DIR / "checkpoint-storm.fio", str(m.path),
                              {**self.storm_env, "RUNTIME": self.reader_env["RUNTIME"]},
                              cwd=str(self.run.work))
        assert storm is not None
        fig = cpu.figures()
        seconds = (fig["daemon_cpu_pct"] or 0.0) / 100 * fig["wall_s"]
        return {"cap": cap, "storm_bw": storm.bw_bytes, **fig,
                "daemon_ms_per_mib": 1e3 * seconds / (storm.io_bytes / MiB)}


def burst_series(run: Run, src: Path, cap: str | None) -> dict[str, Any]:
    """mixed.fio through a mount whose checkpoints class is capped at *cap* (or not):
    readers all along, periodic checkpoint bursts; rates of both classes every 0.5 s."""
    env = {"RUNTIME": str(int(run.pick(20, 12))), "NUMJOBS": READER_JOBS,
           "SIZE": "512m" if not run.quick else "256m",
           "CKPT_MB": str(int(run.pick(128, 64))), "CKPT_INTERVAL": "5s", "CKPT_DELAY": "3s"}
    with run.mount(src, policy(cap)) as m:
        drop_caches()
        with StatusSampler(m.socket, 0.5) as sampler:
            t0 = time.monotonic()
            _, doc, _ = run_job(run.fio, JOBS_DIR / "mixed.fio", str(m.path), env,
                                cwd=str(run.work))
    assert doc is not None
    runtime = float(env["RUNTIME"])
    series = {}
    for name, counter in (("datasets", "read_bytes"), ("checkpoints", "write_bytes")):
        # the readers' span only: the checkpoint job's runtime starts after its delay
        series[name] = [(round(w.mid - t0, 3), w.rate)
                        for w in windows(sampler.samples, ("class", name, None), counter)
                        if 0.0 < w.mid - t0 < runtime]
    return {"cap": cap, "env": env, "series": series, **burst_figures(series),
            "reader": parse_fio_json(doc, 0).to_dict(),
            "checkpoint": parse_fio_json(doc, 1).to_dict()}


def burst_figures(series: dict[str, list[tuple[float, float]]]) -> dict[str, float | None]:
    """The readers' mean rate in the windows where checkpoints moved data and in those
    where they did not (the first and last windows left out: fio starting and ending)."""
    pairs = list(zip(series["datasets"], series["checkpoints"], strict=True))[1:-1]
    during = [d for (_, d), (_, c) in pairs if c > 0]
    between = [d for (_, d), (_, c) in pairs if c == 0]
    return {"reader_during": sum(during) / len(during) if during else None,
            "reader_between": sum(between) / len(between) if between else None}


def run(run: Run) -> IsolationResult:
    src = run.scratch("isolation")
    iso = Isolation(run, src)
    # lay the dataset out once, on the backing directory (through qosfs is only slower)
    run_job(run.fio, JOBS_DIR / "dataset.fio", str(src), iso.reader_env,
            ("--create_only=1",), parse=False, cwd=str(run.work))
    reps = run.repetitions(3)  # p99 ratios move ~10% run to run: a median of 3
    with run.mount(src, no_qos=True) as m:
        # discarded: the first writes after the set-up run slow for a few seconds (see
        # bench.suites.caps), which would soften the storm of the first scenario
        run_job(run.fio, JOBS_DIR / "checkpoint-storm.fio", str(m.path),
                {**iso.storm_env, "RUNTIME": str(int(run.pick(5, 3)))}, parse=False,
                cwd=str(run.work))
        for _ in range(reps):
            iso.solo(m, "solo no-qos")
            iso.storm(m, "storm no-qos")
    with run.mount(src, policy(SWEEP[0])) as m:
        for _ in range(reps):
            iso.solo(m, "solo policy")
            for cap in SWEEP:
                call(m.socket, {"cmd": "set", "target": "class", "name": "checkpoints",
                                "changes": {"write_bandwidth": cap}})
                iso.storm(m, f"storm cap {cap}")
        cost = [iso.write_cost(m, cap) for cap in (None, HEADLINE_CAP)]
    bursts = [burst_series(run, src, cap) for cap in (None, HEADLINE_CAP)]
    return IsolationResult.from_json({
        "runs": iso.runs, "sweep": list(SWEEP), "headline_cap": HEADLINE_CAP,
        "write_cost": cost, "reader_env": iso.reader_env, "storm_env": iso.storm_env,
        "policy": policy(HEADLINE_CAP).strip(), "bursts": bursts,
        "summary": summarize(iso.runs)})


def summarize(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per scenario: the reader's median throughput and latency percentiles, as a share of
    (ratio to) the solo reader on the same kind of mount, and the storm's throughput."""
    def med(label: str, who: str, key: str) -> float | None:
        vals = [r[who][key] for r in runs.get(label, []) if r.get(who)]
        return statistics.median(vals) if vals else None

    out = []
    for label in runs:
        kind = "no-qos" if label.endswith("no-qos") else "policy"
        solo = f"solo {kind}"
        row: dict[str, Any] = {"scenario": label, "baseline": solo, "reps": len(runs[label]),
                               "storm_bw": med(label, "storm", "bw_bytes")}
        for key in ("bw_bytes", "clat_p50_us", "clat_p99_us", "clat_p999_us"):
            value, base = med(label, "reader", key), med(solo, "reader", key)
            row[key] = value
            row[f"{key}_ratio"] = value / base if value is not None and base else None
        for key in ("daemon_cpu_pct", "machine_busy_pct"):
            vals = [r[key] for r in runs[label] if r.get(key) is not None]
            row[key] = statistics.median(vals) if vals else None
        out.append(row)
    return out


# -- its part of REPORT.md --


def headline(iso: IsolationResult) -> Rows:
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


def section(plots: Plots, r: IsolationResult) -> list[str]:
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
            "windows in which checkpoints moved data.", "", *policy_block(r.policy)]
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


def chart(plt: Any, r: IsolationResult, out: Path, name: str) -> str:
    rows = [s for s in r.summary if not s.scenario.startswith("solo")]
    fig, ax = plt.subplots(figsize=(8, 4))
    bars(ax, [s.scenario.replace("storm ", "") for s in rows], {
        "reader throughput / solo": [s.bw_bytes_ratio for s in rows],
        "reader p99 / solo": [s.clat_p99_us_ratio for s in rows]}, "ratio to solo")
    ax.axhline(0.9, color="green", lw=0.8, ls="--")
    ax.axhline(1.2, color="red", lw=0.8, ls="--")
    ax.set_title("Isolation: reader under a 4-writer checkpoint storm")
    return save(plt, fig, out, name)


def burst_chart(plt: Any, r: IsolationResult, out: Path, name: str) -> str:
    fig, axes = plt.subplots(len(r.bursts), 1, figsize=(9, 3 * len(r.bursts)),
                             sharex=True, squeeze=False)
    for ax, b in zip(axes[:, 0], r.bursts, strict=False):
        for cls, style in (("datasets", "-"), ("checkpoints", "--")):
            pts = b.series[cls]
            ax.plot([t for t, _ in pts], [v / MiB for _, v in pts], style, label=cls)
        ax.set_ylabel("MiB/s")
        ax.set_title(f"checkpoints {'capped at ' + b.cap if b.cap else 'uncapped'}",
                     fontsize=9)
        ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("s since fio start (0.5 s windows)")
    return save(plt, fig, out, name)
