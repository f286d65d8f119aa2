"""BackingIO on a temporary file: each I/O mode's reads and writes, short syscalls made
whole, and which calls leave the event loop for a thread (through whose limiter)."""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from qosfs.passthrough.backing_io import (
    OFFLOAD_WRITE,
    PREFETCH_MAX,
    BackingIO,
    IoMode,
    backing_mount,
    choose_io_mode,
)

BLOCK = 4096
DATA = bytes(range(256)) * 48 + b"tail" * 25  # 3 blocks and 100 bytes
_real_pread, _real_preadv, _real_pwrite = os.pread, os.preadv, os.pwrite


@pytest.fixture
def path(tmp_path: Path) -> Path:
    path = tmp_path / "f"
    path.write_bytes(DATA)
    return path


@pytest.fixture
def fds(path: Path) -> Iterator[dict[bool, int]]:
    """Descriptors on the file, buffered (False) and O_DIRECT (True), read-write."""
    out = {False: os.open(path, os.O_RDWR | os.O_CLOEXEC)}
    try:
        out[True] = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        pass  # a filesystem without O_DIRECT: those cases skip
    yield out
    for fd in out.values():
        os.close(fd)


def fd_for(fds: dict[bool, int], direct: bool) -> int:
    if direct not in fds:
        pytest.skip("the temporary directory refuses O_DIRECT")
    return fds[direct]


@pytest.mark.parametrize(("fstype", "mode"), [
    ("tmpfs", IoMode.INLINE), ("ramfs", IoMode.INLINE), ("ext4", IoMode.NOWAIT),
    ("xfs", IoMode.NOWAIT), ("nfs4", IoMode.THREADS), ("lustre", IoMode.THREADS),
    ("fuse.sshfs", IoMode.THREADS), ("", IoMode.NOWAIT),
])
def test_the_mode_follows_the_backing_filesystem(fstype: str, mode: IoMode) -> None:
    assert choose_io_mode(fstype) is mode


def test_backing_mount_names_the_filesystem_a_descriptor_is_on() -> None:
    fd = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fstype, options = backing_mount(fd)
    finally:
        os.close(fd)
    assert fstype == "proc" and options & {"rw", "ro"}


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("mode", list(IoMode))
def test_reads_return_the_file_and_are_short_only_at_eof(
        fds: dict[bool, int], mode: IoMode, direct: bool) -> None:
    fd = fd_for(fds, direct)
    io = BackingIO(mode)
    limiter = trio.CapacityLimiter(1)

    async def main() -> None:
        assert bytes(await io.read(fd, BLOCK, 2 * BLOCK, direct, limiter)) == \
            DATA[BLOCK:3 * BLOCK]
        assert bytes(await io.read(fd, 2 * BLOCK, 2 * BLOCK, direct, limiter)) == \
            DATA[2 * BLOCK:]  # at EOF: BLOCK + 100 bytes
        assert bytes(await io.read(fd, 8 * BLOCK, BLOCK, direct, limiter)) == b""

    trio.run(main)
    if mode is IoMode.INLINE:
        assert io.thread_hops == 0  # memory filesystems never leave the loop
    elif mode is IoMode.THREADS or direct:
        assert io.thread_hops == 3  # every read, in a thread


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("mode", list(IoMode))
def test_writes_land_whole(path: Path, fds: dict[bool, int], mode: IoMode,
                           direct: bool) -> None:
    fd = fd_for(fds, direct)
    io = BackingIO(mode)
    block = b"w" * BLOCK

    async def main() -> None:
        assert await io.write(fd, BLOCK, block, direct, trio.CapacityLimiter(1)) == BLOCK

    trio.run(main)
    assert path.read_bytes() == DATA[:BLOCK] + block + DATA[2 * BLOCK:]
    assert io.thread_hops == (0 if mode is IoMode.INLINE or
                              (mode is IoMode.NOWAIT and not direct) else 1)


def test_short_reads_and_writes_are_completed(
        path: Path, fds: dict[bool, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A syscall may move fewer bytes than asked (a signal, a network filesystem): the
    request is answered whole all the same."""
    calls = {"pread": 0, "preadv": 0, "pwrite": 0}

    def pread(fd: int, n: int, off: int) -> bytes:
        calls["pread"] += 1
        return _real_pread(fd, min(n, 100), off)

    def preadv(fd: int, buffers: list[Any], off: int, *flags: int) -> int:
        calls["preadv"] += 1
        return _real_preadv(fd, [memoryview(buffers[0])[:100]], off, *flags)

    def pwrite(fd: int, data: Any, off: int) -> int:
        calls["pwrite"] += 1
        return _real_pwrite(fd, memoryview(data)[:1000], off)

    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "pwrite", pwrite)
    limiter = trio.CapacityLimiter(1)

    async def main() -> None:
        for mode in (IoMode.INLINE, IoMode.NOWAIT):  # pread loop, preadv loop
            io = BackingIO(mode)
            assert bytes(await io.read(fds[False], 1, 3000, False, limiter)) == DATA[1:3001]
        io = BackingIO(IoMode.INLINE)
        assert await io.write(fds[False], 0, b"n" * 5000, False, limiter) == 5000

    trio.run(main)
    assert path.read_bytes() == b"n" * 5000 + DATA[5000:]
    assert calls["pread"] == 30 and calls["preadv"] >= 30 and calls["pwrite"] == 5


def test_a_page_cache_miss_under_nowait_finishes_in_a_thread(
        fds: dict[bool, int], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    refuse: list[int] = [errno.EAGAIN]

    def preadv(fd: int, buffers: list[Any], off: int, *flags: int) -> int:
        if flags and flags[0] & os.RWF_NOWAIT:
            raise OSError(refuse[0], os.strerror(refuse[0]))
        return _real_preadv(fd, buffers, off)

    monkeypatch.setattr(os, "preadv", preadv)
    caplog.set_level(logging.INFO)
    io = BackingIO(IoMode.NOWAIT)

    async def main() -> None:
        limiter = trio.CapacityLimiter(1)
        assert bytes(await io.read(fds[False], 0, BLOCK, False, limiter)) == DATA[:BLOCK]
        assert (io.thread_hops, io.mode) == (1, IoMode.NOWAIT)
        refuse[0] = errno.EOPNOTSUPP  # a filesystem that cannot say: threads from now on
        assert bytes(await io.read(fds[False], 0, BLOCK, False, limiter)) == DATA[:BLOCK]
        assert (io.thread_hops, io.mode) == (2, IoMode.THREADS)

    trio.run(main)
    assert [r.getMessage() for r in caplog.records] == [
        "backing store refuses RWF_NOWAIT; all reads now use threads"]


@pytest.mark.parametrize(("mode", "size", "asked"), [
    (IoMode.NOWAIT, 112 * 1024, True), (IoMode.NOWAIT, PREFETCH_MAX, True),
    (IoMode.NOWAIT, PREFETCH_MAX + 1, False),  # a big file: maybe only its footer is read
    (IoMode.NOWAIT, 0, False),
    (IoMode.INLINE, BLOCK, False),  # memory: nothing to read ahead
    (IoMode.THREADS, BLOCK, False),  # network: the hint could wait for the server
])
def test_only_small_files_on_local_disks_are_read_ahead(
        mode: IoMode, size: int, asked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, int, int]] = []
    monkeypatch.setattr(os, "posix_fadvise", lambda *args: calls.append(args))
    io = BackingIO(mode)
    io.prefetch(7, size)
    assert calls == ([(7, 0, size, os.POSIX_FADV_WILLNEED)] if asked else [])
    assert io.prefetches == len(calls)


def test_a_prefetch_the_kernel_refuses_changes_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: int) -> None:
        raise OSError(errno.ESPIPE, os.strerror(errno.ESPIPE))

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    io = BackingIO(IoMode.NOWAIT)
    io.prefetch(7, BLOCK)  # only a hint: the READ takes a thread hop, as without it
    assert (io.prefetches, io.thread_hops, io.mode) == (1, 0, IoMode.NOWAIT)


def test_a_miss_is_tried_once_more_after_the_loop_ran_the_other_requests(
        fds: dict[bool, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The readahead the miss (or the open's prefetch) started often lands while the loop
    serves the requests already waiting: then the read needs no thread."""
    tries: list[str] = []

    def preadv(fd: int, buffers: list[Any], off: int, *flags: int) -> int:
        if flags and flags[0] & os.RWF_NOWAIT and not tries:
            tries.append("miss")
            raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        tries.append("hit" if flags else "blocking")
        return _real_preadv(fd, buffers, off)

    real_checkpoint = trio.lowlevel.checkpoint

    async def checkpoint() -> None:
        tries.append("loop")  # the requests already waiting run here
        await real_checkpoint()

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(trio.lowlevel, "checkpoint", checkpoint)
    io = BackingIO(IoMode.NOWAIT)

    async def main() -> None:
        data = await io.read(fds[False], 0, BLOCK, False, trio.CapacityLimiter(1))
        assert bytes(data) == DATA[:BLOCK]

    trio.run(main)
    assert (tries, io.thread_hops) == (["miss", "loop", "hit"], 0)


@pytest.mark.parametrize(("size", "throttled", "hops"), [
    (OFFLOAD_WRITE, True, 1),  # a capped flow's large write: off the loop
    (OFFLOAD_WRITE, False, 0),  # an uncapped one stays (a thread's GIL wait costs more)
    (OFFLOAD_WRITE - 1, True, 0),
])
def test_only_large_writes_of_throttled_flows_leave_the_loop(
        fds: dict[bool, int], size: int, throttled: bool, hops: int) -> None:
    io = BackingIO(IoMode.INLINE)

    async def main() -> None:
        await io.write(fds[False], 0, b"x" * size, False, trio.CapacityLimiter(1), throttled)

    trio.run(main)
    assert io.thread_hops == hops


def test_blocking_calls_run_in_threads_no_more_at_once_than_the_limiter_allows() -> None:
    loop_thread = threading.get_ident()
    running, peak, where = [0], [0], set()
    lock = threading.Lock()

    def call() -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        where.add(threading.get_ident())
        threading.Event().wait(0.02)
        with lock:
            running[0] -= 1

    async def main(io: BackingIO, limiter: trio.CapacityLimiter) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(io.blocking, limiter, call)
            nursery.start_soon(io.meta, limiter, call)

    threads = BackingIO(IoMode.THREADS)
    trio.run(main, threads, trio.CapacityLimiter(2))
    assert peak[0] == 2 and loop_thread not in where and threads.thread_hops == 5
    where.clear()
    inline = BackingIO(IoMode.INLINE)
    trio.run(main, inline, trio.CapacityLimiter(2))
    assert where == {loop_thread} and inline.thread_hops == 0
    nowait = BackingIO(IoMode.NOWAIT)  # fsync and the like wait for the device: threads
    trio.run(main, nowait, trio.CapacityLimiter(2))
    assert nowait.thread_hops == 4  # metadata calls stay inline on a local filesystem


def test_a_descriptor_retired_during_a_threaded_call_is_closed_after_it(path: Path) -> None:
    io = BackingIO(IoMode.THREADS)
    started, release = threading.Event(), threading.Event()

    def slow_stat() -> None:
        started.set()
        release.wait(5)

    async def main() -> None:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(io.meta, trio.CapacityLimiter(1), slow_stat)
            await trio.to_thread.run_sync(started.wait, 5)
            io.fd_guard.retire(fd)  # evicted while the call may still be using it
            assert io.fd_guard.pending == 1 and os.fstat(fd)
            release.set()
        assert io.fd_guard.pending == 0
        with pytest.raises(OSError) as closed:
            os.fstat(fd)
        assert closed.value.errno == errno.EBADF

    trio.run(main)
