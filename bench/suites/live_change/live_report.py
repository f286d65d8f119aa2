"""The live-change suite's figures and its part of REPORT.md: the record
:func:`bench.suites.live_change.writes.run` returns, and its headline rows, its section
and its plot, pure functions of that record (no measuring, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.core.plotting import save
from bench.core.sampler import Series
from bench.core.tables import Plots, Rows, plot, table, verdict
from bench.core.typed import Json, Record, key

MiB = float(1 << 20)
LIVE_MS = 100.0  # DESIGN §4 target
CTL_STATUS_MS = 60.0  # issue 38: `qosfs ctl status`, the whole command, median of 10


@dataclass(frozen=True, kw_only=True)
class DelaySummary(Record):
    median_delay_ms: float
    max_delay_ms: float
    n: int


@dataclass(frozen=True, kw_only=True)
class StepChange(Record):
    at_s: float
    from_: str = field(metadata=key("from"))
    to: str
    settle_ms: float | None


@dataclass(frozen=True, kw_only=True)
class Step(Record):
    block: int
    bin_s: float
    changes: list[StepChange]
    series: Series
    caps: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class CtlStatusTimes(Record):
    """Whole ``qosfs ctl status`` processes, start to exit, and the interpreter alone."""

    n: int
    median_ms: float
    max_ms: float
    python_median_ms: float
    busy_before_pct: float  # the machine (other tenants) just before the runs
    runs_ms: list[float] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class LiveChangeResult(Record):
    low: str
    high: str
    summary: dict[str, DelaySummary]  # per method: set, reload, cli-set
    all_parked: bool
    step: Step
    repetitions: Json = None
    ctl_status: CtlStatusTimes | None = None  # absent from runs before issue 38


def headline(live: LiveChangeResult) -> Rows:
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


def section(plots: Plots, r: LiveChangeResult) -> list[str]:
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


def chart(plt: Any, r: LiveChangeResult, out: Path, name: str) -> str:
    step = r.step
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.plot([t for t, _ in step.series], [v / MiB for _, v in step.series],
            drawstyle="steps-post", label="writer")
    for c in step.changes:
        ax.axvline(c.at_s, color="red", lw=0.8, ls="--")
        ax.annotate(f"set {c.to}", (c.at_s, ax.get_ylim()[1] * 0.9), fontsize=8)
    ax.set_xlabel("s since the first ctl set")
    ax.set_ylabel("MiB/s (100 ms bins)")
    ax.set_title("Live change: cap stepped with qosfs ctl set")
    return save(plt, fig, out, name)
