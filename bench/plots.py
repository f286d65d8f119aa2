"""PNG plots of one run's figures (matplotlib, the ``bench`` extra: ``pip install
'.[bench]'``). :func:`draw` raises ImportError when matplotlib is missing; the caller
writes the report without plots and says so. Every plot reads the same typed result the
report's tables are rendered from, so plots and tables never disagree.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from bench.figures import (
    CapsResult,
    FairshareResult,
    IsolationResult,
    LiveChangeResult,
    MetadataResult,
    OverheadResult,
    PlanRow,
    PrioritiesResult,
    TrainingResult,
)

MiB = float(1 << 20)
# (pyplot, a suite's result, output directory, file stem) -> the PNG's file name
PlotFn = Callable[[Any, Any, Path, str], str]


def _pyplot() -> Any:
    # imported by name: an optional dependency, typed as what it is here (Any)
    matplotlib = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def _save(plt: Any, fig: Any, out: Path, name: str) -> str:
    fig.tight_layout()
    tmp = out / f"{name}.png.tmp"
    fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    tmp.replace(out / f"{name}.png")
    return f"{name}.png"


def _bars(ax: Any, labels: list[str], series: dict[str, list[float | None]],
          ylabel: str) -> None:
    width = 0.8 / max(1, len(series))
    for i, (name, vals) in enumerate(series.items()):
        xs = [x + i * width for x in range(len(labels))]
        ax.bar(xs, [v or 0 for v in vals], width, label=name)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(labels))])
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def overhead(plt: Any, r: OverheadResult, out: Path, name: str) -> str:
    rows = [s for s in r.summary if not s.error]
    fig, ax = plt.subplots(figsize=(9, 4))
    _bars(ax, [s.key for s in rows], {
        "no-qos / native": [s.ratio_to_native.get("no-qos") for s in rows],
        "policy / native": [s.ratio_to_native.get("policy") for s in rows],
        "policy / no-qos": [s.machinery for s in rows]}, "ratio (higher is better)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(0.95, color="red", lw=0.8, ls="--", label="0.95")
    ax.set_title("Overhead: throughput ratios (same run)")
    return _save(plt, fig, out, name)


def caps(plt: Any, r: CapsResult, out: Path, name: str) -> str:
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
    return _save(plt, fig, out, name)


def isolation(plt: Any, r: IsolationResult, out: Path, name: str) -> str:
    rows = [s for s in r.summary if not s.scenario.startswith("solo")]
    fig, ax = plt.subplots(figsize=(8, 4))
    _bars(ax, [s.scenario.replace("storm ", "") for s in rows], {
        "reader throughput / solo": [s.bw_bytes_ratio for s in rows],
        "reader p99 / solo": [s.clat_p99_us_ratio for s in rows]}, "ratio to solo")
    ax.axhline(0.9, color="green", lw=0.8, ls="--")
    ax.axhline(1.2, color="red", lw=0.8, ls="--")
    ax.set_title("Isolation: reader under a 4-writer checkpoint storm")
    return _save(plt, fig, out, name)


def isolation_burst(plt: Any, r: IsolationResult, out: Path, name: str) -> str:
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
    return _save(plt, fig, out, name)


def live_change(plt: Any, r: LiveChangeResult, out: Path, name: str) -> str:
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
    return _save(plt, fig, out, name)


def fairshare(plt: Any, r: FairshareResult, out: Path, name: str) -> str:
    fig, ax = plt.subplots(figsize=(9, 3.5))
    for uid, pts in r.series.items():
        ax.plot([t for t, _ in pts], [v / MiB for _, v in pts], label=f"uid {uid}")
    for p in r.phases:
        t0 = (p.phase - 1) * r.phase_s
        ax.hlines(p.share / MiB, t0, t0 + r.phase_s, colors="grey", linestyles=":")
    ax.set_xlabel("s (phases: dotted line = equal share)")
    ax.set_ylabel("MiB/s (0.5 s windows)")
    ax.set_title(f"Fair share of {r.cap} between active uids")
    ax.legend(fontsize=8)
    return _save(plt, fig, out, name)


def metadata(plt: Any, r: MetadataResult, out: Path, name: str) -> str:
    rows = r.summary
    sides = ("native", "no-qos", "policy", "meta-cap")
    fig, ax = plt.subplots(figsize=(8, 4))
    _bars(ax, [s.key for s in rows], {
        side: [s.side(side) for s in rows] for side in sides},
        "files/s")
    ax.set_yscale("log")
    ax.set_title("Metadata operations")
    return _save(plt, fig, out, name)


def priorities(plt: Any, r: PrioritiesResult, out: Path, name: str) -> str:
    rows = [(sc.name, c) for sc in r.scenarios for c in sc.classes]
    fig, ax = plt.subplots(figsize=(8, 4))
    _bars(ax, [f"{n}: {c.class_}" for n, c in rows], {
        "expected": [c.expected / MiB for _, c in rows],
        "achieved": [(c.achieved or 0) / MiB for _, c in rows]}, "MiB/s")
    ax.set_title(f"Backend {r.backend} shared by priority and minimum")
    return _save(plt, fig, out, name)


def training(plt: Any, r: TrainingResult, out: Path, name: str) -> str:
    shapes = r.shapes
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [s.label for s in next(iter(shapes.values())).scenarios]
    _bars(axes[0], labels, {
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
    return _save(plt, fig, out, name)


def _planned(p: PlanRow) -> float:
    """The planner's T for the cap in force when it is known, else for the cap set."""
    return p.planned_in_force_s if p.planned_in_force_s is not None else p.planned_s


def draw(jobs: Iterable[tuple[str, PlotFn, Any]], out: Path, prefix: str = ""
         ) -> tuple[dict[str, str], list[str]]:
    """Draw each (plot name, plot function, the suite's result) of *jobs* into *out*;
    returns (plot name -> file, errors). One plot failing spoils only itself."""
    plt = _pyplot()
    files, errors = {}, []
    for name, fn, result in jobs:
        try:
            files[name] = fn(plt, result, out, prefix + name)
        except Exception as exc:
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            plt.close("all")
    return files, errors
