"""A dataset reader next to a checkpoint storm, the scene of the demo, the storage suite
and the isolation suite: fio's ``dataset.fio`` (random 4 KiB-1 MiB reads) and
``checkpoint-storm.fio`` (1 MiB sequential writers, fsync at the end), alone and together.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.core.fio import JOBS_DIR, FioError, FioMetrics, run_job


def with_storm(fio: str, reader_dir: str, storm_dir: str, reader_env: dict[str, str],
               storm_env: dict[str, str], lead: float = 1.0, cwd: str | None = None
               ) -> tuple[FioMetrics, FioMetrics]:
    """Run the checkpoint storm in the background and the dataset reader once it has been
    under way for *lead* s; return (reader, storm). The storm's RUNTIME should outlast
    the reader's by more than *lead*."""
    storm: dict[str, Any] = {}

    def run_storm() -> None:
        try:
            storm["m"], _, _ = run_job(fio, JOBS_DIR / "checkpoint-storm.fio", storm_dir,
                                       storm_env, cwd=cwd)
        except FioError as exc:
            storm["error"] = exc

    writer = threading.Thread(target=run_storm, name="checkpoint-storm")
    writer.start()
    try:
        time.sleep(lead)
        reader, _, _ = run_job(fio, JOBS_DIR / "dataset.fio", reader_dir, reader_env, cwd=cwd)
    finally:
        writer.join()
    if "error" in storm:
        raise storm["error"]
    assert reader is not None
    return reader, storm["m"]


# -- the demo's scenarios (python -m bench demo; the storage suite on a disk) --

RUNTIME = "8"
READER = {"RUNTIME": RUNTIME, "SIZE": "256m", "NUMJOBS": "2"}
STORM = {"RUNTIME": str(int(RUNTIME) + 1), "SIZE": "128m", "NUMJOBS": "4"}
STORM_ALONE = "10"  # seconds: the window the cap is held over


def _reader(fio: str, top: Path) -> FioMetrics:
    metrics, _, _ = run_job(fio, JOBS_DIR / "dataset.fio", str(top / "data"), READER)
    assert metrics is not None
    return metrics


def _storm_alone(fio: str, top: Path) -> FioMetrics:
    metrics, _, _ = run_job(fio, JOBS_DIR / "checkpoint-storm.fio", str(top / "checkpoints"),
                            {**STORM, "RUNTIME": STORM_ALONE})
    assert metrics is not None
    return metrics


def _with_storm(fio: str, top: Path) -> tuple[FioMetrics, FioMetrics]:
    return with_storm(fio, str(top / "data"), str(top / "checkpoints"), READER, STORM,
                      lead=0.5)


Row = tuple[str, FioMetrics, FioMetrics | None]


def scenarios(fio: str, label: str, top: Path, rows: list[Row],
              mounted: Callable[[], object] | None = None) -> None:
    """Reader alone, storm alone, reader with the storm, on *top* (a mount or the bare
    directory); appended to *rows*."""
    _reader(fio, top)  # lay the dataset files out once
    rows.append((f"reader alone, {label}", _reader(fio, top), None))
    rows.append((f"checkpoint storm alone, {label}", _storm_alone(fio, top), None))
    rows.append((f"reader + storm, {label}", *_with_storm(fio, top)))
