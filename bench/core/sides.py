"""Workloads side by side: the same fio job on the native directory and through qosfs
mounts, for the overhead suite (:mod:`bench.suites.overhead`) and the metadata suite
(:mod:`bench.suites.metadata`, which adds sides and kinds of workload).

Sides: ``native`` (the scratch directory itself), ``no-qos`` (qosfs ``--no-qos``: the
pass-through that only counts) and ``policy`` (a policy whose caps are far above any
demand: every request runs the whole token-bucket path and never waits). ``no-qos`` /
``native`` is the cost of the FUSE pass-through; ``policy`` / ``no-qos`` is the cost of the
QoS machinery (the figure held to 5%).

Each side has its own copy of the files (``native/``, ``backing-<side>/``), each qosfs side
a fresh daemon per group of workloads, so one group's failure does not spoil the next.
Every workload runs on every side in the same run, the order rotating from one repetition
to the next, and the figure reported is the median over repetitions. Before every run the
page cache, dentries and inodes are dropped: tmpfs keeps its data (its pages are the
files), a FUSE mount loses its cached pages, so qosfs sides start cold.
"""

from __future__ import annotations

import os
import resource
import shlex
import shutil
import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from bench.core import fio as fiolib
from bench.core.context import Mounted, Run
from bench.core.fio import JOBS_DIR, FioError
from bench.core.system import BenchError, CpuWatch, drop_caches, wait_quiet
from bench.core.typed import Record

GB = 1e9

# Caps far above what this machine (or any single mount) can move: the limiter charges
# every request at every level and never parks one. cache = "keep" in every class: a
# read cap would otherwise make the class bypass the page cache (cache = "auto"), a
# different I/O path than the no-qos side (buffered reads ran 2.5x faster that way),
# and this figure is about the machinery, not that choice.
GENEROUS_POLICY = """
[classes.checkpoints]
paths = ["**/*.distcp", "**/checkpoints/**"]
write_bandwidth = "64GiB/s"
write_iops = "10M"
cache = "keep"

[classes.datasets]
paths = ["**/*.tfrecord", "data/**"]
priority = "high"
read_bandwidth = "64GiB/s"
read_iops = "10M"
meta_iops = "10M"
cache = "keep"

[classes.default]
read_bandwidth = "64GiB/s"
write_bandwidth = "64GiB/s"
read_iops = "10M"
write_iops = "10M"
meta_iops = "10M"
cache = "keep"
"""


# -- the figures of a row, as the suites' records hold them --


@dataclass(frozen=True, kw_only=True)
class SideFigures(Record):
    """One side of a row: medians over its repetitions."""

    value: float | None  # the row's figure: bytes/s or ops/s
    reps: int
    clat_p50_us: float | None
    clat_p99_us: float | None
    clat_p999_us: float | None
    daemon_cpu_pct: float | None


@dataclass(frozen=True, kw_only=True)
class SummaryRow(Record):
    key: str
    label: str
    group: str
    area: str
    metric: str  # "bw" or "iops"
    target: float | None
    sides: dict[str, SideFigures]
    ratio_to_native: dict[str, float]
    machinery: float | None  # policy / no-qos
    error: str | None
    max_other_cpu_pct: float | None

    def side(self, name: str, what: str = "value") -> float | None:
        """A figure of side *name* (None when the side did not run)."""
        s = self.sides.get(name)
        return None if s is None else getattr(s, what)

    def over(self, a: str, b: str) -> float | None:
        """Side *a*'s figure / side *b*'s, when both ran."""
        va, vb = self.side(a), self.side(b)
        return va / vb if va is not None and vb else None


@dataclass(frozen=True)
class Side:
    """Where a workload runs: the native directory, or a qosfs mount of its own copy."""

    name: str
    policy: str | None = None  # TOML text; None with no_qos=False is the default policy
    no_qos: bool = False

    @property
    def is_native(self) -> bool:
        return self.name == "native"


NATIVE = Side("native")
NO_QOS = Side("no-qos", no_qos=True)
POLICY = Side("policy", GENEROUS_POLICY)


@dataclass(frozen=True)
class Row:
    """One line of the report: a figure, its unit and the target for the no-qos side."""

    key: str
    label: str
    metric: str  # "bw" (bytes/s) or "iops" (ops/s)
    target: float | None = None

    def value(self, m: dict[str, Any]) -> float:
        return float(m["bw_bytes"] if self.metric == "bw" else m["iops"])


@dataclass
class Group:
    """Workloads that share mounts and laid-out files; ``kind`` names the method that
    runs them (``Runner._kind_<kind>``)."""

    name: str
    kind: str
    rows: list[Row]
    area: str = "tmpfs"  # or "disk"
    sides: tuple[Side, ...] = (NATIVE, NO_QOS, POLICY)
    env: dict[str, str] = field(default_factory=dict)
    reps: int = 3  # repetitions in a full run (quick: 1)
    # filled by the runner: row key -> side -> per-repetition records
    runs: dict[str, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)
    error: str | None = None
    elapsed: float = 0.0


class Runner:
    def __init__(self, run: Run) -> None:
        self.run = run
        self.turn = 0  # rotates which side goes first
        self.caches_dropped = True
        self.backing: dict[str, str] = {}  # qosfs side -> the directory its mount serves
        self.mounts: dict[str, Mounted] = {}

    # --------------------------------------------------------------- measuring

    def measure(self, job: str, directory: str, env: dict[str, str],
                mounted: Mounted | None, extra: tuple[str, ...] = ()) -> dict[str, Any]:
        """Drop caches, run one fio job, return its figures plus CPU accounting."""
        self.caches_dropped &= drop_caches()
        waited, busy_before = wait_quiet(self.run.quiet_wait)
        kids0 = _child_cpu()
        watch = CpuWatch(mounted.mount if mounted else None)
        metrics, doc, cmd = fiolib.run_job(self.run.fio, JOBS_DIR / job, directory, env, extra,
                                           cwd=str(self.run.work))
        cpu = watch.figures()
        wall, busy = cpu["wall_s"], cpu["machine_busy_pct"]
        assert metrics is not None and doc is not None
        rec: dict[str, Any] = metrics.to_dict()
        rec.update(command=shlex.join(cmd), wall_s=round(wall, 3),
                   machine_busy_pct=round(busy, 1), busy_before_pct=round(busy_before, 1),
                   quiet_wait_s=round(waited, 2))
        fio_cpu = _child_cpu() - kids0  # fio and its job processes, set-up included
        daemon_cpu = 0.0
        if cpu["daemon_cpu_pct"] is not None:
            rec["daemon_cpu_pct"] = round(cpu["daemon_cpu_pct"], 1)
            daemon_cpu = cpu["daemon_cpu_pct"] / 100 * wall
        # CPU the machine spent on anything but fio and our daemon (other tenants, kernel
        # threads, this runner), in percent of one CPU: a noisy neighbour shows up here.
        other = busy / 100 * len(os.sched_getaffinity(0)) * wall - fio_cpu - daemon_cpu
        rec["other_cpu_pct"] = round(max(0.0, 100 * other / wall), 1)
        return rec

    def sides(self, group: Group, dirs: dict[str, str]) -> list[tuple[Side, str]]:
        order = [(s, dirs[s.name]) for s in group.sides]
        k = self.turn % len(order)
        self.turn += 1
        return order[k:] + order[:k]

    def record(self, group: Group, row: Row, side: Side, rec: dict[str, Any]) -> None:
        group.runs.setdefault(row.key, {}).setdefault(side.name, []).append(rec)
        value = row.value(rec)
        shown = f"{value / GB:.2f} GB/s" if row.metric == "bw" else f"{value:.0f} ops/s"
        self.run.log(f"  {row.key:18s} {side.name:8s} {shown}  p99 {rec['clat_p99_us']:.0f} us"
                     + (f"  daemon {rec['daemon_cpu_pct']:.0f}% CPU"
                        if "daemon_cpu_pct" in rec else "")
                     + (f"  other load {rec['other_cpu_pct']:.0f}%"
                        if rec["other_cpu_pct"] >= 20 else ""))

    # --------------------------------------------------------------- groups

    def run_group(self, group: Group) -> None:
        top = self.run.scratch(group.name, group.area)
        dirs: dict[str, str] = {}
        mounts: dict[str, Mounted] = {}
        try:
            with ExitStack() as stack:
                for side in group.sides:
                    sub = top / ("native" if side.is_native else f"backing-{side.name}")
                    sub.mkdir()
                    dirs[side.name] = str(sub)
                    if not side.is_native:
                        m = stack.enter_context(self.run.mount(
                            sub, side.policy, no_qos=side.no_qos))
                        mounts[side.name] = m
                        dirs[side.name] = str(m.path)
                self.backing = {s.name: str(top / f"backing-{s.name}")
                                for s in group.sides if not s.is_native}
                self.mounts = mounts
                getattr(self, f"_kind_{group.kind}")(group, dirs)
        finally:
            shutil.rmtree(top, ignore_errors=True)

    def _run_rows(self, group: Group, job: str, dirs: dict[str, str],
                  variants: list[tuple[Row, dict[str, str]]]) -> None:
        # One discarded run per side first (time-based jobs for 1 s): a side's first run
        # pays for what the others find ready -- on ext4 the first dump into a fresh
        # directory ran at half speed (246 vs 448-489 MiB/s), and a new daemon has cold
        # Python paths and an empty inode table -- whichever side draws it.
        for side, d in self.sides(group, dirs):
            self.measure(job, d, {**variants[0][1], "RUNTIME": "1"}, self.mounts.get(side.name))
        for row, env in variants:
            for _ in range(self.run.repetitions(group.reps)):
                for side, d in self.sides(group, dirs):
                    rec = self.measure(job, d, env, self.mounts.get(side.name))
                    self.record(group, row, side, rec)

    def layout(self, job: str, env: dict[str, str], native: str, rel: str = "",
               extra: tuple[str, ...] = ()) -> None:
        """Lay out a job's files (untimed) in the native directory *native*/*rel* and copy
        them to every qosfs side's backing directory: writing them through qosfs would only
        make the set-up slower."""
        src = os.path.join(native, rel)
        fiolib.run_job(self.run.fio, JOBS_DIR / job, src, env, ("--create_only=1", *extra),
                       parse=False, cwd=str(self.run.work))
        for backing in self.backing.values():
            dst = os.path.join(backing, rel)
            for entry in os.scandir(src):
                if entry.is_file(follow_symlinks=False):
                    shutil.copyfile(entry.path, os.path.join(dst, entry.name))

    def _kind_seqread(self, group: Group, dirs: dict[str, str]) -> None:
        self.layout("seqread.fio", {**group.env, "DIRECT": "0"}, dirs["native"])
        self._run_rows(group, "seqread.fio", dirs, [
            (row, {**group.env, "DIRECT": direct})
            for row, direct in zip(group.rows, "01", strict=False)])

    def _kind_checkpoint(self, group: Group, dirs: dict[str, str]) -> None:
        self._run_rows(group, "checkpoint.fio", dirs, [(group.rows[0], group.env)])

    def _kind_randread(self, group: Group, dirs: dict[str, str]) -> None:
        self.layout("randread.fio", group.env, dirs["native"])
        self._run_rows(group, "randread.fio", dirs, [(group.rows[0], group.env)])

    def _kind_dataset(self, group: Group, dirs: dict[str, str]) -> None:
        self.layout("dataset.fio", group.env, dirs["native"])
        self._run_rows(group, "dataset.fio", dirs, [(group.rows[0], group.env)])


def run_groups(run: Run, groups: list[Group], runner_cls: type[Runner] = Runner
               ) -> dict[str, Any]:
    """Run *groups* (each failure recorded in its group); return their summary and runs."""
    runner = runner_cls(run)
    for g in groups:
        run.log(f"{g.name} ({g.area}):")
        t0 = time.monotonic()
        try:
            runner.run_group(g)
        except (FioError, BenchError, OSError) as exc:
            g.error = str(exc).splitlines()[0][:300]
            run.log(f"  {g.name} failed: {g.error}")
        g.elapsed = time.monotonic() - t0
    return {
        "summary": summarize(groups),
        "caches_dropped": runner.caches_dropped,
        "groups": [{"name": g.name, "area": g.area, "sides": [s.name for s in g.sides],
                    "env": g.env, "error": g.error,
                    "elapsed_s": round(g.elapsed, 1), "runs": g.runs} for g in groups],
    }


def _child_cpu() -> float:
    """CPU seconds of our waited-for children (fio and the job processes it reaped)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _median_of(recs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in recs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarize(groups: list[Group]) -> list[dict[str, Any]]:
    """Per row and side: medians of the figure, p50/p99/p99.9 and daemon CPU; ratios of
    every side to native, and of ``policy`` to ``no-qos``."""
    out = []
    for g in groups:
        for row in g.rows:
            runs = g.runs.get(row.key, {})
            sides: dict[str, dict[str, Any]] = {}
            for side in g.sides:
                recs = runs.get(side.name, [])
                vals = [row.value(r) for r in recs]
                sides[side.name] = {
                    "value": statistics.median(vals) if vals else None,
                    "reps": len(vals),
                    **{k: _median_of(recs, k) for k in (
                        "clat_p50_us", "clat_p99_us", "clat_p999_us", "daemon_cpu_pct")},
                }
            nat = sides.get("native", {}).get("value")
            ratios = {name: s["value"] / nat for name, s in sides.items()
                      if name != "native" and s["value"] is not None and nat}
            noq, pol = sides.get("no-qos", {}).get("value"), sides.get("policy", {}).get("value")
            out.append({
                "key": row.key, "label": row.label, "group": g.name, "area": g.area,
                "metric": row.metric, "target": row.target, "sides": sides,
                "ratio_to_native": ratios,
                "machinery": pol / noq if pol is not None and noq else None,
                "error": g.error,
                "max_other_cpu_pct": max((r["other_cpu_pct"] for side in runs.values()
                                          for r in side), default=None),
            })
    return out
