"""Mount lifecycle: readiness, clear errors, signals, unmount, stale mounts, forgets."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.mounting import ROOT, QosfsMount, is_mounted, scratch_fs
from tests.waiting import wait_for

pytestmark = pytest.mark.mount


def qosfs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qosfs", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def _dirs(tmp: Path) -> tuple[Path, Path]:
    src, mnt = tmp / "src", tmp / "mnt"
    src.mkdir()
    mnt.mkdir()
    return src, mnt


def _unmount(mnt: Path) -> None:
    subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True)
    deadline = time.monotonic() + 10
    while is_mounted(mnt) and time.monotonic() < deadline:
        time.sleep(0.05)
    if is_mounted(mnt):
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_background_mount_is_usable_when_the_command_returns(tmp_tree: Path) -> None:
    src, mnt = _dirs(tmp_tree)
    (src / "hello").write_text("world")
    try:
        result = qosfs("mount", str(src), str(mnt))
        assert result.returncode == 0, result.stderr
        assert (mnt / "hello").read_text() == "world"  # no polling: ready means ready
        with open(mnt / "hello") as held:  # qosfs mount again: a handover, not a refusal
            again = qosfs("mount", str(src), str(mnt))
            assert again.returncode == 0, again.stderr
            assert held.read() == "world"
        assert (mnt / "hello").read_text() == "world"
    finally:
        _unmount(mnt)
    assert not is_mounted(mnt)


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["/nonexistent/src", "{mnt}"], 3, "qosfs: source /nonexistent/src does not exist"),
        (["{src}", "{tmp}/nope"], 4, "qosfs: mountpoint {tmp}/nope does not exist"),
        (["{src}/file", "{mnt}"], 3, "qosfs: source {src}/file is not a directory"),
    ],
)
def test_mount_errors_are_one_line_with_distinct_codes(tmp_tree: Path, args: list[str],
                                                       code: int, message: str) -> None:
    src, mnt = _dirs(tmp_tree)
    (src / "file").write_text("")
    fmt = {"src": src, "mnt": mnt, "tmp": tmp_tree}
    result = qosfs("mount", *(a.format(**fmt) for a in args))
    assert result.returncode == code
    assert result.stderr.strip() == message.format(**fmt)
    assert "Traceback" not in result.stderr
    assert not is_mounted(mnt)


def test_sigterm_unmounts_cleanly_with_exit_0(tmp_tree: Path) -> None:
    src, mnt = _dirs(tmp_tree)
    m = QosfsMount(src, mnt).start()
    try:
        (mnt / "f").write_text("data")
        fd = os.open(mnt / "f", os.O_RDONLY)  # an open file does not block shutdown
        assert m.proc is not None
        m.proc.send_signal(signal.SIGTERM)
        assert m.proc.wait(20) == 0
        # The file outlived the connection. close() asks nothing of the daemon (it
        # answered FLUSH with ENOSYS once, so the kernel stopped sending it): no error.
        os.close(fd)
        assert not is_mounted(mnt)
        assert (src / "f").read_text() == "data"
    finally:
        m.stop()


def test_fusermount_u_ends_the_daemon_with_exit_0(tmp_tree: Path) -> None:
    src, mnt = _dirs(tmp_tree)
    m = QosfsMount(src, mnt).start()
    try:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=True)
        assert m.proc is not None and m.proc.wait(20) == 0
        assert "Traceback" not in m.log()
    finally:
        m.stop()


@pytest.mark.root
def test_stale_mount_after_kill_9_is_recovered_and_fsynced_data_kept(tmp_tree: Path) -> None:
    """Without a keeper (--keeper none) the connection dies with the daemon: ENOTCONN,
    and the next mount cleans the stale one (test_crash_recovery: with a keeper)."""
    src, mnt = _dirs(tmp_tree)
    m = QosfsMount(src, mnt, "--keeper", "none").start()
    try:
        with open(mnt / "durable", "wb") as f:
            f.write(b"d" * 1_000_000)
            f.flush()
            os.fsync(f.fileno())
        assert m.proc is not None
        m.proc.kill()
        m.proc.wait(10)
        with pytest.raises(OSError) as info:
            os.stat(mnt / "durable")
        assert info.value.errno == errno.ENOTCONN
        m2 = QosfsMount(src, mnt, "--keeper", "none", log_path=tmp_tree / "second.log").start()
        try:
            assert (mnt / "durable").read_bytes() == b"d" * 1_000_000
        finally:
            assert m2.stop() == 0
    finally:
        m.stop()


@pytest.mark.root
def test_in_place_mount_recovers_at_once_after_kill_9(tmp_tree: Path) -> None:
    """In place, the source is covered by the dead mount itself: the keeper's copy of the
    source's root is what the restarted daemon serves from (qosfs.daemon.takeover.keeper)."""
    src = tmp_tree / "mlfs"
    src.mkdir()
    m = QosfsMount(src, src).start()
    try:
        with open(src / "durable", "wb") as f:
            f.write(b"d" * 100_000)
            os.fsync(f.fileno())
        assert m.proc is not None
        m.proc.kill()
        m.proc.wait(10)
        m2 = QosfsMount(src, src, log_path=tmp_tree / "second.log").start()
        try:
            assert (src / "durable").read_bytes() == b"d" * 100_000
            assert "recovering after the death of pid" in m2.log()
        finally:
            assert m2.stop() == 0
    finally:
        m.stop()
    assert not is_mounted(src)


FILES = 1500


@pytest.mark.root
def test_forgotten_inodes_release_their_descriptors(qmount) -> None:
    # Fewer files than the inodes kept as objects (inodes.HOT_LIMIT): one past those is
    # folded into the cold table, which holds no descriptor (cold_inodes).
    tree = qmount.source / "many"
    tree.mkdir()
    for i in range(FILES):
        (tree / f"f{i}").write_bytes(b"")
    assert len(os.listdir(qmount.mountpoint / "many")) == FILES
    for i in range(FILES):
        os.stat(qmount.mountpoint / "many" / f"f{i}")
    pid = qmount.proc.pid
    before = len(os.listdir(f"/proc/{pid}/fd"))
    assert before > FILES
    def descriptors_after_forgetting() -> int:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("2\n")
        return len(os.listdir(f"/proc/{pid}/fd"))

    wait_for(f"the daemon's descriptors ({before}) to go once the kernel forgot",
             descriptors_after_forgetting, until=lambda after: after < 100, interval=0.2)
    # And the tree still works after the forgets.
    assert (qmount.mountpoint / "many" / f"f{FILES - 1}").stat().st_size == 0


@pytest.mark.root
def test_enospc_from_a_small_source_reaches_the_caller(tmp_tree: Path) -> None:
    src, mnt = _dirs(tmp_tree)
    with scratch_fs(src, "tmpfs", "size=2m"), QosfsMount(src, mnt):
        with pytest.raises(OSError) as info, open(mnt / "big", "wb") as f:
            for _ in range(8):
                f.write(b"x" * (1 << 20))
                f.flush()
        assert info.value.errno == errno.ENOSPC
        os.unlink(mnt / "big")
        (mnt / "small").write_text("still works")
        assert (src / "small").read_text() == "still works"
