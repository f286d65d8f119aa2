"""Changes to the tree's names (create, mknod, mkdir, symlink, link, unlink, rmdir, rename), each
done exactly once: recorded by request id in the crash journal's ring, so that one the
kernel sends again after a crash is answered with what was done, not done twice
(:class:`qosfs.passthrough.intents.ExactlyOnce`), and the tables updated after it, by
this process or for a predecessor that died."""

from __future__ import annotations

import errno
import functools
import os
import stat
from collections.abc import Awaitable, Callable
from typing import Any

import pyfuse3
from pyfuse3 import FUSEError

from qosfs.core import syscalls
from qosfs.passthrough import odirect
from qosfs.passthrough.entries import Entries
from qosfs.passthrough.handle_table import OPEN_DROP, HandleTable
from qosfs.passthrough.inode import Inode
from qosfs.passthrough.inodes import InodeTable
from qosfs.passthrough.intents import EXISTS, GONE, ExactlyOnce
from qosfs.passthrough.meta_calls import MetaCalls
from qosfs.passthrough.ownership import SUID_SGID, Ownership
from qosfs.passthrough.paths import PathBook
from qosfs.qos.charge import charge_renamed
from qosfs.qos.interface import FilesystemQos


class Namespace:
    """The name changes of one mount (the operations check and admit them first)."""

    __slots__ = ("_calls", "_entries", "_handles", "_inodes", "_once", "_owners", "_paths",
                 "_qos")

    def __init__(self, inodes: InodeTable, paths: PathBook, handles: HandleTable,
                 qos: FilesystemQos, calls: MetaCalls, entries: Entries, owners: Ownership,
                 once: ExactlyOnce) -> None:
        self._inodes = inodes
        self._paths = paths
        self._handles = handles
        self._qos = qos
        self._calls = calls
        self._entries = entries
        self._owners = owners
        self._once = once

    # ----------------------------------------------------------------- new names

    async def _make(self, ctx: pyfuse3.RequestContext | None, op: str, parent: Inode,
                    name: bytes, mode: int, call: Callable[..., Any],
                    *args: Any) -> pyfuse3.EntryAttributes:
        """``call(*args)`` once, then the entry it made (*ctx* None: a link, whose object
        keeps its owner; *mode*: what the caller is given it with)."""
        return await self._once.run(
            ctx, op, name, EXISTS, functools.partial(self._calls.run, call, *args),
            functools.partial(self._made, parent, name, ctx, mode))

    async def _made(self, parent: Inode, name: bytes, ctx: pyfuse3.RequestContext | None,
                    mode: int, done: object) -> pyfuse3.EntryAttributes:
        """The entry a mknod, mkdir, symlink or link made (*done*: None if it was made by
        a predecessor that died, recorded or not: then the ownership, which a kill may
        have left root's, is given to the caller again)."""
        if done is None and ctx is not None:
            await self._calls.run(self._owners.give_to_caller, parent, name, ctx, mode)
        return await self._entries.adopt_new(parent, name)

    def mknod(self, parent: Inode, name: bytes, mode: int, rdev: int,
              ctx: pyfuse3.RequestContext) -> Awaitable[pyfuse3.EntryAttributes]:
        return self._make(ctx, "mknod", parent, name, mode, self._mknod, parent, name, mode,
                          rdev, ctx)

    def _mknod(self, parent: Inode, name: bytes, mode: int, rdev: int,
               ctx: pyfuse3.RequestContext) -> None:
        os.mknod(name, mode, rdev, dir_fd=parent.fd)
        self._owners.give_to_caller(parent, name, ctx, mode)

    def mkdir(self, parent: Inode, name: bytes, mode: int,
              ctx: pyfuse3.RequestContext) -> Awaitable[pyfuse3.EntryAttributes]:
        return self._make(ctx, "mkdir", parent, name, mode & ~SUID_SGID, self._mkdir, parent,
                          name, mode, ctx)

    def _mkdir(self, parent: Inode, name: bytes, mode: int, ctx: pyfuse3.RequestContext) -> None:
        os.mkdir(name, stat.S_IMODE(mode), dir_fd=parent.fd)
        # chown keeps a directory's setgid bit, so no mode fix-up is needed here.
        self._owners.give_to_caller(parent, name, ctx, mode & ~SUID_SGID)

    def symlink(self, parent: Inode, name: bytes, target: bytes,
                ctx: pyfuse3.RequestContext) -> Awaitable[pyfuse3.EntryAttributes]:
        return self._make(ctx, "symlink", parent, name, stat.S_IFLNK, self._symlink, parent,
                          name, target, ctx)

    def _symlink(self, parent: Inode, name: bytes, target: bytes,
                 ctx: pyfuse3.RequestContext) -> None:
        os.symlink(target, name, dir_fd=parent.fd)
        self._owners.give_to_caller(parent, name, ctx, stat.S_IFLNK)

    def link(self, node: Inode, parent: Inode, name: bytes,
             ctx: pyfuse3.RequestContext) -> Awaitable[pyfuse3.EntryAttributes]:
        return self._once.run(
            ctx, "link", name, EXISTS,
            functools.partial(self._calls.run, syscalls.link_fd, node.fd, parent.fd, name),
            functools.partial(self._made, parent, name, None, 0))

    async def create(self, parent: Inode, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[int, bool, Inode, os.stat_result]:
        """Create and open *name*: its descriptor, whether it is O_DIRECT, its inode and
        its attributes (the operations make the open's handle)."""
        if flags & os.O_EXCL:  # done twice it fails: recorded (qosfs.passthrough.intents)
            return await self._once.run(
                ctx, "create", name, EXISTS,
                functools.partial(self._create_new, parent, name, mode, flags),
                functools.partial(self._created, parent, name, mode, flags, ctx))
        made = await self._create_new(parent, name, mode, flags)
        return await self._created(parent, name, mode, flags, ctx, made)

    async def _create_new(self, parent: Inode, name: bytes, mode: int,
                          flags: int) -> tuple[int, bool]:
        # The kernel sends CREATE when it believes the name does not exist (a negative
        # entry, cached for entry_timeout). If something appeared underneath since (another
        # node, another path), a plain O_CREAT would open it as root -- another user's file,
        # or the target of a symlink outside the tree -- and hand it to the caller. O_EXCL
        # creates only what is new and never follows a symlink.
        try:
            made: tuple[int, bool] = await self._calls.opening(
                odirect.open_backing,
                (flags & ~(os.O_NOCTTY | os.O_NOFOLLOW)) | os.O_CREAT | os.O_EXCL,
                _create_in, parent, name, stat.S_IMODE(mode),
            )
            return made
        except FileExistsError:
            if flags & os.O_EXCL:
                raise
            # ESTALE makes the VFS redo the open with a fresh lookup: the kernel then
            # opens the existing object itself, checking permissions as the caller.
            raise FUSEError(errno.ESTALE) from None

    async def _created(self, parent: Inode, name: bytes, mode: int, flags: int,
                       ctx: pyfuse3.RequestContext, made: tuple[int, bool] | None,
                       ) -> tuple[int, bool, Inode, os.stat_result]:
        """A create that made *name* (*made*: its descriptor and whether it is direct), or
        whose file a predecessor that died made (None): that file is opened as it is,
        never created or emptied again, nor through a symlink."""
        if made is None:
            made = await self._calls.opening(
                odirect.open_backing,
                (flags & ~(os.O_NOCTTY | OPEN_DROP | os.O_TRUNC)) | os.O_NOFOLLOW,
                _create_in, parent, name, 0)
        fd, direct = made
        try:
            await self._calls.run(self._owners.give_to_caller, parent, name, ctx, mode)
            opath = await self._calls.opening(os.open, f"/proc/self/fd/{fd}",
                                              os.O_PATH | os.O_CLOEXEC)
            st = os.fstat(opath)
        except BaseException:
            os.close(fd)
            raise
        return fd, direct, self._entries.adopt(parent, name, opath, st), st

    # ----------------------------------------------------------------- names gone

    async def unlink(self, parent: Inode, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self._once.run(ctx, "unlink", name, GONE,
                             functools.partial(self._calls.run, self._unlink, parent.fd, name),
                             self._unlinked)

    async def _unlinked(self, st: os.stat_result | None) -> None:
        inode = None if st is None else self._inodes.find(st)
        if st is not None and inode is not None and st.st_nlink <= 1:
            # The last name is gone: let go of the blocks now, as a native unlink does.
            self._inodes.release_unlinked(inode)

    async def rmdir(self, parent: Inode, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self._once.run(ctx, "rmdir", name, GONE,
                             functools.partial(self._calls.run, self._rmdir, parent.fd, name),
                             _nothing)

    def _looked_up(self, parent_fd: int, name: bytes) -> os.stat_result:
        """The object under *name*, which must be one the kernel looked up (ESTALE if not).

        The kernel checked permissions (a sticky directory, say) on the object it looked
        up under this name. If the name holds something else now (changed underneath),
        acting on it as root would skip that check; ESTALE makes the VFS look the name up
        again and check what is really there.
        """
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        if self._inodes.find(st) is None:
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE))
        return st

    def _unlink(self, parent_fd: int, name: bytes) -> os.stat_result:
        st = self._looked_up(parent_fd, name)
        os.unlink(name, dir_fd=parent_fd)
        return st

    def _rmdir(self, parent_fd: int, name: bytes) -> None:
        self._looked_up(parent_fd, name)
        os.rmdir(name, dir_fd=parent_fd)

    # ----------------------------------------------------------------- renames

    async def rename(self, old: Inode, name_old: bytes, new: Inode, name_new: bytes,
                     flags: int, ctx: pyfuse3.RequestContext) -> None:
        try:
            await self._once.run(
                ctx, "rename", name_old, GONE,
                functools.partial(self._calls.run, self._rename, old.fd, name_old, new.fd,
                                  name_new, flags),
                functools.partial(self._renamed, old, name_old, new, name_new, flags, ctx))
        finally:
            # Paths below the renamed name changed: every memoized path (and the engine's
            # classifications from them) is stale. After the call, so that one read while
            # the rename ran is dropped too.
            self._paths.renamed()

    def _rename(self, old_fd: int, name_old: bytes, new_fd: int, name_new: bytes,
                flags: int) -> None:
        self._looked_up(old_fd, name_old)
        if flags & syscalls.RENAME_EXCHANGE:
            self._looked_up(new_fd, name_new)
        syscalls.renameat2(old_fd, name_old, new_fd, name_new, flags)

    async def _renamed(self, old: Inode, name_old: bytes, new: Inode, name_new: bytes,
                       flags: int, ctx: pyfuse3.RequestContext, done: object) -> None:
        """The tables after a rename (done here, or by a predecessor that died)."""
        self._inodes.renamed(new, name_new)
        if flags & syscalls.RENAME_EXCHANGE:
            self._inodes.renamed(old, name_old)
        # Before the report classifies the new name; rename's finally does it again, for
        # a call that failed and for a path memoized while this one ran.
        self._paths.renamed()
        await self._report_rename(new, name_new, ctx)

    async def _report_rename(self, parent: Inode, name: bytes,
                             ctx: pyfuse3.RequestContext) -> None:
        """Tell the QoS layer which inode just got *name* and which opens it has: an
        atomic save's final name may re-charge what it wrote under its temporary one
        (:func:`qosfs.qos.charge.charge_renamed`)."""
        try:
            st = await self._calls.run(functools.partial(os.stat, dir_fd=parent.fd,
                                                         follow_symlinks=False), name)
        except OSError:
            return  # gone already (renamed again, unlinked): nothing to charge
        inode = self._inodes.find(st)
        if inode is not None:
            charge_renamed(self._qos, self._paths, inode, ctx,
                           self._handles.charges_of(inode))


def _create_in(dir_fd: int, name: bytes, mode: int, flags: int) -> int:
    return os.open(name, flags, mode, dir_fd=dir_fd)


async def _nothing(done: object) -> None:
    """The answer of an operation whose reply carries nothing (rmdir)."""
