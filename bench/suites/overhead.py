"""Overhead: the same fio workload on the native directory and through qosfs, side by side.

Sides: ``native`` (the scratch directory itself), ``no-qos`` (qosfs ``--no-qos``: the
pass-through that only counts) and ``policy`` (a policy whose caps are far above any
demand: every request runs the whole token-bucket path and never waits). ``no-qos`` /
``native`` is the cost of the FUSE pass-through; ``policy`` / ``no-qos`` is the cost of the
QoS machinery (the figure held to 5%). How the sides run: :mod:`bench.core.sides`, shared
with :mod:`bench.suites.metadata` (which adds a ``meta_iops`` cap).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.core.context import Run
from bench.core.plotting import bars, save
from bench.core.sides import GB, GENEROUS_POLICY, Group, Row, SummaryRow, run_groups
from bench.core.tables import (
    MACHINERY_MIN,
    Plots,
    Rows,
    pct,
    per_metric,
    plot,
    policy_block,
    ratio,
    table,
    us,
    verdict,
)
from bench.core.typed import Json, Record


@dataclass(frozen=True, kw_only=True)
class OverheadResult(Record):
    summary: list[SummaryRow]
    policy: str
    caches_dropped: bool = False
    groups: Json = None  # per group: env, error, every fio record per side


def data_groups(run: Run) -> list[Group]:
    """The overhead suite: ML shapes on tmpfs (the pass-through's own cost) and on disk."""
    size = "256m" if run.quick else "1g"
    runtime = str(int(run.pick(5, 3)))
    base = {"SIZE": size, "RUNTIME": runtime}
    groups = [
        Group("seqread", "seqread", [
            Row("seqread-buffered", "1 MiB seq read, buffered (cold)", "bw", 1.5 * GB),
            Row("seqread-direct", "1 MiB seq read, direct=1", "bw", 3.0 * GB),
        ], env=base),
        Group("checkpoint", "checkpoint",
              [Row("checkpoint", "checkpoint dump: 1 MiB seq write + fsync, 1 writer", "bw")],
              env={"SIZE": size, "NUMJOBS": "1"}),
        Group("randread", "randread",
              [Row("randread-1", "4 KiB rand read, direct=1, QD1", "iops", 25e3)],
              env={**base, "NUMJOBS": "1", "DIRECT": "1"}),
        Group("dataset", "dataset",
              [Row("dataset", "dataset: rand read 4K-1M, 4 jobs, direct=1", "bw")],
              env={**base, "SIZE": "512m" if not run.quick else "256m", "NUMJOBS": "4"}),
    ]
    if run.disk is not None:
        groups += [
            Group("disk-checkpoint", "checkpoint",
                  [Row("disk-checkpoint", "disk: checkpoint dump, 1 writer + fsync", "bw")],
                  area="disk", env={"SIZE": "256m" if run.quick else "512m", "NUMJOBS": "1"}),
            Group("disk-dataset", "dataset",
                  [Row("disk-dataset", "disk: dataset rand read 4K-1M, 4 jobs", "bw")],
                  area="disk", env={**base, "SIZE": "256m", "NUMJOBS": "4"}),
        ]
    return groups


def run(run: Run) -> OverheadResult:
    """The overhead suite (see the module docstring)."""
    result = run_groups(run, data_groups(run))
    result["policy"] = GENEROUS_POLICY.strip()
    return OverheadResult.from_json(result)


# -- its part of REPORT.md --


def headline(ov: OverheadResult) -> Rows:
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


def section(plots: Plots, r: OverheadResult) -> list[str]:
    rows = []
    for s in r.summary:
        rt = s.ratio_to_native
        if s.error:
            rows.append([s.label, f"error: {s.error}", *[""] * 8])
            continue
        rows.append([
            s.label, *(per_metric(s.metric, s.side(k)) for k in ("native", "no-qos", "policy")),
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
        *policy_block(r.policy),
    ]


def chart(plt: Any, r: OverheadResult, out: Path, name: str) -> str:
    rows = [s for s in r.summary if not s.error]
    fig, ax = plt.subplots(figsize=(9, 4))
    bars(ax, [s.key for s in rows], {
        "no-qos / native": [s.ratio_to_native.get("no-qos") for s in rows],
        "policy / native": [s.ratio_to_native.get("policy") for s in rows],
        "policy / no-qos": [s.machinery for s in rows]}, "ratio (higher is better)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(0.95, color="red", lw=0.8, ls="--", label="0.95")
    ax.set_title("Overhead: throughput ratios (same run)")
    return save(plt, fig, out, name)
