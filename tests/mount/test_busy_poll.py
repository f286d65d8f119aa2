"""Busy polling for the next request (``--busy-poll-us``, deploy/libfuse's
pyfuse3-busy-poll.patch): a mount polls for the next request after answering one, the
answers are the same, ``--busy-poll-us 0`` never polls, and a mount left idle goes back
to sleeping (it does not keep a core busy)."""

from __future__ import annotations

import errno
import fcntl
import os
import termios
import time
from pathlib import Path

import pyfuse3
import pytest

from qosfs.control.ctl import Client
from qosfs.daemon.config import MountConfig
from qosfs.daemon.serve import MAX_TASKS, MIN_TASKS, main_arguments
from tests.mounting import QosfsMount

pytestmark = [pytest.mark.mount, pytest.mark.root]

ROUND_TRIPS = 10000  # enough clock ticks (10 ms) of the daemon's CPU to compare


def _round_trip_us(path: Path) -> float:
    """The mean round trip of a TCGETS ioctl on *path* (FUSE forwards every ioctl; the
    daemon answers ENOTTY, as the backing file would), one at a time."""
    fd = os.open(path, os.O_RDONLY)
    buf = bytearray(64)
    try:
        start = time.perf_counter()
        for _ in range(ROUND_TRIPS):
            with pytest.raises(OSError) as err:
                fcntl.ioctl(fd, termios.TCGETS, buf)
            assert err.value.errno == errno.ENOTTY
        return (time.perf_counter() - start) / ROUND_TRIPS * 1e6
    finally:
        os.close(fd)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_main_is_asked_to_poll_only_where_pyfuse3_can() -> None:
    cfg = MountConfig(source="/s", mountpoint="/m", busy_poll_us=50)
    arguments = main_arguments(cfg)
    assert arguments["min_tasks"] == MIN_TASKS and arguments["max_tasks"] == MAX_TASKS
    if getattr(pyfuse3, "BUSY_POLL_SUPPORTED", False):
        assert arguments["busy_poll_us"] == 50
    else:  # PyPI's pyfuse3 (the system's libfuse): its main() takes no such argument
        assert "busy_poll_us" not in arguments


def _poll_counts(sock: Path) -> tuple[int, int]:
    with Client(str(sock)) as client:
        status = client.request({"cmd": "status"})
    return int(status["busy_polled"]), int(status["busy_poll_misses"])


@pytest.mark.skipif(not getattr(pyfuse3, "BUSY_POLL_SUPPORTED", False),
                    reason="pyfuse3 without busy polling (make deps builds it)")
@pytest.mark.parametrize("in_place", [False, True], ids=["separate", "in-place"])
def test_a_polling_mount_polls_after_requests_and_sleeps_when_idle(
        tmp_tree: Path, in_place: bool) -> None:
    """TCGETS round trips, one at a time, on a mount that polls (the default) and on one
    that does not (--busy-poll-us 0): both answer ENOTTY; the one that polls polled after
    answering (ctl status: busy_polled, busy_poll_misses), the other never. Then, left
    idle, the polling daemon sleeps. How many requests a poll catches depends on the
    machine (nearly all on two idle CPUs; on busy ones a woken caller waits for the
    poller's own CPU, and after 4 misses in a row polling stops until requests come close
    together again; a caller quicker than the daemon has its next request queued before
    any poll): bench figures in deploy/libfuse/README.md, not asserted here. In place
    too (qosfs mount SRC, as systemd and the DaemonSet run it), each over its own tree."""
    run = tmp_tree / "run"
    run.mkdir()
    sources = {name: tmp_tree / f"src-{name}" for name in ("polling", "sleeping")}
    for src in sources.values():
        (src / "data").mkdir(parents=True)
        (src / "data" / "f").write_bytes(b"x" * 4096)
    polling, sleeping = ((sources[name] if in_place else tmp_tree / name)
                         for name in ("polling", "sleeping"))
    for d in {polling, sleeping} - set(sources.values()):
        d.mkdir()
    socks = {polling: run / "polling.sock", sleeping: run / "sleeping.sock"}
    with QosfsMount(sources["polling"], polling, "--socket", str(socks[polling])) as fast, \
            QosfsMount(sources["sleeping"], sleeping, "--busy-poll-us", "0",
                       "--socket", str(socks[sleeping])):
        assert fast.proc is not None
        polls: dict[Path, int] = {}
        times: dict[Path, float] = {}
        for mnt in (polling, sleeping):
            before = sum(_poll_counts(socks[mnt]))
            times[mnt] = _round_trip_us(mnt / "data" / "f")
            polls[mnt] = sum(_poll_counts(socks[mnt])) - before
        assert polls[sleeping] == 0, (polls, times)
        assert polls[polling] > 0, (polls, times)
        # Left idle, the polling daemon sleeps: it polls only after a request, and stops
        # after 4 polls in vain. Its timers (the counting's drain, the rate sampler) cost
        # a few per cent of a core; a poller that never slept would cost all of it.
        before_cpu, start = _cpu_seconds(fast.proc.pid), time.monotonic()
        time.sleep(2.0)  # the idle time itself is what is measured
        share = (_cpu_seconds(fast.proc.pid) - before_cpu) / (time.monotonic() - start)
        assert share < 0.25, share
