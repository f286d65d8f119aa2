"""The holder that keeps a mount's FUSE descriptor while its daemon is dead, run as a real
process: it gives the descriptors to a successor only while no daemon holds the lease,
lets go of them when it is told to, when nobody comes back in time or when the
connection is gone, refuses peers of other users, and never reads the FUSE descriptor.

Pipes stand in for the descriptors: the end the holder keeps tells the test when the
holder lets go (the test's end of the pipe reports POLLHUP once no other process holds
the holder's end), and the write end of a pipe reports POLLERR to a poll for no events
once its reader is gone, as ``/dev/fuse`` does once the connection is aborted."""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from qosfs.core.errors import QosfsError
from qosfs.daemon.takeover.keeper import Lease, claim, drop, holder_pid, start_holder

OTHER_UID = 4243


@dataclass
class Holder:
    """A running holder and the test's ends of the pipes it holds."""

    path: str
    pid: int
    pidfd: int
    fuse: int  # the test's end of the pipe whose other end stands for /dev/fuse (or -1)
    root: int  # likewise for the source's root
    given: tuple[tuple[int, int], tuple[int, int]]  # (st_dev, st_ino) of what it holds
    mine: list[int] = field(default_factory=list)  # descriptors to close at the end

    def status(self) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5)
            sock.connect(self.path)
            sock.sendall(b"status\n")
            return json.loads(sock.makefile("rb").readline())  # type: ignore[no-any-return]

    def exited(self, within: float) -> bool:
        """Whether the holder process has ended (by *within* seconds from now)."""
        return bool(select.select([self.pidfd], [], [], within)[0])

    def let_go(self, within: float) -> bool:
        """Whether no process holds the holder's ends of the pipes any more."""
        deadline = time.monotonic() + within
        for fd in (self.fuse, self.root):
            if fd < 0:
                continue
            poller = select.poll()
            poller.register(fd, 0)
            left = max(0.0, deadline - time.monotonic())
            if not poller.poll(int(left * 1000)):
                return False
        return True

    def open_fds(self) -> list[str]:
        fd_dir = f"/proc/{self.pid}/fd"
        return sorted(os.readlink(f"{fd_dir}/{name}") for name in os.listdir(fd_dir))


def identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def unread(fd: int) -> int:
    """Bytes waiting in the pipe *fd* is an end of."""
    return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0])


Start = Callable[..., Holder]


@pytest.fixture
def start(tmp_tree: Path) -> Iterator[Start]:
    """Starts holders; each is made to let go at the end, and killed if it will not."""
    holders: list[Holder] = []

    def run(grace: float = 30.0, fuse_read_end: bool = False) -> Holder:
        path = str(tmp_tree / f"k{len(holders)}.keeper")
        fuse_r, fuse_w = os.pipe()
        root_r, root_w = os.pipe()
        if fuse_read_end:  # it gets the reader; the test writes into the pipe
            given_fuse, kept_fuse = fuse_r, fuse_w
        else:  # it gets the writer: closing the reader aborts "the connection"
            given_fuse, kept_fuse = fuse_w, fuse_r
        try:
            start_holder(path, given_fuse, root_w, grace)
            given = (identity(given_fuse), identity(root_w))
        finally:
            os.close(given_fuse)
            os.close(root_w)
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(path)
            sock.sendall(b"status\n")
            pid = json.loads(sock.makefile("rb").readline())["pid"]
        holder = Holder(path, pid, os.pidfd_open(pid), kept_fuse, root_r, given)
        holder.mine += [holder.pidfd, kept_fuse, root_r]
        holders.append(holder)
        return holder

    yield run
    outlived = []
    for holder in holders:
        if not holder.exited(0):
            drop(holder.path)
        if not holder.exited(5):
            with open(f"/proc/{holder.pid}/cmdline", "rb") as f:
                assert holder.path.encode() in f.read()  # ours: the one on our socket
            signal.pidfd_send_signal(holder.pidfd, signal.SIGKILL)
            outlived.append(holder.pid)
        for fd in holder.mine:
            os.close(fd)
    assert not outlived, f"holders that did not let go when dropped: {outlived}"


def claim_when_free(path: str, within: float = 5.0) -> tuple[int, int]:
    """Claim the descriptors; the holder may not have seen the old lease's end yet."""
    deadline = time.monotonic() + within
    while True:
        fds = claim(path)
        if fds is not None:
            return fds
        assert time.monotonic() < deadline, "the holder never gave its descriptors"
        time.sleep(0.02)


def test_it_holds_only_its_descriptors_and_reports_its_status(start: Start) -> None:
    holder = start()
    status = holder.status()
    assert status["pid"] == holder.pid and status["leases"] == 0
    assert abs(status["since"] - time.time()) < 60
    deadline = time.monotonic() + 5
    while len(fds := holder.open_fds()) > 6 and time.monotonic() < deadline:
        time.sleep(0.01)  # the status connection, closed just after its answer
    # /dev/null thrice, the two pipes and its listening socket
    assert fds.count("/dev/null") == 3 and len(fds) == 6, repr(fds)
    assert sum(fd.startswith("pipe:") for fd in fds) == 2
    assert os.readlink(f"/proc/{holder.pid}/cwd") == "/"  # nothing under the mount
    assert os.stat(holder.path).st_mode & 0o777 == 0o600


def test_its_pid_is_what_qosfs_umount_waits_for(start: Start, tmp_path: Path) -> None:
    holder = start()
    assert holder_pid(holder.path) == holder.pid
    assert holder_pid(str(tmp_path / "nobody.keeper")) is None


def test_a_successor_gets_nothing_while_a_daemon_holds_the_lease(start: Start) -> None:
    holder = start()
    lease = Lease(holder.path)
    try:
        assert holder.status()["leases"] == 1
        assert claim(holder.path) is None  # busy: a daemon serves the mount
    finally:
        lease.end(unmounting=False)  # a daemon that stops without unmounting
    fuse, root = claim_when_free(holder.path)
    holder.mine += [fuse, root]
    assert (identity(fuse), identity(root)) == holder.given  # the very same files
    assert not holder.exited(0.2)  # it keeps its copies for the next crash


def test_a_daemon_killed_without_bye_leaves_the_descriptors_to_a_successor(
        start: Start) -> None:
    holder = start()
    daemon = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from qosfs.daemon.takeover.keeper import Lease\n"
         "lease = Lease(sys.argv[1])\nprint('serving', flush=True)\ntime.sleep(60)\n",
         holder.path], stdout=subprocess.PIPE)
    try:
        assert daemon.stdout is not None and daemon.stdout.readline() == b"serving\n"
        assert claim(holder.path) is None
    finally:
        daemon.kill()  # kill -9: no bye
        daemon.wait()
        assert daemon.stdout is not None
        daemon.stdout.close()
    fuse, root = claim_when_free(holder.path)
    holder.mine += [fuse, root]
    assert (identity(fuse), identity(root)) == holder.given
    assert holder.status()["leases"] == 0


def test_bye_makes_it_let_go_and_exit(start: Start) -> None:
    holder = start()
    lease = Lease(holder.path)
    assert not holder.let_go(0.1)
    lease.end(unmounting=True)
    assert holder.exited(5) and holder.let_go(1)
    assert not os.path.exists(holder.path)
    assert claim(holder.path) is None  # no holder: nothing to adopt


def test_drop_makes_it_let_go_and_exit_even_under_a_lease(start: Start) -> None:
    for leased in (False, True):
        holder = start()
        lease = Lease(holder.path) if leased else None
        drop(holder.path)
        assert holder.exited(5) and holder.let_go(1)
        assert not os.path.exists(holder.path)
        if lease is not None:
            lease.end(unmounting=True)  # to nobody: raises nothing


def test_with_nobody_to_take_over_it_lets_go_after_the_grace_period(start: Start) -> None:
    grace = 0.5
    holder = start(grace=grace)  # nobody takes a lease at all
    assert holder.exited(5) and holder.let_go(1)
    holder = start(grace=grace)
    lease = Lease(holder.path)
    assert not holder.exited(3 * grace)  # a daemon serves: no deadline
    ended = time.monotonic()
    lease.end(unmounting=False)
    assert holder.exited(5) and holder.let_go(1)
    assert time.monotonic() - ended >= grace * 0.9  # not before the grace period


def test_it_lets_go_when_the_connection_is_gone(start: Start) -> None:
    holder = start()  # no daemon serves yet: /dev/fuse is watched
    os.close(holder.fuse)  # "/dev/fuse" now reports POLLERR, as after an abort
    holder.mine.remove(holder.fuse)
    holder.fuse = -1
    assert holder.exited(5) and holder.let_go(1)


def test_it_does_not_watch_the_connection_while_a_daemon_serves(start: Start) -> None:
    """A poller of /dev/fuse is woken by every request queued, so while a daemon serves
    (and says bye when the mount ends) the holder does not watch it; a connection gone
    meanwhile is seen as soon as the daemon is, without waiting out the grace period."""
    holder = start(grace=30.0)
    lease = Lease(holder.path)
    os.close(holder.fuse)
    holder.mine.remove(holder.fuse)
    holder.fuse = -1
    assert not holder.exited(0.5)  # served: the daemon's to tell
    ended = time.monotonic()
    lease.end(unmounting=False)  # the daemon dies without bye
    assert holder.exited(5) and holder.let_go(1)
    assert time.monotonic() - ended < 5  # at once, not after 30 s


def test_it_never_reads_the_fuse_descriptor(start: Start) -> None:
    holder = start(fuse_read_end=True)
    request = b"a request only the daemon may read"
    os.write(holder.fuse, request)
    lease = Lease(holder.path)
    holder.status()
    lease.end(unmounting=False)
    fuse, root = claim_when_free(holder.path)
    holder.mine += [fuse, root]
    time.sleep(0.2)  # time enough to read, had it asked to
    assert unread(holder.fuse) == len(request)
    assert os.read(fuse, 4096) == request  # still there for the successor


PEER = """
import socket, sys
sock = socket.socket(socket.AF_UNIX)
sock.settimeout(5)
try:
    sock.connect(sys.argv[1])
except PermissionError:
    print("EACCES")
    sys.exit()
try:
    sock.sendall(sys.argv[2].encode() + b"\\n")
    data, ancdata, _, _ = sock.recvmsg(256, socket.CMSG_SPACE(8))
except (BrokenPipeError, ConnectionResetError):  # closed before it read the request
    data, ancdata = b"", []
print(repr(data), len(ancdata))
"""


def as_other_user(path: str, request: str) -> str:
    result = subprocess.run(["/usr/bin/python3", "-c", PEER, path, request],
                            user=OTHER_UID, group=OTHER_UID, extra_groups=[], cwd="/",
                            capture_output=True, timeout=30)
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout.decode().strip()


@pytest.mark.root
def test_a_peer_of_another_user_gets_nothing(start: Start) -> None:
    holder = start()
    assert as_other_user(holder.path, "adopt") == "EACCES"  # the socket is 0600
    os.chmod(holder.path, 0o666)  # past the file's mode, the peer's uid is checked
    assert as_other_user(holder.path, "adopt") == "b'' 0"
    assert as_other_user(holder.path, "status") == "b'' 0"
    assert as_other_user(holder.path, "drop") == "b'' 0"
    fuse, root = claim_when_free(holder.path)  # it still serves its own user
    holder.mine += [fuse, root]
    assert (identity(fuse), identity(root)) == holder.given


def test_a_successor_asking_as_the_old_lease_ends_is_not_told_busy(start: Start) -> None:
    """The holder learns of the daemon's death and of its successor in the same wakeup
    (it was busy with another client meanwhile): the death counts first, else the
    successor would think a daemon serves and wait on the dead mount."""
    holder = start()
    lease = Lease(holder.path)
    with socket.socket(socket.AF_UNIX) as slow:
        slow.connect(holder.path)
        slow.sendall(b"status")  # the holder waits for the end of this line...
        time.sleep(0.1)
        lease.end(unmounting=False)  # ...while the daemon dies...
        adopt = socket.socket(socket.AF_UNIX)  # ...and its successor asks
        adopt.settimeout(5)
        adopt.connect(holder.path)
        time.sleep(0.1)
        slow.sendall(b"\n")
        assert json.loads(slow.makefile("rb").readline())["leases"] == 1
    with adopt:
        adopt.sendall(b"adopt\n")
        data, ancdata, _, _ = adopt.recvmsg(16, socket.CMSG_SPACE(8),
                                            socket.MSG_CMSG_CLOEXEC)
        fds = [fd for _, _, cdata in ancdata
               for fd in struct.unpack(f"{len(cdata) // 4}i", cdata)]
    holder.mine += fds
    assert data == b"fd\n" and len(fds) == 2


def test_a_keeper_that_ends_before_it_listens_fails_its_start_at_once(
        tmp_tree: Path) -> None:
    """Before: the daemon polled the keeper's socket for 10 s (an unmount in the first
    moments of a mount kept it that long). Now the keeper's end says it on the pipe."""
    fuse_r, fuse_w = os.pipe()
    root_r, root_w = os.pipe()
    try:
        start = time.monotonic()
        with pytest.raises(QosfsError, match=r"^the keeper ended before it listened"):
            start_holder(str(tmp_tree / "no-such-dir" / "k.keeper"), fuse_w, root_w, 30.0)
        assert time.monotonic() - start < 5.0  # the keeper's start, not the 10 s deadline
    finally:
        for fd in (fuse_r, fuse_w, root_r, root_w):
            os.close(fd)
