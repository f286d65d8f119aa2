"""systemd's descriptor store, with a datagram socket standing in for systemd, and the
descriptors it passes back (in a child process, where 3, 4, ... are free to use)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from qosfs.daemon.notify import (
    FUSE_FD_NAME,
    fd_store_possible,
    inherited_fds,
    remove_fd,
    store_fd,
)
from tests.mounting import ROOT


@pytest.fixture
def manager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """The service manager's end of $NOTIFY_SOCKET."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    monkeypatch.delenv("FDSTORE", raising=False)
    yield sock
    sock.close()


def test_store_sends_the_same_open_file_with_its_name(manager: socket.socket,
                                                      tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_bytes(b"0123456789")
    fd = os.open(path, os.O_RDONLY)
    try:
        assert store_fd(fd, FUSE_FD_NAME) is True
        message, fds, _, _ = socket.recv_fds(manager, 4096, 4)
        assert message == b"FDSTORE=1\nFDNAME=qosfs-fuse"
        [kept] = fds
        try:
            assert os.path.samestat(os.fstat(kept), os.fstat(fd))
            # One open file description, not a reopen: what keeps a FUSE connection alive.
            os.lseek(fd, 7, os.SEEK_SET)
            assert os.lseek(kept, 0, os.SEEK_CUR) == 7
            assert os.read(kept, 3) == b"789"
        finally:
            os.close(kept)
    finally:
        os.close(fd)


def test_remove_names_what_to_drop_and_carries_nothing(manager: socket.socket) -> None:
    assert remove_fd(FUSE_FD_NAME) is True
    message, fds, _, _ = socket.recv_fds(manager, 4096, 4)
    assert message == b"FDSTOREREMOVE=1\nFDNAME=qosfs-fuse" and fds == []


def test_possible_only_with_a_manager_that_keeps_descriptors(
        monkeypatch: pytest.MonkeyPatch, manager: socket.socket) -> None:
    assert fd_store_possible() is True  # systemd 252: no $FDSTORE, nothing more to know
    monkeypatch.setenv("FDSTORE", "4")  # 254+: FileDescriptorStoreMax=
    assert fd_store_possible() is True
    monkeypatch.setenv("FDSTORE", "0")
    assert fd_store_possible() is False
    monkeypatch.delenv("FDSTORE")
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    assert fd_store_possible() is False
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert fd_store_possible() is False
    r, w = os.pipe()
    try:
        assert store_fd(r, FUSE_FD_NAME) is False  # a quiet no-op, as notify() is
        assert remove_fd(FUSE_FD_NAME) is False
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("name", ["", "a:b", "tab\there", "é", "x" * 256])
def test_names_systemd_would_refuse_raise(manager: socket.socket, name: str) -> None:
    with pytest.raises(ValueError, match="not a valid descriptor name"):
        store_fd(0, name)
    with pytest.raises(ValueError, match="not a valid descriptor name"):
        remove_fd(name)


def test_variables_for_another_process_are_ignored_and_removed() -> None:
    env = {"LISTEN_PID": str(os.getppid()), "LISTEN_FDS": "1", "LISTEN_FDNAMES": "x",
           "OTHER": "1"}
    assert inherited_fds(env) == {}
    assert env == {"OTHER": "1"}
    assert inherited_fds({}) == {}


def test_malformed_variables_are_ignored(caplog: pytest.LogCaptureFixture) -> None:
    env = {"LISTEN_PID": "self", "LISTEN_FDS": "1"}
    assert inherited_fds(env) == {} and env == {}
    [record] = caplog.records
    assert "malformed" in record.getMessage()
    record.expected = True  # type: ignore[attr-defined]


CHILD = """
import fcntl, json, os, sys
from qosfs.daemon.notify import inherited_fds
names, count = sys.argv[1], int(sys.argv[2])

def is_open(fd):
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError:
        return False
    return True

for i in range(count):
    fd = os.open(f"{sys.argv[3]}/f{i}", os.O_RDONLY)  # not close-on-exec, as passed
    os.set_inheritable(fd, True)
    if fd != 3 + i:
        os.dup2(fd, 3 + i)
        os.close(fd)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS=sys.argv[4])
if names:
    os.environ["LISTEN_FDNAMES"] = names
got = inherited_fds()
print(json.dumps({
    "got": got,
    "files": {n: os.readlink(f"/proc/self/fd/{fd}") for n, fd in got.items()},
    "cloexec": all(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC for fd in got.values()),
    "open": [fd for fd in range(3, 8) if is_open(fd)],
    "left": sorted(k for k in os.environ if k.startswith("LISTEN_")),
}))
"""


def passed(tmp_path: Path, names: str, count: int, listen_fds: int | None = None
           ) -> dict[str, object]:
    """Run CHILD with *count* files open on 3, 4, ... and LISTEN_FDS=*listen_fds*."""
    for i in range(count):
        (tmp_path / f"f{i}").write_text(str(i))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, names, str(count), str(tmp_path),
         str(count if listen_fds is None else listen_fds)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    result["stderr"] = done.stderr
    return result


def test_passed_descriptors_by_name_close_on_exec(tmp_path: Path) -> None:
    result = passed(tmp_path, f"{FUSE_FD_NAME}:state", 2)
    assert result["got"] == {FUSE_FD_NAME: 3, "state": 4}
    assert result["files"] == {FUSE_FD_NAME: f"{tmp_path}/f0", "state": f"{tmp_path}/f1"}
    assert result["cloexec"] is True and result["left"] == []


def test_unnamed_or_miscounted_names_are_unknown(tmp_path: Path) -> None:
    assert passed(tmp_path, "", 1)["got"] == {"unknown": 3}  # systemd before 227
    result = passed(tmp_path, "a:b:c", 1)
    assert result["got"] == {"unknown": 3} and "3 names for 1" in str(result["stderr"])


def test_a_second_descriptor_under_one_name_is_closed(tmp_path: Path) -> None:
    result = passed(tmp_path, f"{FUSE_FD_NAME}:{FUSE_FD_NAME}", 2)
    assert result["got"] == {FUSE_FD_NAME: 3} and result["open"] == [3]


def test_a_descriptor_not_open_is_skipped(tmp_path: Path) -> None:
    result = passed(tmp_path, f"{FUSE_FD_NAME}:gone", 1, listen_fds=2)
    assert result["got"] == {FUSE_FD_NAME: 3} and "4 (gone) is not open" in str(
        result["stderr"])
