"""Data loader: what a training job's input pipeline sees, native against qosfs.

A PyTorch-style loader opens each sample, reads it whole and closes it: per sample an
open (a lookup past the entry timeout, maybe a getattr), reads, a release. Samples are
64-512 KiB files under ``data/`` (the embedded default policy's dataset class); an epoch
reads each once, in a shuffled order split among WORKERS processes. The figures are
samples/s over the epoch and the latency of one sample (open to close).

* ``cold``: the first epoch after caches were dropped; on tmpfs the native side stays in
  memory (its pages are the files), a FUSE mount starts without cached pages or names.
* ``cached``: the next epoch. With ``--cache
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
from bench.figures import LoaderResult
from bench.system import drop_caches, wait_quiet

MiB = 1 << 20
WORKERS = 4
SIDES = ("native", "no-qos", "policy")  # policy: the embedded default, as users mount it


def make_samples(top: Path, count: int, seed: int = 7, kib: int | None = None) -> list[str]:
    """*count* files of 64-512 KiB (each *kib* KiB when given) under top/data/, in 16
    directories; their relative paths."""
    rng = random.Random(seed)
    names = []
    block = os.urandom(max(512, kib or 0) * 1024)
    for i in range(count):
        rel = f"data/shard{i % 16:02d}/sample{i:06d}.bin"
        path = top / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(block[:(kib or rng.randrange(64, 513)) * 1024])
        names.append(rel)
    return names


def _worker(root: str, names: list[str], out: Any) -> None:
    latencies = []
    nbytes = 0
    for name in names:
        start = time.perf_counter()
        fd = os.open(os.path.join(root, name), os.O_RDONLY)
        try:
            while chunk := os.read(fd, 1 << 20):
                nbytes += len(chunk)
        finally:
            os.close(fd)
        latencies.append(time.perf_counter() - start)
    out.put((latencies, nbytes))


def epoch(root: Path, names: list[str], seed: int, workers: int = WORKERS) -> dict[str, float]:
    """One epoch on *root*: every sample read once, in a shuffled order split among
    *workers* processes; samples/s, MB/s and per-sample latency."""
    order = list(names)
    random.Random(seed).shuffle(order)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(root), order[i::workers], queue))
             for i in range(workers)]
    start = time.perf_counter()
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    elapsed = time.perf_counter() - start
    for p in procs:
        p.join()
    latencies = sorted(x for lat, _ in results for x in lat)
    total = sum(n for _, n in results)
    q = statistics.quantiles(latencies, n=100)
    return {"samples_per_s": len(latencies) / elapsed, "mb_per_s": total / elapsed / 1e6,
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


def run(run: Run) -> LoaderResult:
    from contextlib import ExitStack

    count = int(run.pick(8000, 3000))
    big = int(run.pick(2048, 512)) * MiB
    reps = run.repetitions(3, 1)
    # One tree for every side (they run one after the other, caches dropped between):
    # three copies of a full run's 4 GiB would not fit the scratch tmpfs.
    source = run.scratch("loader")
    names = make_samples(source, count)
    with open(source / "data" / "big.bin", "wb") as f:
        block = os.urandom(MiB)
        for _ in range(big // MiB):
            f.write(block)
    sources = dict.fromkeys(SIDES, source)
    figures: dict[str, dict[str, list[dict[str, float]]]] = {
        s: {"cold": [], "cached": [], "reread": []} for s in SIDES}
    with ExitStack() as stack:
        roots = {side: _side_root(run, side, sources[side], stack) for side in SIDES}
        for rep in range(reps):
            order = SIDES[rep % len(SIDES):] + SIDES[:rep % len(SIDES)]
            for side in order:
                wait_quiet(run.quiet_wait)
                drop_caches()
                cold = epoch(roots[side], names, seed=rep)
                cached = epoch(roots[side], names, seed=rep + 1000)
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
    return LoaderResult.from_json({"samples": count, "workers": WORKERS,
                                   "big_mib": big // MiB, "reps": reps, "summary": summary,
                                   "runs": figures})
