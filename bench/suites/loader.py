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

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.core.context import Run
from bench.core.epochs import WORKERS, epoch, make_samples
from bench.core.system import drop_caches, wait_quiet
from bench.core.tables import Plots, Rows, number, ratio, ratio_of, table, verdict
from bench.core.typed import Json, Record

MiB = 1 << 20
SIDES = ("native", "no-qos", "policy")  # policy: the embedded default, as users mount it


@dataclass(frozen=True, kw_only=True)
class LoaderFigures(Record):
    """Medians of an epoch (cold, cached) or of a big file's re-read (MB/s only)."""

    mb_per_s: float
    samples_per_s: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    samples: float | None = None


@dataclass(frozen=True, kw_only=True)
class LoaderResult(Record):
    samples: int
    workers: int
    big_mib: int
    reps: int
    summary: dict[str, dict[str, LoaderFigures]]  # side -> cold/cached/reread
    runs: Json = None


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


# -- its part of REPORT.md --


LOADER_GAIN = 2.0  # issue targets against the figures before keep_cache / timeouts


RE_READ_MIN = 0.9


def headline(r: LoaderResult) -> Rows:
    sm = r.summary
    rows = []
    for kind in ("cold", "cached"):
        got, native = sm["policy"][kind].samples_per_s, sm["native"][kind].samples_per_s
        rows.append([f"data loader {kind}, default policy: samples/s (native "
                     f"{native or 0:,.0f})", f"{got or 0:,.0f}", "—", ""])
    re_read = sm["policy"]["reread"].mb_per_s / sm["native"]["reread"].mb_per_s
    rows.append(["cached re-read, default policy / native", ratio(re_read),
                 f"≥ {RE_READ_MIN}", verdict(re_read >= RE_READ_MIN)])
    return rows


def section(plots: Plots, r: LoaderResult) -> list[str]:
    sm = r.summary
    rows = []
    for kind, what in (("cold", "data loader, cold"), ("cached", "data loader, cached")):
        for side in ("native", "no-qos", "policy"):
            f = sm[side][kind]
            rows.append([what, side, number(f.samples_per_s, "{:,.0f}"), f"{f.mb_per_s:,.0f}",
                         number(f.p50_ms, "{:.2f} ms"), number(f.p99_ms, "{:.2f} ms"),
                         ratio_of(f.samples_per_s, sm["native"][kind].samples_per_s)])
    for side in ("native", "no-qos", "policy"):
        f = sm[side]["reread"]
        rows.append([f"cached re-read of {r.big_mib} MiB", side, "—",
                     f"{f.mb_per_s:,.0f}", "—", "—",
                     ratio_of(f.mb_per_s, sm["native"]["reread"].mb_per_s)])
    return [
        "## Data loader: samples through the mount", "",
        *table(["workload", "side", "samples/s", "MB/s", "p50 per sample", "p99",
                "of native"], rows), "",
        f"An epoch: {r.workers} processes open, read whole and close each of "
        f"{r.samples} samples of 64-512 KiB under `data/` once, in a shuffled order; "
        f"median of {r.reps} rotating repetitions. `cold`: the first epoch after caches "
        "were dropped (the native tmpfs keeps its pages, the mounts do not); `cached`: the "
        "next epoch. `policy` is the embedded default policy (datasets trust names and "
        "attributes for 60 s).", "",
    ]
