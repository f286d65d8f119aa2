"""The FUSE operations: a faithful pass-through of a backing directory tree.

This module only translates FUSE requests into syscalls on the backing store, relative to
descriptors (see :mod:`qosfs.passthrough.inodes`). What a request is charged to and when it may
proceed is asked of the QoS layer: at open, where pyfuse3 tells us the caller, the handle
gets an :class:`~qosfs.qos.charge.OpenCharge` from the engine (``self.qos``); every read
and write is admitted by its flow, and what the filesystem did (a write, a rename, a
release) is reported to it. No QoS decision is made here.

Choices made here, each for a reason:

* Writes are synchronous pass-through (no writeback cache): a write is acknowledged only
  once the backing store has it, so a daemon crash loses nothing that was acknowledged,
  and every byte is accounted when it really moves.
* The page cache is used for reads unless the QoS class asks for ``direct_io`` (a capped
  read class must not escape its cap through cached pages). With ``--cache auto`` an
  open keeps the pages the kernel has (``keep_cache``) when the backing file's size,
  mtime and ctime are those seen at the previous open and nothing was written through
  the mount since, and drops them otherwise: NFS's close-to-open consistency. Dropping
  them at every open halved a re-read (1.9 against 4.4 GB/s).
* Entry and attribute timeouts default to 1 s, the same order as NFS's ``actimeo``:
  repeated stats do not cost a round trip, and changes made under the mount by other
  nodes become visible within a second.
* An O_DIRECT open stays O_DIRECT underneath, but a request O_DIRECT would refuse (a
  mapping's writeback ending at EOF, dd's unaligned tail) goes to a buffered descriptor
  of the same file (``_buffered``): the kernel sends them, and refusing lost the data.
* A read-only open of a class with ``passthrough = "reads"`` whose reads nothing caps now
  is passed through to the kernel (:mod:`qosfs.passthrough.kernel_opens`, over
  :mod:`qosfs.passthrough.kernel`): its reads never reach the daemon. The kernel passes
  an inode's opens through all or none, so while one is, every other open of that inode
  joins its backing id, a write open too: uncapped, counted and logged once per class,
  because refusing it would break a writer of a file someone reads, and serving it in
  the daemon the kernel forbids.
* Only ``FUSEError`` may leave a handler (anything else ends pyfuse3's main loop, and
  every caller then gets ENOTCONN): a backing-store ``OSError`` becomes its own errno;
  anything unexpected (a bug here or in the QoS layer) is answered with EIO, counted and
  logged once per kind (:mod:`qosfs.core.failures`). ``read`` and ``write`` catch it in
  the body instead of through the decorator: a ``try`` costs nothing until something
  is raised, a decorator's extra frame costs every request.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import mmap
import os
import resource
import stat
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pyfuse3
import trio
from pyfuse3 import FUSEError

from qosfs.core import syscalls
from qosfs.core.failures import Failures
from qosfs.passthrough import interrupts
from qosfs.passthrough.backing_io import BackingIO, IoMode
from qosfs.passthrough.fdcache import DeferredClose
from qosfs.passthrough.handles import PASSED_THROUGH, DirHandle, FileHandle, OpenQuota
from qosfs.passthrough.inodes import Inode, InodeTable, default_fd_budget
from qosfs.passthrough.intents import EXISTS, GONE, ExactlyOnce
from qosfs.passthrough.journal import SessionJournal
from qosfs.passthrough.kernel_opens import KernelOpens
from qosfs.passthrough.paths import PathBook
from qosfs.qos.charge import CUT_MIN, MAX_WRITE, OpenCharge, charge_renamed
from qosfs.qos.interface import FilesystemQos
from qosfs.qos.latency.probe import PROBE_XATTR

log = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Awaitable[Any]])
_T = TypeVar("_T")

# Flags the kernel handles itself (or that make no sense when reopening an existing
# object through its /proc magic link; O_NOFOLLOW would refuse the magic link).
_OPEN_DROP = os.O_CREAT | os.O_EXCL | os.O_NOCTTY | os.O_NOFOLLOW
_ACCMODE = os.O_RDONLY | os.O_WRONLY | os.O_RDWR
_SUID_SGID = stat.S_ISUID | stat.S_ISGID
_CAPABILITY_XATTR = b"security.capability"
_FD_SHORTAGE = (errno.EMFILE, errno.ENFILE)
# readdir lets other requests run every this many entries (~0.3 ms of work), see readdir.
_READDIR_YIELD_MASK = 15
_now_ns = time.perf_counter_ns


def fuse_handler(fn: _F) -> _F:
    """Turn every failure of a metadata handler into a ``FUSEError`` the kernel understands
    (an unexpected one is counted in the filesystem's ``failures``: the first argument is
    the :class:`PassthroughOperations`)."""
    where = fn.__name__

    @functools.wraps(fn)
    async def wrapper(*args: Any) -> Any:
        try:
            return await fn(*args)
        except Exception as exc:
            raise args[0]._answer(where, exc) from None

    return wrapper  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class FsOptions:
    """Mount-wide knobs of the pass-through (see the module docstring for the defaults)."""

    entry_timeout: float = 1.0
    attr_timeout: float = 1.0
    cache: str = "auto"  # "auto": page cache, revalidated per open; "always"; "never"
    # inode descriptors kept open (qosfs.passthrough.inodes); 0: from RLIMIT_NOFILE
    fd_budget: int = 0


class PassthroughOperations(pyfuse3.Operations):
    """pyfuse3 operations that forward everything to a backing directory."""

    supports_dot_lookup = True
    enable_writeback_cache = False  # see module docstring: acknowledged means written
    enable_acl = False

    def __init__(self, root_fd: int, io: BackingIO, qos: FilesystemQos, options: FsOptions,
                 write_as_caller: bool = False, failures: Failures | None = None) -> None:
        super().__init__()
        # Unexpected exceptions answered EIO instead of ending the mount (the daemon's
        # services count theirs in the same place: one figure in ctl status).
        self.failures = failures if failures is not None else Failures()
        # Non-root openers' writes run with their fsuid (root's reserve: qosfs.daemon.privileges).
        self._write_as_caller = write_as_caller
        # Evicted inode descriptors are closed only once no worker thread can still be
        # using them (network backing stores run metadata syscalls in threads).
        guard = DeferredClose()
        io.fd_guard = guard
        budget = options.fd_budget or default_fd_budget()
        self.inodes = InodeTable(root_fd, budget, guard)
        # Each uid may hold half of the descriptors the inode cache leaves
        # (qosfs.passthrough.handles).
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 20
        self.open_quota = OpenQuota(max(64, (soft - budget) // 2))
        self.io = io
        self.qos = qos
        self.options = options
        # Open files and directories by the fh the kernel was given: a sequence number,
        # not the backing descriptor (qosfs.passthrough.handles says why); the hot path's
        # cost is the same dict lookup by an int.
        self.files: dict[int, FileHandle] = {}
        self.dirs: dict[int, DirHandle] = {}
        self.next_fh = 1
        self._as_root = os.geteuid() == 0
        # Paths for the QoS engine's classification (it asks paths.relpath_until(inode)).
        self.paths = PathBook(root_fd, self.inodes.root)
        self._learn_paths = qos.needs_paths
        self._meta_limiter = qos.meta_limiter
        # Pids of the latency canary process (qosfs.qos.latency.probe), filled by it.
        self.probe_tids: set[int] = set()
        # Kernel passthrough (asked for at INIT by daemon/assembly.py, or why not), which
        # opens the kernel serves itself, counted by class.
        self.kernel_opens = KernelOpens(self.files)
        # Where the state is written down for a successor after a crash (attach_journal).
        self.journal: SessionJournal | None = None
        # Opens a dead predecessor held that could not be reopened (their fh answers
        # ESTALE until released: qosfs.passthrough.recovery).
        self.lost: dict[int, FileHandle] = {}
        # Renames, unlinks, mkdirs... recorded by request id, so that one the kernel sends
        # again after a crash is answered with what was done, not done twice.
        self.once = ExactlyOnce()

    # ----------------------------------------------------------------- helpers

    def _entry(self, inode: Inode, st: os.stat_result) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = inode.nodeid
        e.generation = 0
        e.entry_timeout = self.options.entry_timeout
        e.attr_timeout = self.options.attr_timeout
        by_path = self.qos.cache_timeouts  # by the classes' paths, if the policy says
        if by_path is not None:
            entry, attr = by_path(self.paths.relpath(inode))
            if entry is not None:
                e.entry_timeout = entry
            if attr is not None:
                e.attr_timeout = attr
        e.st_mode = st.st_mode
        e.st_nlink = st.st_nlink
        e.st_uid = st.st_uid
        e.st_gid = st.st_gid
        e.st_rdev = st.st_rdev
        e.st_size = st.st_size
        e.st_blksize = st.st_blksize
        e.st_blocks = st.st_blocks
        e.st_atime_ns = st.st_atime_ns
        e.st_mtime_ns = st.st_mtime_ns
        e.st_ctime_ns = st.st_ctime_ns
        return e

    async def _meta(self, fn: Callable[..., _T], *args: Any) -> _T:
        result: _T = await self.io.meta(self._meta_limiter, fn, *args)
        return result

    async def _meta_opening(self, fn: Callable[..., _T], *args: Any) -> _T:
        """:meth:`_meta` for a call that opens a descriptor; an :class:`Inode` among *args*
        is passed as its descriptor, taken just before the call.

        If the daemon is out of descriptors, cached inode descriptors are shed and the call
        is tried once more (with descriptors taken afresh, since shedding may have closed
        the first ones): a caller must never see EMFILE because of the daemon's own
        bookkeeping.
        """
        result: _T
        try:
            result = await self.io.meta(self._meta_limiter, fn, *_fds(args))
            return result
        except OSError as exc:
            if exc.errno not in _FD_SHORTAGE or not self.inodes.relieve():
                raise
        result = await self.io.meta(self._meta_limiter, fn, *_fds(args))
        return result

    async def _admit_meta(self, inode: Inode, ctx: pyfuse3.RequestContext) -> None:
        if self.qos.meta_limited:
            await self.qos.admit_meta(self.paths, inode, ctx)

    def _adopt(self, parent: Inode, name: bytes, fd: int, st: os.stat_result) -> Inode:
        """The inode for *parent*'s entry *name* (opened as *fd*), its path noted for the
        QoS engine so that the open which usually follows need not read it from /proc."""
        inode = self.inodes.adopt(fd, st, (parent, name))
        if self._learn_paths:
            self.paths.note_child(parent, name, inode)
        return inode

    async def _adopt_new(self, parent: Inode, name: bytes) -> pyfuse3.EntryAttributes:
        fd, st = await self._meta_opening(self.inodes.resolve, parent, name)
        return self._entry(self._adopt(parent, name, fd, st), st)

    def _give_to_caller(self, parent: Inode, name: bytes, ctx: pyfuse3.RequestContext,
                        mode: int) -> None:
        """Make a freshly created object owned by the caller, as if they had created it.

        The daemon runs as root, so the backing store made it root's. The group follows
        the caller unless the parent directory is setgid (then the backing store already
        gave it the directory's group). chown clears setuid/setgid bits, so they are put
        back when the caller asked for them.
        """
        if not self._as_root:
            return
        parent_mode = os.fstat(parent.fd).st_mode
        gid = -1 if parent_mode & stat.S_ISGID else ctx.gid
        os.chown(name, ctx.uid, gid, dir_fd=parent.fd, follow_symlinks=False)
        if mode & _SUID_SGID and not stat.S_ISLNK(mode):
            os.chmod(name, stat.S_IMODE(mode), dir_fd=parent.fd)

    # ----------------------------------------------------------------- lookups

    async def lookup(self, parent_inode: int, name: bytes,
                     ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        # One per file a loader opens once its entry has expired. Failures are caught
        # here as in read (not by @fuse_handler), and the name is resolved inline unless
        # metadata calls go to threads: the coroutine frames of the decorator, _meta_opening
        # and BackingIO.meta cost ~1 us. With the file handle put off to eviction
        # (inodes.py), a new file's lookup went from 14.0 to 8.9 us CPU (in-process, default
        # policy, tmpfs, medians of alternated runs; bench/opcost.py has the mount's view).
        try:
            parent = self.inodes.get(parent_inode)
            if self.qos.meta_limited:
                await self.qos.admit_meta(self.paths, parent, ctx)
            if name == b".":
                parent.lookups += 1
                self.inodes.counted(parent)
                return self._entry(parent, await self._meta(os.fstat, parent.fd))
            if name == b"..":
                # From the inode table, never the backing store's '..': in place, that of
                # a child of the root is the covered source, and a walk from there lands
                # on this very mount (qosfs.passthrough.inodes). The root's '..' is the
                # root: the source tree is never left.
                up = self.inodes.lookup_parent(parent)
                return self._entry(up, await self._meta(os.fstat, up.fd))
            try:
                if self.io.mode is IoMode.THREADS:
                    fd, st = await self._meta_opening(self.inodes.resolve, parent, name)
                else:
                    fd, st = self._resolve_inline(parent, name)
            except FileNotFoundError:
                # A negative entry the kernel may cache for entry_timeout (st_ino 0).
                e = pyfuse3.EntryAttributes()
                e.st_ino = 0
                e.entry_timeout = self.options.entry_timeout
                return e
            return self._entry(self._adopt(parent, name, fd, st), st)
        except Exception as exc:  # the errno, or EIO for a bug: the mount serves on
            raise self._answer("lookup", exc) from None

    def _resolve_inline(self, parent: Inode, name: bytes) -> tuple[int, os.stat_result]:
        """:meth:`InodeTable.resolve` of *parent*'s *name* on the event loop's thread, as
        :meth:`_meta_opening` does it (once more after shedding cached descriptors if the
        daemon is out of them), without its two coroutine frames."""
        try:
            return self.inodes.resolve(parent.fd, name)
        except OSError as exc:
            if exc.errno not in _FD_SHORTAGE or not self.inodes.relieve():
                raise
        return self.inodes.resolve(parent.fd, name)

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for nodeid, count in inode_list:
            try:
                self.inodes.forget(nodeid, count)
            except Exception as exc:  # forget must not raise: no request to answer
                self.failures.record("forget", exc, "the inode stays known")

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        # Failures are caught here as in read (not by @fuse_handler), and the fstat is
        # called inline unless metadata calls go to threads: the decorator's coroutine
        # frame and _meta's were a fifth of a getattr (5.4 -> 4.4 us CPU, as in lookup).
        try:
            node = self.inodes.get(inode)
            if self.qos.meta_limited:
                await self.qos.admit_meta(self.paths, node, ctx)
            if self.io.mode is IoMode.THREADS:
                st = await self.io.meta(self._meta_limiter, os.fstat, node.fd)
            else:
                st = os.fstat(node.fd)
            return self._entry(node, st)
        except Exception as exc:  # the errno, or EIO for a bug: the mount serves on
            raise self._answer("getattr", exc) from None

    @fuse_handler
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes,
                      fields: pyfuse3.SetattrFields, fh: int | None,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = self.inodes.get(inode)
        await self._admit_meta(node, ctx)
        handle = self.files.get(fh) if fh is not None else None
        await self._meta(self._apply_setattr, node, handle, attr, fields, ctx.uid)
        return self._entry(node, await self._meta(os.fstat, node.fd))

    def _apply_setattr(self, node: Inode, handle: FileHandle | None,
                       attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                       caller_uid: int) -> None:
        if not (fields.update_size or fields.update_mode or fields.update_uid
                or fields.update_gid or fields.update_atime or fields.update_mtime):
            # chown(-1, -1) (and lchown, fchown): the kernel sends a setattr with nothing
            # to change, yet natively the call updates ctime. The same no-op chown on the
            # backing object does exactly what it does there. (update_ctime alone comes
            # only with the writeback cache, which is off.)
            syscalls.chown_fd(node.fd, -1, -1)
            return
        if fields.update_size:
            node.cache_stamp = None  # cached pages past the new size are gone: re-read
            if handle is not None:
                os.ftruncate(handle.fd, attr.st_size)
            else:
                os.truncate(node.proc_path, attr.st_size)
            if caller_uid != 0:
                self._kill_priv(node.fd)
        if fields.update_mode:
            mode = stat.S_IMODE(attr.st_mode)
            if handle is not None:
                os.fchmod(handle.fd, mode)
            else:
                os.chmod(node.proc_path, mode)
        if fields.update_uid or fields.update_gid:
            uid = attr.st_uid if fields.update_uid else -1
            gid = attr.st_gid if fields.update_gid else -1
            syscalls.chown_fd(node.fd, uid, gid)
        if fields.update_atime or fields.update_mtime:
            syscalls.utimens_fd(
                node.fd,
                attr.st_atime_ns if fields.update_atime else None,
                attr.st_mtime_ns if fields.update_mtime else None,
            )

    @staticmethod
    def _kill_priv(fd: int) -> None:
        """Clear setuid (and group-exec setgid) as the kernel does when a non-root user writes.

        The daemon writes as root, which keeps those bits, so it clears them itself.
        """
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            return
        kill = stat.S_ISUID | (stat.S_ISGID if mode & stat.S_IXGRP else 0)
        if mode & kill:
            os.chmod(f"/proc/self/fd/{fd}", stat.S_IMODE(mode) & ~kill)

    @fuse_handler
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        node = self.inodes.get(inode)
        await self._admit_meta(node, ctx)
        return await self._meta(functools.partial(os.readlink, b"", dir_fd=node.fd))

    # ----------------------------------------------------------------- namespace changes

    @fuse_handler
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        parent = self.inodes.get(parent_inode)
        await self._admit_meta(parent, ctx)
        return await self.once.run(
            ctx, "mknod", name, EXISTS,
            functools.partial(self._meta, self._mknod, parent, name, mode, rdev, ctx),
            functools.partial(self._made, parent, name, ctx, mode))

    def _mknod(self, parent: Inode, name: bytes, mode: int, rdev: int,
               ctx: pyfuse3.RequestContext) -> None:
        os.mknod(name, mode, rdev, dir_fd=parent.fd)
        self._give_to_caller(parent, name, ctx, mode)

    @fuse_handler
    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        parent = self.inodes.get(parent_inode)
        await self._admit_meta(parent, ctx)
        return await self.once.run(
            ctx, "mkdir", name, EXISTS,
            functools.partial(self._meta, self._mkdir, parent, name, mode, ctx),
            functools.partial(self._made, parent, name, ctx, mode & ~_SUID_SGID))

    def _mkdir(self, parent: Inode, name: bytes, mode: int, ctx: pyfuse3.RequestContext) -> None:
        os.mkdir(name, stat.S_IMODE(mode), dir_fd=parent.fd)
        # chown keeps a directory's setgid bit, so no mode fix-up is needed here.
        self._give_to_caller(parent, name, ctx, mode & ~_SUID_SGID)

    @fuse_handler
    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        parent = self.inodes.get(parent_inode)
        await self._admit_meta(parent, ctx)
        return await self.once.run(
            ctx, "symlink", name, EXISTS,
            functools.partial(self._meta, self._symlink, parent, name, target, ctx),
            functools.partial(self._made, parent, name, ctx, stat.S_IFLNK))

    def _symlink(self, parent: Inode, name: bytes, target: bytes,
                 ctx: pyfuse3.RequestContext) -> None:
        os.symlink(target, name, dir_fd=parent.fd)
        self._give_to_caller(parent, name, ctx, stat.S_IFLNK)

    @fuse_handler
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = self.inodes.get(inode)
        parent = self.inodes.get(new_parent_inode)
        await self._admit_meta(parent, ctx)
        return await self.once.run(
            ctx, "link", new_name, EXISTS,
            functools.partial(self._meta, syscalls.link_fd, node.fd, parent.fd, new_name),
            functools.partial(self._made, parent, new_name, None, 0))

    async def _made(self, parent: Inode, name: bytes, ctx: pyfuse3.RequestContext | None,
                    mode: int, done: object) -> pyfuse3.EntryAttributes:
        """The entry a mknod, mkdir, symlink or link made (*done*: None if it was made by
        a predecessor that died, recorded or not: then the ownership, which a kill may
        have left root's, is given to the caller again; no *ctx*: a link, whose object
        keeps its own)."""
        if done is None and ctx is not None:
            await self._meta(self._give_to_caller, parent, name, ctx, mode)
        return await self._adopt_new(parent, name)

    @fuse_handler
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        parent = self.inodes.get(parent_inode)
        await self._admit_meta(parent, ctx)
        await self.once.run(ctx, "unlink", name, GONE,
                            functools.partial(self._meta, self._unlink, parent.fd, name),
                            self._unlinked)

    async def _unlinked(self, st: os.stat_result | None) -> None:
        inode = None if st is None else self.inodes.find(st)
        if st is not None and inode is not None and st.st_nlink <= 1:
            # The last name is gone: let go of the blocks now, as a native unlink does.
            self.inodes.release_unlinked(inode)

    @fuse_handler
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        parent = self.inodes.get(parent_inode)
        await self._admit_meta(parent, ctx)
        await self.once.run(ctx, "rmdir", name, GONE,
                            functools.partial(self._meta, self._rmdir, parent.fd, name),
                            _nothing)

    def _looked_up(self, parent_fd: int, name: bytes) -> os.stat_result:
        """The object under *name*, which must be one the kernel looked up (ESTALE if not).

        The kernel checked permissions (a sticky directory, say) on the object it looked
        up under this name. If the name holds something else now (changed underneath),
        acting on it as root would skip that check; ESTALE makes the VFS look the name up
        again and check what is really there.
        """
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        if self.inodes.find(st) is None:
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE))
        return st

    def _unlink(self, parent_fd: int, name: bytes) -> os.stat_result:
        st = self._looked_up(parent_fd, name)
        os.unlink(name, dir_fd=parent_fd)
        return st

    def _rmdir(self, parent_fd: int, name: bytes) -> None:
        self._looked_up(parent_fd, name)
        os.rmdir(name, dir_fd=parent_fd)

    def _rename(self, old_fd: int, name_old: bytes, new_fd: int, name_new: bytes,
                flags: int) -> None:
        self._looked_up(old_fd, name_old)
        if flags & syscalls.RENAME_EXCHANGE:
            self._looked_up(new_fd, name_new)
        syscalls.renameat2(old_fd, name_old, new_fd, name_new, flags)

    @fuse_handler
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: pyfuse3.RequestContext) -> None:
        old = self.inodes.get(parent_inode_old)
        new = self.inodes.get(parent_inode_new)
        await self._admit_meta(old, ctx)
        try:
            await self.once.run(
                ctx, "rename", name_old, GONE,
                functools.partial(self._meta, self._rename, old.fd, name_old, new.fd,
                                  name_new, flags),
                functools.partial(self._renamed, old, name_old, new, name_new, flags, ctx))
        finally:
            # Paths below the renamed name changed: every memoized path (and the engine's
            # classifications from them) is stale. After the call, so that one read while
            # the rename ran is dropped too.
            self.paths.renamed()

    async def _renamed(self, old: Inode, name_old: bytes, new: Inode, name_new: bytes,
                       flags: int, ctx: pyfuse3.RequestContext, done: object) -> None:
        """The tables after a rename (done here, or by a predecessor that died)."""
        self.inodes.renamed(new, name_new)
        if flags & syscalls.RENAME_EXCHANGE:
            self.inodes.renamed(old, name_old)
        # Before the report classifies the new name; rename's finally does it again, for
        # a call that failed and for a path memoized while this one ran.
        self.paths.renamed()
        await self._report_rename(new, name_new, ctx)

    async def _report_rename(self, parent: Inode, name: bytes,
                             ctx: pyfuse3.RequestContext) -> None:
        """Tell the QoS layer which inode just got *name* and which opens it has: an
        atomic save's final name may re-charge what it wrote under its temporary one
        (:func:`qosfs.qos.charge.charge_renamed`)."""
        try:
            st = await self._meta(functools.partial(os.stat, dir_fd=parent.fd,
                                                    follow_symlinks=False), name)
        except OSError:
            return  # gone already (renamed again, unlinked): nothing to charge
        inode = self.inodes.find(st)
        if inode is not None:
            charge_renamed(self.qos, self.paths, inode, ctx, self._charges_of(inode))

    def _charges_of(self, inode: Inode) -> list[OpenCharge]:
        """The charges of *inode*'s open files."""
        if not inode.opens:
            return []
        return [handle.charge for handle in self.files.values() if handle.inode is inode]

    # ----------------------------------------------------------------- files

    @staticmethod
    def _open_backing(flags: int, opener: Callable[..., int], *args: Any) -> tuple[int, bool]:
        """``opener(*args, flags)`` with the caller's flags; fall back to buffered I/O if
        O_DIRECT is refused."""
        flags |= os.O_CLOEXEC
        try:
            return opener(*args, flags), bool(flags & os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not flags & os.O_DIRECT:
                raise
        # A create's first attempt made the file before O_DIRECT was refused: reopen it.
        return opener(*args, flags & ~(os.O_DIRECT | os.O_EXCL)), False

    def _file_info(self, fd: int, direct: bool, flags: int, node: Inode,
                   ctx: pyfuse3.RequestContext, owner: int, writing: bool) -> pyfuse3.FileInfo:
        """The handle of a new open (its charge classified as a *writing* open or not)
        and what the kernel is told of its page cache."""
        accmode = flags & _ACCMODE
        kill_priv = False
        if accmode != os.O_RDONLY and ctx.uid != 0:
            kill_priv = bool(os.fstat(node.fd).st_mode & _SUID_SGID)
        charge = OpenCharge(self.qos, self.paths, node, ctx, writing)
        node.opens += 1
        fsuid = ctx.uid if self._write_as_caller else 0
        fh = self.next_fh
        self.next_fh = fh + 1
        handle = self.files[fh] = FileHandle(fd, direct, charge, node, kill_priv, fsuid,
                                             owner, dio_mask_of(fd) if direct else 0, fh=fh)
        kernel_opens = self.kernel_opens
        passed = None
        if kernel_opens.on:  # one attribute per open while passthrough is not asked for
            passed = kernel_opens.open(handle, accmode == os.O_RDONLY and not writing)
        if self.journal is not None:
            self._write_down_file(handle, flags)
        if passed is not None:
            return passed
        cache = self.options.cache
        bypass = charge.flow.direct_io_for(accmode)  # per class and access mode
        if bypass or cache == "never":
            return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)
        if cache == "always":
            return pyfuse3.FileInfo(fh=fh, direct_io=False, keep_cache=True)
        st = os.fstat(fd)
        if self._unchanged(node, st):
            return pyfuse3.FileInfo(fh=fh, direct_io=False, keep_cache=True)
        # The kernel drops its pages and will READ: a small file starts coming from the
        # disk now, so that its READ takes no thread hop (qosfs.passthrough.backing_io).
        if (accmode != os.O_WRONLY and not direct and self.io.mode is IoMode.NOWAIT
                and not charge.flow.reads_capped()):  # the flow's walks its levels: last
            self.io.prefetch(fd, st.st_size)
        return pyfuse3.FileInfo(fh=fh, direct_io=False, keep_cache=False)

    def _write_down_file(self, handle: FileHandle, flags: int) -> None:
        """Journal a new open (qosfs.passthrough.journal): what reopens it after a crash
        (its inode and flags less those that made or emptied the file) and its charge, as
        a tuple, read back in this order by qosfs.passthrough.recovery. A few us per open
        (a dict and json cost 5-25 us more), none per read or write."""
        journal = self.journal
        assert journal is not None
        node = handle.inode
        reopen = (flags & ~(_OPEN_DROP | os.O_TRUNC)) | os.O_CLOEXEC
        if not handle.direct:
            reopen &= ~os.O_DIRECT
        kernel = handle.kernel
        handle.jslot = journal.put_file(handle.fh, self.inodes.slot_of(node), reopen, (
            self.qos.flow_key(handle.charge.flow), handle.charge.state_values(),
            handle.owner, handle.fsuid, handle.kill_priv, kernel,
            self.kernel_opens.kernel.backing_id(node.nodeid)
            if kernel == PASSED_THROUGH else None))
        journal.next_fh(self.next_fh)

    def attach_journal(self, journal: SessionJournal) -> None:
        """Write the filesystem's state down in *journal* and keep it written: the inode
        table, every open file and directory (a new mount's, a successor's, a recovered
        one's: each process writes a journal of its own)."""
        self.journal = journal
        self.once.attach(journal.intents)
        self.inodes.attach_journal(journal, [h.inode for h in self.files.values()]
                                   + [h.inode for h in self.lost.values()]
                                   + [d.inode for d in self.dirs.values()])
        # Their flags are their descriptors' now; a lost one (no descriptor since a crash)
        # is written down too, so its release after another crash is still known.
        for handle in [*self.files.values(), *self.lost.values()]:
            self._write_down_file(handle, fcntl.fcntl(handle.fd, fcntl.F_GETFL)
                                  if handle.fd >= 0 else os.O_RDONLY)
        for dir_handle in self.dirs.values():
            dir_handle.jslot = journal.put_dir(dir_handle.fh, self.inodes.slot_of(
                dir_handle.inode), dir_handle.owner)
        journal.next_fh(self.next_fh)

    @staticmethod
    def _unchanged(node: Inode, st: os.stat_result) -> bool:
        """Whether the kernel's cached pages of *node* still hold the backing file (*st*,
        its fstat now): same size, mtime and ctime as at the last open, and no write
        through the mount since (a write clears the stamp). Records the stamp for the
        next open either way.

        The stamp is taken at open, as NFS's close-to-open does: a change made underneath
        is seen by the next open, not by reads of an open that is already open. Kernels
        from 6.13 give a change right after a stat a fine-grained ctime (multigrain
        timestamps), so a same-size rewrite within one clock tick is seen too.
        """
        stamp = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        kept = stamp == node.cache_stamp
        node.cache_stamp = stamp
        return kept

    @fuse_handler
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        node = self.inodes.get(inode)
        owner = self.open_quota.claim(ctx.uid)
        try:
            fd, direct = await self._meta_opening(
                self._open_backing, flags & ~_OPEN_DROP, _reopen, node
            )
        except BaseException:
            self.open_quota.release(owner)
            raise
        writing = (flags & _ACCMODE) != os.O_RDONLY
        return self._file_info(fd, direct, flags, node, ctx, owner, writing)

    @fuse_handler
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext,
                     ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        parent = self.inodes.get(parent_inode)
        await self._admit_meta(parent, ctx)
        owner = self.open_quota.claim(ctx.uid)
        try:
            return await self._create(parent, name, mode, flags, ctx, owner)
        except BaseException:
            self.open_quota.release(owner)
            raise

    async def _create(self, parent: Inode, name: bytes, mode: int, flags: int,
                      ctx: pyfuse3.RequestContext,
                      owner: int) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        if flags & os.O_EXCL:  # done twice it fails: recorded (qosfs.passthrough.intents)
            return await self.once.run(
                ctx, "create", name, EXISTS,
                functools.partial(self._create_new, parent, name, mode, flags),
                functools.partial(self._created, parent, name, mode, flags, ctx, owner))
        made = await self._create_new(parent, name, mode, flags)
        return await self._created(parent, name, mode, flags, ctx, owner, made)

    async def _create_new(self, parent: Inode, name: bytes, mode: int,
                          flags: int) -> tuple[int, bool]:
        # The kernel sends CREATE when it believes the name does not exist (a negative
        # entry, cached for entry_timeout). If something appeared underneath since (another
        # node, another path), a plain O_CREAT would open it as root -- another user's file,
        # or the target of a symlink outside the tree -- and hand it to the caller. O_EXCL
        # creates only what is new and never follows a symlink.
        try:
            made: tuple[int, bool] = await self._meta_opening(
                self._open_backing,
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
                       ctx: pyfuse3.RequestContext, owner: int, made: tuple[int, bool] | None,
                       ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        """The reply to a create that made *name* (*made*: its descriptor and whether it
        is direct), or whose file a predecessor that died made (None): that file is
        opened as it is, never created or emptied again, nor through a symlink."""
        if made is None:
            made = await self._meta_opening(
                self._open_backing,
                (flags & ~(os.O_NOCTTY | _OPEN_DROP | os.O_TRUNC)) | os.O_NOFOLLOW,
                _create_in, parent, name, 0)
        fd, direct = made
        try:
            await self._meta(self._give_to_caller, parent, name, ctx, mode)
            opath = await self._meta_opening(os.open, f"/proc/self/fd/{fd}",
                                             os.O_PATH | os.O_CLOEXEC)
            st = os.fstat(opath)
        except BaseException:
            os.close(fd)
            raise
        node = self._adopt(parent, name, opath, st)
        # Classified as a write whatever the access mode: it made the file.
        return (self._file_info(fd, direct, flags, node, ctx, owner, True),
                self._entry(node, st))

    async def read(self, fh: int, off: int, size: int) -> Any:
        # Hot path: no decorator frame, no logging, everything resolved at open. The only
        # accounting is one perf_counter_ns() pair around the backing syscall and one
        # call bumping plain integers (see qosfs.qos.accounting for what it costs). The
        # try blocks cost nothing until something is raised (Python 3.11).
        try:
            handle = self.files[fh]
            flow = handle.charge.flow  # may change (a streaming move): read per request
            # Admission may refuse (EAGAIN: too many parked) or give up (EINTR: killed).
            waited = await flow.admit_read(size) if flow.limited else 0.0
            mask = handle.dio_mask  # 0 unless O_DIRECT; allocates nothing when aligned
            if mask and (off & mask or size & mask):  # O_DIRECT refuses it: _buffered
                fd, direct = await self._buffered(handle), False
            else:
                fd, direct = handle.fd, handle.direct
            start = _now_ns()
            data = await self.io.read(fd, off, size, direct, flow.threads)
            took = _now_ns() - start
        except Exception as exc:  # the errno, or EIO for a bug: the mount serves on
            raise self._answer("read", exc) from None
        try:
            n = len(data)
            if n < size and flow.limited:
                flow.refund_read(size - n)  # EOF: readahead of a small file is not charged
            flow.stats.record_read(n, waited, took)
        except Exception as exc:  # the data was read: a bookkeeping bug must not lose it
            self.failures.record("read", exc, "answered with the data read")
        return data

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        try:
            handle = self.files[fh]
            charge = handle.charge
            flow = charge.flow
            waited = await flow.admit_write(len(buf)) if flow.limited else 0.0
            if handle.kill_priv:
                handle.kill_priv = False
                self._kill_priv(handle.fd)
            mask = handle.dio_mask  # 0 unless O_DIRECT; allocates nothing when aligned
            if mask and (off & mask or len(buf) & mask):  # O_DIRECT refuses it: _buffered
                fd, direct = await self._buffered(handle), False
            else:
                fd, direct = handle.fd, handle.direct
            start = _now_ns()
            n = await self.io.write(fd, off, buf, direct, flow.threads, flow.throttled_writes,
                                    handle.fsuid)
            took = _now_ns() - start
        except Exception as exc:  # the errno, or EIO for a bug: the mount serves on
            raise self._answer("write", exc) from None
        handle.inode.cache_stamp = None  # the next open drops cached pages (keep_cache)
        try:
            flow.stats.record_write(n, waited, took)
            # The charge's own filter (see OpenCharge.wrote), inlined: most writes need
            # nothing more, and a call per write would cost more than these two tests.
            if charge.watching or CUT_MIN < n < MAX_WRITE:
                charge.wrote(off, n)
        except Exception as exc:  # the data is written: say so, whatever the bookkeeping
            self.failures.record("write", exc, "answered with the bytes written")
        return n

    async def _buffered(self, handle: FileHandle) -> int:
        """A descriptor without O_DIRECT on the file of an O_DIRECT open, for the requests
        whose offset or length O_DIRECT refuses (EINVAL): opened at the first one by
        reopening the open's descriptor with its flags less O_DIRECT, closed at release.
        At most one per open, so nothing new can pile up; an aligned request never comes
        here (one integer test in read and write).

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
        fd: int = await self._meta_opening(_reopen, handle.fd, flags)
        if handle.buffered >= 0:  # another request opened one while this one waited
            os.close(fd)
            return handle.buffered
        handle.buffered = fd
        return fd

    def _answer(self, where: str, exc: Exception) -> FUSEError:
        """What the kernel is told of a request of handler *where* that raised *exc*: a
        ``FUSEError`` as it is, a backing-store ``OSError`` as its own errno, anything
        else (a bug here or in the QoS layer) as EIO, counted and logged once per kind.
        The one mapping of every handler (``fuse_handler`` and the handlers that catch
        in their body); off the hot path: reached only once something was raised."""
        if isinstance(exc, FUSEError):
            return exc
        if isinstance(exc, KeyError) and exc.args and exc.args[0] in self.lost:
            # An open a dead predecessor held that could not be reopened
            # (qosfs.passthrough.recovery): its handle is gone, as NFS would say.
            return FUSEError(errno.ESTALE)
        if isinstance(exc, OSError):
            return FUSEError(exc.errno or errno.EIO)
        self.failures.record(where, exc, "answered EIO")
        return FUSEError(errno.EIO)

    @fuse_handler
    async def flush(self, fh: int) -> None:
        # Writes are already on the backing store. On a network filesystem, closing a
        # duplicate descriptor makes the client flush and report deferred write errors
        # (NFS reports them at close), so the caller's close() sees them.
        if self.io.mode.value == "threads":
            handle = self.files[fh]
            await self.io.blocking(handle.charge.flow.threads, _close_dup, handle.fd)
            return
        # On local filesystems a flush has nothing to do. ENOSYS makes the kernel stop
        # sending FLUSH for the rest of the mount (close() still returns 0), which saves a
        # round trip per close: create+close went from 5 to 4 requests (bench/overhead).
        raise FUSEError(errno.ENOSYS)

    @fuse_handler
    async def release(self, fh: int) -> None:
        handle = self.files.pop(fh, None)
        if handle is None:
            handle = self.lost.pop(fh)  # not reopened after a crash: only bookkeeping
        if handle.jslot >= 0 and self.journal is not None:
            self.journal.free(handle.jslot)
        try:
            self.open_quota.release(handle.owner)
            handle.charge.release()
        finally:  # whatever the bookkeeping did, a bug must not leak a descriptor per open
            handle.inode.opens -= 1
            self.kernel_opens.release(handle)  # a backing id must not leak either
            if handle.fd < 0:
                pass  # lost in a crash (qosfs.passthrough.recovery): nothing to close
            elif self.io.mode is IoMode.THREADS:
                # A network client flushes and reports deferred write errors at close.
                await self.io.blocking(handle.charge.flow.threads, _close_file, handle.fd,
                                       handle.buffered)
            else:
                # Local filesystems do not wait for the disk at close, and the inode table's
                # O_PATH descriptor keeps the inode, so this is never the last reference
                # that frees an unlinked file's blocks. Inline: the thread hop was 28% of
                # the daemon's CPU per file of a warm small-file loader on ext4
                # (bench/opcost.py: 4,696 -> 14,230 files/s, passthrough_hp 12,994).
                _close_file(handle.fd, handle.buffered)
        if handle.inode.opens == 0 and handle.inode.lookups > 0:
            self.inodes.release_unlinked(handle.inode)

    @fuse_handler
    async def fsync(self, fh: int, datasync: bool) -> None:
        handle = self.files[fh]
        await self.io.blocking(handle.charge.flow.threads,
                               os.fdatasync if datasync else os.fsync,
                               handle.fd)

    # ----------------------------------------------------------------- directories

    @fuse_handler
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        node = self.inodes.get(inode)
        await self._admit_meta(node, ctx)
        owner = self.open_quota.claim(ctx.uid)
        try:
            fd = await self._meta_opening(_reopen, node,
                                          os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except BaseException:
            self.open_quota.release(owner)
            raise
        fh = self.next_fh
        self.next_fh = fh + 1
        handle = self.dirs[fh] = DirHandle(fd, node, owner=owner, fh=fh)
        journal = self.journal
        if journal is not None:
            handle.jslot = journal.put_dir(fh, self.inodes.slot_of(node), owner)
            journal.next_fh(self.next_fh)
        return fh

    @fuse_handler
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        handle = self.dirs[fh]
        if start_id == 0 or not handle.listed:
            # A snapshot per pass keeps offsets stable while entries come and go.
            handle.names = await self._meta(_list_names, handle.fd)
            handle.listed = True
        names = handle.names
        resolve = self.inodes.resolve
        for index in range(start_id, len(names)):
            name = names[index]
            if index < 2:  # "." and "..": listed like the backing store, never counted
                if not pyfuse3.readdir_reply(token, name, self._dot_entry(handle, name),
                                             index + 1):
                    break
                continue
            try:
                fd, st = await self._meta_opening(resolve, handle.fd, name)
            except OSError as exc:
                if exc.errno in _FD_SHORTAGE:
                    raise  # not an entry that went away: the listing must not skip it
                continue  # removed since the snapshot
            # A batch may hold a thousand entries (the kernel's readdir buffer is up to
            # max_pages): ~15 ms of work that would stall every other class's requests,
            # so let them run every few entries, and trim the descriptor cache as we go.
            # Both are safe: this loop holds no inode descriptor across entries.
            if index & _READDIR_YIELD_MASK == 0:
                await trio.lowlevel.checkpoint()
            self.inodes.trim()
            inode = self.inodes.adopt(fd, st, (handle.inode, name))
            if not pyfuse3.readdir_reply(token, name, self._entry(inode, st), index + 1):
                self.inodes.forget(inode.nodeid, 1)  # not sent: the kernel holds no reference
                break

    def _dot_entry(self, handle: DirHandle, name: bytes) -> pyfuse3.EntryAttributes:
        """The "." or ".." entry of a listing. The kernel takes only its inode number and
        type (it never links dot entries of a READDIRPLUS), so ".." carries the parent's
        node id from the inode table and this directory's own attributes: no stat of
        the backing ".." (which, mounted in place, can be this very mount: see
        qosfs.passthrough.inodes)."""
        node = handle.inode
        entry = self._entry(node, os.fstat(node.fd))
        if name == b"..":
            entry.st_ino = self.inodes.parent_nodeid(node)
        return entry

    @fuse_handler
    async def releasedir(self, fh: int) -> None:
        handle = self.dirs.pop(fh)
        if handle.jslot >= 0 and self.journal is not None:
            self.journal.free(handle.jslot)
        self.open_quota.release(handle.owner)
        os.close(handle.fd)

    @fuse_handler
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        handle = self.dirs[fh]
        await self.io.blocking(self._meta_limiter, os.fsync, handle.fd)

    # ----------------------------------------------------------------- filesystem-wide

    @fuse_handler
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        sv = await self._meta(os.fstatvfs, self.inodes.root.fd)
        out = pyfuse3.StatvfsData()
        out.f_bsize = sv.f_bsize
        out.f_frsize = sv.f_frsize
        out.f_blocks = sv.f_blocks
        out.f_bfree = sv.f_bfree
        out.f_bavail = sv.f_bavail
        out.f_files = sv.f_files
        out.f_ffree = sv.f_ffree
        out.f_favail = sv.f_favail
        out.f_namemax = sv.f_namemax
        return out

    # ----------------------------------------------------------------- xattrs

    @fuse_handler
    async def setxattr(self, inode: int, name: bytes, value: bytes,
                       ctx: pyfuse3.RequestContext) -> None:
        node = self.inodes.get(inode)
        await self._admit_meta(node, ctx)
        await self._meta(os.setxattr, node.proc_path, name, value)

    @fuse_handler
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if name == PROBE_XATTR and ctx.pid in self.probe_tids:
            raise FUSEError(errno.ENODATA)  # our own canary: only its round trip matters
        node = self.inodes.get(inode)
        # The kernel itself asks for security.capability before every write (to know
        # whether the write must drop file capabilities). That is not the caller's
        # metadata operation, so it is not charged: otherwise a meta_iops cap would
        # throttle a class's writes.
        if name != _CAPABILITY_XATTR:
            await self._admit_meta(node, ctx)
        return await self._meta(os.getxattr, node.proc_path, name)

    @fuse_handler
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        node = self.inodes.get(inode)
        await self._admit_meta(node, ctx)
        names = await self._meta(os.listxattr, node.proc_path)
        return [os.fsencode(n) for n in names]

    @fuse_handler
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        node = self.inodes.get(inode)
        await self._admit_meta(node, ctx)
        await self._meta(os.removexattr, node.proc_path, name)

    # ----------------------------------------------------------------- observation

    def resources(self) -> dict[str, Any]:
        """What the filesystem holds now, for ``ctl status`` (inodes, descriptors, handles,
        the open quota, failures). The engine's figures come from the engine itself
        (:meth:`qosfs.qos.interface.QosControl.counters`)."""
        inodes = self.inodes
        return {
            "inodes": len(inodes), "inode_fds": inodes.fds_held,
            "inode_fd_budget": inodes.cache.capacity, "inode_fd_reopens": inodes.reopens,
            "file_handles": len(self.files), "dir_handles": len(self.dirs),
            "open_per_uid_limit": self.open_quota.per_uid,
            "open_refused": self.open_quota.refused,
            "killed_callers": interrupts.killed_callers,
            "backing_thread_hops": self.io.thread_hops,
            "backing_prefetches": self.io.prefetches,
            "internal_errors": self.failures.counts(),
            "passthrough": self.kernel_opens.status(),
        }

    # ----------------------------------------------------------------- shutdown

    def close_all(self) -> None:
        """Close every backing descriptor once the kernel connection is gone."""
        held = [h.buffered for h in self.files.values() if h.buffered >= 0]
        fds = [h.fd for h in self.files.values()] + [h.fd for h in self.dirs.values()]
        for fd in fds + held:
            try:
                os.close(fd)
            except OSError:
                pass
        self.files.clear()
        self.dirs.clear()
        self.inodes.close_all()
        self.io.fd_guard.close_all()


async def _nothing(done: object) -> None:
    """The answer of an operation whose reply carries nothing (unlink, rmdir, rename)."""


def _fds(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """*args* with each :class:`Inode` replaced by its descriptor, taken now."""
    return tuple([arg.fd if arg.__class__ is Inode else arg for arg in args])


def _reopen(fd: int, flags: int) -> int:
    """Open the object behind an O_PATH descriptor for I/O (the /proc magic link does not
    re-resolve a path)."""
    return os.open(f"/proc/self/fd/{fd}", flags)


def _create_in(dir_fd: int, name: bytes, mode: int, flags: int) -> int:
    return os.open(name, flags, mode, dir_fd=dir_fd)


def dio_mask_of(fd: int) -> int:
    """The bits an offset or length must not have for O_DIRECT on *fd*. Where the kernel
    does not report its alignment, a page: the largest logical block size of common
    devices, and what the page cache's own requests are multiples of."""
    return (syscalls.dio_offset_align(fd) or mmap.PAGESIZE) - 1


def _close_file(fd: int, buffered: int) -> None:
    """Close an open's descriptor and its buffered twin (-1: none), in one thread hop."""
    try:
        os.close(fd)
    finally:
        if buffered >= 0:
            os.close(buffered)


def _close_dup(fd: int) -> None:
    os.close(os.dup(fd))


def _list_names(fd: int) -> list[bytes]:
    return [b".", b".."] + [os.fsencode(name) for name in os.listdir(fd)]
