"""The canary process (qosfs.qos.latency.probe) on a plain directory: its commands, and
its timed reads of a backing file named by the daemon's descriptor."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from qosfs.qos.latency.probe import FIRST_PAUSE, LatencyProbe, _commands, _open_backing
from tests.waiting import wait_for


def test_commands_set_the_interval_and_a_line_that_makes_no_sense_ends_the_canary() -> None:
    buffer = bytearray(b"i\t0.01\ni\t0.0")
    assert _commands(buffer, 0.002, {}) == 0.01
    assert buffer == b"i\t0.0"  # a partial line waits for its end
    assert _commands(bytearray(b"what\n"), 0.002, {}) is None
    assert _commands(bytearray(b"i\tfast\n"), 0.002, {}) is None


def test_a_descriptor_number_reused_for_another_file_is_not_read(tmp_path: Path) -> None:
    f = tmp_path / "shard"
    f.write_bytes(b"x" * 8192)
    fd = os.open(f, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        link = f"/proc/{os.getpid()}/fd/{fd}"
        opened = _open_backing(link, st.st_dev, st.st_ino)
        assert opened is not None and opened.blocks == 2
        os.close(opened.fd)
        assert _open_backing(link, st.st_dev, st.st_ino + 1) is None
    finally:
        os.close(fd)


def _holds(pid: int, target: Path) -> bool:
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for name in names:
        try:
            if os.path.realpath(f"/proc/{pid}/fd/{name}") == str(target):
                return True
        except OSError:
            continue
    return False


def test_the_canary_times_reads_of_the_file_it_is_given_and_lets_it_go(tmp_path: Path) -> None:
    # getxattr of the canary's xattr on a plain directory answers ENODATA, as the mount does.
    shard = tmp_path / "shard"
    shard.write_bytes(os.urandom(1 << 20))
    probe = LatencyProbe(str(tmp_path), set(), interval=0.001)
    fd = os.open(shard, os.O_RDONLY)
    try:
        probe.start()
        assert probe._proc is not None
        pid = probe._proc.pid
        probe.watch_backing("data", fd)
        wait_for("timed backing reads", lambda: sum(probe.backing_snapshot("data") or ()),
                 until=lambda n: n >= 20, timeout=20.0, interval=0.05)
        assert _holds(pid, shard.resolve())
        assert sum(probe.snapshot()) >= 20  # the round trips go on beside them
        probe.watch_backing("data", None)
        wait_for("the canary to let the file go", lambda: not _holds(pid, shard.resolve()),
                 timeout=20.0, interval=0.05)
    finally:
        probe.stop()
        os.close(fd)


def test_a_canary_that_cannot_run_is_started_again_after_a_growing_pause(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        ) -> None:
    """A canary that ends at once (here: a Python that exits before running it, as after
    an install that moved its module) is not started again at every 50 ms check of the
    latency loop, but after a pause that doubles; each end is said once, as a warning."""
    monkeypatch.setattr(sys, "executable", "/bin/false")
    probe = LatencyProbe(str(tmp_path), set())
    try:
        _pauses_after_quick_ends(probe, caplog)
    finally:
        probe.stop()  # closes the last canary's pipe


def _pauses_after_quick_ends(probe: LatencyProbe, caplog: pytest.LogCaptureFixture) -> None:
    probe.start()
    assert probe.starts == 1
    wait_for("the canary to end", lambda: not probe.running)
    ended = time.monotonic()
    for _ in range(5):  # the loop's checks during the pause start nothing
        probe.start()
    assert probe.starts == 1 and not probe.running
    wait_for("the second start", lambda: (probe.start(), probe.starts)[1], until=lambda n: n == 2)
    assert time.monotonic() - ended >= FIRST_PAUSE * 0.9
    wait_for("the second canary to end", lambda: not probe.running)
    assert probe._pause == 2 * FIRST_PAUSE  # doubled
    assert probe.start() is None and probe.starts == 2
    ends = [r for r in caplog.records if "started again in" in r.getMessage()]
    assert [r.levelname for r in ends] == ["WARNING", "WARNING"]
    for record in ends:
        record.expected = True  # what this test checks (tests/conftest.py)


def test_a_canary_stopped_by_the_daemon_is_started_again_at_once(tmp_path: Path) -> None:
    probe = LatencyProbe(str(tmp_path), set(), interval=0.01)
    probe.start()
    try:
        wait_for("the canary to run", lambda: probe.running)
        probe.stop()
        wait_for("the canary to end", lambda: not probe.running)
        probe.start()  # no pause: it was stopped, it did not fail
        assert probe.starts == 2
    finally:
        probe.stop()
