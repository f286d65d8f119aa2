"""Security through a real mount: nothing beyond what the directory underneath allows.

The kernel checks permissions (``default_permissions``) against what it has cached: an
entry and its attributes for ``entry_timeout``. When the tree changes underneath within
that window (another node of a shared filesystem, another path to the source), the name
the kernel checked is no longer the object the daemon -- running as root -- would act
on. These tests make that window on purpose: a user primes the kernel's cache, the tree
changes underneath, the user acts; the outcome must be what the same user would get on
the directory itself, never another user's file or a path outside the tree.

Complements the differential ``user`` scenario of ``test_fidelity`` (modes, sticky
directories, setuid, hard links), which covers a tree that does not change underneath.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.mounting import as_user

pytestmark = [pytest.mark.mount, pytest.mark.root]

USER, OTHER = 4242, 4243

# Run as USER: prime the kernel's cache of NAME (stat), say "ready", wait for a line
# (the tree changes underneath meanwhile), then do OP and print what happened.
RACER = r"""
import errno, json, os, sys
op, path, other = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    os.stat(path)
except OSError:
    pass
print("ready", flush=True)
sys.stdin.readline()
try:
    if op == "create":
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        result = ["ok", os.read(fd, 100).decode()]
        os.close(fd)
    elif op == "create-trunc":
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644))
        result = ["ok"]
    elif op == "unlink":
        os.unlink(path)
        result = ["ok"]
    elif op == "rmdir":
        os.rmdir(path)
        result = ["ok"]
    elif op == "rename-from":
        os.rename(path, other)
        result = ["ok"]
    elif op == "rename-onto":
        os.rename(other, path)
        result = ["ok"]
    else:
        raise SystemExit(f"unknown op {op}")
except OSError as exc:
    result = ["error", errno.errorcode[exc.errno]]
print(json.dumps(result))
"""


def race(op: str, path: Path, change_underneath: Callable[[], None],
         other: Path | None = None) -> list[str]:
    """USER primes the cache of *path*, the tree changes underneath, USER does *op*."""
    proc = subprocess.Popen(["/usr/bin/python3", "-c", RACER, op, str(path), str(other or "")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            preexec_fn=as_user(USER), cwd="/")
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == "ready\n"
        change_underneath()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out = proc.stdout.readline()
    finally:
        proc.communicate(timeout=30)
    return json.loads(out)


def _file(path: Path, owner: int, data: bytes = b"", mode: int = 0o600) -> None:
    path.write_bytes(data)
    os.chown(path, owner, owner)
    os.chmod(path, mode)


@pytest.fixture
def shared(qmount) -> tuple[Path, Path]:
    """A world-writable sticky directory, as /tmp: (backing path, path through the mount)."""
    src = qmount.source / "shared"
    src.mkdir()
    os.chmod(src, 0o1777)
    return src, qmount.mountpoint / "shared"


def test_create_never_opens_another_users_file_that_appeared_underneath(shared) -> None:
    src, mnt = shared
    got = race("create", mnt / "f", lambda: _file(src / "f", OTHER, b"not yours"))
    assert got == ["error", "EACCES"]  # what USER gets opening OTHER's 0600 file natively
    st = (src / "f").stat()
    assert (st.st_uid, (src / "f").read_bytes()) == (OTHER, b"not yours")


def test_create_opens_a_file_that_appeared_underneath_as_the_caller_may(shared) -> None:
    src, mnt = shared
    got = race("create", mnt / "g", lambda: _file(src / "g", OTHER, b"shared", 0o666))
    assert got == ["ok", "shared"]  # native O_CREAT without O_EXCL opens what exists
    assert (src / "g").stat().st_uid == OTHER  # and does not take it over


def test_create_never_follows_a_symlink_out_of_the_tree(shared, tmp_tree: Path) -> None:
    outside = tmp_tree / "outside"
    outside.mkdir()
    target = outside / "precious"
    _file(target, 0, b"root's data")
    src, mnt = shared

    def plant() -> None:
        os.symlink(target, src / "link")
        os.lchown(src / "link", OTHER, OTHER)

    got = race("create-trunc", mnt / "link", plant)
    # Natively the kernel follows the link as USER, who may not write root's file.
    assert got == ["error", "EACCES"]
    assert target.read_bytes() == b"root's data" and target.stat().st_uid == 0
    assert sorted(os.listdir(outside)) == ["precious"]


def test_unlink_in_a_sticky_directory_checks_what_is_there_now(shared) -> None:
    src, mnt = shared
    _file(src / "x", USER)

    def replace() -> None:
        os.unlink(src / "x")
        _file(src / "x", OTHER, b"other's")

    assert race("unlink", mnt / "x", replace) == ["error", "EPERM"]  # sticky: not USER's
    assert (src / "x").read_bytes() == b"other's"


def test_rmdir_in_a_sticky_directory_checks_what_is_there_now(shared) -> None:
    src, mnt = shared
    (src / "d").mkdir()
    os.chown(src / "d", USER, USER)

    def replace() -> None:
        os.rmdir(src / "d")
        (src / "d").mkdir()
        os.chown(src / "d", OTHER, OTHER)

    assert race("rmdir", mnt / "d", replace) == ["error", "EPERM"]
    assert (src / "d").is_dir()


def test_rename_in_a_sticky_directory_checks_what_is_there_now(shared) -> None:
    src, mnt = shared
    _file(src / "mine", USER, b"mine")
    # Onto a name that was free when the kernel looked, and is another user's file now.
    got = race("rename-onto", mnt / "victim", lambda: _file(src / "victim", OTHER, b"other's"),
               other=mnt / "mine")
    assert got == ["error", "EPERM"]
    assert (src / "victim").read_bytes() == b"other's" and (src / "mine").exists()
    # From a name that was USER's when the kernel looked, and is another user's file now.

    def replace() -> None:
        os.unlink(src / "mine")
        _file(src / "mine", OTHER, b"other's too")

    got = race("rename-from", mnt / "mine", replace, other=mnt / "moved")
    assert got == ["error", "EPERM"]
    assert (src / "mine").read_bytes() == b"other's too" and not (src / "moved").exists()


def test_an_open_directory_whose_name_becomes_a_symlink_keeps_its_operations_inside(
        qmount, tmp_tree: Path) -> None:
    outside = tmp_tree / "outside"
    outside.mkdir()
    src = qmount.source
    (src / "d").mkdir()
    dfd = os.open(qmount.mountpoint / "d", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.rename(src / "d", src / "d.old")
        os.symlink(outside, src / "d")  # the daemon acts on its descriptor, not the name
        os.close(os.open("new", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=dfd))
        os.mkdir("sub", dir_fd=dfd)
        os.symlink("new", "sl", dir_fd=dfd)
        os.mkfifo("fifo", dir_fd=dfd)
        os.rename("new", "new2", src_dir_fd=dfd, dst_dir_fd=dfd)
        os.link("new2", "hard", src_dir_fd=dfd, dst_dir_fd=dfd)
        os.unlink("hard", dir_fd=dfd)
        assert sorted(os.listdir(dfd)) == ["fifo", "new2", "sl", "sub"]
    finally:
        os.close(dfd)
    assert os.listdir(outside) == []
    assert sorted(os.listdir(src / "d.old")) == ["fifo", "new2", "sl", "sub"]
