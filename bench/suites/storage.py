"""Storage-bound: the demo's reader and storm on a disk, where they share a device.

On tmpfs the contended resource is the daemon's CPU, not the storage. Here the backing
store is the run's disk area (ext4 on the VM's disk): the reader's reads are O_DIRECT
(dataset.fio, ``DIRECT=1``) so every one goes to the device, and the storm's writes reach
the same device through writeback and its final fsync. Scenarios, as in the demo: the
reader and the storm each alone, then together, on the bare directory, through qosfs
``--no-qos`` and through qosfs with the embedded default policy.

Targets (issue "The protector must not be the bottleneck"): with the default policy the
reader keeps >= 90% of its solo throughput and <= 1.5x its solo p99, and does better than
the same reader on the bare directory under the same storm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.core.context import Run
from bench.core.fio import FioMetrics
from bench.core.storm import Row, scenarios
from bench.core.system import drop_caches
from bench.core.tables import Plots, Rows, ratio, table
from bench.core.typed import Record

READER_KEEPS, P99_AT_MOST = 0.90, 1.5


@dataclass(frozen=True, kw_only=True)
class StorageFigures(Record):
    mb_per_s: float
    p99_ms: float
    p50_ms: float


@dataclass(frozen=True, kw_only=True)
class StorageSide(Record):
    alone: StorageFigures
    storm_alone: StorageFigures
    with_storm: StorageFigures
    storm: StorageFigures


@dataclass(frozen=True, kw_only=True)
class StorageResult(Record):
    sides: dict[str, StorageSide]  # bare, no-qos, policy
    reader_keeps_target: float
    p99_target: float


def _figures(m: FioMetrics) -> dict[str, float]:
    return {"mb_per_s": m.bw_bytes / 1e6, "p99_ms": m.clat_p99_us / 1e3,
            "p50_ms": m.clat_p50_us / 1e3}


def run(run: Run) -> StorageResult:
    if run.disk is None:
        raise ValueError("the storage suite needs a disk area (--disk-dir)")
    fio = run.fio
    sides: dict[str, dict[str, Any]] = {}
    for label, args in (("bare", None), ("no-qos", ("--no-qos",)), ("policy", ())):
        src = run.scratch(f"storage-{label}", "disk")
        (src / "data").mkdir()
        (src / "checkpoints").mkdir()
        rows: list[Row] = []
        drop_caches()
        if args is None:
            scenarios(fio, label, src, rows)
        else:
            with run.mount(src, no_qos=label == "no-qos") as mounted:
                scenarios(fio, label, mounted.path, rows)
        (_, alone, _), (_, storm_alone, _), (_, reader, storm) = rows
        assert storm is not None
        sides[label] = {"alone": _figures(alone), "storm_alone": _figures(storm_alone),
                        "with_storm": _figures(reader), "storm": _figures(storm)}
        run.log(f"  storage {label}: reader alone {alone.bw_bytes / 1e6:.0f} MB/s p99 "
                f"{alone.clat_p99_us / 1e3:.2f} ms; with storm {reader.bw_bytes / 1e6:.0f} "
                f"MB/s p99 {reader.clat_p99_us / 1e3:.2f} ms; storm "
                f"{storm.bw_bytes / 1e6:.0f} MB/s (alone {storm_alone.bw_bytes / 1e6:.0f})")
    return StorageResult.from_json({"sides": sides, "reader_keeps_target": READER_KEEPS,
                                    "p99_target": P99_AT_MOST})


# -- its part of REPORT.md --


def headline(r: StorageResult) -> Rows:
    """None: its targets are in its section, measured against the bare directory."""
    return []


def section(plots: Plots, r: StorageResult) -> list[str]:
    rows = []
    for side, f in r.sides.items():
        alone, mixed = f.alone, f.with_storm
        rows.append([side, f"{alone.mb_per_s:,.0f}", f"{alone.p99_ms:.2f} ms",
                     f"{mixed.mb_per_s:,.0f}", f"{mixed.p99_ms:.2f} ms",
                     ratio(mixed.mb_per_s / alone.mb_per_s),
                     ratio(mixed.p99_ms / alone.p99_ms),
                     f"{f.storm.mb_per_s:,.0f}", f"{f.storm_alone.mb_per_s:,.0f}"])
    return [
        "## Storage-bound: reader and storm on one disk", "",
        *table(["side", "reader alone MB/s", "p99", "with storm MB/s", "p99",
                "kept", "p99 × alone", "storm MB/s (with reader)", "storm alone"], rows), "",
        "dataset.fio (2 jobs, O_DIRECT random 4 KiB-1 MiB reads) and checkpoint-storm.fio "
        "(4 writers, 1 MiB, fsync at the end) on the disk area; `bare` is the directory "
        f"itself. Targets for `policy`: kept ≥ {r.reader_keeps_target}, p99 ≤ "
        f"{r.p99_target}× alone, and more than `bare` under the storm.", "",
    ]
