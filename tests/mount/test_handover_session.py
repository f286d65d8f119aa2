"""A live FUSE session handed to a successor process, through real mounts
(qosfs.daemon.takeover.fuse_session over deploy/libfuse's adopt patches), with a minimal
filesystem of the tests' own (tests/mount/handover_fs.py) whose node ids and file handles travel.

- Planned: a reader and a writer that fsyncs keep their descriptors across 10 handovers
  in a row (G0 -> G1 -> ... -> G10): no error, data intact, the same node id, and the
  window without a reader and the longest call are reported.
- Refused halfway: a successor that refuses after receiving the descriptor leaves the old
  process serving, and a later one takes over.
- Crash: the daemon is killed while it holds a read unanswered; the test keeps the
  descriptor alive (as systemd's descriptor store would), a new process adopts it, asks
  the kernel to resend (FUSE_NOTIFY_RESEND), and the read completes. An open whose file
  handle died with the old process fails with ESTALE, never hangs.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import xxhash

from qosfs.daemon.takeover import fuse_session
from tests.mount.timed_load import TimedLoad
from tests.mounting import ROOT, is_mounted
from tests.waiting import wait_for

pytestmark = [pytest.mark.mount, pytest.mark.root]

KiB = 1 << 10
MiB = 1 << 20
CHUNK = 64 * KiB

_reason = fuse_session.unavailable_reason()
if _reason is not None:
    pytest.skip(f"handover unavailable: {_reason}", allow_module_level=True)


class Daemon:
    """One handover_fs process, its log in a file."""

    def __init__(self, source: Path, mountpoint: Path, name: str, *args: str) -> None:
        self.name = name
        self.log_path = mountpoint.parent / f"handover-{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        cmd = [sys.executable, "-m", "tests.mount.handover_fs", str(source), str(mountpoint),
               "--name", name, *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=ROOT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_serving(self, timeout: float = 20.0) -> None:
        def serving() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode}: {self.log()}")
            return f"serving {self.name}" in self.log()

        wait_for(f"{self.name} to serve", serving, timeout=timeout, interval=0.01)

    def wait_exit(self, timeout: float = 20.0) -> int:
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    (src / "data.bin").write_bytes(os.urandom(16 * MiB))
    (src / "out.bin").write_bytes(b"")
    yield src, mnt
    if is_mounted(mnt):
        # A test that failed may have left a request no process will answer: abort this
        # connection (only this one) so that nothing waits on it for ever.
        abort_connection(mnt)
        if subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def abort_connection(mountpoint: Path) -> None:
    """Abort the FUSE connection mounted on *mountpoint*, found by its device number in
    mountinfo (a stat of the mountpoint could wait for ever)."""
    target = str(mountpoint.resolve())
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if fields[4] == target:
                minor = fields[2].split(":")[1]
                Path(f"/sys/fs/fuse/connections/{minor}/abort").write_text("1")


@pytest.fixture
def daemons(tree: tuple[Path, Path]) -> Iterator[Callable[..., Daemon]]:
    started: list[Daemon] = []
    src, mnt = tree

    def start(name: str, *args: str) -> Daemon:
        d = Daemon(src, mnt, name, *args)
        started.append(d)
        return d

    yield start
    if is_mounted(mnt) and all(d.proc.poll() is not None for d in started):
        abort_connection(mnt)  # nobody serves it: nothing must wait on it
    if is_mounted(mnt):
        subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, check=False)
    for d in started:
        try:
            d.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        d.close()


@dataclass
class Load(TimedLoad):
    """A reader (pread of a 16 MiB file, stat, who served) and a writer (pwrite + fsync at
    growing offsets), each on one descriptor opened before the first handover, in a
    thread, recording every error and the longest call."""

    mountpoint: Path
    source: Path
    served_by: list[str] = field(default_factory=list)
    reads: int = 0
    written: int = 0
    inodes: set[int] = field(default_factory=set)

    def start(self) -> Load:
        self.expected = (self.source / "data.bin").read_bytes()
        self.rfd = os.open(self.mountpoint / "data.bin", os.O_RDONLY)
        self.wfd = os.open(self.mountpoint / "out.bin", os.O_WRONLY)
        self.out = xxhash.xxh64()
        self._spawn(self._read, self._write)
        return self

    def _read(self) -> None:
        off = 0
        path = self.mountpoint / "data.bin"
        who = self.mountpoint / ".whoami"
        while not self._stop.is_set():
            data = self._timed(functools.partial(os.pread, self.rfd, CHUNK, off))
            if data is not None and data != self.expected[off:off + CHUNK]:
                self.errors.append(f"data differs at {off}")
            st = self._timed(lambda: os.stat(path))
            if isinstance(st, os.stat_result):
                self.inodes.add(st.st_ino)
            name = self._timed(lambda: who.read_text().split()[0])
            if isinstance(name, str) and (not self.served_by or self.served_by[-1] != name):
                self.served_by.append(name)
            self.reads += 1
            off = (off + CHUNK) % len(self.expected)

    def _write(self) -> None:
        i = 0
        while not self._stop.is_set():
            block = (b"%08d" % i) * (4 * KiB // 8)
            if self._timed(functools.partial(os.pwrite, self.wfd, block, i * len(block))) \
                    is not None:
                self._timed(lambda: os.fsync(self.wfd))
                self.out.update(block)
                self.written += len(block)
            i += 1


def adopted_after_ms(d: Daemon) -> float:
    """What the successor reports: from the predecessor's last read of /dev/fuse to its
    own session being ready."""
    for line in d.log().splitlines():
        if line.startswith("adopted after "):
            return float(line.split()[2])
    raise AssertionError(f"{d.name} did not adopt: {d.log()}")


def load_crossed(load: Load, successor: str) -> Callable[[], bool]:
    """Whether the reader has been served by *successor* and the writer has written twice
    since this was made (a call in flight then may have been the predecessor's)."""
    written = load.written
    return lambda: load.served_by[-1] == successor and load.written >= written + 2 * 4 * KiB


HANDOVERS = 10


def test_reader_and_writer_keep_their_descriptors_across_handovers(
        tree: tuple[Path, Path], daemons: Callable[..., Daemon],
        record_property: Callable[[str, object], None]) -> None:
    src, mnt = tree
    sock = mnt.parent
    names = [f"G{i}" for i in range(HANDOVERS + 1)]
    old = daemons(names[0], "--listen", str(sock / f"{names[0]}.sock"))
    old.wait_serving()
    load = Load(mnt, src).start()
    time.sleep(0.5)
    baseline, load.worst = load.worst, 0.0  # the longest call without a handover, for scale
    stalls = []
    for name in names[1:]:
        new = daemons(name, "--adopt", str(sock / f"{old.name}.sock"),
                      "--listen", str(sock / f"{name}.sock"))
        new.wait_serving()
        assert old.wait_exit() == 0, old.log()
        assert f"handed over {old.name}" in old.log()
        stalls.append(adopted_after_ms(new))
        wait_for("the reader and the writer to go on", load_crossed(load, name))
        old = new
    load.stop()

    assert load.errors == []
    assert load.served_by == names
    assert len(load.inodes) == 1, "the file's node id changed: the table was not honoured"
    assert is_mounted(mnt)
    written = (src / "out.bin").read_bytes()
    assert len(written) == load.written
    assert xxhash.xxh64(written).hexdigest() == load.out.hexdigest()
    record_property("no_reader_ms", stalls)
    record_property("worst_call_ms", round(load.worst * 1000, 1))
    print(f"{HANDOVERS} handovers: reads {load.reads}, written {load.written // KiB} KiB; "
          f"nobody reading /dev/fuse for {min(stalls):.1f}-{max(stalls):.1f} ms "
          f"(median {sorted(stalls)[len(stalls) // 2]:.1f}); longest call "
          f"{load.worst * 1000:.1f} ms across the handovers, {baseline * 1000:.1f} ms before")


def test_a_refused_handover_leaves_the_old_process_serving(
        tree: tuple[Path, Path], daemons: Callable[..., Daemon]) -> None:
    src, mnt = tree
    a = daemons("A", "--listen", str(mnt.parent / "a.sock"))
    a.wait_serving()
    load = Load(mnt, src).start()
    refused = daemons("B", "--adopt", str(mnt.parent / "a.sock"), "--refuse")
    assert refused.wait_exit() == 3, refused.log()
    time.sleep(0.3)
    assert a.proc.poll() is None
    assert "successor refused: --refuse" in a.log()
    assert (mnt / ".whoami").read_text().split()[0] == "A"
    b = daemons("B2", "--adopt", str(mnt.parent / "a.sock"))
    b.wait_serving()
    assert a.wait_exit() == 0
    time.sleep(0.3)
    load.stop()
    assert load.errors == []
    assert load.served_by == ["A", "B2"]


def hold(path: Path) -> fuse_session.Session:
    """What systemd's descriptor store does for a unit: keep the FUSE descriptor (and
    here the state negotiated at INIT) while the daemon serves on."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(path))
        fuse_session.send_message(s, "hold", {})
        prepare = fuse_session.receive_message(s)
    return fuse_session.Session(prepare.fds[0], fuse_session.check_state(prepare.payload["state"]))


def hand_held(listener: socket.socket, held: fuse_session.Session, died_at: float,
              resend: bool = True) -> None:
    """The holder's side of a handover to a successor of a dead daemon: the descriptor
    and state, no tables (they died with the process), and "resend"."""
    conn, _ = listener.accept()
    with conn:
        assert fuse_session.receive_message(conn).kind == "adopt"
        fuse_session.send_message(conn, "prepare", {"state": held.state}, [held.fuse_fd])
        assert fuse_session.receive_message(conn).kind == "ready"
        tables = {"inodes": [], "next_inode": 0, "opens": [], "next_fh": 1,
                  "stopped_at": died_at, "resend": resend}
        fuse_session.send_message(conn, "commit", tables)
        assert fuse_session.receive_message(conn).kind == "serving"


@pytest.mark.parametrize("resend", [True, False], ids=["resend", "no-resend"])
def test_after_a_crash_a_successor_gets_the_unanswered_requests_again(
        tree: tuple[Path, Path], daemons: Callable[..., Daemon], resend: bool) -> None:
    src, mnt = tree
    a = daemons("A", "--listen", str(mnt.parent / "a.sock"), "--park")
    a.wait_serving()
    held = hold(mnt.parent / "a.sock")
    rfd = os.open(mnt / "data.bin", os.O_RDONLY)
    parked: dict[str, object] = {}

    def read_parked() -> None:
        try:
            with open(mnt / ".park", "rb", buffering=0) as f:
                parked["data"] = f.read()
        except OSError as exc:
            parked["error"] = exc.errno
        parked["at"] = time.monotonic()

    reader = threading.Thread(target=read_parked, daemon=True)
    reader.start()
    time.sleep(0.5)
    assert reader.is_alive(), f"the read was not held: {parked}"

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(mnt.parent / "holder.sock"))
        listener.listen(1)
        # Started while A serves: a process forked while no daemon serves would block in
        # FLUSH as it closes the descriptors it inherited of files on the mount (the
        # reader's), before it could exec the successor.
        b = daemons("B", "--adopt", str(mnt.parent / "holder.sock"))
        time.sleep(0.5)
        died_at = time.monotonic()
        a.proc.send_signal(signal.SIGKILL)
        a.wait_exit()
        time.sleep(0.3)
        assert reader.is_alive(), "the read failed when the daemon died (descriptor not held?)"
        assert is_mounted(mnt)
        hand_held(listener, held, died_at, resend)
    b.wait_serving()
    os.close(held.fuse_fd)  # B holds its own now

    if not resend:  # the control: without FUSE_NOTIFY_RESEND the read waits for ever
        reader.join(timeout=2)
        assert reader.is_alive()
        assert (mnt / ".whoami").read_text().split()[0] == "B"  # though B serves
        abort_connection(mnt)
        reader.join(timeout=10)
        assert not reader.is_alive()
        assert parked["error"] == errno.ENOTCONN  # the connection was aborted
        with contextlib.suppress(OSError):  # its FLUSH fails likewise; the fd is closed
            os.close(rfd)
        return
    reader.join(timeout=10)
    assert not reader.is_alive(), "the resent read was not served"
    assert parked["data"] == b"B\n"
    recovered_ms = (float(str(parked["at"])) - died_at) * 1000
    print(f"the held read completed {recovered_ms:.0f} ms after the kill "
          f"(of which 300 ms the test's own wait)")

    # The open's file handle died with A's table: a clear errno, not a hang.
    with pytest.raises(OSError) as raised:
        os.pread(rfd, 4096, 0)
    assert raised.value.errno == errno.ESTALE
    os.close(rfd)
    # New opens are served.
    assert (mnt / "data.bin").read_bytes() == (src / "data.bin").read_bytes()
