"""Reopening an O_PATH descriptor for I/O (``odirect.reopen``), through the process's own
``/proc/self/fd`` held open: also in a fork's child (the daemon forks to daemonize)."""

from __future__ import annotations

import os
from pathlib import Path

from qosfs.passthrough import odirect


def test_reopen_opens_the_object_behind_an_o_path_descriptor(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"mine")
    path_fd = os.open(tmp_path / "f", os.O_PATH)
    try:
        fd = odirect.reopen(path_fd, os.O_RDONLY | os.O_CLOEXEC)
        try:
            assert os.pread(fd, 16, 0) == b"mine"
        finally:
            os.close(fd)
        os.rename(tmp_path / "f", tmp_path / "g")  # a descriptor, not a path: renames hold
        fd = odirect.reopen(path_fd, os.O_RDONLY | os.O_CLOEXEC)
        os.close(fd)
    finally:
        os.close(path_fd)


def test_a_forked_child_reopens_its_own_descriptors(tmp_path: Path) -> None:
    """The parent's held ``/proc/self/fd`` names the parent's descriptors: a child that
    used it would reopen whatever the parent has under that number, or nothing."""
    (tmp_path / "parent").write_bytes(b"parent")
    (tmp_path / "child").write_bytes(b"child")
    warm = os.open(tmp_path / "parent", os.O_PATH)
    os.close(odirect.reopen(warm, os.O_RDONLY | os.O_CLOEXEC))  # the parent's is held now
    os.close(warm)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it reads, then leave at once
        try:
            os.close(read)
            path_fd = os.open(tmp_path / "child", os.O_PATH)
            fd = odirect.reopen(path_fd, os.O_RDONLY)
            os.write(write, os.pread(fd, 16, 0))
        except BaseException as exc:
            os.write(write, repr(exc).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        got = os.read(read, 256)
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert got == b"child"
