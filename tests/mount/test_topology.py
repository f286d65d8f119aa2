"""Layouts that cannot work are refused by ``qosfs mount`` with one line and an exit code:
a source in a qosfs mount (unless ``--allow-stacked``), a mountpoint inside its source.

Through the real command line; the stacking tests use a real qosfs mount as the source.
Whatever a test's outcome, nothing it mounted is left behind (before the checks existed,
these commands mounted with exit 0).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mounting import ROOT, QosfsMount, is_mounted

pytestmark = [pytest.mark.mount, pytest.mark.root]


def qosfs_mount(*args: str) -> subprocess.CompletedProcess[str]:
    """``qosfs mount ARGS`` as an administrator runs it (daemonized)."""
    return subprocess.run([sys.executable, "-m", "qosfs", "mount", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def _unmount(path: Path) -> None:
    """Never leave a mount behind (without ever looking inside it)."""
    if is_mounted(path):
        subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True)
    if is_mounted(path):
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
    assert not is_mounted(path)


@pytest.fixture
def inner(tmp_tree: Path) -> Iterator[tuple[Path, Path]]:
    """A qosfs mount (tmp/src on tmp/inner) to use as a source; yields (src, inner)."""
    src, mnt = tmp_tree / "src", tmp_tree / "inner"
    (src / "sub").mkdir(parents=True)
    mnt.mkdir()
    (tmp_tree / "outer").mkdir()
    m = QosfsMount(src, mnt)
    m.start()
    try:
        yield src, mnt
    finally:
        _unmount(tmp_tree / "outer")
        assert m.stop() == 0, m.log()


@pytest.mark.parametrize("where", ["root", "sub", "symlink"])
def test_a_source_in_a_qosfs_mount_is_refused(tmp_tree: Path, inner: tuple[Path, Path],
                                               where: str) -> None:
    _, mnt = inner
    source = {"root": mnt, "sub": mnt / "sub", "symlink": tmp_tree / "link"}[where]
    if where == "symlink":  # only the source's device tells: the path is outside
        os.symlink(mnt / "sub", source)
    result = qosfs_mount(str(source), str(tmp_tree / "outer"))
    assert (result.returncode, result.stderr.strip()) == (3, (
        f"qosfs: source {source} is "
        f"{'a qosfs mount' if where == 'root' else f'inside the qosfs mount {mnt}'}: "
        "qosfs over qosfs throttles every request twice "
        "(--allow-stacked if that is what you want)"))
    assert not is_mounted(tmp_tree / "outer")


def test_qosfs_over_qosfs_when_asked_for(tmp_tree: Path, inner: tuple[Path, Path]) -> None:
    src, mnt = inner
    outer = QosfsMount(mnt / "sub", tmp_tree / "outer", "--allow-stacked")
    outer.start()
    try:
        (tmp_tree / "outer" / "f").write_bytes(b"through both")
        assert (src / "sub" / "f").read_bytes() == b"through both"
        # A FUSE source: every data syscall on a worker thread (a slow server, here the
        # inner mount, never stalls the outer mount's loop).
        assert "backing filesystem fuse.qosfs: I/O mode threads" in outer.log()
    finally:
        assert outer.stop() == 0, outer.log()


def test_a_mountpoint_inside_its_source_is_refused(tmp_tree: Path) -> None:
    src = tmp_tree / "src"
    (src / "mnt").mkdir(parents=True)
    try:
        result = qosfs_mount(str(src), str(src / "mnt"))
        assert (result.returncode, result.stderr.strip()) == (4, (
            f"qosfs: mountpoint {src / 'mnt'} is inside the source {src}: the daemon's own "
            "lookups of it would wait for its own mount and hang (mount outside the source, "
            "or in place over it)"))
    finally:
        _unmount(src / "mnt")  # (mounted before the check existed: never looked into)


def test_a_source_inside_its_mountpoint_is_served(tmp_tree: Path) -> None:
    """The reverse is fine: the source is opened before the mount covers it."""
    top = tmp_tree / "top"
    (top / "src").mkdir(parents=True)
    (top / "src" / "f").write_text("under")
    with QosfsMount(top / "src", top):
        assert os.listdir(top) == ["f"]  # the mount shows the source, which it covers
        assert (top / "f").read_text() == "under"
