"""The latency-target controller's canary through a real mount: runs, reports, goes away."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from qosfs.control.ctl import Client
from tests.mounting import QosfsMount, is_mounted
from tests.waiting import wait_for

pytestmark = pytest.mark.mount

POLICY = """
[classes.data]
paths = ["data/**"]
priority = "high"
target_read_latency = "50ms"

[classes.ckpt]
paths = ["ckpt/**"]
priority = "low"
"""


def _latency_status(sock: Path) -> dict:
    with Client(str(sock)) as client:
        reply = client.request({"cmd": "status"})
    assert reply["ok"], reply
    return reply["latency_control"]


def _canaries(daemon_pid: int) -> list[int]:
    """Pids of the daemon's child processes running the canary."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == daemon_pid and b"qosfs.qos.latency_probe" in cmd:
            found.append(int(entry))
    return found


def test_the_canary_measures_while_a_protected_class_reads_then_leaves(tmp_tree: Path) -> None:
    src, mnt = tmp_tree / "src", tmp_tree / "mnt"
    for d in (src, mnt, src / "data"):
        d.mkdir()
    (src / "data" / "shard").write_bytes(os.urandom(1 << 20))
    policy = tmp_tree / "policy.toml"
    policy.write_text(POLICY)
    sock = tmp_tree / "ctl.sock"
    m = QosfsMount(src, mnt, "--policy", str(policy), "--socket", str(sock)).start()
    try:
        assert m.proc is not None
        assert _latency_status(sock)["probe_running"] is False  # nothing protected is open
        with open(mnt / "data" / "shard", "rb") as f:
            def status_after_a_read() -> dict:
                f.seek(0)
                f.read(4096)
                return _latency_status(sock)

            status = wait_for("the canary's first measure", status_after_a_read,
                              until=lambda s: s["probe_running"]
                              and s["protected"][0]["queue_seconds"], interval=0.1)
            assert len(_canaries(m.proc.pid)) == 1
            queue = status["protected"][0]["queue_seconds"]
            # An idle mount answers the canary in well under the 50 ms target.
            assert queue is not None and 0 < queue < 0.05, status
        m.proc.send_signal(signal.SIGTERM)
        assert m.proc.wait(20) == 0
        assert not is_mounted(mnt)
        assert "Traceback" not in m.log()
    finally:
        m.stop()
