"""The pointer a mount made with ``--socket PATH`` leaves at its derived socket path
(qosfs.daemon.pointer), through the listeners whose lifetime it shares
(qosfs.daemon.takeover.listeners), on real sockets in a temporary directory: left at bind and by a
successor, kept at release, removed at close unless replaced; a stale one is replaced by
a mount bound at the derived path, a live one is not."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from qosfs.control import address
from qosfs.core import mountinfo
from qosfs.core.errors import QosfsError
from qosfs.core.mountinfo import QOSFS_FSTYPE, MountEntry
from qosfs.daemon import pointer
from qosfs.daemon.takeover.listeners import Listeners


@pytest.fixture
def run_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The directory of derived socket paths (/run/qosfs, here a temporary one with a
    short name: a derived name and pytest's directory are too long for a socket)."""
    run = Path(tempfile.mkdtemp(prefix="qosfs-run-"))
    monkeypatch.setattr(address, "SYSTEM_SOCKET_DIR", str(run))
    monkeypatch.setattr(address, "socket_dir", lambda: str(run))
    yield run
    shutil.rmtree(run)


def _connects(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def test_a_socket_elsewhere_is_pointed_at_from_its_derived_path_while_bound(
        run_dir: Path, tmp_path: Path) -> None:
    mnt, custom = str(tmp_path / "mnt"), str(tmp_path / "elsewhere" / "qosfs.sock")
    os.makedirs(os.path.dirname(custom))
    derived = address.default_socket_path(mnt)
    assert pointer.pointer_path(mnt, derived) is None  # at the derived path: no pointer
    assert pointer.pointer_path(mnt, custom) == derived
    assert pointer.pointed(mnt) is None and pointer.mount_socket_path(mnt) == derived
    listeners = Listeners.bind(custom, None, None, pointer.pointer_path(mnt, custom))
    try:
        assert os.readlink(derived) == custom
        assert pointer.pointed(mnt) == pointer.mount_socket_path(mnt) == custom
        assert _connects(derived)  # what ctl --socket MOUNTPOINT does
    finally:
        listeners.close()
    assert not os.path.lexists(derived) and not os.path.exists(custom)


def test_a_successor_keeps_the_pointer_and_removes_it_at_the_end(
        run_dir: Path, tmp_path: Path) -> None:
    mnt, custom = str(tmp_path / "mnt"), str(tmp_path / "qosfs.sock")
    derived = address.default_socket_path(mnt)
    old = Listeners.bind(custom, None, None, derived)
    os.unlink(derived)  # as if left by a version without pointers
    new = Listeners.inherit(custom, None, None, os.dup(old.control.fileno()), None, derived)
    old.release()  # the handover: the path and the pointer stay
    assert os.readlink(derived) == custom and _connects(derived)
    new.close()
    assert not os.path.lexists(derived)


def test_a_pointer_replaced_by_a_later_mount_is_left_alone(
        run_dir: Path, tmp_path: Path) -> None:
    mnt = str(tmp_path / "mnt")
    derived = address.default_socket_path(mnt)
    first = Listeners.bind(str(tmp_path / "a.sock"), None, None, derived)
    pointer.leave(derived, str(tmp_path / "b.sock"))  # a later mount's
    first.close()
    assert os.readlink(derived) == str(tmp_path / "b.sock")


def test_a_stale_pointer_is_replaced_and_a_live_one_refused_at_the_derived_path(
        run_dir: Path, tmp_path: Path) -> None:
    mnt = str(tmp_path / "mnt")
    derived = address.default_socket_path(mnt)
    live = Listeners.bind(str(tmp_path / "live.sock"), None, None, derived)
    try:
        with pytest.raises(QosfsError, match="in use by a running qosfs daemon"):
            Listeners.bind(derived, None, None)
    finally:
        live.release()  # its path and pointer stay, nothing listens: a killed daemon's
    fresh = Listeners.bind(derived, None, None)  # a new mount without --socket
    try:
        assert not os.path.islink(derived) and _connects(derived)
        assert pointer.pointed(mnt) is None
    finally:
        fresh.close()


def test_a_pointer_counts_for_a_new_mount_only_while_a_qosfs_mount_is_there(
        run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mnt, custom = str(tmp_path / "mnt"), str(tmp_path / "qosfs.sock")
    pointer.leave(address.default_socket_path(mnt), custom)
    table: list[MountEntry] = []
    monkeypatch.setattr(mountinfo, "mounts", lambda _path=mountinfo.MOUNTINFO: table)
    assert pointer.running_socket_path(mnt) is None  # nothing mounted: stale
    table.append(MountEntry("0:50", mnt, frozenset(), QOSFS_FSTYPE))
    assert pointer.running_socket_path(mnt) == custom
    table.append(MountEntry("0:51", mnt, frozenset(), "tmpfs"))  # covered by another
    assert pointer.running_socket_path(mnt) is None
