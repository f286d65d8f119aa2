"""``python -m bench demo``: the point of qosfs in under a minute, on this machine.

A dataset reader (random reads, the latency a GPU waits on) runs three times through a
qosfs mount of a scratch tmpfs: alone; next to a checkpoint storm with QoS off
(``--no-qos``); next to the same storm with the embedded default policy, which caps
checkpoint writes. The table shows what the reader keeps in each case.
"""

from __future__ import annotations

from pathlib import Path

from bench.fio import FioMetrics, find_fio, run_job
from bench.isolation import with_storm
from bench.system import QosfsMount, require_root, tmpfs_area

JOBS = Path(__file__).resolve().parent / "jobs"
RUNTIME = "8"
READER = {"RUNTIME": RUNTIME, "SIZE": "256m", "NUMJOBS": "2"}


def _reader(fio: str, mnt: Path) -> FioMetrics:
    metrics, _, _ = run_job(fio, JOBS / "dataset.fio", str(mnt / "data"), READER)
    assert metrics is not None
    return metrics


def _with_storm(fio: str, mnt: Path) -> tuple[FioMetrics, FioMetrics]:
    return with_storm(fio, str(mnt / "data"), str(mnt / "checkpoints"),
                      READER,
                      {"RUNTIME": str(int(RUNTIME) + 1), "SIZE": "128m", "NUMJOBS": "4"},
                      lead=0.5)


def run(quick: bool = True) -> int:
    require_root("the demo mounts a scratch tmpfs and qosfs")
    fio = find_fio()
    rows: list[tuple[str, FioMetrics, FioMetrics | None]] = []
    with tmpfs_area("2g", ["src", "mnt"]) as top:
        src, mnt = top / "src", top / "mnt"
        (src / "data").mkdir()
        (src / "checkpoints").mkdir()
        log = str(top / "qosfs.log")
        print("qosfs demo: dataset reader (random 4k-1M reads, 2 jobs) on a qosfs mount of tmpfs")
        with QosfsMount(str(src), str(mnt), [], log):
            _reader(fio, mnt)  # lay the dataset files out once
            alone = _reader(fio, mnt)
        rows.append(("reader alone", alone, None))
        with QosfsMount(str(src), str(mnt), ["--no-qos"], log):
            rows.append(("+ checkpoint storm, no QoS", *_with_storm(fio, mnt)))
        with QosfsMount(str(src), str(mnt), [], log):
            rows.append(("+ checkpoint storm, default policy", *_with_storm(fio, mnt)))
    print()
    print(f"{'scenario':38} {'reader MB/s':>11} {'of alone':>8} {'p99 ms':>7} "
          f"{'x alone':>7} {'ckpt MB/s':>9}")
    for name, reader, storm in rows:
        print(f"{name:38} {reader.bw_bytes / 1e6:11.0f} {reader.bw_bytes / alone.bw_bytes:8.0%} "
              f"{reader.clat_p99_us / 1e3:7.2f} {reader.clat_p99_us / alone.clat_p99_us:7.2f} "
              f"{'' if storm is None else f'{storm.bw_bytes / 1e6:.0f}':>9}")
    print("\nThe default policy caps checkpoint writes (**/checkpoints/**, *.pt, *.distcp, ...)"
          " at 400 MiB/s;\nsee `qosfs policy default`.")
    return 0
