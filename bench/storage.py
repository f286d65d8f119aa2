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

from typing import Any

from bench import demo
from bench.context import Run
from bench.figures import StorageResult
from bench.fio import FioMetrics
from bench.system import drop_caches

READER_KEEPS, P99_AT_MOST = 0.90, 1.5


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
        rows: list[demo.Row] = []
        drop_caches()
        if args is None:
            demo._scenarios(fio, label, src, rows)
        else:
            with run.mount(src, no_qos=label == "no-qos") as mounted:
                demo._scenarios(fio, label, mounted.path, rows)
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
