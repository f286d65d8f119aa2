"""Small files, side by side: what a loader of small files gets through each FUSE daemon,
against the bare storage, with the round trips each file costs (issue 40).

One tree of small files (under ``data/``, so the default policy classifies them as
``datasets``) on each area of the run: the scratch tmpfs and the disk area (ext4 on the
VM's disk here). Each side reads it with 1, 4 and 16 threads of one process (open, read
whole, close; every file once per pass, :func:`bench.core.epochs.read_files`):

* ``bare``: the directory itself;
* ``hp-single``, ``hp-multi``, ``hp-passthrough``: libfuse's ``passthrough_hp``
  (:mod:`bench.core.libfuse_peer`);
* ``pyfuse3``: the least a pyfuse3 daemon does (:mod:`bench.core.floorfs`, one process:
  LOOKUP, OPEN with a backing id kept per inode, RELEASE; no journal, classification or
  descriptor cache), with the pyfuse3 build and busy polling qosfs uses: the floor under
  qosfs's CPU per file, the part that is the transport and the interpreter, not qosfs;
* ``no-qos``: qosfs ``--no-qos``; ``policy``: qosfs with its embedded default policy.

For each side and thread count the daemon is mounted fresh, the caches dropped
(``drop_caches``: page cache, dentries, inodes), and the first pass is ``cold``, the
next ``warm``. Per pass: files/s, the kernel's FUSE requests by opcode (a histogram
trigger on ``fuse_request_send``, :mod:`bench.core.fuse_trace`) per file, and the daemon's
CPU (user + system, /proc/PID/stat) per file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.core.context import Run
from bench.core.epochs import make_tree, read_files
from bench.core.floorfs import clonefs
from bench.core.fuse_trace import FuseTrace
from bench.core.libfuse_peer import PEER_OPTIONS, build_peer, peer_mount
from bench.core.plotting import save
from bench.core.system import REPO, BenchError, cpu_seconds, describe_disk, drop_caches, wait_quiet
from bench.core.tables import Plots, Rows, plot, ratio, table, verdict
from bench.core.typed import Record
from qosfs.daemon.config import MountConfig
from qosfs.policy.loading import default_policy

SIDES = ("bare", "hp-single", "hp-multi", "hp-passthrough", "pyfuse3", "no-qos", "policy")
THREADS = (1, 4, 16)
PHASES = ("cold", "warm")
FILES, QUICK_FILES, FILE_KIB = 8000, 1000, 112
# a file's life, in order; other opcodes follow
OPCODE_ORDER = ("LOOKUP", "GETATTR", "OPEN", "BACKING_OPEN", "READ", "FLUSH", "RELEASE",
                "BACKING_CLOSE")
# issue 40's acceptance, policy against bare on disk, cold, by threads
DISK_COLD_MIN = {1: 0.8, 4: 0.9, 16: 0.9}




@dataclass(frozen=True, kw_only=True)
class Pass(Record):
    """One pass of one side: where, how many threads, cold or warm, and what it gave."""

    area: str  # "tmpfs" or "disk"
    side: str  # one of SIDES
    threads: int
    phase: str  # "cold" or "warm"
    files_s: float
    cpu_us: float | None  # the daemon's CPU per file (None: bare, or its pid unknown)
    requests: dict[str, float]  # FUSE requests per file, by opcode ({} for bare)


@dataclass(frozen=True, kw_only=True)
class SmallfilesResult(Record):
    """bench.smallfiles: every pass measured; a side that could not run is named in
    ``errors`` ("<area> <side> <threads>" -> one line)."""

    files: int
    file_kib: int
    threads: list[int]
    disk: str | None  # what the disk area is ("ext4 on /dev/vda1, mounted at /")
    peer: str | None  # the passthrough_hp binary measured
    peer_missing: str | None  # why it was not
    trace: str | None  # why requests were not counted ("not available here: ..."), or None
    passes: list[Pass]
    errors: dict[str, str] = field(default_factory=dict)


@contextmanager
def _side(run: Run, side: str, source: Path, peer: str | None,
          missing: str | None) -> Iterator[tuple[Path, int | None]]:
    """(where to read, the daemon's pid) for *side* over *source*, mounted fresh."""
    if side == "bare":
        yield source, None
    elif side.startswith("hp-"):
        if peer is None:
            raise BenchError(f"passthrough_hp not measured: {missing}")
        mnt = run.work / f"smallfiles-{side}"
        log = run.work / f"smallfiles-{side}.log"
        with peer_mount(str(REPO / peer), source, mnt, PEER_OPTIONS[side], log) as pid:
            yield mnt, pid
    elif side == "pyfuse3":
        mnt = run.work / "smallfiles-pyfuse3"
        mnt.mkdir(exist_ok=True)
        poll_us, cache_s = _as_qosfs_defaults()
        with clonefs(source, mnt, run.work, workers=1, burn_us=0, poll_us=poll_us,
                     cache_s=cache_s) as (pids, _):
            yield mnt, pids[0]
    else:
        with run.mount(source, no_qos=side == "no-qos") as mounted:
            yield mounted.path, mounted.mount.pid


def _as_qosfs_defaults() -> tuple[int, float]:
    """What the pyfuse3 side takes from qosfs as users mount it: its busy polling
    (``--busy-poll-us``), and how long the embedded policy lets the kernel keep the
    entries of a dataset (:func:`make_tree`'s files are the ``datasets`` class's)."""
    cfg = MountConfig(source="", mountpoint="")
    datasets = next(c for c in default_policy().classes if c.name == "datasets")
    return cfg.busy_poll_us, datasets.entry_timeout or cfg.fs_options.entry_timeout


def _passes(run: Run, area: str, side: str, source: Path, names: list[str], threads: int,
            peer: str | None, missing: str | None) -> tuple[list[Pass], str | None]:
    """The cold and warm passes of one side at *threads*, and the trace's reason when it
    counted nothing."""
    out = []
    with _side(run, side, source, peer, missing) as (root, pid), \
            FuseTrace(root, pid) as trace:
        for phase in PHASES:
            wait_quiet(run.quiet_wait)
            if phase == "cold":
                drop_caches()
            trace.take()
            cpu0 = cpu_seconds(pid) if pid else None
            rate = read_files(root, names, threads, seed=threads)
            cpu1 = cpu_seconds(pid) if pid else None
            counts = trace.take() if side != "bare" else {}
            out.append(Pass(
                area=area, side=side, threads=threads, phase=phase, files_s=rate,
                cpu_us=None if cpu0 is None or cpu1 is None
                else (cpu1 - cpu0) / len(names) * 1e6,
                requests={op: n / len(names) for op, n in sorted(counts.items())}))
        return out, trace.unavailable if side != "bare" else None


def run(run: Run) -> SmallfilesResult:
    peer, missing = build_peer()
    files = int(run.pick(FILES, QUICK_FILES))
    areas = [("tmpfs", run.scratch("smallfiles"))]
    if run.disk is not None:
        areas.append(("disk", run.scratch("smallfiles", "disk")))
    passes: list[Pass] = []
    errors: dict[str, str] = {}
    if run.disk is None:
        errors["disk"] = "no disk area in this run (--disk-dir '')"
    unavailable = None
    for area, source in areas:
        names = make_tree(source, files, FILE_KIB * 1024)
        os.sync()
        for threads in THREADS:
            for side in SIDES:
                try:
                    got, why = _passes(run, area, side, source, names, threads, peer, missing)
                except (BenchError, OSError) as exc:
                    errors[f"{area} {side} {threads}"] = str(exc).strip().splitlines()[0]
                    continue
                passes += got
                unavailable = unavailable or why
                run.log(f"  smallfiles {area} {side} {threads} threads: " + ", ".join(
                    f"{p.phase} {p.files_s:,.0f}/s" for p in got))
    return SmallfilesResult(
        files=files, file_kib=FILE_KIB, threads=list(THREADS),
        disk=describe_disk(areas[1][1]) if len(areas) > 1 else None, peer=peer,
        peer_missing=missing, trace=unavailable, passes=passes, errors=errors)


# -- its part of REPORT.md --


def _find(r: SmallfilesResult, area: str, side: str, threads: int, phase: str) -> Pass | None:
    return next((p for p in r.passes if (p.area, p.side, p.threads, p.phase)
                 == (area, side, threads, phase)), None)


def files_ratio(r: SmallfilesResult, area: str, side: str, threads: int, phase: str,
                base: str = "bare") -> float | None:
    """*side*'s files/s over *base*'s, same area, threads and phase, when both ran."""
    got, of = _find(r, area, side, threads, phase), _find(r, area, base, threads, phase)
    return got.files_s / of.files_s if got and of and of.files_s else None


def _best_hp(r: SmallfilesResult, area: str, threads: int, phase: str) -> float | None:
    rates = [p.files_s for s in SIDES if s.startswith("hp-")
             if (p := _find(r, area, s, threads, phase))]
    return max(rates) if rates else None


def headline(r: SmallfilesResult) -> Rows:
    """Issue 40's acceptance: the default policy against bare (disk, cold) and against
    passthrough_hp (tmpfs)."""
    rows = []
    for threads in r.threads:
        x = files_ratio(r, "disk", "policy", threads, "cold")
        floor = DISK_COLD_MIN.get(threads, 0.9)
        rows.append([f"smallfiles (disk, cold, {threads} thr): default policy / bare",
                     ratio(x), f"≥ {floor}", verdict(None if x is None else x >= floor)])
    policy = _find(r, "tmpfs", "policy", 16, "warm")
    best = _best_hp(r, "tmpfs", 16, "warm")
    x = policy.files_s / best if policy and best else None
    rows.append(["smallfiles (tmpfs, warm, 16 thr): default policy / best passthrough_hp",
                 ratio(x), "≥ 1", verdict(None if x is None else x >= 1)])
    x = files_ratio(r, "tmpfs", "policy", 16, "cold", "hp-passthrough")
    rows.append(["smallfiles (tmpfs, cold, 16 thr): default policy / passthrough_hp "
                 "kernel passthrough", ratio(x), "≥ 1", verdict(None if x is None else x >= 1)])
    return rows


def _rate(v: float) -> str:
    return f"{v / 1e3:.1f}k" if v >= 1e4 else f"{v:,.0f}"


def _rates_table(r: SmallfilesResult, area: str) -> list[str]:
    rows = []
    for phase in PHASES:
        for threads in r.threads:
            cells = [f"{phase}, {threads}"]
            for side in SIDES:
                p, x = _find(r, area, side, threads, phase), None
                if p is not None and side != "bare":
                    x = files_ratio(r, area, side, threads, phase)
                cells.append("—" if p is None else _rate(p.files_s) if x is None
                             else f"{_rate(p.files_s)} ({x:.2f}×)")
            rows.append(cells)
    return table(["pass, threads", *SIDES], rows)


def _cpu_table(r: SmallfilesResult, area: str) -> list[str]:
    rows = []
    for phase in PHASES:
        for threads in r.threads:
            cells = [f"{phase}, {threads}"]
            for side in SIDES[1:]:
                p = _find(r, area, side, threads, phase)
                cells.append("—" if p is None or p.cpu_us is None else f"{p.cpu_us:.0f}")
            rows.append(cells)
    return table(["pass, threads", *SIDES[1:]], rows)


def _per_file(v: float) -> str:
    return "<0.01" if 0 < v < 0.005 else f"{v:.2f}"


def round_trips_table(r: SmallfilesResult, area: str, threads: int) -> list[str]:
    """FUSE requests per file by opcode, each daemon side cold and warm, at *threads*."""
    picked = [p for side in SIDES[1:] for phase in PHASES
              if (p := _find(r, area, side, threads, phase)) is not None]
    seen = {op for p in picked for op in p.requests}
    ops = [op for op in OPCODE_ORDER if op in seen] + sorted(seen - set(OPCODE_ORDER))
    rows = [[f"{p.side}, {p.phase}", _per_file(sum(p.requests.values())),
             *(_per_file(p.requests[op]) if op in p.requests else "·" for op in ops)]
            for p in picked]
    return table(["side, pass", "all", *ops], rows)


def section(plots: Plots, r: SmallfilesResult) -> list[str]:
    notes = [f"Not measured, {where}: {why}." for where, why in r.errors.items()]
    if r.peer is None:
        notes.append(f"passthrough_hp was not measured: {r.peer_missing}.")
    if r.trace is not None:
        notes.append(f"FUSE requests: {r.trace}.")
    lines = ["## Small files: bare, passthrough_hp, a minimal pyfuse3 daemon and qosfs", "",
             f"{r.files:,} files of {r.file_kib} KiB under `data/`, read by 1, 4 and 16 "
             "threads of one process (open, read whole, close; each file once per pass). "
             "Each side and thread count is mounted fresh; `cold`: the first pass, caches "
             "dropped just before; `warm`: the next. files/s, in brackets the ratio to bare "
             "(same area, pass and threads). The daemon's CPU is counted in clock ticks "
             f"(10 ms over {r.files:,} files: steps of {1e4 / r.files:.0f} µs). "
             "`pyfuse3` is the least a pyfuse3 daemon does with qosfs's pyfuse3 build and "
             "polling (LOOKUP, OPEN answered with a backing id kept per inode, RELEASE; "
             "no journal, classification or descriptor cache; polling and keeping entries "
             "as qosfs's defaults do for datasets): what the transport and the "
             "interpreter cost a file, under qosfs's own work.", "",
             *plot(plots, "smallfiles", "files/s by threads, each area and pass"), ""]
    for area, what in (("tmpfs", "tmpfs"), ("disk", r.disk or "no disk area")):
        if not any(p.area == area for p in r.passes):
            continue
        lines += [f"### {area} ({what})", "", *_rates_table(r, area), "",
                  "The daemon's CPU per file (µs, user + system):", "",
                  *_cpu_table(r, area), ""]
        for threads in (r.threads[0], r.threads[-1]):
            lines += [f"FUSE requests per file, {threads} thread(s) (the kernel's "
                      "`fuse_request_send`, by opcode; `BACKING_*`: the daemon's "
                      "passthrough registrations; FORGETs are not counted):", "",
                      *round_trips_table(r, area, threads), ""]
    lines += [f"passthrough_hp: {r.peer or 'not built'} (`make passthrough-hp`).", "",
              *(f"- {n}" for n in notes), ""]
    return lines


def chart(plt: Any, r: SmallfilesResult, out: Path, name: str) -> str:
    areas = [a for a in ("tmpfs", "disk") if any(p.area == a for p in r.passes)]
    fig, axes = plt.subplots(len(areas), 2, figsize=(10, 3.5 * len(areas)), squeeze=False)
    for row, area in zip(axes, areas, strict=True):
        for ax, phase in zip(row, PHASES, strict=True):
            for side in SIDES:
                pts = [(t, p.files_s) for t in r.threads
                       if (p := _find(r, area, side, t, phase)) is not None]
                if pts:
                    ax.plot([t for t, _ in pts], [v for _, v in pts], marker="o", label=side)
            ax.set_xscale("log", base=2)
            ax.set_xticks(r.threads, [str(t) for t in r.threads])
            ax.set_title(f"{area}, {phase}")
            ax.set_xlabel("threads")
            ax.set_ylabel("files/s")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Small files: files/s by threads")
    return save(plt, fig, out, name)
