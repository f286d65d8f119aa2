"""Metadata system calls of the operations, inline or in threads (:class:`BackingIO.meta
<qosfs.passthrough.backing_io.BackingIO.meta>`), and never EMFILE because of the daemon's
own bookkeeping: a call that opens a descriptor is tried again once cached inode
descriptors are shed (:meth:`MetaCalls.opening`)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any, TypeVar

import trio

from qosfs.passthrough import odirect
from qosfs.passthrough.backing_io import BackingIO
from qosfs.passthrough.inode import Inode
from qosfs.passthrough.inodes import InodeTable

_T = TypeVar("_T")

FD_SHORTAGE = (errno.EMFILE, errno.ENFILE)


class MetaCalls:
    """The metadata calls of one mount, within *limiter*'s threads when they go to one."""

    __slots__ = ("_inodes", "_io", "_limiter")

    def __init__(self, io: BackingIO, limiter: trio.CapacityLimiter,
                 inodes: InodeTable) -> None:
        self._io = io
        self._limiter = limiter
        self._inodes = inodes

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        result: _T = await self._io.meta(self._limiter, fn, *args)
        return result

    async def opening(self, fn: Callable[..., _T], *args: Any) -> _T:
        """:meth:`run` for a call that opens a descriptor; an :class:`Inode` among *args*
        is passed as its descriptor, taken just before the call.

        If the daemon is out of descriptors, cached inode descriptors are shed and the call
        is tried once more (with descriptors taken afresh, since shedding may have closed
        the first ones): a caller must never see EMFILE because of the daemon's own
        bookkeeping.
        """
        result: _T
        try:
            result = await self._io.meta(self._limiter, fn, *_fds(args))
            return result
        except OSError as exc:
            if exc.errno not in FD_SHORTAGE or not self._inodes.relieve():
                raise
        result = await self._io.meta(self._limiter, fn, *_fds(args))
        return result

    def resolve_inline(self, parent: Inode | int, name: bytes) -> tuple[int, os.stat_result]:
        """:meth:`InodeTable.resolve` of *parent*'s *name* on the event loop's thread, as
        :meth:`opening` does it (once more after shedding cached descriptors if the
        daemon is out of them), without its two coroutine frames. *parent* is an inode
        (its descriptor taken at each try: shedding may close the first) or a directory
        descriptor the caller holds open itself (a listing's)."""
        return self.inline(self._inodes.resolve, parent, name)

    def reopen_inline(self, node: Inode, flags: int) -> tuple[int, bool]:
        """:func:`odirect.open_backing <qosfs.passthrough.odirect.open_backing>` of
        *node*'s own descriptor reopened with *flags*, on the event loop's thread, as
        :meth:`opening` does it, without its two coroutine frames (as
        :meth:`resolve_inline`): the cold open of every file of a loader makes one."""
        return self.inline(odirect.open_backing, flags, odirect.reopen, node)

    def inline(self, fn: Callable[..., _T], *args: Any) -> _T:
        """:meth:`opening` on the event loop's thread, for a call that never waits for
        the backing store (local filesystems): its shed-and-retry, without its two
        coroutine frames."""
        try:
            return fn(*_fds(args))
        except OSError as exc:
            if exc.errno not in FD_SHORTAGE or not self._inodes.relieve():
                raise
        return fn(*_fds(args))


def _fds(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """*args* with each :class:`Inode` replaced by its descriptor, taken now."""
    return tuple([arg.fd if arg.__class__ is Inode else arg for arg in args])
