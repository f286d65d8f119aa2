"""O_DIRECT opens, and the buffered twin that serves what O_DIRECT refuses.

An O_DIRECT open stays O_DIRECT underneath (:func:`open_backing`; buffered if the backing
store refuses O_DIRECT), but a request O_DIRECT would refuse (a mapping's writeback ending
at EOF, dd's unaligned tail) goes to a buffered descriptor of the same file
(:func:`buffered`): the kernel sends them, and refusing lost the data. The operations
test one integer per read and write (the handle's ``dio_mask``, :func:`dio_mask_of`).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from collections.abc import Awaitable, Callable
from typing import Any

from qosfs.core import syscalls
from qosfs.passthrough.handles import FileHandle


def open_backing(flags: int, opener: Callable[..., int], *args: Any) -> tuple[int, bool]:
    """``opener(*args, flags)`` with the caller's flags, and whether the descriptor is
    O_DIRECT; falls back to buffered I/O if O_DIRECT is refused."""
    flags |= os.O_CLOEXEC
    try:
        return opener(*args, flags), bool(flags & os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL or not flags & os.O_DIRECT:
            raise
    # A create's first attempt made the file before O_DIRECT was refused: reopen it.
    return opener(*args, flags & ~(os.O_DIRECT | os.O_EXCL)), False


def reopen(fd: int, flags: int) -> int:
    """Open the object behind an O_PATH descriptor for I/O (the /proc magic link does not
    re-resolve a path). Once per cold open of a file: the link is looked up in the
    process's own ``/proc/self/fd``, held open, instead of walking ``/proc``, ``self`` (a
    symbolic link), the pid and ``fd`` each time (6.0 -> 5.0 us in a loop of its own)."""
    directory = _FdDirectory.fd
    if directory < 0:
        directory = _FdDirectory.open()
    return os.open(str(fd), flags, dir_fd=directory)


class _FdDirectory:
    """This process's ``/proc/self/fd``, held open for :func:`reopen`. A fork's child
    (daemonizing) opens its own: the descriptor it inherits names the parent's."""

    fd = -1

    @classmethod
    def open(cls) -> int:
        cls.fd = os.open("/proc/self/fd", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        return cls.fd

    @classmethod
    def forget(cls) -> None:
        if cls.fd >= 0:
            os.close(cls.fd)
            cls.fd = -1


os.register_at_fork(after_in_child=_FdDirectory.forget)


def dio_mask_of(fd: int) -> int:
    """The bits an offset or length must not have for O_DIRECT on *fd*. Where the kernel
    does not report its alignment, a page: the largest logical block size of common
    devices, and what the page cache's own requests are multiples of."""
    return (syscalls.dio_offset_align(fd) or mmap.PAGESIZE) - 1


async def buffered(handle: FileHandle, opening: Callable[..., Awaitable[int]]) -> int:
    """A descriptor without O_DIRECT on the file of an O_DIRECT open, for the requests
    whose offset or length O_DIRECT refuses (EINVAL): opened at the first one by
    reopening the open's descriptor with its flags less O_DIRECT (through *opening*, the
    operations' descriptor-opening metadata call), closed at release. At most one per
    open, so nothing new can pile up; an aligned request never comes here (one integer
    test in read and write).

    The kernel sends such requests on an O_DIRECT open of its own accord: the
    writeback of a shared mapping stops at EOF, mid-block, and may go through any
    writable open of the file (msync of a mapped O_DIRECT file failed with EINVAL and
    the mapped range read back as zeros); a page fault reads a page, which a device
    with larger blocks would refuse. A program that clears O_DIRECT with ``fcntl``
    writes through the page cache from then on (GNU dd ``oflag=direct`` does for a
    last partial block), and FUSE never tells the filesystem of the change.

    The trade-off: an unaligned request a caller makes itself on an O_DIRECT open,
    which ext4 refuses with EINVAL, is served too, through the page cache. Nothing
    tells it apart from dd's tail (the same caller, the same request, no flag), and
    pyfuse3 hides ``FUSE_WRITE_CACHE``, which would single out writeback alone. A
    program that misaligns by mistake gets its data written instead of an error;
    refusing would keep losing the data of the ones that did nothing wrong.

    Why the two descriptors stay coherent: both are the same inode and page cache
    underneath. On ext4, xfs and btrfs a direct read first writes back the dirty
    cached pages of its range, and a direct write writes back and drops them before
    and after it, so neither descriptor reads what the other has overwritten
    (``tests/mount/test_odirect.py`` checks mixed sequences against ext4 itself).
    tmpfs serves O_DIRECT from its page cache; an NFS client writes back its cache
    when an inode switches to direct I/O and drops what a direct write covered.
    Overlapping requests in flight at once are as unordered as they are natively.
    ``fsync`` and a network ``flush`` on the O_DIRECT descriptor act on the inode,
    so they cover what went through this one; O_SYNC, O_DSYNC and O_APPEND carry over.
    """
    if handle.buffered >= 0:
        return handle.buffered
    flags = (fcntl.fcntl(handle.fd, fcntl.F_GETFL) & ~os.O_DIRECT) | os.O_CLOEXEC
    fd = await opening(reopen, handle.fd, flags)
    if handle.buffered >= 0:  # another request opened one while this one waited
        os.close(fd)
        return handle.buffered
    handle.buffered = fd
    return fd


def close_file(fd: int, buffered_fd: int) -> None:
    """Close an open's descriptor and its buffered twin (-1: none), in one thread hop."""
    try:
        os.close(fd)
    finally:
        if buffered_fd >= 0:
            os.close(buffered_fd)
