"""Differential POSIX tests: the same scenario on a plain directory and through qosfs."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mount import posix_scenarios
from tests.mounting import QosfsMount, as_user, scratch_fs

pytestmark = pytest.mark.mount

SCENARIOS = ["files", "rename", "links", "xattr", "special", "names", "ctime"]
TEST_UID = 4242
TEST_GID = 4242


def _fresh(path: Path) -> str:
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    return str(path)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_separate_mount_matches_native(scenario: str, qmount, tmp_tree: Path) -> None:
    native = posix_scenarios.SCENARIOS[scenario](_fresh(tmp_tree / "native"))
    through = posix_scenarios.SCENARIOS[scenario](_fresh(qmount.mountpoint / "case"))
    assert through == native


@pytest.mark.root
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_inplace_mount_matches_native(scenario: str, inplace_mount, tmp_tree: Path) -> None:
    mount, view = inplace_mount
    native = posix_scenarios.SCENARIOS[scenario](_fresh(tmp_tree / "native"))
    through = posix_scenarios.SCENARIOS[scenario](_fresh(mount.mountpoint / "case"))
    assert through == native
    # What was done through the in-place mount is what the backing tree holds.
    assert sorted(os.listdir(view / "case")) == sorted(os.listdir(mount.mountpoint / "case"))


def _run_as_user(root: str, scenario: str, scratch: Path) -> list:
    """Replay a scenario as TEST_UID with the system interpreter (the venv's may live
    under /root, which the test user cannot enter) from a copy of the script."""
    script = scratch / "posix_scenarios.py"
    shutil.copy(posix_scenarios.__file__, script)
    os.chmod(script, 0o644)
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable

    out = subprocess.run(
        [python, str(script), root, scenario],
        cwd="/", capture_output=True, text=True, preexec_fn=as_user(TEST_UID, TEST_GID),
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.root
def test_unprivileged_user_sees_native_permissions(qmount, tmp_tree: Path) -> None:
    native = _fresh(tmp_tree / "native")
    through = _fresh(qmount.mountpoint / "case")
    for root in (native, through):
        posix_scenarios.prepare_user_tree(root, gid=TEST_GID + 1)
    expected = _run_as_user(native, "user", tmp_tree)
    got = _run_as_user(through, "user", tmp_tree)
    assert got == expected
    # Objects created through the mount are owned by the caller in the backing tree too.
    backing = qmount.source / "case" / "shared" / f"mine-{TEST_UID}"
    assert backing.stat().st_uid == TEST_UID and backing.stat().st_gid == TEST_GID


def test_parent_of_mount_root_stays_inside(qmount) -> None:
    # '..' of the root resolves in the kernel to the mountpoint's parent, never to the
    # source's parent through the daemon: the source's siblings are not reachable.
    (qmount.source / "inside").write_text("x")
    assert sorted(os.listdir(qmount.mountpoint)) == ["inside"]
    assert os.stat(qmount.mountpoint / "..").st_ino == os.stat(qmount.mountpoint.parent).st_ino


@pytest.fixture
def on_tmpfs(tmp_tree: Path) -> Iterator[Path]:
    """A fresh tmpfs under tmp_tree (the default temporary directory may be ext4)."""
    with scratch_fs(tmp_tree / "tmpfs") as fs:
        yield fs


@pytest.mark.root
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_mount_over_tmpfs_matches_native(scenario: str, on_tmpfs: Path) -> None:
    src, mnt = Path(_fresh(on_tmpfs / "src")), on_tmpfs.parent / "mnt"
    mnt.mkdir()
    native = posix_scenarios.SCENARIOS[scenario](_fresh(on_tmpfs / "native"))
    mount = QosfsMount(src, mnt, log_path=on_tmpfs.parent / "qosfs.log").start()
    try:
        through = posix_scenarios.SCENARIOS[scenario](_fresh(mnt / "case"))
    finally:
        code = mount.stop()
    assert code == 0, mount.log()
    assert through == native


def test_o_tmpfile_is_refused_and_leaves_nothing_behind(qmount) -> None:
    """Documented in docs/administration.md: pyfuse3 and libfuse 3.14 have no tmpfile operation, so
    the kernel answers EOPNOTSUPP (every time, not only the first); the directory
    underneath would have accepted it, and fallbacks such as tempfile still work."""
    native = os.open(qmount.source, os.O_TMPFILE | os.O_WRONLY, 0o600)
    os.close(native)
    for _ in range(2):  # the first asks the daemon, later ones the kernel answers alone
        with pytest.raises(OSError) as refused:
            os.open(qmount.mountpoint, os.O_TMPFILE | os.O_WRONLY, 0o600)
        assert refused.value.errno == errno.EOPNOTSUPP
    assert os.listdir(qmount.source) == []
    with tempfile.TemporaryFile(dir=qmount.mountpoint) as f:
        f.write(b"scratch")
        f.seek(0)
        assert f.read() == b"scratch"
        assert os.listdir(qmount.source) == []  # named, then unlinked at once
    assert os.listdir(qmount.source) == []
