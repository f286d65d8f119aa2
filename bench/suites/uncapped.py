"""Reads no cap limits, through the mount and bare (issue 41): fio on a generic file name,
a checkpoint restore with torch.load, whether ``ctl stats`` counts what the kernel read,
and what that counting costs.

With the embedded default policy a read-only open of a class whose reads nothing caps
(``default`` included) is passed through to the kernel, and two BPF programs count its
reads into the class's counters (:mod:`qosfs.passthrough.read_counting`). On each area of
the run (the scratch tmpfs, and the disk area: ext4 on the VM's disk here), page-cached:

* ``fio``: ``bench/jobs/generic-read.fio`` on ``misc/fio-test.bin`` (1 GiB; quick:
  256 MiB): 4 KiB random reads at queue depth 1, the same with 4 jobs, 128 KiB random
  reads, 1 MiB sequential O_DIRECT reads; bare and through qosfs, alternating, each the
  median of its repetitions; the ratio is qosfs over bare;
* ``counted``: for each fio run through the mount, the ``default`` class's read bytes in
  ``ctl stats`` (after the daemon's next drain) over what fio read: 1.00 on a filesystem
  the counting sees; on tmpfs (which it does not) no figure, and the reason
  ``ctl status`` gives for the class's uncounted opens in its place;
* ``cost``: 4 KiB random reads at queue depth 1 through a mount with the counting and
  one with ``--no-read-counting``, alternating (and which goes first), the median of
  each's IOPS, and the median over the pairs of fio's CPU time per read with over
  without (the steadier figure on a shared machine);
* ``restore``: ``torch.load`` of a checkpoint (2 GiB of tensors; quick: 256 MiB) named
  ``checkpoints/model.pt``, cold (caches dropped) and warm, bare and through qosfs
  alternating, the median of the repetitions.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.core.context import Run
from bench.core.fio import FioError, FioMetrics, run_job
from bench.core.system import REPO, BenchError, describe_disk, drop_caches, wait_quiet
from bench.core.tables import Plots, Rows, ratio, table, verdict
from bench.core.typed import Record
from qosfs.control.ctl import call

JOB = REPO / "bench" / "jobs" / "generic-read.fio"
FILE = "misc/fio-test.bin"
CHECKPOINT = "checkpoints/model.pt"
#: (name, RW, BS, NUMJOBS, DIRECT)
SHAPES = (("4k QD1", "randread", "4k", 1, 0), ("4k 4 jobs", "randread", "4k", 4, 0),
          ("128k", "randread", "128k", 1, 0), ("1m direct", "read", "1m", 1, 1))
AREAS = ("tmpfs", "disk")
AT_LEAST = 0.9  # the floor for every fio shape and the restore
COUNT_WITHIN = 0.02  # counted bytes within 2% of fio's
COST_AT_MOST = 0.05  # the counting may cost at most 5% of 4 KiB QD1 reads


@dataclass(frozen=True, kw_only=True)
class FioShape(Record):
    area: str
    shape: str
    bare_iops: float
    qosfs_iops: float
    bare_mb_s: float
    qosfs_mb_s: float
    counted: float | None  # ctl stats' read bytes of the class / fio's bytes (median)


@dataclass(frozen=True, kw_only=True)
class Restore(Record):
    area: str
    phase: str  # "cold" or "warm"
    bare_s: float
    qosfs_s: float


@dataclass(frozen=True, kw_only=True)
class UncappedResult(Record):
    """bench.uncapped: every figure measured; what could not run is in ``errors``."""

    file_mib: int
    checkpoint_mib: int
    runtime_s: float
    reps: int
    disk: str | None
    shapes: list[FioShape]
    counting: dict[str, str]  # area -> ctl status's read_counting state and reason
    cost_with_iops: list[float]
    cost_without_iops: list[float]
    restores: list[Restore]
    errors: dict[str, str] = field(default_factory=dict)
    # fio's CPU time per read (ns), the same runs as cost_*_iops: FioMetrics.cpu_ns_per_io.
    cost_with_cpu_ns: list[float] = field(default_factory=list)
    cost_without_cpu_ns: list[float] = field(default_factory=list)


def _fio(run: Run, root: Path, shape: tuple[str, str, str, int, int], size_mib: int,
         runtime: float) -> tuple[float, float, int]:
    """(IOPS, MB/s, bytes read) of one fio run of *shape* on *root*."""
    m = _fio_metrics(run, root, shape, size_mib, runtime)
    return m.iops, m.bw_bytes / 1e6, m.io_bytes


def _fio_metrics(run: Run, root: Path, shape: tuple[str, str, str, int, int], size_mib: int,
                 runtime: float) -> FioMetrics:
    _, rw, bs, jobs, direct = shape
    env = {"FILE": FILE, "SIZE": f"{size_mib}m", "RW": rw, "BS": bs, "NUMJOBS": str(jobs),
           "DIRECT": str(direct), "RUNTIME": str(int(runtime))}
    m, _, _ = run_job(run.fio, JOB, str(root), env)
    assert m is not None
    return m


def _class_read_bytes(socket: str, cls: str = "default") -> int:
    stats = call(socket, {"cmd": "stats"})
    return sum(int(a["read_bytes"]) for a in stats["accounts"] if a["class"] == cls)


def _counting(socket: str) -> dict[str, Any]:
    status = call(socket, {"cmd": "status"})
    found: dict[str, Any] = status.get("passthrough", {}).get("read_counting") or {}
    return found


def _uncounted(socket: str) -> str | None:
    """Why the ``default`` class's passed-through opens were not counted, if the daemon
    says they were not (a tmpfs source: its reads take shmem's path, which the counting
    tracepoints do not see), else None. A 0 in the table would read as a miss."""
    found = _counting(socket).get("uncounted_opens", {}).get("default") or {}
    return "; ".join(sorted(found)) or None


def _counted_after(socket: str, before: int, expected: int) -> float:
    """The class's read bytes since *before* over *expected*, once the daemon's drains
    (every 0.5 s) have added all the kernel counted: when the figure has not moved for
    a second, or after 5 s."""
    deadline = time.monotonic() + 5.0
    last, since = -1, time.monotonic()
    while True:
        got = _class_read_bytes(socket) - before
        now = time.monotonic()
        if got != last:
            last, since = got, now
        elif now - since >= 1.0 or now > deadline:
            return got / expected if expected else 0.0
        time.sleep(0.1)


def _fio_area(run: Run, area: str, source: Path, size_mib: int, runtime: float,
              reps: int) -> tuple[list[FioShape], str]:
    (source / "misc").mkdir(exist_ok=True)
    with open(source / FILE, "wb") as f:
        for _ in range(size_mib):
            f.write(os.urandom(1 << 20))
    subprocess.run(["cat", str(source / FILE)], stdout=subprocess.DEVNULL, check=True)
    shapes = []
    with run.mount(source) as mounted:
        state = _counting(mounted.socket)
        said = f"{state.get('state', '?')}: {state.get('reason', '?')}"
        for shape in SHAPES:
            bare: list[tuple[float, float]] = []
            via: list[tuple[float, float]] = []
            counted: list[float] = []
            for _ in range(reps):
                wait_quiet(run.quiet_wait)
                iops, mbs, _ = _fio(run, source, shape, size_mib, runtime)
                bare.append((iops, mbs))
                before = _class_read_bytes(mounted.socket)
                iops, mbs, nbytes = _fio(run, mounted.path, shape, size_mib, runtime)
                via.append((iops, mbs))
                counted.append(_counted_after(mounted.socket, before, nbytes))
            why_not = _uncounted(mounted.socket)
            if why_not is not None:
                said = f"not counted: {why_not}"
            shapes.append(FioShape(
                area=area, shape=shape[0],
                bare_iops=statistics.median(i for i, _ in bare),
                qosfs_iops=statistics.median(i for i, _ in via),
                bare_mb_s=statistics.median(m for _, m in bare),
                qosfs_mb_s=statistics.median(m for _, m in via),
                counted=None if why_not is not None else statistics.median(counted)))
            got = shapes[-1]
            run.log(f"  uncapped {area} {shape[0]}: bare {got.bare_iops:,.0f} IOPS, "
                    f"qosfs {got.qosfs_iops:,.0f} IOPS, counted "
                    + ("not" if got.counted is None else f"{got.counted:.3f}"))
    return shapes, said


def _cost(run: Run, source: Path, size_mib: int, runtime: float,
          reps: int) -> tuple[list[float], list[float], list[float], list[float]]:
    """4 KiB QD1 with and without the counting, alternating mounts (which goes first
    alternates too): IOPS with, without, fio's CPU ns per read with, without."""
    with_, without, with_cpu, without_cpu = [], [], [], []
    sides: tuple[tuple[tuple[str, ...], list[float], list[float]], ...] = (
        ((), with_, with_cpu), (("--no-read-counting",), without, without_cpu))
    for rep in range(reps):
        for extra, iops, cpu in (sides if rep % 2 == 0 else sides[::-1]):
            with run.mount(source, extra=extra) as mounted:
                wait_quiet(run.quiet_wait)
                m = _fio_metrics(run, mounted.path, SHAPES[0], size_mib, runtime)
                iops.append(m.iops)
                cpu.append(m.cpu_ns_per_io())
    return with_, without, with_cpu, without_cpu


_SAVE = """
import sys, torch
n = int(sys.argv[2]) // 4 // 8
torch.save({f"layer{i}.weight": torch.rand(n) for i in range(8)}, sys.argv[1])
"""
_LOAD = """
import sys, time, torch
t = time.perf_counter()
state = torch.load(sys.argv[1], weights_only=True)
print(time.perf_counter() - t)
"""


def _torch(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                          text=True, timeout=900)
    if done.returncode != 0:
        raise BenchError(done.stderr.strip().splitlines()[-1] if done.stderr.strip()
                         else f"python exited with {done.returncode}")
    return done.stdout.strip()


def _restores(run: Run, area: str, source: Path, mib: int, reps: int) -> list[Restore]:
    """Cold and warm restores, bare and through qosfs alternating, the median of *reps*."""
    (source / "checkpoints").mkdir(exist_ok=True)
    _torch(_SAVE, str(source / CHECKPOINT), str(mib << 20))
    os.sync()
    out = []
    with run.mount(source) as mounted:
        for phase in ("cold", "warm"):
            times: dict[str, list[float]] = {"bare": [], "qosfs": []}
            for _ in range(reps):
                for side, root in (("bare", source), ("qosfs", mounted.path)):
                    wait_quiet(run.quiet_wait)
                    if phase == "cold":
                        drop_caches()
                    else:
                        _torch(_LOAD, str(root / CHECKPOINT))  # the warm-up read
                    times[side].append(float(_torch(_LOAD, str(root / CHECKPOINT))))
            got = Restore(area=area, phase=phase, bare_s=statistics.median(times["bare"]),
                          qosfs_s=statistics.median(times["qosfs"]))
            out.append(got)
            run.log(f"  uncapped restore {area} {phase}: bare {got.bare_s:.2f} s, "
                    f"qosfs {got.qosfs_s:.2f} s")
    return out


def run(run: Run) -> UncappedResult:
    size_mib = int(run.pick(1024, 256))
    ckpt_mib = int(run.pick(2048, 256))
    runtime = run.pick(10, 3)
    reps = run.repetitions(3, 1)
    errors: dict[str, str] = {}
    areas = [("tmpfs", run.scratch("uncapped"))]
    if run.disk is not None:
        areas.append(("disk", run.scratch("uncapped", "disk")))
    else:
        errors["disk"] = "no disk area in this run (--disk-dir '')"
    shapes: list[FioShape] = []
    counting: dict[str, str] = {}
    restores: list[Restore] = []
    cost_with: list[float] = []
    cost_without: list[float] = []
    cpu_with: list[float] = []
    cpu_without: list[float] = []
    for area, source in areas:
        try:
            got, counting[area] = _fio_area(run, area, source, size_mib, runtime, reps)
            shapes += got
        except (BenchError, FioError, OSError) as exc:
            errors[f"{area} fio"] = str(exc).strip().splitlines()[0]
        if area == "disk":
            try:
                cost_with, cost_without, cpu_with, cpu_without = _cost(
                    run, source, size_mib, runtime, run.repetitions(6, 2))
            except (BenchError, FioError, OSError) as exc:
                errors["cost"] = str(exc).strip().splitlines()[0]
        try:
            restores += _restores(run, area, source, ckpt_mib, reps)
        except (BenchError, OSError, subprocess.TimeoutExpired) as exc:
            errors[f"{area} restore"] = str(exc).strip().splitlines()[0]
    disk = describe_disk(areas[-1][1]) if run.disk is not None else None
    return UncappedResult(file_mib=size_mib, checkpoint_mib=ckpt_mib, runtime_s=runtime,
                          reps=reps, disk=disk, shapes=shapes, counting=counting,
                          cost_with_iops=cost_with, cost_without_iops=cost_without,
                          cost_with_cpu_ns=cpu_with, cost_without_cpu_ns=cpu_without,
                          restores=restores, errors=errors)


# -- its part of REPORT.md --


def _cost_ratio(r: UncappedResult) -> float | None:
    if not r.cost_with_iops or not r.cost_without_iops:
        return None
    return 1 - statistics.median(r.cost_with_iops) / statistics.median(r.cost_without_iops)


def _cpu_cost_ratio(r: UncappedResult) -> float | None:
    """The median over adjacent pairs of mounts of (CPU per read with the counting /
    without) - 1: each pair ran back to back, so slow drift of the machine cancels."""
    pairs = [w / wo - 1 for w, wo in zip(r.cost_with_cpu_ns, r.cost_without_cpu_ns,
                                         strict=False) if wo]
    return statistics.median(pairs) if pairs else None


def headline(r: UncappedResult) -> Rows:
    """Issue 41's acceptance: fio and the restore against bare, counting, its cost."""
    rows = []
    for s in r.shapes:
        x = s.qosfs_iops / s.bare_iops if s.bare_iops else None
        rows.append([f"uncapped fio {s.shape} ({s.area}): qosfs / bare", ratio(x),
                     f"≥ {AT_LEAST}", verdict(None if x is None else x >= AT_LEAST)])
    for rs in r.restores:
        x = rs.bare_s / rs.qosfs_s if rs.qosfs_s else None
        rows.append([f"uncapped restore torch.load ({rs.area}, {rs.phase}): qosfs / bare "
                     "speed", ratio(x), f"≥ {AT_LEAST}",
                     verdict(None if x is None else x >= AT_LEAST)])
    for s in r.shapes:
        if s.area == "disk" and s.counted is not None:
            ok = abs(s.counted - 1) <= COUNT_WITHIN
            rows.append([f"uncapped counted {s.shape} (disk): ctl stats / fio bytes",
                         ratio(s.counted, 3), f"1 ± {COUNT_WITHIN}", verdict(ok)])
    for what, cost in (("", _cost_ratio(r)), (", CPU per read", _cpu_cost_ratio(r))):
        if cost is None and what:
            continue  # a result from before the CPU figure was kept
        rows.append([f"uncapped: the counting's cost on 4k QD1 reads (disk){what}",
                     "—" if cost is None else f"{cost * 100:+.1f}%",
                     f"≤ {COST_AT_MOST * 100:.0f}%",
                     verdict(None if cost is None else cost <= COST_AT_MOST)])
    return rows


def section(plots: Plots, r: UncappedResult) -> list[str]:
    lines = ["## Reads no cap limits: passed through, and counted", "",
             f"`{FILE}` ({r.file_mib} MiB, page-cached) read by fio "
             f"(`bench/jobs/generic-read.fio`, {r.runtime_s:g} s, median of {r.reps}), "
             "bare and through qosfs with the embedded default policy (the `default` "
             "class: no cap, so its reads are passed through to the kernel). `counted`: "
             "the class's read bytes in `ctl stats` over fio's.", ""]
    rows = [[s.area, s.shape, f"{s.bare_iops:,.0f}", f"{s.qosfs_iops:,.0f}",
             ratio(s.qosfs_iops / s.bare_iops if s.bare_iops else None),
             f"{s.bare_mb_s:,.0f}", f"{s.qosfs_mb_s:,.0f}",
             "—" if s.counted is None else f"{s.counted:.3f}"] for s in r.shapes]
    lines += [*table(["area", "shape", "bare IOPS", "qosfs IOPS", "ratio", "bare MB/s",
                      "qosfs MB/s", "counted"], rows), ""]
    for area, said in sorted(r.counting.items()):
        lines.append(f"- counting on {area}: {said}")
    cost = _cost_ratio(r)
    if cost is not None:
        lines += ["", f"The counting's cost (disk, 4 KiB QD1, {len(r.cost_with_iops)} "
                  "alternating mounts each): "
                  f"{statistics.median(r.cost_with_iops):,.0f} IOPS with it, "
                  f"{statistics.median(r.cost_without_iops):,.0f} with "
                  f"`--no-read-counting`: {cost * 100:+.1f}%."]
    cpu_cost = _cpu_cost_ratio(r)
    if cpu_cost is not None:
        lines += ["", "fio's own CPU time per read in the same runs (steal time from other "
                  "VMs is not in it, so it drifts less than the IOPS): "
                  f"{statistics.median(r.cost_with_cpu_ns):,.0f} ns with the counting, "
                  f"{statistics.median(r.cost_without_cpu_ns):,.0f} ns without; per pair "
                  "of mounts run back to back, "
                  + ", ".join(f"{w / wo - 1:+.1%}" for w, wo in
                              zip(r.cost_with_cpu_ns, r.cost_without_cpu_ns, strict=False))
                  + f": median {cpu_cost * 100:+.1f}%."]
    if r.restores:
        lines += ["", f"`torch.load` of `{CHECKPOINT}` ({r.checkpoint_mib} MiB of "
                  f"tensors), cold (caches dropped) and warm, median of {r.reps}:", ""]
        lines += table(["area", "phase", "bare s", "qosfs s", "qosfs / bare speed"],
                       [[x.area, x.phase, f"{x.bare_s:.2f}", f"{x.qosfs_s:.2f}",
                         ratio(x.bare_s / x.qosfs_s if x.qosfs_s else None)]
                        for x in r.restores])
    lines += ["", *(f"- Not measured, {where}: {why}." for where, why in r.errors.items()),
              f"- disk area: {r.disk or 'none'}.", ""]
    return lines
