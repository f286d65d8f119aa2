"""Data loader: what a training job's input pipeline sees, native against qosfs.

A PyTorch-style loader opens each sample, reads it whole and closes it: per sample an
open (a lookup past the entry timeout, maybe a getattr), reads, a release. Samples are
64-512 KiB files under ``data/`` (the embedded default policy's dataset class), read in a
random order by WORKERS processes for a fixed time; the figure is samples/s and the
latency of one sample (open to close).

* ``cold``: caches dropped before the run; on tmpfs the native side stays in memory (its
  pages are the files), a FUSE mount starts without cached pages or names.
* ``cached``: after one pass over every sample; the second pass is timed. With ``--cache
  auto`` qosfs keeps a file's pages across opens while it is unchanged, and the default
  policy lets the kernel trust a dataset's names and attributes for 60 s.

Plus a cached re-read of one large file (read once, then timed), the case where dropping
the page cache at every open used to halve the throughput.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench.context import Run
from bench.system import drop_caches, wait_quiet

MiB = 1 << 20
WORKERS = 4
SIDES = ("native", "no-qos", "policy")  # policy: the embedded default, as users mount it


def make_samples(top: Path, count: int, seed: int = 7) -> list[str]:
    """*count* files of 64-512 KiB under top/data/, in 16 directories; their relative paths."""
    rng = random.Random(seed)
    names = []
    block = os.urandom(512 * 1024)
    for i in range(count):
        rel = f"data/shard{i % 16:02d}/sample{i:06d}.bin"
        path = top / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(block[:rng.randrange(64, 513) * 1024])
        names.append(rel)
    return names


def _worker(root: str, names: list[str], seconds: float, seed: int,
            out: Any) -> None:
    rng = random.Random(seed)
    latencies = []
    nbytes = 0
    deadline = time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        if start >= deadline:
            break
        fd = os.open(os.path.join(root, rng.choice(names)), os.O_RDONLY)
        try:
            while chunk := os.read(fd, 1 << 20):
                nbytes += len(chunk)
        finally:
            os.close(fd)
        latencies.append(time.perf_counter() - start)
    out.put((latencies, nbytes))


def load(root: Path, names: list[str], seconds: float, workers: int = WORKERS) -> dict[str, float]:
    """Run the loader pattern on *root*; samples/s, MB/s and per-sample latency."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(root), names, seconds, 100 + i, queue))
             for i in range(workers)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    latencies = sorted(x for lat, _ in results for x in lat)
    total = sum(n for _, n in results)
    q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [0.0] * 99
    return {"samples_per_s": len(latencies) / seconds, "mb_per_s": total / seconds / 1e6,
            "p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3, "samples": len(latencies)}


def read_all(path: Path) -> float:
    """Read *path* with 1 MiB reads; MB/s."""
    start = time.perf_counter()
    total = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while chunk := os.read(fd, 1 << 20):
            total += len(chunk)
    finally:
        os.close(fd)
    return total / (time.perf_counter() - start) / 1e6


def _side_root(run: Run, side: str, src: Path, stack: Any) -> Path:
    if side == "native":
        return src
    mounted = stack.enter_context(run.mount(src, no_qos=side == "no-qos"))
    return mounted.path


def run(run: Run) -> dict[str, Any]:
    from contextlib import ExitStack

    count = int(run.pick(4000, 1500))
    seconds = run.pick(8.0, 4.0)
    big = int(run.pick(2048, 512)) * MiB
    reps = run.repetitions(3, 1)
    sources = {}
    for side in SIDES:
        sources[side] = run.scratch(f"loader-{side}")
        names = make_samples(sources[side], count)
        with open(sources[side] / "data" / "big.bin", "wb") as f:
            block = os.urandom(MiB)
            for _ in range(big // MiB):
                f.write(block)
    figures: dict[str, dict[str, list[dict[str, float]]]] = {
        s: {"cold": [], "cached": [], "reread": []} for s in SIDES}
    with ExitStack() as stack:
        roots = {side: _side_root(run, side, sources[side], stack) for side in SIDES}
        for rep in range(reps):
            order = SIDES[rep % len(SIDES):] + SIDES[:rep % len(SIDES)]
            for side in order:
                wait_quiet(run.quiet_wait)
                drop_caches()
                cold = load(roots[side], names, seconds)
                load(roots[side], names, seconds)  # every sample read at least once...
                for name in names:  # ... and for sure
                    with open(roots[side] / name, "rb") as f:
                        f.read()
                cached = load(roots[side], names, seconds)
                read_all(roots[side] / "data" / "big.bin")
                reread = {"mb_per_s": read_all(roots[side] / "data" / "big.bin")}
                figures[side]["cold"].append(cold)
                figures[side]["cached"].append(cached)
                figures[side]["reread"].append(reread)
                run.log(f"  loader {side} rep {rep}: cold {cold['samples_per_s']:.0f}/s, "
                        f"cached {cached['samples_per_s']:.0f}/s, re-read "
                        f"{reread['mb_per_s']:.0f} MB/s")
    summary = {side: {kind: {key: statistics.median(r[key] for r in runs)
                             for key in runs[0]}
                      for kind, runs in kinds.items()}
               for side, kinds in figures.items()}
    return {"samples": count, "seconds": seconds, "workers": WORKERS, "big_mib": big // MiB,
            "reps": reps, "summary": summary, "runs": figures}
