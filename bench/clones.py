"""Past one core, measured: one FUSE connection served by several Python processes.

docs/architecture.md ("Past one core") designs how qosfs would serve one mount from
several worker processes, each reading its own clone of the connection's descriptor
(``FUSE_DEV_IOC_CLONE``). Before that is built into qosfs (a shared node table, leases
of the buckets, the workers' lifecycle), this measures what the mechanism itself gives on
this machine, with the same pyfuse3 and the same kernel passthrough qosfs uses:

* ``clonefs`` (:mod:`bench.core.floorfs`): a minimal read-only pass-through filesystem
  in pyfuse3 whose node ids any process can resolve alone (the stand-in for the shared
  node table), its opens answered with a backing id, so that only LOOKUP, GETATTR, OPEN
  and RELEASE reach a process.
* ``--burn-us``: each LOOKUP and OPEN also spins that long, to give a request the cost
  of qosfs's own Python (its classification, charge, journal and counting), so that the
  figures say what a second process would give qosfs, not only a daemon that does
  nothing.
* The first process mounts and answers INIT; each further one gets a clone of the
  descriptor and adopts the session. The kernel hands each request to whichever process
  reads first.

The driver runs the small-file loader (:func:`bench.core.epochs.read_files`: open, read
whole, close, on N threads) bare and through 1 and 2 processes, cold on the disk (caches
dropped) and warm on tmpfs, and prints files/s, the ratio to bare, the processes' CPU per
file and the share of requests each process answered::

    python -m bench clones [--files 2400] [--threads 1,4,16] [--burn-us 0,40]
                           [--rounds 2] [--disk-dir /var/tmp]
"""

from __future__ import annotations

import argparse
import mmap
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.core.epochs import make_tree, read_files
from bench.core.floorfs import clonefs, served_counts
from bench.core.system import cpu_seconds, drop_caches


def _measure(root: Path, names: list[str], threads: int, seed: int, cold: bool,
             pids: list[int], shared: mmap.mmap | None) -> dict[str, Any]:
    if cold:
        drop_caches()
    else:
        read_files(root, names, 4, seed + 1000)  # the warm pass's files in every cache
    before = [cpu_seconds(p) or 0.0 for p in pids]
    counts = served_counts(shared, len(pids)) if shared else []
    rate = read_files(root, names, threads, seed)
    cpu = sum((cpu_seconds(p) or 0.0) - b for p, b in zip(pids, before, strict=True))
    served = [n - c for n, c in zip(served_counts(shared, len(pids)), counts, strict=True)] \
        if shared else []
    return {"rate": rate, "cpu_us": cpu / len(names) * 1e6, "served": served}


def run(files: int, threads: list[int], burns: list[int], rounds: int, disk_dir: Path,
        poll_us: int) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """{place: {side: [one measurement per round and thread count...]}}."""
    work = Path(tempfile.mkdtemp(prefix="clones-", dir=disk_dir))
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    shm = Path(tempfile.mkdtemp(prefix="clones-", dir="/dev/shm"))
    try:
        places = {"disk, cold": (work / "src", True), "tmpfs, warm": (shm / "src", False)}
        names = {}
        for place, (src, _) in places.items():
            names[place] = make_tree(src, files, 112 * 1024)
        mnt = work / "mnt"
        mnt.mkdir()
        sides = ["bare"] + [f"{w} proc, burn {b} us" for b in burns for w in (1, 2)]
        for rnd in range(rounds):
            for place, (src, cold) in places.items():
                out = results.setdefault(place, {})
                for side in sides:
                    for n in threads:
                        if side == "bare":
                            m = _measure(src, names[place], n, rnd, cold, [], None)
                            out.setdefault(f"{side} {n}", []).append(m)
                    if side == "bare":
                        continue
                    w, b = int(side.split()[0]), int(side.split()[-2])
                    with clonefs(src, mnt, work, w, b, poll_us) as (pids, shared):
                        for n in threads:
                            m = _measure(mnt, names[place], n, rnd, cold, pids, shared)
                            out.setdefault(f"{side} {n}", []).append(m)
            print(f"round {rnd + 1} of {rounds} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return results


def report(results: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    lines = []
    for place, sides in results.items():
        lines += [f"## {place}", "",
                  "| side | threads | files/s | x bare | CPU/file (us) | requests per process |",
                  "|---|---:|---:|---:|---:|---|"]
        for key, ms in sides.items():
            side, n = key.rsplit(" ", 1)
            rate = statistics.median(m["rate"] for m in ms)
            bare = statistics.median(m["rate"] for m in sides[f"bare {n}"])
            cpu = statistics.median(m["cpu_us"] for m in ms)
            served = ms[-1]["served"]
            total = sum(served) or 1
            share = " / ".join(f"{100 * s / total:.0f}%" for s in served) if served else ""
            lines.append(f"| {side} | {n} | {rate:,.0f} | {rate / bare:.2f} | "
                         f"{cpu:.0f} | {share} |")
        lines.append("")
    return "\n".join(lines)


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--files", type=int, default=2400, help="files of 112 KiB (2,400)")
    p.add_argument("--threads", default="1,4,16", help="reader threads (1,4,16)")
    p.add_argument("--burn-us", default="0,40", help="CPU spent per LOOKUP and OPEN (0,40)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--poll-us", type=int, default=50, help="busy polling, as qosfs's (50)")
    p.add_argument("--disk-dir", type=Path, default=Path("/var/tmp"),
                   help="where the disk tree goes (a disk, not tmpfs)")


def run_command(args: argparse.Namespace) -> int:
    results = run(args.files, [int(x) for x in args.threads.split(",")],
                  [int(x) for x in args.burn_us.split(",")], args.rounds, args.disk_dir,
                  args.poll_us)
    print(report(results))
    return 0


def main(argv: list[str] | None = None) -> int:
    """As ``python -m bench clones``."""
    if argv is None:
        argv = sys.argv[1:]
    p = argparse.ArgumentParser(prog="python -m bench clones")
    options(p)
    return run_command(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
