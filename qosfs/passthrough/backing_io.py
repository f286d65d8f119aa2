"""Data-path syscalls on the backing store without stalling the one event loop.

pyfuse3 runs every request on one trio thread. A ``pread`` that blocks for milliseconds
(NFS, a cold disk) would stall every class, so how a syscall is issued depends on what
the backing filesystem is (chosen once at mount, overridable with ``--io-mode``):

``inline``
    memory filesystems (tmpfs, ramfs): the syscall never waits for a device, and a thread
    hop costs ~140 us on this class of machine against ~1-2 us for a 4 KiB ``pread``.
    Large buffered writes are the exception (see ``OFFLOAD_WRITE``).
``nowait``
    local block filesystems (ext4, xfs, btrfs): reads try ``preadv(RWF_NOWAIT)`` inline and
    only page-cache misses go to a thread. Small buffered writes stay inline (ext4 refuses
    ``RWF_NOWAIT`` for them and they complete into the page cache), large ones go to a
    thread (``OFFLOAD_WRITE``); ``O_DIRECT`` I/O and fsync always go to a thread.
``threads``
    network and FUSE filesystems: every data syscall runs in a worker thread.

Threads are drawn through a ``trio.CapacityLimiter`` chosen by the caller (one per QoS
class), so a class whose backend calls hang cannot take every thread from another.

A thread hop is not cheap where it matters most. Its two passes through the one thread
that runs the loop (the worker waits for the GIL and a CPU to start; its result waits for
the loop's next batch) grow with the requests in flight. For the one READ of each cold
112 KiB file on this VM's ext4 disk (``--no-qos``, medians): 110-160 us at 1 caller,
~700 us at 4 and 2.8 ms at 16, against 40-170 us for the disk read it waited for; and the
loop thread lost 86 us per file at 16 callers waiting for the GIL its workers held. So
daemon-served cold small files stopped scaling with callers. Hence
:meth:`BackingIO.prefetch`: the open of a small file starts reading it
(``POSIX_FADV_WILLNEED``: the kernel submits the reads and returns), so that by its READ
the pages are in and ``RWF_NOWAIT`` serves it inline; and a READ that still misses tries
once more after the loop ran the requests already waiting (``_nowait_again``). The more
callers, the longer both gaps and the surer the hit. One run of ``python -m bench
coldscale`` (5 rounds, files/s at 1/4/16 threads, thread hops per file):

=====================  =========================  ==================
bare disk              4,191 / 8,796 / 11,373
``--no-qos`` before    1,259 / 2,065 / 2,240      1 / 1 / 1
prefetch at open       1,494 / 2,587 / 3,985      0.94 / 0.18 / 0.01
and the second try     1,640 / 3,484 / 3,934      0.55 / 0.08 / 0.00
=====================  =========================  ==================

Buffer ownership: reads into pooled buffers return a ``memoryview`` slice and put the
buffer back into the pool *before* returning. That is safe because pyfuse3 copies the
reply to the kernel synchronously right after the handler returns, with no checkpoint in
between, so no other task can reuse the buffer before the reply is sent. (A read that
waits, for a thread or for the loop's other requests, holds its buffer until it returns.)
"""

from __future__ import annotations

import enum
import errno
import logging
import mmap
import os
from collections.abc import Callable
from typing import Any

import trio

from qosfs.core.mountinfo import mounts
from qosfs.core.syscalls import setfsuid
from qosfs.passthrough.fdcache import DeferredClose

log = logging.getLogger(__name__)

MAX_REQUEST = 1 << 20  # FUSE sends at most max_pages (256) * 4 KiB per read/write

# Buffered writes at least this large of a *throttled* flow go to a worker thread in every
# mode. Writing 1 MiB that extends a tmpfs file costs ~1.6 ms of page allocation (a page
# cache write on ext4 may also sleep in dirty-page throttling); done inline, a 50 MiB/s
# checkpoint stream stalled the loop often enough to take a concurrent dataset reader
# from 100 % to 65 % of its throughput and its p99 latency x7; offloaded, 95 % and x1.48.
# Not for unthrottled flows: a worker thread returning from its write waits for the GIL,
# which a busy loop hands over only every switch interval (5 ms), so offloading every
# large write cut uncapped 1 MiB writes from 1.96 to 0.87 GB/s (bench: caps). A capped
# flow's pace is its cap, so the hop costs it nothing.
OFFLOAD_WRITE = 256 * 1024
# Files at most this large are read ahead whole at open (BackingIO.prefetch): what the
# kernel asks for in one READ (max_pages), so a loader's sample is in by its first READ.
# Not larger ones: a reader of a big file may want only its footer or a few records.
PREFETCH_MAX = MAX_REQUEST
_POOL_KEEP = 64  # buffers kept for reuse; more are allocated on demand and dropped

_MEMORY_FS = frozenset({"tmpfs", "ramfs", "hugetlbfs", "devtmpfs", "shm"})
_NETWORK_FS = frozenset(
    {
        "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "ceph", "glusterfs", "9p",
        "gpfs", "beegfs", "afs", "virtiofs", "fuse", "fuseblk", "orangefs", "ocfs2", "gfs2",
    }
)


class IoMode(enum.Enum):
    INLINE = "inline"
    NOWAIT = "nowait"
    THREADS = "threads"


def backing_mount(fd: int) -> tuple[str, frozenset[str]]:
    """Type and per-mount options (nosuid, nodev, noexec, ...) of the mount *fd* lives on.

    Read from /proc/self/mountinfo by device number; ("", {}) if not found.
    """
    st = os.fstat(fd)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    for entry in mounts():
        if entry.dev == dev:
            return entry.fstype, entry.options
    return "", frozenset()


def choose_io_mode(fstype: str) -> IoMode:
    """The syscall strategy for a backing filesystem type (see the module docstring)."""
    if fstype in _MEMORY_FS:
        return IoMode.INLINE
    if fstype in _NETWORK_FS or fstype.startswith("fuse."):
        return IoMode.THREADS
    return IoMode.NOWAIT


class _Pool:
    """Free list of request-sized buffers; ``aligned`` ones are mmap pages for O_DIRECT."""

    __slots__ = ("_aligned", "_free")

    def __init__(self, aligned: bool) -> None:
        self._free: list[Any] = []
        self._aligned = aligned

    def take(self, size: int) -> Any:
        if size <= MAX_REQUEST and self._free:
            return self._free.pop()
        alloc = max(size, MAX_REQUEST)
        return mmap.mmap(-1, alloc) if self._aligned else bytearray(alloc)

    def give(self, buf: Any) -> None:
        if len(buf) == MAX_REQUEST and len(self._free) < _POOL_KEEP:
            self._free.append(buf)


def _preadv_full(fd: int, view: memoryview, off: int, done: int) -> int:
    """Fill *view* from *off* (blocking), starting after *done* bytes; stop at EOF."""
    size = len(view)
    while done < size:
        n = os.preadv(fd, [view[done:]], off + done)
        if n == 0:
            break
        done += n
    return done


async def _nowait_again(fd: int, view: memoryview, off: int) -> int:
    """After a page-cache miss, one more ``RWF_NOWAIT`` try once the loop's other ready
    requests have run (0 if it misses again, then the caller hops as before).

    The miss started the readahead, or an open's prefetch did (see the module
    docstring); while other requests wait for the loop, the disk often delivers before
    they are done. Cold small files through ``--no-qos`` with the metadata cached
    (tests/mount/test_cold_reads.py, 16 threads): thread hops per file 0.08-0.60 without
    this try, 0.004-0.13 with it. An idle loop comes back at once; the try then costs a
    syscall (~3 us) against the hop's 110-160 us.
    """
    await trio.lowlevel.checkpoint()
    try:
        return os.preadv(fd, [view], off, os.RWF_NOWAIT)
    except BlockingIOError:
        return 0


def _pread_full(fd: int, size: int, off: int) -> bytes:
    data = os.pread(fd, size, off)
    if len(data) == size or not data:
        return data
    parts = [data]
    got = len(data)
    while got < size:
        more = os.pread(fd, size - got, off + got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _pwrite_full(fd: int, data: Any, off: int) -> int:
    view = memoryview(data)
    size = len(view)
    done = os.pwrite(fd, view, off)
    while done < size:
        n = os.pwrite(fd, view[done:], off + done)
        if n == 0:  # pragma: no cover - the kernel does not do this for regular files
            raise OSError(errno.EIO, "backing store accepted no bytes")
        done += n
    return done


def _pwrite_as(fsuid: int, fd: int, data: Any, off: int) -> int:
    """_pwrite_full with this thread's fsuid set to *fsuid* (0: as the daemon), so that
    the filesystem allocates for that user (root's reserved blocks: qosfs.daemon.privileges)."""
    if not fsuid:
        return _pwrite_full(fd, data, off)
    setfsuid(fsuid)
    try:
        return _pwrite_full(fd, data, off)
    finally:
        setfsuid(0)


class BackingIO:
    """Issues data-path syscalls according to the mount's :class:`IoMode`."""

    def __init__(self, mode: IoMode, fd_guard: DeferredClose | None = None) -> None:
        self.mode = mode
        self._plain = _Pool(aligned=False)
        self._aligned = _Pool(aligned=True)
        self.thread_hops = 0  # how many syscalls went to a worker thread (diagnostics)
        self.prefetches = 0  # how many opens started reading their file (prefetch)
        # Inode descriptors evicted while a metadata call runs in a thread are closed only
        # once it returns (qosfs.passthrough.fdcache): the inode table closes through
        # the same guard (qosfs.daemon.fs_assembly builds both with it).
        self.fd_guard = fd_guard if fd_guard is not None else DeferredClose()

    def __repr__(self) -> str:
        return (f"BackingIO(mode={self.mode.value}, thread_hops={self.thread_hops}, "
                f"prefetches={self.prefetches})")

    async def read(
        self, fd: int, off: int, size: int, direct: bool, limiter: trio.CapacityLimiter
    ) -> Any:
        """Read up to *size* bytes at *off*; short only at EOF. Raises OSError."""
        mode = self.mode
        if not direct:
            if mode is IoMode.INLINE:
                return _pread_full(fd, size, off)
            if mode is IoMode.THREADS:
                self.thread_hops += 1
                return await trio.to_thread.run_sync(_pread_full, fd, size, off, limiter=limiter)
            return await self._read_nowait(fd, off, size, limiter)
        # O_DIRECT backing fd: the buffer must be page aligned, so read into pooled mmap pages.
        pool = self._aligned
        buf = pool.take(size)
        view = memoryview(buf)[:size]
        try:
            if mode is IoMode.INLINE:
                n = _preadv_full(fd, view, off, 0)
            else:
                self.thread_hops += 1
                n = await trio.to_thread.run_sync(
                    _preadv_full, fd, view, off, 0, limiter=limiter
                )
        finally:
            pool.give(buf)  # safe: see "Buffer ownership" in the module docstring
        return view[:n]

    async def _read_nowait(
        self, fd: int, off: int, size: int, limiter: trio.CapacityLimiter
    ) -> Any:
        pool = self._plain
        buf = pool.take(size)
        view = memoryview(buf)[:size]
        try:
            try:
                n = os.preadv(fd, [view], off, os.RWF_NOWAIT)
            except BlockingIOError:
                n = await _nowait_again(fd, view, off)
            except OSError as exc:
                if exc.errno != errno.EOPNOTSUPP:
                    raise
                # This filesystem cannot tell us whether a read would block: be safe.
                log.info("backing store refuses RWF_NOWAIT; all reads now use threads")
                self.mode = IoMode.THREADS
                n = 0
            if n < size:
                # A miss (or a partial hit): finish in a thread. A genuine EOF costs one hop.
                self.thread_hops += 1
                n = await trio.to_thread.run_sync(_preadv_full, fd, view, off, n, limiter=limiter)
        finally:
            pool.give(buf)  # safe: see "Buffer ownership" in the module docstring
        return view[:n]

    def prefetch(self, fd: int, size: int) -> None:
        """Start reading the *size* bytes of a file just opened for reading, if it is
        small and on a local disk, so that its first READ finds them in the page cache
        and takes no thread hop (see the module docstring). Once per open, never per
        request; the caller asks only for flows whose reads nothing caps, so that no
        byte is read before its admission.

        ``WILLNEED`` submits the reads and returns without waiting for them: it blocks
        no more than the ``RWF_NOWAIT`` read of the same bytes does, which starts the
        same readahead on the loop's thread. Not in the other modes: memory filesystems
        have nothing to read, and on network ones the call may wait for the server.
        """
        if self.mode is not IoMode.NOWAIT or not 0 < size <= PREFETCH_MAX:
            return
        self.prefetches += 1
        try:
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # only a hint: without it the read takes the thread hop, as before

    async def write(
        self, fd: int, off: int, data: bytes, direct: bool, limiter: trio.CapacityLimiter,
        throttled: bool = False, fsuid: int = 0,
    ) -> int:
        """Write all of *data* at *off* (looping on short writes). Raises OSError.

        *throttled*: the writer's flow is capped; a large write then runs in a thread
        (see ``OFFLOAD_WRITE``). *fsuid*: if not 0, the uid to write as (the daemon's
        own fsuid, 0, is restored after the syscall).
        """
        if direct:
            pool = self._aligned
            size = len(data)
            buf = pool.take(size)
            view = memoryview(buf)[:size]
            view[:] = data
            try:
                if self.mode is IoMode.INLINE:
                    return _pwrite_as(fsuid, fd, view, off)
                self.thread_hops += 1
                return await trio.to_thread.run_sync(_pwrite_as, fsuid, fd, view, off,
                                                     limiter=limiter)
            finally:
                pool.give(buf)
        if self.mode is IoMode.THREADS or (throttled and len(data) >= OFFLOAD_WRITE):
            self.thread_hops += 1
            return await trio.to_thread.run_sync(_pwrite_as, fsuid, fd, data, off,
                                                 limiter=limiter)
        return _pwrite_as(fsuid, fd, data, off)

    async def blocking(
        self, limiter: trio.CapacityLimiter, fn: Callable[..., Any], *args: Any
    ) -> Any:
        """Run a call that may wait for the device (fsync, close on NFS) in a thread."""
        if self.mode is IoMode.INLINE:
            return fn(*args)
        self.thread_hops += 1
        return await trio.to_thread.run_sync(fn, *args, limiter=limiter)

    async def meta(self, limiter: trio.CapacityLimiter, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a metadata syscall: inline unless the backing store is remote."""
        if self.mode is IoMode.THREADS:
            self.thread_hops += 1
            guard = self.fd_guard
            epoch = guard.enter()
            try:
                return await trio.to_thread.run_sync(fn, *args, limiter=limiter)
            finally:
                guard.leave(epoch)
        return fn(*args)
