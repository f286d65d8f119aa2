"""The few Linux syscalls the ``os`` module does not expose, through ctypes.

Metadata operations use these (rename flags, timestamps with ``UTIME_OMIT``, ownership
of symlinks by descriptor); only :func:`setfsuid` is on the write path (see
:mod:`qosfs.daemon.privileges`), and :func:`dio_offset_align` runs once per ``O_DIRECT``
open.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

AT_FDCWD = -100
AT_SYMLINK_NOFOLLOW = 0x100
AT_EMPTY_PATH = 0x1000
UTIME_NOW = (1 << 30) - 1
UTIME_OMIT = (1 << 30) - 2
RENAME_NOREPLACE = 1 << 0
RENAME_EXCHANGE = 1 << 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                            ctypes.c_uint]
_libc.utimensat.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(_Timespec),
                            ctypes.c_int]
_libc.fchownat.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint,
                           ctypes.c_int]


def _check(ret: int) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def renameat2(olddirfd: int, oldname: bytes, newdirfd: int, newname: bytes, flags: int) -> None:
    """rename with RENAME_NOREPLACE / RENAME_EXCHANGE, which os.rename cannot pass."""
    _check(_libc.renameat2(olddirfd, oldname, newdirfd, newname, flags))


def _timespec(ns: int | None) -> _Timespec:
    if ns is None:
        return _Timespec(0, UTIME_OMIT)
    return _Timespec(ns // 1_000_000_000, ns % 1_000_000_000)


def utimens_fd(fd: int, atime_ns: int | None, mtime_ns: int | None) -> None:
    """Set times on the object behind *fd* (O_PATH allowed, symlinks not followed).

    ``None`` leaves that time untouched (UTIME_OMIT), which os.utime cannot express.
    """
    times = (_Timespec * 2)(_timespec(atime_ns), _timespec(mtime_ns))
    _check(_libc.utimensat(fd, b"", times, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW))


def chown_fd(fd: int, uid: int, gid: int) -> None:
    """chown the object behind *fd* (O_PATH allowed, symlinks not followed); -1 keeps a field."""
    _check(_libc.fchownat(fd, b"", uid & 0xFFFFFFFF, gid & 0xFFFFFFFF,
                          AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW))


_libc.linkat.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                         ctypes.c_int]


def link_fd(fd: int, newdirfd: int, newname: bytes) -> None:
    """Hard-link the object behind *fd* (O_PATH allowed, symlinks too) as *newname*.

    ``AT_EMPTY_PATH`` needs CAP_DAC_READ_SEARCH; without it, fall back to the /proc magic
    link, which works for everything but symlinks.
    """
    if _libc.linkat(fd, b"", newdirfd, newname, AT_EMPTY_PATH) == 0:
        return
    err = ctypes.get_errno()
    if err not in (1, 2):  # EPERM, ENOENT: no capability for AT_EMPTY_PATH
        raise OSError(err, os.strerror(err))
    os.link(f"/proc/self/fd/{fd}", newname, dst_dir_fd=newdirfd, follow_symlinks=True)


# File handles: a stable, descriptor-free reference to an inode (what NFS servers hand
# out). ``struct file_handle`` is {u32 handle_bytes; i32 handle_type; u8 f_handle[]}.
MAX_HANDLE_SZ = 128
_HANDLE_HEADER = 8
# No argtypes for these two: every argument is already what C takes (ints, bytes, the
# buffer, a byref), and ctypes' conversion through argtypes cost ~0.5-1 us per call (the
# old and new functions alternated, ext4, medians of 7 rounds: handle_of_fd 2.71 -> 1.73
# us, open_by_handle with the close 3.30 -> 2.81 us). They run once per file a listing
# names past the objects kept, and once per open of an inode whose descriptor was evicted.
_name_to_handle_at = _libc.name_to_handle_at
_open_by_handle_at = _libc.open_by_handle_at


# One buffer, reused: handles are taken on the event loop's thread only (a new inode per
# lookup), and allocating the ctypes buffers per call cost a third of the call (2.6 us).
_handle_buf = ctypes.create_string_buffer(_HANDLE_HEADER + MAX_HANDLE_SZ)
_handle_bytes = ctypes.c_uint32.from_buffer(_handle_buf)
_mount_id = ctypes.c_int()
_mount_id_ref = ctypes.byref(_mount_id)


def handle_of_fd(fd: int) -> tuple[bytes, int]:
    """The file handle of the object behind *fd* (O_PATH allowed) and its mount id.

    The handle is returned whole (header included), ready for :func:`open_by_handle`.
    Not thread-safe (one shared buffer): call it from the event loop's thread.
    Raises OSError: EOPNOTSUPP where the filesystem cannot export handles.
    """
    _handle_bytes.value = MAX_HANDLE_SZ
    if _name_to_handle_at(fd, b"", _handle_buf, _mount_id_ref, AT_EMPTY_PATH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return _handle_buf.raw[:_HANDLE_HEADER + _handle_bytes.value], _mount_id.value


_SYS_KEYCTL = 250  # x86_64; glibc has no keyctl() (libkeyutils does)
_libc.syscall.restype = ctypes.c_long


def keyctl(*args: int | bytes) -> int:
    """keyctl(2): integers as C longs (addresses too), bytes as strings; its result, a
    key's serial or a length (used by :mod:`qosfs.core.keyring`, once per start)."""
    ret = int(_libc.syscall(ctypes.c_long(_SYS_KEYCTL),
                            *(a if isinstance(a, bytes) else ctypes.c_long(a) for a in args)))
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


def open_by_handle(mount_fd: int, handle: bytes, flags: int) -> int:
    """Open the object a handle from :func:`handle_of_fd` names (needs CAP_DAC_READ_SEARCH).

    Raises OSError: ESTALE if the object is gone (the handle carries the inode's
    generation, so a recycled inode number is never mistaken for the old object).
    """
    fd: int = _open_by_handle_at(mount_fd, handle, flags)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


_libc.setfsuid.argtypes = [ctypes.c_uint]


def setfsuid(uid: int) -> int:
    """Set this thread's filesystem uid; returns the previous one.

    The kernel reports no error: a refused change (no CAP_SETUID) just leaves it, so
    callers that must know compare with a second call (an invalid uid only reports).
    """
    return int(_libc.setfsuid(uid & 0xFFFFFFFF))


# statx(2) for STATX_DIOALIGN (Linux 6.1), which os.stat cannot ask for. ``struct statx`` is
# 256 bytes; stx_mask is its first u32 and stx_dio_offset_align the u32 at byte 156.
_STATX_DIOALIGN = 0x2000
_AT_STATX_DONT_SYNC = 0x4000  # a local property: never ask an NFS server for attributes
_STATX_SIZE = 256
_DIO_OFFSET_ALIGN = 156
_statx = getattr(_libc, "statx", None)  # glibc >= 2.28
if _statx is not None:
    _statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint,
                       ctypes.c_char_p]


def dio_offset_align(fd: int) -> int:
    """The alignment ``O_DIRECT`` I/O on *fd* needs for its file offset and length (the
    device's logical block size on ext4 and xfs), or 0 if the kernel does not say (before
    Linux 6.1, no statx in libc, or a filesystem that does not report it: tmpfs, NFS)."""
    if _statx is None:
        return 0
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if _statx(fd, b"", AT_EMPTY_PATH | _AT_STATX_DONT_SYNC, _STATX_DIOALIGN, buf) != 0:
        return 0
    if not int.from_bytes(buf.raw[:4], "little") & _STATX_DIOALIGN:
        return 0
    return int.from_bytes(buf.raw[_DIO_OFFSET_ALIGN:_DIO_OFFSET_ALIGN + 4], "little")


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (``malloc_trim``): after a large
    table was freed, glibc otherwise keeps them for the process."""
    trim = getattr(_libc, "malloc_trim", None)  # glibc only
    if trim is not None:
        trim(0)
