"""What a `find` over a big tree costs through a mount: microseconds per entry, and the
daemon's CPU per entry, qosfs (embedded default policy) beside the bare directory and
libfuse's ``passthrough_hp``.

Not a suite: a profiling tool for changes to the listing path (READDIRPLUS, the inode
table's objects and compact rows), run by hand as root::

    python -m bench.walkcost [--source DIR] [--dirs 200] [--files 999] [--nofile 1024]
                             [--rounds 4] [--hp PATH] [SIDE ...]

A SIDE is ``bare``, ``hp`` (passthrough_hp, one thread, its own day-long timeouts), or
``NAME=PYTHONPATH``: qosfs with the embedded default policy, its daemon run with that
PYTHONPATH (``before=/path/to/old/tree after=$PWD``). Default: ``bare``, ``qosfs=`` (this
environment) and ``hp``.

The tree (*dirs* directories of *files* empty files, made once under *source*, default
/var/tmp/walkcost) is walked twice per mount by ``find -printf '%i %s %p'``, as an
unprivileged user for qosfs, with the daemon's descriptor limit at *nofile* (a million
files at 1,024 is what tests/mount/test_scale.py walks). The first walk makes the kernel
learn every inode; the second finds them known (qosfs: folded into its compact rows past
the 2,048 objects kept). The backing tree stays in the page cache: this measures the
daemon, not the disk. passthrough_hp keeps a descriptor per inode, so past its limit its
walk fails; it is run with this process's limit and says how many entries it listed.
Rounds alternate the sides; figures are medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.core.epochs import make_empty_files
from bench.core.libfuse_peer import build_peer, peer_mount
from bench.core.system import cpu_seconds, qosfs_mount

WALKER_UID = 4242  # the walk runs as a user, as one would


def make_tree(top: Path, dirs: int, files: int) -> None:
    """*dirs* directories of *files* empty files under *top*/tree (once: kept between
    runs of the same shape, whose making takes longer than the walks)."""
    tree = top / "tree"
    shape = top / "shape"
    if shape.exists() and shape.read_text() == f"{dirs} {files}":
        return
    subprocess.run(["rm", "-rf", str(tree)], check=True)
    tree.mkdir(parents=True, mode=0o755)
    for d in range(dirs):
        make_empty_files(tree / f"d{d:05d}", files)
    os.chmod(top, 0o755)
    shape.write_text(f"{dirs} {files}")


def walk(root: Path, as_user: bool) -> tuple[float, int]:
    """``find`` over *root*/tree: (seconds, entries listed)."""
    def drop() -> None:
        os.setgroups([])
        os.setgid(WALKER_UID)
        os.setuid(WALKER_UID)

    start = time.monotonic()
    out = subprocess.run(["find", str(root / "tree"), "-printf", "%i %s %p\n"],
                         capture_output=True, check=False, preexec_fn=drop if as_user else None)
    return time.monotonic() - start, out.stdout.count(b"\n")


@contextmanager
def _bare(source: Path) -> Iterator[tuple[Path, int | None]]:
    yield source, None


@contextmanager
def _qosfs(source: Path, work: Path, name: str, pythonpath: str,
           nofile: int) -> Iterator[tuple[Path, int | None]]:
    mnt = work / name
    mnt.mkdir(exist_ok=True)
    with qosfs_mount(source, mnt, work, pythonpath, [], nofile=nofile) as mounted:
        yield mounted


@contextmanager
def _hp(binary: str, source: Path, work: Path) -> Iterator[tuple[Path, int | None]]:
    with peer_mount(binary, source, work / "hp", ("--single", "--nopassthrough"),
                    work / "hp.log") as pid:
        yield work / "hp", pid


def _cpu(pid: int | None) -> float:
    """The daemon's CPU seconds so far (0 for the bare directory)."""
    return (cpu_seconds(pid) or 0.0) if pid else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.walkcost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, default=Path("/var/tmp/walkcost"))
    ap.add_argument("--dirs", type=int, default=200)
    ap.add_argument("--files", type=int, default=999)
    ap.add_argument("--nofile", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--hp", help="passthrough_hp's path (default: built by deploy/libfuse)")
    ap.add_argument("sides", nargs="*", default=["bare", "qosfs=", "hp"])
    args = ap.parse_args(argv)
    make_tree(args.source, args.dirs, args.files)
    entries = args.dirs * args.files + args.dirs + 1
    hp = args.hp
    if "hp" in args.sides and hp is None:
        hp, why = build_peer()
        if hp is None:
            print(f"passthrough_hp left out: {why}", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="walkcost-"))
    os.chmod(work, 0o755)
    figures: dict[str, dict[str, list[float]]] = {}
    try:
        for r in range(args.rounds):
            order = args.sides if r % 2 == 0 else args.sides[::-1]
            for side in order:
                if side == "hp" and hp is None:
                    continue
                name, _, pythonpath = side.partition("=")
                mount = (_bare(args.source) if side == "bare" else
                         _hp(hp, args.source, work) if side == "hp" else
                         _qosfs(args.source, work, name, pythonpath, args.nofile))
                got = figures.setdefault(name, {})
                with mount as (root, pid):
                    for n in (1, 2):
                        cpu = _cpu(pid)
                        seconds, listed = walk(root, as_user=side not in ("bare", "hp"))
                        used = _cpu(pid) - cpu
                        per = max(listed, 1)
                        got.setdefault(f"walk{n}_us", []).append(seconds / per * 1e6)
                        got.setdefault(f"walk{n}_cpu_us", []).append(used / per * 1e6)
                        got.setdefault(f"walk{n}_listed", []).append(listed)
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    print(f"{entries:,} entries, daemon limit {args.nofile} (hp: this process's), "
          f"medians of {args.rounds} rounds; µs per entry (daemon CPU µs per entry)")
    for name, got in figures.items():
        cells = []
        for n in (1, 2):
            listed = int(min(got[f"walk{n}_listed"]))
            note = "" if listed == entries else f", listed {listed:,}"
            cells.append(f"walk {n}: {statistics.median(got[f'walk{n}_us']):.1f} "
                         f"({statistics.median(got[f'walk{n}_cpu_us']):.1f}){note}")
        print(f"  {name:10s} " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
