"""The latency-target controller through a real mount: its canary runs, reports and goes
away; a reader starting into a running storm is protected from its first open."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from qosfs.control.ctl import Client
from tests.mounting import BOTH_LAYOUTS, QosfsMount, is_mounted
from tests.waiting import wait_for

pytestmark = pytest.mark.mount

POLICY = """
[classes.data]
paths = ["data/**"]
priority = "high"
target_read_latency = "50ms"
passthrough = "off"  # its reads reach the daemon (PASSTHROUGH_POLICY: the kernel's)

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
        if ppid == daemon_pid and b"qosfs.qos.latency.probe" in cmd:
            found.append(int(entry))
    return found


class ShardMount(NamedTuple):
    """A started mount, its mountpoint and control socket, and the backing file
    ``data/shard`` by (st_dev, st_ino), taken before mounting (in place, its path then
    leads through the mount)."""

    mount: QosfsMount
    mnt: Path
    sock: Path
    backing: tuple[int, int]


def _mount_with_shard(tmp_tree: Path, policy_text: str, shard_bytes: int, *,
                      in_place: bool = False, dirs: tuple[str, ...] = ()) -> ShardMount:
    """qosfs on ``tmp_tree/src`` (onto ``tmp_tree/mnt``, or over itself) under
    *policy_text*, with ``data/shard`` of *shard_bytes* random bytes and *dirs* made."""
    src = tmp_tree / "src"
    mnt = src if in_place else tmp_tree / "mnt"
    for d in (src, mnt, src / "data", *(src / name for name in dirs)):
        d.mkdir(exist_ok=True)
    shard = src / "data" / "shard"
    shard.write_bytes(os.urandom(shard_bytes))
    st = shard.stat()
    policy = tmp_tree / "policy.toml"
    policy.write_text(policy_text)
    sock = tmp_tree / "ctl.sock"
    m = QosfsMount(src, mnt, "--policy", str(policy), "--socket", str(sock)).start()
    return ShardMount(m, mnt, sock, (st.st_dev, st.st_ino))


def test_the_canary_measures_while_a_protected_class_reads_then_leaves(tmp_tree: Path) -> None:
    m, mnt, sock, _ = _mount_with_shard(tmp_tree, POLICY, 1 << 20)
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
            # Measured: positive, and far from a stall (an idle mount answers in well under
            # the 50 ms target; the bound is for a loaded machine).
            assert queue is not None and 0 < queue < 0.5, status
        m.proc.send_signal(signal.SIGTERM)
        assert m.proc.wait(20) == 0
        assert not is_mounted(mnt)
        assert "Traceback" not in m.log()
    finally:
        m.stop()


def _wakeups(pid: int) -> int:
    """The times the daemon's threads went to sleep and were woken (voluntary switches)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            text = Path(f"/proc/{pid}/task/{task}/status").read_text()
        except OSError:
            continue  # a thread that ended meanwhile
        total += int(text.split("voluntary_ctxt_switches:")[1].split()[0])
    return total


@BOTH_LAYOUTS
def test_an_idle_mount_wakes_a_few_times_a_second_and_a_file_opened_is_watched(
        tmp_tree: Path, in_place: bool) -> None:
    # An idle mount's latency loop checks once a window (0.5 s), not every 50 ms: the
    # daemon woke 23 times a second before (1% of a core here), ~5 now (the windows, the
    # counting's drain, the rate sampler). Once a protected file is open, the canary runs.
    m, mnt, sock, _ = _mount_with_shard(tmp_tree, POLICY, 1 << 20, in_place=in_place)
    try:
        assert m.proc is not None
        wait_for("the first windows", lambda: _latency_status(sock)["windows"],
                 until=lambda n: n >= 2, interval=0.1)
        before, start = _wakeups(m.proc.pid), time.monotonic()
        time.sleep(3.0)  # the idle time itself is what is measured
        rate = (_wakeups(m.proc.pid) - before) / (time.monotonic() - start)
        assert rate < 12, rate
        with open(mnt / "data" / "shard", "rb") as f:
            f.read(4096)
            wait_for("the canary", lambda: _latency_status(sock)["probe_running"],
                     interval=0.1)
    finally:
        m.stop()


def _storm(path: Path, stop: threading.Event, written: list[int]) -> None:
    """A checkpoint writer: 1 MiB writes through the mount, over and over 32 MiB."""
    chunk = os.urandom(1 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while not stop.is_set():
            os.pwrite(fd, chunk, (written[0] % 32) << 20)
            written[0] += 1
    finally:
        os.close(fd)


def test_a_reader_starting_into_a_running_storm_is_cut_for_at_its_first_open(
        tmp_tree: Path) -> None:
    """The bound: the controller looks for a protected class becoming active every 50 ms
    and cuts the classes below at once, before it can judge a single read. Through a
    real mount on a shared 2-CPU machine: the daemon says it cut in the very decision
    that saw the class become active (the check that fails without the bound). How soon
    that is seen is bench/latency_target.py's figure (within 1.5 windows, 0.75 s; before:
    1.3 s, and 3.3 s for a relative target); here it is only held to a few seconds, which
    a loaded machine cannot break."""
    m, mnt, sock, _ = _mount_with_shard(tmp_tree, POLICY, 1 << 20, dirs=("ckpt",))
    stop = threading.Event()
    written = [0]
    storm = threading.Thread(target=_storm, args=(mnt / "ckpt" / "state", stop, written))
    try:
        storm.start()
        wait_for("the storm to run", lambda: written[0] >= 64, timeout=20.0)
        time.sleep(1.0)  # two windows of storm with the protected class idle: no cut
        status = _latency_status(sock)
        assert status["throttled"] == [] and status["protected"][0]["verdict"] == "idle"
        opened = time.monotonic()
        with open(mnt / "data" / "shard", "rb") as f:
            status = wait_for("the first cut", lambda: _latency_status(sock),
                              until=lambda s: s["throttled"], timeout=10.0, interval=0.02)
            seen = time.monotonic() - opened
            f.read(4096)
        p = status["protected"][0]
        assert seen <= 3.0, (seen, status)
        assert p["first_cut_reason"] == "starting", status
        assert p["first_cut_at"] == p["active_since"], status
        assert 0 <= status["now"] - p["first_cut_at"] <= seen, status
        assert status["early_windows"] >= 1
        ckpt = status["throttled"][0]
        assert ckpt["class"] == "ckpt" and ckpt["write_bandwidth"] is not None
    finally:
        stop.set()
        storm.join(30)
        m.stop()
    assert not is_mounted(mnt)
    assert "Traceback" not in m.log()


# The default: reads nothing caps are passed through, a "request" target included.
PASSTHROUGH_POLICY = POLICY.replace(
    'passthrough = "off"  # its reads reach the daemon (PASSTHROUGH_POLICY: the kernel\'s)\n',
    "")


def _open_by(pid: int, target: tuple[int, int]) -> bool:
    """Whether process *pid* holds the file (st_dev, st_ino) *target* open (False once it
    is gone). By identity, not path: in place, the backing file and the mount's file have
    the same path."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == target:
            return True
    return False


@BOTH_LAYOUTS
def test_a_passthrough_reader_is_judged_on_reads_of_its_backing_file(
        tmp_tree: Path, in_place: bool) -> None:
    """The kernel reads the class's files itself, so none of its reads reaches the daemon
    and none waits in its queue: the canary times reads of the very backing file the
    reader holds (opened through the daemon's descriptor, which in place is the covered
    file, not the mount's), the status shows them as the class's backend time, and the
    canary lets the file go when the reader closes it."""
    import pyfuse3

    if not getattr(pyfuse3, "PASSTHROUGH_SUPPORTED", False):
        pytest.skip("pyfuse3 without kernel passthrough: `make deps` builds it")
    m, mnt, sock, backing = _mount_with_shard(tmp_tree, PASSTHROUGH_POLICY, 4 << 20,
                                              in_place=in_place)
    try:
        assert m.proc is not None
        with Client(str(sock)) as client:
            kernel = client.request({"cmd": "status"})["passthrough"]
        if kernel["state"] != "active":
            pytest.skip(f"kernel passthrough unavailable here: {kernel['reason']}")
        with open(mnt / "data" / "shard", "rb") as f:
            assert os.fstat(f.fileno()).st_dev != backing[0]  # through the mount
            assert f.read(4096)  # served by the kernel: the daemon sees the open only
            status = wait_for("the canary's reads of the backing file",
                              lambda: _latency_status(sock),
                              until=lambda s: s["protected"][0]["backend_seconds"],
                              timeout=20.0, interval=0.1)
            p = status["protected"][0]
            assert p["reads_observed"] is False and p["reads"] == 0, status
            assert 0 < p["backend_seconds"] < 0.5, status  # an idle file: measured, no stall
            assert p["latency_seconds"] is not None, status
            canaries = _canaries(m.proc.pid)
            assert len(canaries) == 1 and _open_by(canaries[0], backing)
        wait_for("the canary to let the file go",
                 lambda: not any(_open_by(c, backing) for c in canaries),
                 timeout=20.0, interval=0.1)
    finally:
        m.stop()
    assert not is_mounted(mnt)
    assert "Traceback" not in m.log()
