"""Faults of the backing store reach the caller as their own errno; the daemon survives.

Each test makes the directory underneath fail in one way (no space, no inodes, read
only, I/O errors, objects or the whole source removed underneath), checks what callers
get through the mount, that the rest of the tree keeps working, that the daemon's log
holds no traceback or error, and that the mount comes down cleanly (exit 0).
ENOSPC on blocks alone is in ``test_lifecycle``.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests.mounting import QosfsMount, scratch_fs

pytestmark = [pytest.mark.mount, pytest.mark.root]

MiB = 1 << 20


def errno_of(fn: Callable[[], Any]) -> str:
    """The errno name *fn* fails with, or "ok"."""
    try:
        fn()
    except OSError as exc:
        return errno.errorcode[exc.errno or 0]
    return "ok"


def _clean_stop(m: QosfsMount) -> None:
    log = m.log()
    assert m.stop() == 0, log
    assert "Traceback" not in log and " ERROR " not in log, log


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def test_no_space_and_no_inodes_reach_the_caller_even_when_throttled(tmp_tree: Path) -> None:
    mnt = tmp_tree / "mnt"
    mnt.mkdir()
    policy = tmp_tree / "policy.toml"
    policy.write_text('[classes.ckpt]\npaths = ["ckpt/**"]\nwrite_bandwidth = "4MiB/s"\n'
                      'burst = "1MiB"\n')
    with scratch_fs(tmp_tree / "src", "tmpfs", "size=3m,nr_inodes=32") as src:
        (src / "ckpt").mkdir()
        _write(src / "keep", b"k" * 4096)
        m = QosfsMount(src, mnt, "--policy", str(policy)).start()
        try:
            # A throttled writer is delayed, then told ENOSPC like anyone else.
            with pytest.raises(OSError) as info, \
                    open(mnt / "ckpt" / "big", "wb", buffering=0) as f:
                for _ in range(8):
                    f.write(b"x" * MiB)
            assert info.value.errno == errno.ENOSPC
            os.unlink(mnt / "ckpt" / "big")
            for i in range(100):  # 32 inodes: the tree fills up well before
                if (got := errno_of(partial(_write, mnt / f"f{i}", b""))) != "ok":
                    break
            assert got == "ENOSPC"
            assert errno_of(lambda: os.mkdir(mnt / "d")) == "ENOSPC"
            assert errno_of(lambda: os.symlink("keep", mnt / "l")) == "ENOSPC"
            assert (mnt / "keep").read_bytes() == b"k" * 4096  # the rest still works
            os.unlink(mnt / "f0")
            _write(mnt / "again", b"fine")
            assert (src / "again").read_bytes() == b"fine"
        finally:
            _clean_stop(m)


def test_read_only_source_answers_erofs_and_keeps_serving_reads(tmp_tree: Path) -> None:
    mnt = tmp_tree / "mnt"
    mnt.mkdir()
    with scratch_fs(tmp_tree / "src", "tmpfs", "size=8m") as src:
        _write(src / "f", b"data")
        (src / "d").mkdir()
        m = QosfsMount(src, mnt).start()
        try:
            subprocess.run(["mount", "-o", "remount,ro", str(src)], check=True)
            f, d = mnt / "f", mnt / "d"
            attempts = {
                "open-write": lambda: os.close(os.open(f, os.O_WRONLY)),
                "create": lambda: _write(mnt / "new", b""),
                "mkdir": lambda: os.mkdir(mnt / "nd"),
                "unlink": lambda: os.unlink(f),
                "rmdir": lambda: os.rmdir(d),
                "rename": lambda: os.rename(f, mnt / "g"),
                "chmod": lambda: os.chmod(f, 0o600),
                "truncate": lambda: os.truncate(f, 0),
                "utime": lambda: os.utime(f, (1, 1)),
                "setxattr": lambda: os.setxattr(f, "user.x", b"1"),
                "symlink": lambda: os.symlink("f", mnt / "l"),
                "link": lambda: os.link(f, mnt / "h"),
            }
            got = {name: errno_of(fn) for name, fn in attempts.items()}
            assert got == dict.fromkeys(attempts, "EROFS")
            assert f.read_bytes() == b"data"
            assert sorted(os.listdir(mnt)) == ["d", "f"]
            assert os.statvfs(mnt).f_bsize > 0
            subprocess.run(["mount", "-o", "remount,rw", str(src)], check=True)
            _write(mnt / "new", b"writable again")
            assert (src / "new").read_bytes() == b"writable again"
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(src)], check=False)
            _clean_stop(m)


@contextmanager
def _ext4_on_loop(tmp: Path, size_mib: int) -> Iterator[tuple[Path, Path, str]]:
    """An ext4 filesystem on a loop device: (mountpoint, image file, loop device)."""
    if shutil.which("mkfs.ext4") is None or shutil.which("losetup") is None:
        pytest.skip("needs mkfs.ext4 and losetup")
    image, where = tmp / "disk.img", tmp / "disk"
    with open(image, "wb") as f:
        f.truncate(size_mib * MiB)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    found = subprocess.run(["losetup", "-f", "--show", str(image)], capture_output=True,
                           text=True)
    if found.returncode != 0:
        pytest.skip(f"no loop device: {found.stderr.strip()}")
    loop = found.stdout.strip()
    where.mkdir()
    try:
        subprocess.run(["mount", "-o", "errors=continue", loop, str(where)], check=True)
        try:
            yield where, image, loop
        finally:
            subprocess.run(["umount", str(where)], check=False)
    finally:
        subprocess.run(["losetup", "-d", loop], check=False)


def test_io_errors_of_the_device_reach_the_caller_as_eio(tmp_tree: Path) -> None:
    mnt = tmp_tree / "mnt"
    mnt.mkdir()
    with _ext4_on_loop(tmp_tree, 32) as (src, image, loop):
        payload = os.urandom(8 * MiB)
        _write(src / "victim", payload)
        _write(src / "small", b"s")
        m = QosfsMount(src, mnt, "--cache", "never").start()
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            # Shrink the device under the filesystem: blocks past 4 MiB now fail with EIO.
            os.truncate(image, 4 * MiB)
            subprocess.run(["losetup", "-c", loop], check=True)
            assert errno_of(lambda: (mnt / "victim").read_bytes()) == "EIO"  # noqa: PLW0108
            with open(mnt / "victim", "rb") as f:  # and again: the daemon still answers
                assert errno_of(lambda: f.read()) == "EIO"  # noqa: PLW0108
            assert os.stat(mnt / "small").st_size == 1
            assert sorted(os.listdir(mnt))[:2] == ["lost+found", "small"]
        finally:
            _clean_stop(m)


def test_objects_removed_or_renamed_underneath_while_open(qmount) -> None:
    src, mnt = qmount.source, qmount.mountpoint
    (src / "dir").mkdir()
    _write(src / "dir" / "f", b"before")
    fd = os.open(mnt / "dir" / "f", os.O_RDWR)
    dfd = os.open(mnt / "dir", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.rename(src / "dir" / "f", src / "dir" / "g")
        os.pwrite(fd, b"after!", 0)  # the open file is the object, whatever its name
        assert (src / "dir" / "g").read_bytes() == b"after!"
        os.unlink(src / "dir" / "g")
        os.pwrite(fd, b"orphan", 0)
        assert os.pread(fd, 100, 0) == b"orphan" and os.fstat(fd).st_nlink == 0
        shutil.rmtree(src / "dir")
        time.sleep(1.2)  # past the entry and attribute timeouts: the kernel asks again
        assert errno_of(lambda: os.stat(mnt / "dir" / "f")) == "ENOENT"
        assert errno_of(lambda: os.stat(mnt / "dir")) == "ENOENT"
        # A directory still held open answers for what it is now: removed.
        assert errno_of(lambda: _write(Path(f"/proc/self/fd/{dfd}") / "new", b"")) in (
            "ENOENT", "ESTALE")
        assert errno_of(lambda: os.mkdir("sub", dir_fd=dfd)) in ("ENOENT", "ESTALE")
        assert os.listdir(dfd) == []
    finally:
        os.close(fd)
        os.close(dfd)
    _write(mnt / "still", b"works")
    assert (src / "still").read_bytes() == b"works"


def test_the_whole_source_removed_underneath(tmp_tree: Path) -> None:
    src, mnt = tmp_tree / "src", tmp_tree / "mnt"
    src.mkdir()
    mnt.mkdir()
    (src / "d").mkdir()
    _write(src / "f", b"data")
    m = QosfsMount(src, mnt, "--attr-timeout", "0.1").start()
    fd = os.open(mnt / "f", os.O_RDONLY)
    try:
        shutil.rmtree(src)
        time.sleep(0.3)
        attempts = {
            "stat-f": lambda: os.stat(mnt / "f"),
            "stat-d": lambda: os.stat(mnt / "d"),
            "open": lambda: os.close(os.open(mnt / "f", os.O_RDONLY)),
            "create": lambda: _write(mnt / "new", b""),
            "mkdir": lambda: os.mkdir(mnt / "nd"),
            "symlink": lambda: os.symlink("x", mnt / "l"),
            "mknod": lambda: os.mkfifo(mnt / "p"),
            "rename": lambda: os.rename(mnt / "f", mnt / "g"),
            "unlink": lambda: os.unlink(mnt / "f"),
            "rmdir": lambda: os.rmdir(mnt / "d"),
        }
        got = {name: errno_of(fn) for name, fn in attempts.items()}
        assert set(got.values()) <= {"ENOENT", "ESTALE"}, got
        assert os.listdir(mnt) == []
        assert os.stat(mnt).st_nlink == 0  # the root is the removed directory itself
        assert os.statvfs(mnt).f_bsize > 0
        assert os.pread(fd, 100, 0) == b"data"  # an open file outlives its names
    finally:
        os.close(fd)
        _clean_stop(m)
