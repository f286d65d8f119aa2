"""The training suite's figures and its part of REPORT.md: the record
:func:`bench.suites.training.workload.run` returns, and its headline rows, its section and
its plot, pure functions of that record (no measuring, no I/O)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean, median
from typing import Any

from bench.core.plotting import bars, save
from bench.core.tables import Plots, Rows, pct, plot, table, verdict
from bench.core.typed import Json, Record

MiB = float(1 << 20)


@dataclass(frozen=True, kw_only=True)
class DlioShape(Record):
    """bench.suites.training.workload.Shape as written to JSON."""

    name: str
    record_length: int
    files: int
    files_quick: int
    batch_size: int
    computation_time: float
    read_threads: int


@dataclass(frozen=True, kw_only=True)
class StormShape(Record):
    """bench.suites.training.workload.Storm as written to JSON."""

    ranks: int
    shard: int
    interval: float


@dataclass(frozen=True, kw_only=True)
class CheckpointRound(Record):
    round: int
    kind: str
    mode: str
    ranks: int
    bytes: int
    start: float
    end: float
    duration_s: float
    blocked_s: float
    write_start: float | None = None
    write_s: float | None = None
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class PlanRow(Record):
    round: int
    way: str
    bytes: int
    measured_s: float
    planned_s: float
    error_pct: float
    cap_in_force: float | None = None
    planned_in_force_s: float | None = None
    error_in_force_pct: float | None = None


@dataclass(frozen=True, kw_only=True)
class TrainingScenario(Record):
    label: str
    serve: str
    storm: bool
    au_pct: list[float]
    read_mib_s: list[float]
    rounds: list[CheckpointRound]
    cap: float | None
    burst: float | None
    plan: list[PlanRow]
    daemon_cpu_pct: float | None
    epochs: Json = None  # DLIO's figures per epoch
    # s from the storm's start to its first round (0: writing when the first epoch starts)
    storm_lead_s: float | None = None
    cap_changes: Json = None


@dataclass(frozen=True, kw_only=True)
class ShapeRun(Record):
    shape: DlioShape
    files: int
    area: str
    config: Json  # the DLIO workload configuration, shown as it is
    scenarios: list[TrainingScenario]
    cap: float
    burst: float

    def scenario(self, label: str) -> TrainingScenario | None:
        return next((s for s in self.scenarios if s.label == label), None)


@dataclass(frozen=True, kw_only=True)
class TrainingResult(Record):
    shapes: dict[str, ShapeRun]
    storm: StormShape
    epochs: int
    latency_target: str
    versions: dict[str, str]
    au_pass_pct: float
    storm_keeps: float
    plan_pct: float


def _mean(xs: list[float]) -> float | None:
    return mean(xs) if xs else None


def au_of(shape: ShapeRun, label: str) -> float | None:
    """Mean AU (%) over the epochs of scenario *label*."""
    s = shape.scenario(label)
    return None if s is None else _mean(s.au_pct)


def first_epoch_of(shape: ShapeRun, label: str) -> float | None:
    """AU (%) of the first epoch of scenario *label* (its controller state still cold)."""
    s = shape.scenario(label)
    return s.au_pct[0] if s is not None and s.au_pct else None


def worst_plan_error(shape: ShapeRun, serve: str,
                     key: str = "error_pct") -> float | None:
    """The round of scenario kind *serve* furthest from the planner (*key*: against the
    configured cap, or ``error_in_force_pct``: against the cap in force)."""
    errs = [e for s in shape.scenarios if s.serve == serve
            for p in s.plan if (e := getattr(p, key)) is not None]
    return max(errs, key=abs) if errs else None


def targets(r: TrainingResult, name: str) -> Rows:
    """(what, figure, target, result) for shape *name* against the issue's targets."""
    shape = r.shapes[name]
    keeps, au_pass, plan_pct = r.storm_keeps, r.au_pass_pct, r.plan_pct
    policy = au_of(shape, "default policy + storm")
    mount_alone, bare = au_of(shape, "no-qos"), au_of(shape, "bare + storm")
    free = au_of(shape, "no-qos + storm")
    rows: Rows = []
    if policy is not None and mount_alone:
        ratio = policy / mount_alone
        rows.append([f"{name}: AU, default policy + storm / --no-qos alone "
                     f"({policy:.1f}% / {mount_alone:.1f}%)", f"{ratio:.2f}×",
                     f"≥ {keeps}×", verdict(ratio >= keeps,
                                            f"by {100 * (keeps - ratio):.1f} points")])
    if policy is not None and bare is not None:
        rows.append([f"{name}: AU, default policy + storm vs the bare directory + storm",
                     f"{policy:.1f}% vs {bare:.1f}%", "≥ bare",
                     verdict(policy >= bare, f"by {bare - policy:.1f} points")])
    if policy is not None and mount_alone is not None:
        if mount_alone >= au_pass:
            rows.append([f"{name}: AU under the storm with the default policy (alone "
                         f"{mount_alone:.1f}%)", f"{policy:.1f}%", f"≥ {au_pass:.0f}%",
                         verdict(policy >= au_pass, f"by {au_pass - policy:.1f} points")])
        else:
            rows.append([f"{name}: AU alone through the mount is under MLPerf's pass line",
                         f"{mount_alone:.1f}%", f"≥ {au_pass:.0f}%", "(premise not met)"])
    alone, bare_alone = au_of(shape, "default policy"), au_of(shape, "bare")
    if alone is not None and bare_alone:
        rows.append([f"{name}: AU through the mount alone, default policy / bare alone "
                     f"({alone:.1f}% / {bare_alone:.1f}%)", f"{alone / bare_alone:.2f}×",
                     "(for the record)", "—"])
    first, bare_first = (first_epoch_of(shape, "default policy + running storm"),
                         first_epoch_of(shape, "bare + running storm"))
    if first is not None and bare_first is not None:
        rows.append([f"{name}: first epoch's AU in a storm already running, default policy "
                     "vs the bare directory", f"{first:.1f}% vs {bare_first:.1f}%", "≥ bare",
                     verdict(first >= bare_first, f"by {bare_first - first:.1f} points")])
    if free is not None:
        rows.append([f"{name}: AU under the storm without QoS (--no-qos)", f"{free:.1f}%",
                     f"(contrast: {au_pass:.0f}%)",
                     "passes" if free >= au_pass else f"fails by {au_pass - free:.1f} points"])
    for serve, what, key in (
            ("fixed", "fixed cap", "error_pct"),
            ("default", "default policy, for the cap in force", "error_in_force_pct"),
            ("latency", "latency target, for the cap in force", "error_in_force_pct")):
        worst = worst_plan_error(shape, serve, key)
        if worst is not None:
            rows.append([f"{name}: checkpoint duration vs `qosfs plan`, {what}, worst round",
                         pct(worst), f"±{plan_pct:.0f}%", verdict(abs(worst) <= plan_pct)])
    return rows


def headline(r: TrainingResult) -> Rows:
    return [row for name in r.shapes for row in targets(r, name)]


def _secs(xs: list[float]) -> str:
    return "—" if not xs else f"{median(xs):.2f} / {max(xs):.2f} s"


def _scenario_rows(shape: ShapeRun) -> Rows:
    rows = []
    for s in shape.scenarios:
        rounds = s.rounds
        au = s.au_pct
        rows.append([s.label, "—" if not au else f"{au[0]:.1f}%",
                     ", ".join(f"{a:.1f}" for a in au),
                     "—" if not au else f"{mean(au):.1f}%",
                     "—" if not s.read_mib_s else f"{mean(s.read_mib_s):.0f} MiB/s",
                     str(len(rounds)) if s.storm else "—",
                     ", ".join(f"{x.duration_s:.1f}" for x in rounds) or "—",
                     _secs([x.blocked_s for x in rounds])])
    return rows


def _plan_rows(shape: ShapeRun) -> Rows:
    rows = []
    for s in shape.scenarios:
        cap = s.cap or shape.cap
        for p in s.plan:
            in_force = p.cap_in_force
            rows.append([s.label, str(p.round), p.way, f"{p.bytes / MiB:.0f} MiB",
                         f"{p.measured_s:.2f} s", f"{cap / MiB:.0f} MiB/s",
                         f"{p.planned_s:.2f} s", pct(p.error_pct),
                         "—" if in_force is None else f"{in_force / MiB:.0f} MiB/s",
                         "—" if in_force is None else f"{p.planned_in_force_s:.2f} s",
                         "—" if in_force is None else pct(p.error_in_force_pct)])
    return rows


def section(plots: Plots, r: TrainingResult) -> list[str]:
    storm = r.storm
    lines = ["## Training I/O: DLIO's accelerator utilization under a PyTorch checkpoint "
             "storm", "",
             "MLPerf Storage's measure: DLIO emulates an accelerator that computes a fixed "
             "time per batch its PyTorch data loader delivers; AU = compute time / epoch "
             f"time, pass line {r.au_pass_pct:.0f}%. Each epoch is one DLIO run after the "
             "dataset's pages were evicted (posix_fadvise DONTNEED on the backing files and "
             "through the mount), so every epoch reads through the mount. The storm: "
             f"{storm.ranks} PyTorch ranks (gloo) saving {storm.shard / MiB:.0f} MiB "
             f"each every {storm.interval:.0f} s under `checkpoints/`, in turn "
             "`torch.save` and `dcp.save` (the step waits), a staged `torch.save` in a "
             "thread and `dcp.async_save` (training goes on). The latency-target scenario "
             f"is the default policy with `target_read_latency = \"{r.latency_target}\"` "
             "on datasets instead of `target_read_slowdown`; the fixed-cap scenario is the "
             "default policy with the checkpoints cap lowered and no read target, so that "
             "nothing moves the cap. The storm's first round comes 5 s after it starts, "
             "about 3 s into the first epoch.", ""]
    lines += plot(plots, "training", "DLIO AU per scenario")
    lines += ["", "Its figures against the targets are in the headline above."]
    for name, shape in r.shapes.items():
        sh = shape.shape
        lines += ["", f"### {name}: {shape.files} files of "
                  f"{sh.record_length / MiB:.2f} MiB, batch {sh.batch_size}, "
                  f"{sh.computation_time} s compute per batch, on {shape.area}", ""]
        lines += table(["scenario", "first epoch AU", "AU per epoch (%)", "AU mean", "read",
                        "checkpoints",
                        "each checkpoint's duration (s)",
                        "training waited (median / max)"], _scenario_rows(shape))
        plan = _plan_rows(shape)
        if plan:
            lines += ["", "Checkpoint rounds under the checkpoints cap against `qosfs plan` "
                      "(T = size × replicas / cap, replicas 1; burst "
                      f"{shape.burst / MiB:.0f} MiB); a round is every rank's shard, "
                      "measured from the first rank's first write (after an asynchronous "
                      "save's staging, the in-memory copy its step waits for) to the last "
                      "rank's end. \"cap in "
                      "force\" is the time-weighted mean of the cap the daemon enforced "
                      "during the round (`ctl status` every 0.25 s): the configured cap, or "
                      "the lower one the latency controller set while dataset reads were "
                      "slow. The planner can only know the configured cap; the second "
                      "error says whether the cap, whatever it was, governed the duration.",
                      ""]
            lines += table(["scenario", "round", "way", "size", "measured", "cap",
                            "planned", "error", "cap in force", "planned (in force)",
                            "error (in force)"], plan)
        lines += ["", "<details><summary>DLIO workload configuration</summary>", "",
                  "```yaml", json.dumps(shape.config, indent=1), "```", "", "</details>"]
    versions = ", ".join(f"{k} {v}" for k, v in r.versions.items())
    lines += ["", f"Versions: {versions}. {r.epochs} epoch(s) per scenario.", ""]
    return lines


def chart(plt: Any, r: TrainingResult, out: Path, name: str) -> str:
    shapes = r.shapes
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [s.label for s in next(iter(shapes.values())).scenarios]
    bars(axes[0], labels, {
        shape_name: [sum(s.au_pct) / len(s.au_pct) if s.au_pct else None
                     for s in shape.scenarios] for shape_name, shape in shapes.items()},
          "AU (%)")
    axes[0].axhline(r.au_pass_pct, color="red", lw=0.8, ls="--")
    axes[0].set_ylim(0, 105)
    axes[0].set_title("DLIO accelerator utilization, mean over epochs")
    ax = axes[1]
    for shape_name, shape in shapes.items():
        for s in shape.scenarios:
            if s.plan:
                ax.scatter([_planned(p) for p in s.plan],
                           [p.measured_s for p in s.plan],
                           label=f"{shape_name}: {s.label}")
    plans = [p for sh in shapes.values() for s in sh.scenarios for p in s.plan]
    top = max([p.measured_s for p in plans] + [_planned(p) for p in plans] + [1.0])
    ax.plot([0, top], [0, top], color="grey", lw=0.8)
    ax.fill_between([0, top], [0, 0.9 * top], [0, 1.1 * top], color="green", alpha=0.08)
    ax.set_xlabel("qosfs plan: T = size / cap in force (s)")
    ax.set_ylabel("measured checkpoint round (s)")
    ax.set_title("Checkpoints under the cap vs the planner")
    ax.legend(fontsize=7)
    return save(plt, fig, out, name)


def _planned(p: PlanRow) -> float:
    """The planner's T for the cap in force when it is known, else for the cap set."""
    return p.planned_in_force_s if p.planned_in_force_s is not None else p.planned_s
