"""The inode descriptor cache: bounded, CLOCK eviction, no close under a running thread."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from qosfs.passthrough.fdcache import DeferredClose, FdCache
from qosfs.passthrough.inodes import InodeTable


class Entry:
    def __init__(self) -> None:
        self.cached_fd = -1
        self.referenced = False
        self.slot = -1


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_put_never_evicts_and_trim_keeps_the_recently_used() -> None:
    cache = FdCache(8)
    entries = [Entry() for _ in range(12)]
    fds = [os.open("/", os.O_PATH) for _ in entries]
    for entry, fd in zip(entries, fds, strict=True):
        cache.put(entry, fd)
    assert len(cache) == 12 and cache.over  # a request's descriptors stay valid
    for entry in entries:
        entry.referenced = False
    entries[0].referenced = True  # used since the hand last passed
    assert cache.trim() == 4
    assert len(cache) == 8 and not cache.over
    assert entries[0].cached_fd == fds[0] and is_open(fds[0])
    closed = [e for e in entries if e.cached_fd < 0]
    assert len(closed) == 4 and all(e.slot == -1 for e in closed)
    cache.close_all()
    assert not any(is_open(fd) for fd in fds)


def test_drop_frees_the_slot_for_the_next_put() -> None:
    cache = FdCache(8)
    a, b = Entry(), Entry()
    cache.put(a, os.open("/", os.O_PATH))
    fd = a.cached_fd
    cache.drop(a)
    assert a.cached_fd == -1 and not is_open(fd) and len(cache) == 0
    cache.put(b, os.open("/", os.O_PATH))
    assert b.slot == 0 and len(cache) == 1
    cache.close_all()


def test_a_descriptor_retired_under_a_running_thread_call_closes_when_it_returns() -> None:
    guard = DeferredClose()
    early = guard.enter()
    fd = os.open("/", os.O_PATH)
    guard.retire(fd)
    late = guard.enter()  # entered after the retirement: cannot hold fd
    assert is_open(fd) and guard.pending == 1
    guard.leave(late)
    assert is_open(fd)  # the early call may still be using it
    guard.leave(early)
    assert not is_open(fd) and guard.pending == 0
    other = os.open("/", os.O_PATH)
    guard.retire(other)  # nothing running: closed at once
    assert not is_open(other)


@pytest.fixture
def table(tmp_path: Path):
    root_fd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    table = InodeTable(root_fd, fd_budget=8)
    yield table
    table.close_all()
    os.close(root_fd)


def test_inodes_beyond_the_budget_are_reopened_from_their_handles(
        table: InodeTable, tmp_path: Path) -> None:
    if not table.handles:
        pytest.skip("no file handles on this filesystem")
    for i in range(40):
        (tmp_path / f"f{i}").write_bytes(b"x" * i)
    inodes = [table.adopt(*table.resolve(table.root.fd, f"f{i}".encode())) for i in range(40)]
    table.trim()
    assert table.fds_held <= 8 + 2
    # Every inode still reaches its own object, evicted or not.
    for i, inode in enumerate(inodes):
        table.trim()
        assert os.fstat(inode.fd).st_size == i
    assert table.reopens >= 30


def test_a_recycled_inode_number_is_a_new_object_and_the_old_node_id_is_stale(
        table: InodeTable, tmp_path: Path) -> None:
    if not table.handles:
        pytest.skip("no file handles on this filesystem")
    path = tmp_path / "f"
    path.write_bytes(b"old")
    old = table.adopt(*table.resolve(table.root.fd, b"f"))
    table.cache.shrink(0)  # evicted: only the handle is left
    # Underneath: the file is replaced; make the new one reuse the inode number.
    for _ in range(200):
        path.unlink()
        path.write_bytes(b"new")
        if path.stat().st_ino == old.key[1]:
            break
    else:
        pytest.skip("the filesystem did not reuse the inode number")
    new = table.adopt(*table.resolve(table.root.fd, b"f"))
    assert new is not old and new.nodeid != old.nodeid
    assert os.pread(os.open(new.proc_path, os.O_RDONLY), 3, 0) == b"new"
    with pytest.raises(OSError) as info:
        table.get(old.nodeid)
    assert info.value.errno == errno.ESTALE


def test_without_handles_an_evicted_inode_is_reopened_by_its_name(
        table: InodeTable, tmp_path: Path) -> None:
    table.handles = False  # as on ramfs, or without CAP_DAC_READ_SEARCH
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"one")
    d = table.adopt(*table.resolve(table.root.fd, b"d"), (table.root, b"d"))
    f = table.adopt(*table.resolve(d.fd, b"f"), (d, b"f"))
    assert f.handle is None and table.pinned == 0  # evictable all the same
    table.cache.shrink(0)
    assert os.fstat(f.fd).st_size == 3 and table.reopens >= 2  # f, then d for its name
    # Renamed through the mount: the table is told, and follows.
    table.cache.shrink(0)
    os.rename(tmp_path / "d" / "f", tmp_path / "d" / "g")
    table.renamed(d, b"g")
    assert os.fstat(f.fd).st_size == 3
    # Replaced underneath: the name holds another object now, so the node id is stale.
    table.cache.shrink(0)
    (tmp_path / "d" / "new").write_bytes(b"other")
    os.rename(tmp_path / "d" / "new", tmp_path / "d" / "g")
    with pytest.raises(OSError) as info:
        _ = f.fd
    assert info.value.errno == errno.ESTALE
    with pytest.raises(OSError):
        table.get(f.nodeid)
