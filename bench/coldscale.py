"""Cold small files by number of callers: does a side scale with threads as the disk does?

A loader opens a small file, reads it whole and closes it, on N threads. On the bare disk,
more threads give more files/s (the device serves reads in parallel); a daemon that serves
every read itself must not lose that. This runs the same tree, on a disk-backed directory,
bare, through ``qosfs mount --no-qos`` (every read served by the daemon) and through the
embedded default policy (the tree is under ``data/``: its reads are passed through to the
kernel where the kernel can), at each thread count, with caches dropped before every run::

    python -m bench coldscale [--files 2400] [--kib 112] [--threads 1,4,16] [--rounds 3]
                              [--disk-dir /var/tmp] [SIDE ...]

A SIDE is ``bare``, ``no-qos`` or ``policy``, optionally ``KIND@LABEL=PYTHONPATH``: that
kind with its daemon run from another tree (``no-qos@main=/work/main``), to compare two
builds in one run. Default: ``bare no-qos policy``.

Each round mounts each side once (sides in rotated order) and runs every thread count on
it; the figures are medians over the rounds. Printed per side and thread count: files/s,
the ratio to bare at the same thread count, the ratio to the side's own figure at the
previous thread count, and the daemon's worker-thread hops per file (``ctl status``
``backing_thread_hops``). A side whose median falls from one thread count to the next is
flagged NON-MONOTONIC; the command then exits 1, unless the side is bare (a noisy run,
said in one line).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.core.epochs import make_tree, read_files
from bench.core.system import drop_caches, qosfs_mount, wait_quiet
from qosfs.control.ctl import Client

KINDS = {"bare": None, "no-qos": ["--no-qos"], "policy": []}
THREADS = (1, 4, 16)


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--files", type=int, default=2400)
    p.add_argument("--kib", type=int, default=112, help="size of each file (default 112)")
    p.add_argument("--threads", default=",".join(map(str, THREADS)),
                   help="thread counts, in order (default 1,4,16)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--disk-dir", default="/var/tmp", type=Path,
                   help="a directory on the disk to measure (default /var/tmp)")
    p.add_argument("--quiet-wait", type=float, default=2.0, metavar="SECONDS",
                   help="before each run, wait up to this long for an idle machine")
    p.add_argument("sides", nargs="*", default=list(KINDS),
                   help="bare, no-qos, policy, or KIND@LABEL=PYTHONPATH")


def _hops(sock: Path | None) -> int | None:
    """The daemon's worker-thread hops so far (None: bare, or a daemon that has no count)."""
    if sock is None:
        return None
    with Client(str(sock)) as client:
        hops = client.request({"cmd": "status"}).get("backing_thread_hops")
    return hops if isinstance(hops, int) else None


@contextmanager
def _side(spec: str, src: Path, work: Path) -> Iterator[tuple[Path, Path | None]]:
    """The root a side reads through and its control socket (None for bare)."""
    kind, _, pythonpath = spec.partition("=")
    extra = KINDS[kind.partition("@")[0]]
    if extra is None:
        yield src, None
        return
    label = kind.replace("@", "-")
    mnt = work / f"mnt-{label}"
    mnt.mkdir(exist_ok=True)
    with qosfs_mount(src, mnt, work, pythonpath, extra) as (root, _pid):
        yield root, work / f"ctl-{mnt.name}.sock"


def _check(sides: list[str]) -> None:
    for spec in sides:
        kind = spec.partition("=")[0].partition("@")[0]
        if kind not in KINDS:
            raise SystemExit(f"coldscale: unknown side {spec!r} (bare, no-qos, policy, "
                             "or KIND@LABEL=PYTHONPATH)")


def run(args: argparse.Namespace) -> int:
    sides: list[str] = list(args.sides)
    _check(sides)
    counts = [int(n) for n in args.threads.split(",")]
    if os.geteuid() != 0:
        print("coldscale: needs root (mounts, drop_caches)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="coldscale-", dir=args.disk_dir))
    rate: dict[str, dict[int, list[float]]] = {s: {n: [] for n in counts} for s in sides}
    hops: dict[str, dict[int, list[float]]] = {s: {n: [] for n in counts} for s in sides}
    try:
        src = work / "src"
        names = make_tree(src, args.files, args.kib * 1024)
        for rnd in range(args.rounds):
            for spec in sides[rnd % len(sides):] + sides[:rnd % len(sides)]:
                with _side(spec, src, work) as (root, sock):
                    for n in counts:
                        wait_quiet(args.quiet_wait)
                        drop_caches()
                        before = _hops(sock)
                        rate[spec][n].append(read_files(root, names, n, seed=rnd))
                        after = _hops(sock)
                        if before is not None and after is not None:
                            hops[spec][n].append((after - before) / args.files)
                print(f"round {rnd} {spec}: " + "  ".join(
                    f"{n}: {rate[spec][n][-1]:,.0f}" for n in counts) + " files/s",
                    file=sys.stderr, flush=True)
        return _report(args, sides, counts, rate, hops)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _report(args: argparse.Namespace, sides: list[str], counts: list[int],
            rate: dict[str, dict[int, list[float]]],
            hops: dict[str, dict[int, list[float]]]) -> int:
    print(f"cold small files: {args.files} x {args.kib} KiB in {args.disk_dir}, caches "
          f"dropped before each run, median of {args.rounds} rounds")
    print("files/s (x bare at the same threads; x the side's previous thread count; "
          "worker-thread hops per file)")
    bare = next((s for s in sides if s.partition("=")[0] == "bare"), None)
    width = max(len(s.partition("=")[0]) for s in sides) + 2
    flagged = []
    for spec in sides:
        med = {n: statistics.median(rate[spec][n]) for n in counts}
        cells = []
        for i, n in enumerate(counts):
            parts = []
            if bare is not None and spec != bare:
                parts.append(f"{med[n] / statistics.median(rate[bare][n]):.2f}x bare")
            if i:
                parts.append(f"{med[n] / med[counts[i - 1]]:.2f}x {counts[i - 1]}")
            if hops[spec][n]:
                parts.append(f"{statistics.median(hops[spec][n]):.2f} hops")
            cells.append(f"{n}: {med[n]:,.0f}" + (f" ({'; '.join(parts)})" if parts else ""))
        falls = [f"{a}->{b}" for a, b in itertools.pairwise(counts) if med[b] < med[a]]
        if falls and spec != bare:
            flagged.append(spec)
        label = spec.partition("=")[0]
        print(f"  {label:{width}}" + "  ".join(cells)
              + (f"  NON-MONOTONIC ({', '.join(falls)})" if falls else ""))
    if bare is not None and any(
            b < a for a, b in itertools.pairwise(
                [statistics.median(rate[bare][n]) for n in counts])):
        print("coldscale: the bare disk itself lost files/s with more threads: a noisy "
              "run (more --rounds, or a quieter machine)")
    if flagged:
        print(f"coldscale: fewer files/s with more threads: {', '.join(flagged)}")
        return 1
    return 0
