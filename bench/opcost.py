"""Per-open cost of the small-file loader: files/s and the FUSE requests each file costs,
qosfs (embedded default policy) beside libfuse's single-threaded ``passthrough_hp``.

Not a suite (``bench loader`` is the figure of record): a profiling tool for changes to
the lookup/open/release path, run by hand::

    python -m bench.opcost [--files 4000] [--kib 128] [--workers 4] [--source DIR]
                           [--hp PATH] [--rounds 3] [SIDE ...]

A SIDE is ``hp`` (passthrough_hp, single-threaded, reads through the daemon), ``native``,
or ``NAME=PYTHONPATH``: qosfs with the embedded default policy, its daemon run with that
PYTHONPATH (e.g. ``before=/work/main after=$PWD``; a directory holding another pyfuse3
build may come first). Default: ``qosfs=`` (this environment) and ``hp``.

With ``--handlers``, each qosfs side's daemon also times its FUSE handlers with its own
CPU clock (:mod:`bench.core.handler_times`), and a table gives each handler's CPU per
file, cold and warm, and what is left of the daemon's CPU per file for the work between
requests (pyfuse3, trio, the services).

Each side serves the same tree (default: a tmpfs under /dev/shm); per round, caches are
dropped, one epoch (every file opened, read whole, closed by the readers) is ``cold``,
the next ``warm``. The kernel's own ``fuse_request_send`` tracepoint, in a tracing
instance of its own filtered on the mount's connection, counts the requests by opcode
(so the count is the kernel's, whatever the daemon does); the table gives them per file.
Rounds alternate the sides, and the figures are medians.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.core import handler_times
from bench.core.epochs import epoch, make_tree
from bench.core.fuse_trace import FuseTrace
from bench.core.system import cpu_seconds, drop_caches, qosfs_mount, unmount

WORKERS = 4


@contextmanager
def hp_mount(binary: str, source: Path, mnt: Path) -> Iterator[tuple[Path, int | None]]:
    """passthrough_hp single-threaded, reads through the daemon (no kernel passthrough)."""
    proc = subprocess.Popen([binary, "--single", "--nopassthrough", "--foreground",
                             str(source), str(mnt)])
    try:
        for _ in range(200):
            if os.path.ismount(mnt):
                break
            time.sleep(0.05)
        yield mnt, proc.pid
    finally:
        unmount(mnt)
        proc.wait(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=4000)
    ap.add_argument("--kib", type=int, default=128)
    ap.add_argument("--source", type=Path, help="backing tree's parent (default /dev/shm)")
    ap.add_argument("--hp", default=os.environ.get("PASSTHROUGH_HP", ""),
                    help="the passthrough_hp binary (side 'hp')")
    ap.add_argument("--workers", type=int, default=WORKERS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--qosfs-arg", action="append", default=[])
    ap.add_argument("--handlers", action="store_true",
                    help="time each FUSE handler in the qosfs daemons (CPU per file)")
    ap.add_argument("sides", nargs="*", default=["qosfs=", "hp"])
    opts = ap.parse_args()
    paths = dict(side.partition("=")[::2] for side in opts.sides)
    sides = list(paths)
    work = Path(tempfile.mkdtemp(prefix="opcost-", dir=opts.source or "/dev/shm"))
    try:
        src = work / "src"
        names = make_tree(src, opts.files, opts.kib * 1024)
        figures: dict[str, dict[str, list[float]]] = {
            s: {"cold": [], "warm": [], "cold_cpu": [], "warm_cpu": []} for s in sides}
        requests: dict[str, dict[str, collections.Counter[str]]] = {}
        # side -> kind -> handler -> [(CPU us per file, calls per file), one per round]
        handlers: dict[str, dict[str, dict[str, list[tuple[float, float]]]]] = {}
        site = handler_times.sitecustomize_dir(work) if opts.handlers else None
        for rnd in range(opts.rounds):
            for side in sides[rnd % len(sides):] + sides[:rnd % len(sides)]:
                mnt = work / f"mnt-{side}"
                mnt.mkdir(exist_ok=True)
                timed: Path | None = None  # this mount's handler totals (--handlers)
                if side == "hp":
                    ctx = hp_mount(opts.hp, src, mnt)
                elif side == "native":
                    ctx = _native(src)
                else:
                    pythonpath = paths[side]
                    if site is not None:
                        timed = work / f"handlers-{side}.bin"
                        handler_times.new_file(timed)
                        pythonpath = ":".join(filter(None, (str(site), pythonpath)))
                        os.environ[handler_times.ENV] = str(timed)  # the mount's env
                    ctx = qosfs_mount(src, mnt, work, pythonpath, opts.qosfs_arg)
                with ctx as (root, pid), FuseTrace(root, pid) as counter:
                    os.environ.pop(handler_times.ENV, None)  # the daemon has it now
                    if counter.unavailable and rnd == 0:
                        print(f"{side}: requests {counter.unavailable}", file=sys.stderr)
                    per: dict[str, collections.Counter[str]] = {}
                    for kind, seed in (("cold", rnd), ("warm", rnd + 1000)):
                        if kind == "cold":
                            drop_caches()
                            counter.take()
                        cpu = (cpu_seconds(pid) or 0.0) if pid else 0.0
                        timed_before = handler_times.read(timed) if timed else None
                        got = epoch(root, names, seed, opts.workers)
                        if timed and timed_before:
                            _add_handlers(handlers.setdefault(side, {}).setdefault(kind, {}),
                                          timed_before, handler_times.read(timed), opts.files)
                        figures[side][kind].append(got["samples_per_s"])
                        figures[side][kind + "_cpu"].append(
                            ((cpu_seconds(pid) or 0.0) - cpu if pid else 0.0)
                            / opts.files * 1e6)
                        per[kind] = collections.Counter(counter.take())
                    requests[side] = per
                print(f"round {rnd} {side}: cold {figures[side]['cold'][-1]:,.0f} "
                      f"warm {figures[side]['warm'][-1]:,.0f} files/s", file=sys.stderr)
        print(f"{opts.files} x {opts.kib} KiB, {opts.workers} readers, {opts.rounds} rounds "
              f"(medians): files/s, the daemon's CPU us per file, requests per file "
              f"(last round)")
        for side in sides:
            line = [f"{side:8}"]
            for kind in ("cold", "warm"):
                med = statistics.median(figures[side][kind])
                cpu_us = statistics.median(figures[side][kind + "_cpu"])
                per_file = requests.get(side, {}).get(kind, collections.Counter())
                ops = " ".join(f"{op}={n / opts.files:.2f}" for op, n in
                               sorted(per_file.items(), key=lambda kv: -kv[1]))
                line.append(f"{kind} {med:7,.0f}/s {cpu_us:4.0f} us  [{ops}]")
            print("  ".join(line))
        for side, kinds in handlers.items():
            _print_handlers(side, kinds, figures[side])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _add_handlers(per: dict[str, list[tuple[float, float]]],
                  before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]],
                  files: int) -> None:
    """One pass's (CPU us, calls) per file of each handler that was called."""
    for name, (ns, calls) in after.items():
        ns0, calls0 = before[name]
        if calls > calls0:
            per.setdefault(name, []).append(((ns - ns0) / 1e3 / files,
                                             (calls - calls0) / files))


def _median_of(passes: list[tuple[float, float]], i: int) -> float:
    return statistics.median(p[i] for p in passes)


def _print_handlers(side: str, kinds: dict[str, dict[str, list[tuple[float, float]]]],
                    figures: dict[str, list[float]]) -> None:
    """The handlers' CPU per file (medians over the rounds), then the rest of the
    daemon's CPU per file: what ran between the handlers."""
    print(f"\n{side}: the daemon's CPU per file by handler, us (calls per file); "
          "each timed call includes ~1.5 us of the timer's own")
    cold = kinds.get("cold", {})
    names = sorted({n for per in kinds.values() for n in per},
                   key=lambda n: -_median_of(cold[n], 0) if n in cold else 0.0)
    for name in names:
        cells = []
        for kind in ("cold", "warm"):
            passes = kinds.get(kind, {}).get(name)
            cells.append(f"{kind} {_median_of(passes, 0):6.1f} ({_median_of(passes, 1):.2f})"
                         if passes else f"{kind} {'-':>6} {'':6}")
        print(f"  {name:12} " + "   ".join(cells))
    cells = []
    for kind in ("cold", "warm"):
        timed = sum(_median_of(p, 0) for p in kinds.get(kind, {}).values())
        rest = statistics.median(figures[kind + "_cpu"]) - timed
        cells.append(f"{kind} {rest:6.1f}       ")
    print(f"  {'(between)':12} " + "   ".join(cells))


@contextmanager
def _native(src: Path) -> Iterator[tuple[Path, int | None]]:
    yield src, None


if __name__ == "__main__":
    main()
