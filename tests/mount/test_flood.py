"""Floods of throttled requests: other classes keep their speed, memory stays bounded, and a
killed flooder goes away at once.

One user starts a thousand (or ten thousand) threads that each write 1 MiB into a class
capped at 1 MiB/s. Before: every pyfuse3 worker was parked, so nothing else was read from
/dev/fuse (a 6-byte ``cat`` in an unthrottled class took 19 s), and ``kill -9`` of the
flooder left its threads in D state until the cap was lifted. Now the parking bounds
limit what may wait (the rest is answered EAGAIN), and FUSE INTERRUPT answers the parked
requests of a killed caller (qosfs.qos.bounds, qosfs.passthrough.interrupts).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from qosfs.control.ctl import Client
from qosfs.qos.bounds import ParkingLimits
from tests.mount.test_scale import Reader, p99, reader_alone, rss_mib
from tests.mounting import QosfsMount, as_user
from tests.waiting import wait_for

pytestmark = [pytest.mark.mount, pytest.mark.root]

FLOODER = Path(__file__).with_name("flooder.py")
POLICY = """
[classes.datasets]
paths = ["data/**"]
priority = "high"
passthrough = "off"   # the reader's reads must reach the daemon the flood fills

[classes.slow]
paths = ["slow/**"]
write_bandwidth = "1MiB/s"
burst = "1MiB"
"""
LIMITS = ParkingLimits()


def status(sock: Path) -> dict[str, Any]:
    with Client(str(sock)) as client:
        return client.request({"cmd": "status"})


def flood(tmp_tree: Path, uids: list[int], threads_per_uid: int) -> dict[str, Any]:
    """Flood, measure an unthrottled reader during it, kill -9 the flooders."""
    src, mnt, sock = tmp_tree / "src", tmp_tree / "mnt", tmp_tree / "ctl.sock"
    src.mkdir(mode=0o755)
    mnt.mkdir()
    (src / "data").mkdir()
    (src / "data" / "shard").write_bytes(os.urandom(8 << 20))
    (src / "data" / "unseen").write_bytes(b"hello\n")
    for uid in uids:
        (src / "slow" / str(uid)).mkdir(parents=True)
        os.chown(src / "slow" / str(uid), uid, uid)
    policy = tmp_tree / "policy.toml"
    policy.write_text(POLICY)
    figures: dict[str, Any] = {}
    with QosfsMount(src, mnt, "--policy", str(policy), "--socket", str(sock)) as m:
        assert m.proc is not None
        figures["alone_p99_ms"] = reader_alone(mnt / "data" / "shard") * 1e3
        figures["rss_before_mib"] = rss_mib(m.proc.pid)
        # The system python: the test's may live where the flooding user cannot read.
        python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
        # The reader runs through the whole flood: its start (every write arriving at
        # once), the parked steady state, and the kill.
        reader = Reader(mnt / "data" / "shard")
        reader.start()
        flooders = [subprocess.Popen(
            [python, "-c", FLOODER.read_text(), str(mnt / "slow" / str(uid)),
             str(threads_per_uid), str(1 << 20)],
            stdout=subprocess.PIPE, preexec_fn=as_user(uid), cwd="/") for uid in uids]
        try:
            total = len(uids) * threads_per_uid
            # (Nearly) every writer has parked or been refused; the rest got through at
            # the cap's pace (how many depends on how fast this machine takes the burst).
            # (Opens past a uid's share of the daemon's descriptors are refused: at this
            # machine's limit of 20,000, 7,500 per uid.)
            wait_for("the flooding writes to park or fail",
                     lambda: (s := status(sock))["parked_requests"] + s["parking_refused"]
                     + s["open_refused"], timeout=120, interval=0.05,
                     until=lambda stopped: stopped >= total * 9 // 10)
            st = status(sock)
            figures["parked"], figures["refused"] = st["parked_requests"], st["parking_refused"]
            figures["open_refused"] = st["open_refused"]
            figures["parked_mib"] = st["parked_bytes"] / (1 << 20)
            steady = len(reader.latencies)
            wait_for("2000 reads during the flood", lambda: len(reader.latencies),
                     until=lambda done: done >= steady + 2000, timeout=120, interval=0.05)
            # A file of the unthrottled class nobody has looked up yet.
            start = time.monotonic()
            assert (mnt / "data" / "unseen").read_bytes() == b"hello\n"
            figures["cat_unseen_ms"] = (time.monotonic() - start) * 1e3
            figures["steady_p99_ms"] = p99(reader.latencies[steady:]) * 1e3
            figures["rss_during_mib"] = rss_mib(m.proc.pid)
            figures["parked_at_kill"] = status(sock)["parked_requests"]
            start = time.monotonic()
            for proc in flooders:
                proc.send_signal(signal.SIGKILL)
            for proc in flooders:
                proc.wait(timeout=60)
            figures["kill_s"] = time.monotonic() - start
            latencies = reader.stop()
            figures["during_p99_ms"] = p99(latencies) * 1e3
            figures["during_max_ms"] = max(latencies) * 1e3
            assert not reader.errors, reader.errors[:3]
        finally:
            if reader.is_alive():
                reader.stop()
            for proc in flooders:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                assert proc.stdout is not None
                proc.stdout.close()
        wait_for("the lot to empty", lambda: status(sock)["parked_requests"], timeout=10,
                 interval=0.05, until=lambda parked: parked == 0)
        figures["killed_callers"] = status(sock)["killed_callers"]
    # Underneath, each file holds a prefix of what its writer wrote: an unaligned 1 MiB
    # O_DIRECT write reaches us as two requests (1 MiB - 48 and 48 bytes), and a refused
    # or killed second one leaves the first, reported to the writer as a short write.
    for uid in uids:
        for path in (src / "slow" / str(uid)).iterdir():
            data = path.read_bytes()
            assert len(data) <= 1 << 20 and data.count(b"\xab") == len(data), path
    print(f"\nflood {len(uids)} uid(s) x {threads_per_uid} threads: {figures}")
    return figures


def check(figures: dict[str, Any], uids: int) -> None:
    # One uid parks at most its share; the others are refused at once.
    assert figures["parked_mib"] <= uids * LIMITS.per_uid_bytes / (1 << 20)
    assert figures["refused"] > 0
    # What a flood is held to is the same reader alone on this mount, in this run, with a
    # margin a shared machine cannot break: the failure these guard against is a read
    # waiting for the cap (every worker parked: a 6-byte cat took 19 s), a thousand
    # times what they allow. The product's target, 10 ms p99 over the whole flood
    # (1-6 ms on a quiet machine), is not a bound here: 10,000 threads starting on two
    # shared cores slow the reading thread itself, and a fixed 20 ms failed a fresh
    # clone's run at 25.4 ms (issue 38). Once every write has parked or been refused,
    # reads are nearly as fast as alone.
    alone = figures["alone_p99_ms"]
    assert figures["during_p99_ms"] < max(100.0, 50 * alone), figures
    assert figures["steady_p99_ms"] < max(20.0, 10 * alone), figures
    assert figures["cat_unseen_ms"] < 5000, figures
    # A parked caller killed stays in D state until the cap lets its write through: 1 MiB
    # each at 1 MiB/s, minutes for the lot. Answered at the kill, it goes in well under 10 s.
    assert figures["kill_s"] < 10.0, figures
    # Nearly every parked request was answered because its caller died (a few may be
    # admitted at the cap's pace between the count and the kill).
    assert figures["killed_callers"] >= figures["parked_at_kill"] * 0.9 - uids, figures
    # Parked write data is bounded; the daemon holds about twice that (pyfuse3's copy and
    # its worker's receive buffer).
    grown = figures["rss_during_mib"] - figures["rss_before_mib"]
    assert grown < 3 * LIMITS.total_bytes / (1 << 20), figures


def test_a_thousand_parked_writers_leave_other_classes_alone(tmp_tree: Path) -> None:
    check(flood(tmp_tree, [5001], 1100), 1)


@pytest.mark.slow
def test_ten_thousand_writers_from_one_uid(tmp_tree: Path) -> None:
    check(flood(tmp_tree, [5001], 10000), 1)


@pytest.mark.slow
def test_ten_thousand_writers_from_ten_uids(tmp_tree: Path) -> None:
    check(flood(tmp_tree, list(range(5001, 5011)), 1000), 10)


def test_parking_bounds_are_reported_in_status(tmp_tree: Path) -> None:
    src, mnt, sock = tmp_tree / "src", tmp_tree / "mnt", tmp_tree / "ctl.sock"
    src.mkdir()
    mnt.mkdir()
    with QosfsMount(src, mnt, "--socket", str(sock)):
        st = status(sock)
    assert json.loads(json.dumps(st))["parked_requests"] == 0
    assert st["inode_fds"] <= st["inode_fd_budget"] + 2


def test_sigterm_completes_every_parked_write_whole(tmp_tree: Path) -> None:
    """SIGTERM with writers parked: every write() returns its full length, and the files
    underneath hold all of it -- including the tail request that an unaligned 1 MiB
    O_DIRECT write sends only once its first part is answered."""
    src, mnt, sock = tmp_tree / "src", tmp_tree / "mnt", tmp_tree / "ctl.sock"
    src.mkdir(mode=0o755)
    mnt.mkdir()
    (src / "slow").mkdir()
    os.chown(src / "slow", 5001, 5001)
    policy = tmp_tree / "policy.toml"
    policy.write_text(POLICY)
    writers = 24
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    m = QosfsMount(src, mnt, "--policy", str(policy), "--socket", str(sock)).start()
    try:
        flooder = subprocess.Popen(
            [python, "-c", FLOODER.read_text(), str(mnt / "slow"), str(writers),
             str(1 << 20)], stdout=subprocess.PIPE, text=True, cwd="/",
            preexec_fn=as_user(5001))
        wait_for("the writers to park", lambda: status(sock)["parked_requests"], timeout=30,
                 interval=0.05, until=lambda parked: parked >= writers - 2)
        assert m.proc is not None
        m.proc.send_signal(signal.SIGTERM)
        assert m.proc.wait(30) == 0
        out, _ = flooder.communicate(timeout=30)
    finally:
        m.stop()
    assert json.loads(out) == {"ok": writers}, out
    sizes = sorted(p.stat().st_size for p in (src / "slow").iterdir())
    assert sizes == [1 << 20] * writers, sizes
    assert "Traceback" not in m.log()
