"""Layouts qosfs refuses, decided from a mount table (the real mounts: tests/mount)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from qosfs.core.errors import EXIT_MOUNTPOINT, EXIT_SOURCE, QosfsError
from qosfs.core.mountinfo import MountEntry
from qosfs.daemon.topology import check_before_stat, check_topology


def _qosfs_at(path: Path | str, dev: str = "0:999") -> list[MountEntry]:
    return [MountEntry("259:1", "/", frozenset(), "ext4"),
            MountEntry(dev, str(path), frozenset(), "fuse.qosfs")]


def _dev_of(path: Path) -> str:
    st = os.stat(path)
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def test_a_source_under_a_qosfs_mountpoint_is_refused_without_touching_it() -> None:
    # Nothing exists at these paths: the check reads the table alone.
    table = _qosfs_at("/nonexistent/q")
    for source, where in (("/nonexistent/q", "a qosfs mount"),
                          ("/nonexistent/q/a/b", "inside the qosfs mount /nonexistent/q")):
        with pytest.raises(QosfsError, match=f"^source {re.escape(source)} is {where}: "
                           "qosfs over qosfs "
                           r"throttles every request twice \(--allow-stacked") as info:
            check_before_stat(source, "/elsewhere", False, table)
        assert info.value.exit_code == EXIT_SOURCE
        check_before_stat(source, "/elsewhere", True, table)  # asked for
    check_before_stat("/nonexistent/qx", "/elsewhere", False, table)  # a sibling


def test_in_place_over_a_live_qosfs_mount_says_already_mounted() -> None:
    with pytest.raises(QosfsError, match=r"^/nonexistent/q is already mounted by qosfs$") as info:
        check_before_stat("/nonexistent/q", "/nonexistent/q", False, _qosfs_at("/nonexistent/q"))
    assert info.value.exit_code == EXIT_MOUNTPOINT


def test_a_source_on_a_qosfs_device_is_refused_whatever_its_path(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "mnt").mkdir()
    os.symlink(tmp_path / "src", tmp_path / "link")
    table = _qosfs_at("/somewhere/else", _dev_of(tmp_path))  # src's device is "qosfs"
    with pytest.raises(QosfsError, match="is inside the qosfs mount /somewhere/else") as info:
        check_topology(str(tmp_path / "link"), str(tmp_path / "mnt"), False, table)
    assert info.value.exit_code == EXIT_SOURCE
    check_topology(str(tmp_path / "link"), str(tmp_path / "mnt"), True, table)
    check_topology(str(tmp_path / "link"), str(tmp_path / "mnt"), False, _qosfs_at("/x"))


@pytest.mark.parametrize("allow_stacked", [False, True])
def test_a_mountpoint_inside_the_source_is_always_refused(tmp_path: Path,
                                                          allow_stacked: bool) -> None:
    (tmp_path / "src" / "a" / "mnt").mkdir(parents=True)
    os.symlink(tmp_path / "src" / "a", tmp_path / "link")
    for mountpoint in (tmp_path / "src" / "a" / "mnt", tmp_path / "link" / "mnt"):
        expected = f"^mountpoint {re.escape(str(mountpoint))} is inside the source " \
            f"{re.escape(str(tmp_path / 'src'))}: "
        with pytest.raises(QosfsError, match=expected) as info:
            check_topology(str(tmp_path / "src"), str(mountpoint), allow_stacked, [])
        assert info.value.exit_code == EXIT_MOUNTPOINT
    # In place, the source inside the mountpoint, and a sibling whose name extends the
    # source's are fine.
    (tmp_path / "srcx").mkdir()
    check_topology(str(tmp_path / "src"), str(tmp_path / "src"), allow_stacked, [])
    check_topology(str(tmp_path / "src" / "a"), str(tmp_path / "src"), allow_stacked, [])
    check_topology(str(tmp_path / "src"), str(tmp_path / "srcx"), allow_stacked, [])
