"""Cap accuracy: a capped class with more demand than its cap moves at the cap (DESIGN
§4.2: within 2% over any 10 s window, within 10% over each 1 s window).

One mount, one class ``capped``; for each workload the suite first runs it with a cap far
above any demand (its demand: a baseline measured in the same run and counted the same
way, since metadata requests are only counted under a ``meta_iops`` cap), then at each
cap level, set live with ``qosfs ctl set``. The achieved rate comes from the admitted
bytes (or ops) counter of the class, sampled every second (:mod:`bench.core.sampler`); the
first window of a run is discarded (it holds the bucket's burst: 100 ms of the cap by
default) and so is the last (the job ends inside it). A window in which no request waited for
tokens had no excess demand (its clients left gaps: a busy machine); such windows are
counted and shown, not left out. fio's own average over the whole run (burst included) is
shown beside, as the client's view.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.core.context import Mounted, Run
from bench.core.fio import JOBS_DIR, run_job
from bench.core.plotting import save
from bench.core.sampler import StatusSampler, Window, error_pct, span_rates, steady
from bench.core.system import drop_caches, wait_quiet
from bench.core.tables import Plots, Rows, mib, ops, pct, plot, policy_block, table, verdict
from bench.core.typed import Record
from qosfs.control.ctl import call
from qosfs.core.units import parse_bandwidth, parse_iops

POLICY = """
[classes.capped]
paths = ["**"]

[classes.default]
"""
CAP_LONG_PCT, CAP_1S_PCT = 2.0, 10.0  # DESIGN §4 targets: over 10 s, per 1 s
LIMIT_KEYS = ("read_bandwidth", "write_bandwidth", "read_iops", "write_iops", "meta_iops")


@dataclass(frozen=True, kw_only=True)
class CapLevel(Record):
    """One cap of a workload; without steady windows only ``windows`` (0) is known."""

    level: str
    cap: float
    has_demand: bool
    fio_rate: float
    windows: int
    span_s: float | None = None
    long_window_s: float | None = None
    achieved: float | None = None
    worst_1s_pct: float | None = None
    worst_long_pct: float | None = None
    idle_windows: int = 0
    waiting: list[float] = field(default_factory=list)
    per_second: list[float] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class CapWorkload(Record):
    key: str
    label: str
    demand: float
    levels: list[CapLevel]


@dataclass(frozen=True, kw_only=True)
class CapsResult(Record):
    workloads: list[CapWorkload]
    runtime_s: int
    policy: str
    elapsed_s: float | None = None


@dataclass(frozen=True)
class Workload:
    key: str  # the limit key it is capped by
    job: str
    env: dict[str, str]
    counter: str  # the class counter that key limits
    levels: tuple[str, ...]
    label: str
    extra: tuple[str, ...] = ()  # fio arguments

    @property
    def unbounded(self) -> str:
        """A cap no workload here reaches: the baseline's setting."""
        return "64GiB/s" if self.key.endswith("bandwidth") else "10M"


WORKLOADS = (
    Workload("write_bandwidth", "checkpoint-storm.fio", {"NUMJOBS": "4", "SIZE": "256m"},
             "write_bytes", ("50MiB/s", "200MiB/s", "800MiB/s"),
             "1 MiB seq writes, 4 jobs"),
    Workload("read_bandwidth", "seqread.fio", {"SIZE": "1g", "DIRECT": "1"},
             "read_bytes", ("50MiB/s", "200MiB/s", "800MiB/s"), "1 MiB seq reads, direct=1"),
    Workload("read_iops", "randread.fio", {"SIZE": "256m", "NUMJOBS": "4", "DIRECT": "1"},
             "read_ops", ("1k", "5k"), "4 KiB rand reads, 4 jobs, direct=1"),
    Workload("write_iops", "randwrite.fio", {"SIZE": "256m", "NUMJOBS": "4", "DIRECT": "1"},
             "write_ops", ("1k", "5k"), "4 KiB rand writes, 4 jobs, direct=1"),
    # stat, time based, over more files than a 1 s attribute cache lets the kernel answer
    # at these caps: every stat is a FUSE LOOKUP (fio's set-up stats every file too)
    Workload("meta_iops", "meta.fio", {"NRFILES": "3000", "SETTLE": "0"}, "meta_ops",
             ("1k", "2k"), "stat 3000 files in a loop", ("--section=stat", "--time_based=1")),
)


def cap_value(key: str, level: str) -> float:
    return parse_bandwidth(level) if key.endswith("bandwidth") else parse_iops(level)


def analyse(ws: list[Window], cap: float, long_s: float) -> dict[str, Any]:
    """Figures of one capped run from its per-second windows (see the module docstring)."""
    kept = steady(ws)
    if not kept:
        return {"windows": 0}
    per_s = [error_pct(w.rate, cap) for w in kept]
    long = [error_pct(r, cap) for r in span_rates(kept, long_s)]
    span = kept[-1].t1 - kept[0].t0
    return {
        "windows": len(kept),
        "span_s": round(span, 2),
        "long_window_s": round(min(long_s, span), 2),
        "achieved": sum(w.rate * (w.t1 - w.t0) for w in kept) / span,
        "worst_1s_pct": max(per_s, key=abs),
        "worst_long_pct": max(long, key=abs),
        # windows in which no request waited for tokens: the class had no excess demand
        # there, whatever its rate (a fact; a threshold on the mean number waiting flagged
        # every window of a cap barely under demand, 5k of 6.4k ops/s, that was met)
        "idle_windows": sum(1 for w in kept if w.throttled == 0),
        "waiting": [round(w.throttled, 2) for w in kept],
        "per_second": [round(w.rate, 1) for w in kept],
    }


class Caps:
    def __init__(self, run: Run, m: Mounted) -> None:
        self.run = run
        self.m = m
        self.runtime = int(run.pick(13, 5))

    def set_caps(self, key: str, level: str) -> None:
        changes = dict.fromkeys(LIMIT_KEYS, "unlimited")
        changes[key] = level
        call(self.m.socket, {"cmd": "set", "target": "class", "name": "capped",
                             "changes": changes})

    def one(self, wl: Workload, level: str, runtime: int
            ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Run *wl* for *runtime* s with its cap at *level*: (fio's figures, the class's
        per-second analysis against that cap)."""
        self.set_caps(wl.key, level)
        drop_caches()
        wait_quiet(self.run.quiet_wait)
        with StatusSampler(self.m.socket, 1.0) as sampler:
            metrics, _, _ = run_job(self.run.fio, JOBS_DIR / wl.job, str(self.m.path),
                                    {**wl.env, "RUNTIME": str(runtime)},
                                    (*wl.extra, f"--runtime={runtime}"), cwd=str(self.run.work))
        assert metrics is not None
        ws = sampler.windows(("class", "capped", None), wl.counter)
        return metrics.to_dict(), analyse(ws, cap_value(wl.key, level), 10.0)

    def workload(self, wl: Workload) -> dict[str, Any]:
        # A discarded warm-up first: right after the set-up, 1 MiB writes through a fresh
        # mount ran at ~220 MiB/s for 4 s before reaching 1.6 GB/s, which made the
        # demand look lower than the caps it was meant to exceed.
        self.one(wl, wl.unbounded, int(self.run.pick(5, 3)))
        _, base = self.one(wl, wl.unbounded, max(3, self.runtime // 2))
        demand = base.get("achieved", 0.0)
        out: dict[str, Any] = {"key": wl.key, "label": wl.label, "demand": demand,
                               "levels": []}
        self.run.log(f"  {wl.key:16s} uncapped {_show(wl.key, demand)}")
        # quick: every other level (50 and 800 MiB/s, 1k ops/s)
        for level in wl.levels[::2] if self.run.quick else wl.levels:
            cap = cap_value(wl.key, level)
            fio, figures = self.one(wl, level, self.runtime)
            fio_rate = fio["bw_bytes"] if wl.key.endswith("bandwidth") else fio["iops"]
            row = {"level": level, "cap": cap, "has_demand": demand >= 1.1 * cap,
                   "fio_rate": fio_rate, **figures}
            out["levels"].append(row)
            if figures["windows"]:
                self.run.log(f"  {wl.key:16s} cap {level:9s} achieved "
                             f"{_show(wl.key, figures['achieved'])}  worst 1 s "
                             f"{figures['worst_1s_pct']:+.1f}%  worst "
                             f"{figures['long_window_s']:.0f} s "
                             f"{figures['worst_long_pct']:+.2f}%")
        return out


def _show(key: str, v: float) -> str:
    return f"{v / (1 << 20):.1f} MiB/s" if key.endswith("bandwidth") else f"{v:.0f} ops/s"


def run(run: Run) -> CapsResult:
    src = run.scratch("caps")
    # lay the workloads' files out on the backing directory (untimed, not via qosfs)
    for wl in WORKLOADS:
        if wl.job != "checkpoint-storm.fio":
            run_job(run.fio, JOBS_DIR / wl.job, str(src), {**wl.env, "RUNTIME": "1"},
                    (*wl.extra[:1], "--create_only=1"), parse=False, cwd=str(run.work))
    t0 = time.monotonic()
    with run.mount(src, POLICY) as m:
        caps = Caps(run, m)
        results = [caps.workload(wl) for wl in WORKLOADS]
    return CapsResult.from_json({"workloads": results, "runtime_s": caps.runtime,
                                 "elapsed_s": round(time.monotonic() - t0, 1),
                                 "policy": POLICY.strip()})


# -- its part of REPORT.md --


def headline(r: CapsResult) -> Rows:
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


def section(plots: Plots, r: CapsResult) -> list[str]:
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
        *policy_block(r.policy),
    ]


def chart(plt: Any, r: CapsResult, out: Path, name: str) -> str:
    fig, ax = plt.subplots(figsize=(9, 4))
    for w in r.workloads:
        for lv in w.levels:
            if lv.windows and lv.has_demand:
                ys = [v / lv.cap for v in lv.per_second]
                ax.plot(range(2, len(ys) + 2), ys, marker=".", label=f"{w.key} {lv.level}")
    ax.axhspan(0.9, 1.1, color="green", alpha=0.08, label="±10% (1 s target)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("second of the run (first discarded: burst)")
    ax.set_ylabel("achieved / cap, per 1 s window")
    ax.set_title("Cap accuracy")
    ax.legend(fontsize=7, ncol=2)
    return save(plt, fig, out, name)
