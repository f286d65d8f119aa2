"""A policy written by ``qosfs plan`` mounts, and its checkpoint cap is the one in force."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from qosfs.daemon.cli import main
from tests.mounting import QosfsMount, is_mounted

pytestmark = pytest.mark.mount

MiB = 1 << 20
# 100M params x 6 bytes = 600 MB, asynchronous, half of a 1 min interval: a 20 MB/s cap.
PLAN = ["plan", "--params", "100M", "--bytes-per-param", "6", "--interval", "1m", "--async",
        "--backend-write", "1GB/s", "--reserve-read", "200MB/s"]
CAP = 20e6
BURST = 2e6  # the default bucket depth: 100 ms of the cap


@pytest.fixture
def planned_mount(tmp_tree: Path, capsys: pytest.CaptureFixture[str]) -> Iterator[QosfsMount]:
    policy = tmp_tree / "plan.toml"
    assert main([*PLAN, "--policy-out", str(policy)]) == 0
    assert 'write_bandwidth = "20MB/s" per mount' in capsys.readouterr().out
    src, mnt = tmp_tree / "src", tmp_tree / "mnt"
    src.mkdir()
    mnt.mkdir()
    m = QosfsMount(src, mnt, "--policy", str(policy))
    try:
        m.start()
        yield m
    finally:
        code = m.stop()
        assert not is_mounted(mnt)
        assert code == 0, m.log()
        assert "Traceback" not in m.log(), m.log()


def _write(path: Path, data: bytes) -> float:
    start = time.monotonic()
    with open(path, "wb") as f:
        for off in range(0, len(data), MiB):
            f.write(data[off:off + MiB])
        f.flush()
        os.fsync(f.fileno())
    return time.monotonic() - start


def test_planned_policy_mounts_and_caps_checkpoints(planned_mount: QosfsMount) -> None:
    mnt, src = planned_mount.mountpoint, planned_mount.source
    data = os.urandom(8 * MiB)
    (mnt / "data").mkdir()
    _write(mnt / "data" / "shard-0.parquet", data)
    assert (mnt / "data" / "shard-0.parquet").read_bytes() == data
    assert (src / "data" / "shard-0.parquet").read_bytes() == data

    ckpt = os.urandom(30 * MiB)
    (mnt / "checkpoints" / "step-100").mkdir(parents=True)
    elapsed = _write(mnt / "checkpoints" / "step-100" / "model.pt", ckpt)
    expected = (len(ckpt) - BURST) / CAP  # the burst goes at once, the rest at the cap
    assert expected * 0.85 <= elapsed <= expected * 1.3, (elapsed, expected)
    assert (src / "checkpoints" / "step-100" / "model.pt").read_bytes() == ckpt
