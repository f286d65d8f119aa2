"""Epochs of a small-file data loader: every file opened, read whole and closed once, in
a shuffled order split among processes, as a PyTorch-style loader reads samples. The
loader, peer and smallfiles suites measure with it, and so do the coldscale and opcost
commands (:func:`read_files`: the same pass on threads of one process). The trees they
read are made here too (and the empty ones walkcost and the scale tests list).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

WORKERS = 4


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


def make_empty_files(directory: Path, count: int) -> list[str]:
    """*directory* made, with *count* empty files f000000... in it (``mknod``, the fastest
    way to a big tree: a million in under a minute on ext4); their names."""
    directory.mkdir(parents=True)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        names = [f"f{i:06d}" for i in range(count)]
        for name in names:
            os.mknod(name, 0o644, dir_fd=fd)
    finally:
        os.close(fd)
    return names


def make_tree(top: Path, count: int, size: int) -> list[str]:
    """*count* files of *size* bytes under top/data/shardNN/ (the default policy's
    datasets class); their relative paths."""
    block = os.urandom(size)
    names = []
    for i in range(count):
        rel = f"data/shard{i % 16:02d}/sample{i:06d}.bin"
        path = top / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(block)
        names.append(rel)
    return names


def read_files(root: Path, names: list[str], threads: int, seed: int) -> float:
    """Open, read whole and close every file under *root* once, shuffled and split among
    *threads* threads; files/s."""
    order = list(names)
    random.Random(seed).shuffle(order)

    def work(part: list[str]) -> None:
        for name in part:
            fd = os.open(root / name, os.O_RDONLY)
            try:
                while os.read(fd, 1 << 20):
                    pass
            finally:
                os.close(fd)

    workers = [threading.Thread(target=work, args=(order[i::threads],))
               for i in range(threads)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return len(names) / (time.perf_counter() - start)
