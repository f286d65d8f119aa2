"""Who sent a parked read or write, and FUSE INTERRUPT for it: killed callers leave at once.

A request parked by QoS has been read from ``/dev/fuse``, so its caller sleeps in the
kernel until we answer. When the caller is killed, the kernel sends FUSE_INTERRUPT and
then waits *uninterruptibly* for our answer: without handling the interrupt, ``kill -9``
of a throttled writer does nothing until its tokens come (reproduced: 986 threads in D
state for 35 s). pyfuse3 hands read/write handlers neither the caller (``fuse_req_ctx``)
nor a way to register an interrupt callback (``fuse_req_interrupt_func``); both need the
request's ``fuse_req_t``, which pyfuse3 keeps in its internal ``_Container``.

This is FUSE code, so it lives with the pass-through; the QoS engine reaches it only
through the :class:`~qosfs.qos.interface.CallerWatch` it is given (:data:`WATCH`, passed by
:func:`qosfs.daemon.assembly.build_daemon`). Only on the slow path of a request that must park:

* learns the ``_Container`` of the request being started: pyfuse3 looks its
  ``fuse_read_async``/``fuse_write_async`` up by name at every request, so a thin
  synchronous wrapper notes the container and returns pyfuse3's own coroutine (cost on
  every read/write: one Python call, ~0.1 us; no coroutine of ours);
* reads ``req`` out of the container at the offset of pyfuse3 3.x's layout, checked at
  install time (the object's size) and at every use (the container's ``size`` field must
  equal the request's size), and does nothing if either check fails;
* asks libfuse (the same ``libfuse3.so.3`` pyfuse3 is linked to) for the caller's uid and
  thread id, and registers an interrupt callback that cancels the parked wait **only if
  the caller has SIGKILL pending**: answering EINTR to an ordinary signal (a profiler's
  SIGPROF, a SIGCHLD) would turn a throttled write into an error its program never
  expected from a regular file.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pyfuse3
import trio

from qosfs.qos.interface import Caller as QosCaller

log = logging.getLogger(__name__)

# pyfuse3 3.x ``_Container`` (handlers.pxi): PyObject_HEAD, dev_t rdev, fuse_file_info fi,
# fuse_ino_t ino, fuse_ino_t parent, fuse_req_t req, int flags, mode_t mode, off_t off,
# size_t size, struct stat stat, uint64_t fh -- on LP64 Linux. ``fuse_file_info`` is 40
# bytes up to libfuse 3.16 and 64 from 3.17 (backing_id, compat_flags, reserved): the
# project's own libfuse build (deploy/libfuse) has the larger one. Everything but it is
# fixed, so the container's size tells which one pyfuse3 was built with.
_FILE_INFO_SIZES = (40, 64)
_BEFORE_FILE_INFO = 16 + 8
_AROUND_FILE_INFO = _BEFORE_FILE_INFO + 8 + 8 + 8 + 4 + 4 + 8 + 8 + 144 + 8  # x86_64 stat
_REQ_OFFSET = -1  # set at install: _BEFORE_FILE_INFO + the file info + ino + parent
_SIZE_OFFSET = -1  # set at install: _REQ_OFFSET + req + flags + mode + off

_SIGKILL_MASK = 1 << (9 - 1)


class _FuseCtx(ctypes.Structure):
    _fields_ = [("uid", ctypes.c_uint32), ("gid", ctypes.c_uint32), ("pid", ctypes.c_int32),
                ("umask", ctypes.c_uint32)]


_INTERRUPT_FUNC = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)

_current: Any = None  # the _Container of the request whose handler runs now
_current_size = -1  # its write buffer's length (-1: a read)
_installed = False
_libfuse: Any = None
_on_interrupt_c: Any = None  # keeps the C callback alive for the life of the process
_waiters: dict[int, trio.CancelScope] = {}  # key -> the parked wait to cancel
_next_key = 1
killed_callers = 0  # parked requests answered EINTR because their caller was killed


def install() -> bool:
    """Hook pyfuse3's read/write entry points (idempotent). False: unsupported here."""
    global _installed, _libfuse, _on_interrupt_c  # noqa: PLW0603 (the hook's per-process state)
    if _installed:
        return True
    global _REQ_OFFSET, _SIZE_OFFSET  # noqa: PLW0603 (the layout of this pyfuse3 build)
    container = getattr(pyfuse3, "_Container", None)
    file_info = container.__basicsize__ - _AROUND_FILE_INFO if container is not None else 0
    if file_info not in _FILE_INFO_SIZES or ctypes.sizeof(ctypes.c_void_p) != 8:
        log.warning("pyfuse3's internals are not the expected ones: parked requests of "
                    "killed callers will only be answered when their tokens come")
        return False
    try:
        lib = ctypes.CDLL(_loaded_libfuse())
        lib.fuse_req_ctx.restype = ctypes.POINTER(_FuseCtx)
        lib.fuse_req_ctx.argtypes = [ctypes.c_void_p]
        lib.fuse_req_interrupt_func.restype = None
        lib.fuse_req_interrupt_func.argtypes = [ctypes.c_void_p, _INTERRUPT_FUNC,
                                                ctypes.c_void_p]
    except (OSError, AttributeError) as exc:
        log.warning("libfuse3 not usable through ctypes (%s): no interrupt handling", exc)
        return False
    _REQ_OFFSET = _BEFORE_FILE_INFO + file_info + 8 + 8
    _SIZE_OFFSET = _REQ_OFFSET + 8 + 4 + 4 + 8
    _libfuse = lib
    _on_interrupt_c = _INTERRUPT_FUNC(_on_interrupt)
    for name in ("fuse_read_async", "fuse_write_async", "fuse_write_buf_async"):
        original = getattr(pyfuse3, name, None)
        if original is not None:
            setattr(pyfuse3, name, _noting(original))
    _installed = True
    return True


def _loaded_libfuse() -> str:
    """The libfuse pyfuse3 is linked to, as loaded in this process: the requests it hands
    out are that library's, so its own ``fuse_req_ctx`` must read them. The project's
    build (libfuse3.so.4 by rpath) and the system's (libfuse3.so.3) may both be on the
    machine; ``find_library`` would name the system's."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rsplit(" ", 1)[-1].strip()
            if os.path.basename(path).startswith("libfuse3.so"):
                return path
    return ctypes.util.find_library("fuse3") or "libfuse3.so.3"


def _noting(original: Any) -> Any:
    def start(c: Any, *args: Any) -> Any:
        global _current, _current_size  # noqa: PLW0603 (the hook's per-process state)
        _current = c
        _current_size = len(args[0]) if args else -1  # a write's buffer
        return original(c, *args)  # pyfuse3's own coroutine, awaited by its worker

    return start


class Caller:
    """The request being parked: its ``fuse_req_t`` and who sent it (a
    :class:`qosfs.qos.interface.Caller`)."""

    __slots__ = ("req", "tid", "uid")

    def __init__(self, req: int, uid: int, tid: int) -> None:
        self.req = req
        self.uid = uid
        self.tid = tid


def current_caller(size: int) -> Caller | None:
    """The caller of the read/write of *size* bytes whose handler runs now, if known.

    Must be called before the handler's first checkpoint (the noted container is the
    current request's only until another request starts).
    """
    c = _current
    if c is None or not _installed:
        return None
    base = id(c)
    # A write's size is the buffer noted with it (pyfuse3's write_buf path leaves the
    # container's size field unset); a read's is the container's own field.
    noted = _current_size if _current_size >= 0 else \
        ctypes.c_size_t.from_address(base + _SIZE_OFFSET).value
    if noted != size:
        return None  # not the request we think: never touch it
    req = ctypes.c_void_p.from_address(base + _REQ_OFFSET).value
    if not req:
        return None
    ctx = _libfuse.fuse_req_ctx(req).contents
    return Caller(req, ctx.uid, ctx.pid)


@contextmanager
def cancelled_if_killed(caller: QosCaller | None) -> Iterator[trio.CancelScope]:
    """A cancel scope that FUSE INTERRUPT cancels when *caller* is being killed."""
    global _next_key  # noqa: PLW0603 (the hook's per-process state)
    with trio.CancelScope() as scope:
        if caller is None:
            yield scope
            return
        assert isinstance(caller, Caller)  # made by current_caller()
        key = _next_key
        _next_key += 1
        _waiters[key] = scope
        try:
            # Calls back at once if the request was interrupted already.
            _libfuse.fuse_req_interrupt_func(caller.req, _on_interrupt_c, key)
            yield scope
        finally:
            del _waiters[key]
            _libfuse.fuse_req_interrupt_func(caller.req, _INTERRUPT_FUNC(), None)


def _on_interrupt(req: int, data: int | None) -> None:
    """libfuse's interrupt callback (on the event loop's thread, inside pyfuse3's request
    processing): cancel the parked wait if its caller is dying. Must not raise."""
    global killed_callers  # noqa: PLW0603 (the hook's per-process state)
    try:
        scope = _waiters.get(data or 0)
        if scope is None:
            return
        tid = _libfuse.fuse_req_ctx(req).contents.pid
        if _being_killed(tid):
            killed_callers += 1
            scope.cancel()
    except Exception:  # an exception must not unwind into C
        log.exception("interrupt callback failed")


def _being_killed(tid: int) -> bool:
    """Whether thread *tid* has SIGKILL pending (or is gone)."""
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            for line in f:
                if (line.startswith((b"SigPnd:", b"ShdPnd:"))
                        and int(line.split()[1], 16) & _SIGKILL_MASK):
                    return True
    except OSError:
        return True  # no such thread any more: nobody is waiting for the answer
    return False


class FuseCallerWatch:
    """The :class:`~qosfs.qos.interface.CallerWatch` of a mount: this module's functions,
    for an engine that must not import FUSE. Knows callers only once :func:`install`
    succeeded."""

    def current_caller(self, nbytes: int) -> QosCaller | None:
        return current_caller(nbytes)

    def cancelled_if_killed(self, caller: QosCaller | None) -> AbstractContextManager[object]:
        return cancelled_if_killed(caller)


WATCH = FuseCallerWatch()
