"""The FUSE operations: a faithful pass-through of a backing directory tree.

This module only answers FUSE requests, with syscalls on the backing store relative to
descriptors (:mod:`qosfs.passthrough.inodes`); :func:`qosfs.daemon.fs_assembly.
build_filesystem` hands it its parts. What a request is charged to and when it may
proceed is asked of the QoS layer: at open the handle gets an
:class:`~qosfs.qos.charge.OpenCharge` from the engine (``self.qos``); every read and write
is admitted by its flow, and what the filesystem did (a read, a write, a rename, a
release) is reported to it. No QoS decision is made here.

Choices made here, each for a reason:

* Writes are synchronous pass-through (no writeback cache): a write is acknowledged only
  once the backing store has it, so a daemon crash loses nothing that was acknowledged,
  and every byte is accounted when it really moves.
* The page cache is used for reads as :mod:`qosfs.passthrough.page_cache` says at open
  (``direct_io`` per class, ``keep_cache`` by NFS's close-to-open consistency).
* Entry and attribute timeouts default to 1 s, the same order as NFS's ``actimeo``:
  repeated stats do not cost a round trip, and changes made under the mount by other
  nodes become visible within a second.
* An O_DIRECT open stays O_DIRECT underneath, but a request O_DIRECT would refuse goes
  to a buffered descriptor of the same file (:mod:`qosfs.passthrough.odirect`).
* A read-only open of a class whose reads nothing caps now (``passthrough``, by default on)
  is passed through to the kernel (:mod:`qosfs.passthrough.kernel_opens`, over
  :mod:`qosfs.passthrough.kernel`): its reads never reach the daemon. The kernel wants
  every open of an inode passed through to carry its backing id, so while one is, every
  other open of that inode (a writer, a capped reader) joins the id with direct_io: its
  reads and writes still come here, admitted and capped as any. Where the kernel or
  pyfuse3 cannot say both, it joins uncapped, counted and logged once per class
  (refusing it would break a writer of a file someone reads).
* Only ``FUSEError`` may leave a handler (anything else ends pyfuse3's main loop, and
  every caller then gets ENOTCONN): a backing-store ``OSError`` becomes its own errno;
  anything unexpected (a bug here or in the QoS layer) is answered with EIO, counted and
  logged once per kind (:mod:`qosfs.core.failures`). ``read`` and ``write`` catch it in
  the body instead of through the decorator: a ``try`` costs nothing until something
  is raised, a decorator's extra frame costs every request.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pyfuse3
import trio
from pyfuse3 import FUSEError

from qosfs.core.failures import Failures
from qosfs.passthrough import odirect
from qosfs.passthrough.attributes import apply_setattr
from qosfs.passthrough.backing_io import BackingIO, IoMode
from qosfs.passthrough.entries import Entries
from qosfs.passthrough.forgets import Forgets
from qosfs.passthrough.handle_table import OPEN_DROP, HandleTable
from qosfs.passthrough.handles import NO_DESCRIPTOR, DirHandle
from qosfs.passthrough.inode import Inode
from qosfs.passthrough.inodes import InodeTable
from qosfs.passthrough.kernel_opens import KernelOpens
from qosfs.passthrough.meta_calls import FD_SHORTAGE, MetaCalls
from qosfs.passthrough.namespace import Namespace
from qosfs.passthrough.ownership import Ownership, kill_priv
from qosfs.passthrough.page_cache import file_info
from qosfs.passthrough.paths import PathBook
from qosfs.qos.charge import OpenCharge, open_charge
from qosfs.qos.interface import XATTR_CANARY, XATTR_CHARGED, FilesystemQos

log = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Awaitable[Any]])

_ACCMODE = os.O_RDONLY | os.O_WRONLY | os.O_RDWR
#: Open flags that make an open need a descriptor of its own even when its inode's backing
#: id could serve it: any write access, a truncation, O_DIRECT (its own alignment).
_NEEDS_DESCRIPTOR = _ACCMODE | os.O_TRUNC | os.O_DIRECT
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

    def __init__(self, inodes: InodeTable, handles: HandleTable, paths: PathBook,
                 io: BackingIO, qos: FilesystemQos, options: FsOptions, kernel_opens: KernelOpens,
                 calls: MetaCalls, entries: Entries, names: Namespace,
                 owners: Ownership, failures: Failures) -> None:
        """Made by :func:`qosfs.daemon.fs_assembly.build_filesystem`, which builds the
        parts: *inodes* (held by O_PATH descriptors), *handles* (open files and
        directories by fh), *paths* (for the engine's classification by path), *io* (the
        data path's syscalls), *qos*, *kernel_opens* (which opens the kernel serves
        itself), *calls* (metadata syscalls), *entries* (what the kernel is told of an inode),
        *names* (name changes), *owners* (ownership emulation) and *failures*
        (unexpected exceptions answered EIO instead of ending the mount, counted)."""
        super().__init__()
        self.failures = failures
        self.inodes = inodes
        self.handles = handles
        # The hot path's tables (the handle table's own dicts): one dict lookup by an int.
        self.files = handles.files
        self.dirs = handles.dirs
        self.io = io
        self.qos = qos
        self.options = options
        self.paths = paths
        self.kernel_opens = kernel_opens
        self._owners = owners
        self._meta_limiter = qos.meta_limiter
        # Bound methods looked up once: the handlers call them per request.
        self._meta = calls.run
        self._meta_opening = calls.opening
        self._resolve_inline = calls.resolve_inline
        self._reopen_inline = calls.reopen_inline
        self._entries = entries
        self._entry = entries.of
        self._adopt = entries.adopt
        self._names = names
        self.forgets = Forgets(self._forget_one)  # its service: the daemon's

    # ----------------------------------------------------------------- helpers

    async def _admit_meta(self, inode: Inode, ctx: pyfuse3.RequestContext) -> None:
        if self.qos.meta_limited:
            await self.qos.admit_meta(self.paths, inode, ctx)

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
                return self._entries.negative()  # the kernel may cache it (st_ino 0)
            return self._entry(self._adopt(parent, name, fd, st), st, named=True)
        except Exception as exc:  # the errno, or EIO for a bug: the mount serves on
            raise self._answer("lookup", exc) from None

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        self.forgets.forget(inode_list)  # thousands at once: a batch now, the rest later

    def _forget_one(self, nodeid: int, count: int) -> None:
        try:
            self.kernel_opens.forget(nodeid)  # an idle backing id goes with the inode
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
                st = os.fstat(node.stat_fd)
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
        if handle is not None and handle.fd == NO_DESCRIPTOR:
            self.handles.descriptor(handle)  # opened here: apply_setattr may run in a thread
        await self._meta(apply_setattr, node, handle, attr, fields, ctx.uid)
        return self._entry(node, await self._meta(os.fstat, node.fd))

    @fuse_handler
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        node = self.inodes.get(inode)
        await self._admit_meta(node, ctx)
        return await self._meta(functools.partial(os.readlink, b"", dir_fd=node.fd))

    # ----------------------------------------------------------------- namespace changes
    # Each done exactly once across a crash (qosfs.passthrough.namespace).

    @fuse_handler
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        parent = self.inodes.get(parent_inode)
        await self._admit_meta(parent, ctx)
        return await self._names.mknod(parent, name, mode, rdev, ctx)

    @fuse_handler
    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        parent = self.inodes.get(parent_inode)
        await self._admit_meta(parent, ctx)
        return await self._names.mkdir(parent, name, mode, ctx)

    @fuse_handler
    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        parent = self.inodes.get(parent_inode)
        await self._admit_meta(parent, ctx)
        return await self._names.symlink(parent, name, target, ctx)

    @fuse_handler
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = self.inodes.get(inode)
        parent = self.inodes.get(new_parent_inode)
        await self._admit_meta(parent, ctx)
        return await self._names.link(node, parent, new_name, ctx)

    @fuse_handler
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        parent = self.inodes.get(parent_inode)
        await self._admit_meta(parent, ctx)
        await self._names.unlink(parent, name, ctx)

    @fuse_handler
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        parent = self.inodes.get(parent_inode)
        await self._admit_meta(parent, ctx)
        await self._names.rmdir(parent, name, ctx)

    @fuse_handler
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: pyfuse3.RequestContext) -> None:
        old = self.inodes.get(parent_inode_old)
        new = self.inodes.get(parent_inode_new)
        await self._admit_meta(old, ctx)
        await self._names.rename(old, name_old, new, name_new, flags, ctx)

    # ----------------------------------------------------------------- files

    def _opened(self, fd: int, direct: bool, flags: int, node: Inode,
                ctx: pyfuse3.RequestContext, owner: int, created: bool,
                charge: OpenCharge | None = None) -> pyfuse3.FileInfo:
        """The handle of a new open (*created*: by a create) and the reply to it; its
        *charge* if `open` made it already. *fd* NO_DESCRIPTOR: an open made without one,
        that takes its inode's backing id (one is opened if it is not passed through)."""
        accmode = flags & _ACCMODE
        kill, fsuid = self._owners.of_open(node, accmode, ctx)
        if charge is None:
            charge = open_charge(self.qos, self.paths, node, ctx, accmode, created)
        handle = self.handles.add_file(fd, direct, charge, node, kill, fsuid, owner)
        if fd == NO_DESCRIPTOR:
            handle.open_flags = flags & ~OPEN_DROP
        kernel_opens = self.kernel_opens
        passed = None
        if kernel_opens.on:  # one attribute per open while passthrough is not asked for
            passed = kernel_opens.open(handle, accmode == os.O_RDONLY and not created)
        if passed is None and fd == NO_DESCRIPTOR:  # not passed through after all
            fd = self.handles.descriptor(handle)
        self.handles.write_down(handle, flags)
        if passed is not None:
            return passed
        return file_info(handle.fh, fd, node, accmode, direct, charge.flow,
                         self.options.cache, self.io)

    @fuse_handler
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        node = self.inodes.get(inode)
        owner = self.handles.claim(ctx.uid)
        charge = None
        fd, direct = NO_DESCRIPTOR, False
        try:
            if not flags & _NEEDS_DESCRIPTOR and self._shares_backing_id(node):
                # Read-only, and the kernel holds a backing id for this file (live, or
                # kept idle since its last release): if the open passes its reads through,
                # it takes that id and needs no descriptor of ours. Saves an open and a
                # close per warm open (76 -> 59 us per file, tmpfs; docs/performance.md).
                charge = open_charge(self.qos, self.paths, node, ctx, os.O_RDONLY, False)
            if charge is None or not charge.flow.passes_reads_through():
                handle = self.inodes.handle_to_open(node)
                if handle is None and self.io.mode is not IoMode.THREADS:
                    fd, direct = self._reopen_inline(node, flags & ~OPEN_DROP)  # as lookup
                elif handle is None:
                    fd, direct = await self._meta_opening(
                        odirect.open_backing, flags & ~OPEN_DROP, odirect.reopen, node)
                else:  # its descriptor was evicted: straight from its handle
                    try:
                        fd, direct = await self._meta_opening(
                            odirect.open_backing, flags & ~OPEN_DROP,
                            self.inodes.open_by_handle, handle)
                    except OSError as exc:
                        self.inodes.check_gone(node, exc)
                        raise
        except BaseException:
            self.handles.unclaim(owner)
            if charge is not None:
                charge.release()
            raise
        return self._opened(fd, direct, flags, node, ctx, owner, False, charge)

    def _shares_backing_id(self, node: Inode) -> bool:
        """Whether an open of *node* would take a backing id the kernel already holds for
        it (its reads passed through permitting), so that it needs no descriptor. Not in
        the thread mode (network filesystems), where a flush closes a duplicate of the
        open's own descriptor."""
        kernel_opens = self.kernel_opens
        # Its inode descriptor cached, too: an open of an evicted inode keeps its own
        # descriptor, which answers the inode's GETATTRs and its release's link count
        # without reopening (and evicting) one (InodeTable.handle_to_open).
        return (kernel_opens.on and node.cached_fd >= 0
                and kernel_opens.kernel.shares(node.nodeid)
                and self.io.mode is not IoMode.THREADS)

    @fuse_handler
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext,
                     ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        parent = self.inodes.get(parent_inode)
        await self._admit_meta(parent, ctx)
        owner = self.handles.claim(ctx.uid)
        try:
            fd, direct, node, st = await self._names.create(parent, name, mode, flags, ctx)
            return (self._opened(fd, direct, flags, node, ctx, owner, True),
                    self._entry(node, st, named=True))
        except BaseException:
            self.handles.unclaim(owner)
            raise

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
            if mask and (off & mask or size & mask):  # O_DIRECT refuses it: odirect
                fd, direct = await odirect.buffered(handle, self._meta_opening), False
            else:
                fd, direct = handle.fd, handle.direct
            start = _now_ns()
            data = await self.io.read(fd, off, size, direct, flow.threads)
            took = _now_ns() - start
        except Exception as exc:  # the errno, or EIO for a bug: the mount serves on
            raise self._answer("read", exc) from None
        try:
            flow.read_done(size, len(data), waited, took)  # counted; EOF's short read too
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
                kill_priv(handle.fd)
            mask = handle.dio_mask  # 0 unless O_DIRECT; allocates nothing when aligned
            if mask and (off & mask or len(buf) & mask):  # O_DIRECT refuses it: odirect
                fd, direct = await odirect.buffered(handle, self._meta_opening), False
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
            charge.write_done(off, n, waited, took)
        except Exception as exc:  # the data is written: say so, whatever the bookkeeping
            self.failures.record("write", exc, "answered with the bytes written")
        return n

    def _answer(self, where: str, exc: Exception) -> FUSEError:
        """What the kernel is told of a request of handler *where* that raised *exc*: a
        ``FUSEError`` as it is, a backing-store ``OSError`` as its own errno, anything
        else (a bug here or in the QoS layer) as EIO, counted and logged once per kind.
        The one mapping of every handler (``fuse_handler`` and the handlers that catch
        in their body); off the hot path: reached only once something was raised."""
        if isinstance(exc, FUSEError):
            return exc
        if isinstance(exc, KeyError) and exc.args and exc.args[0] in self.handles.lost:
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
        handle = self.handles.pop_file(fh)  # a lost one too (recovery: no descriptor)
        try:
            self.handles.unclaim(handle.owner)
            handle.charge.release()
        finally:  # whatever the bookkeeping did, a bug must not leak a descriptor per open
            node = handle.inode
            node.opens -= 1
            if node.open_fd == handle.fd:  # not after its close: the number is reused
                node.open_fd = -1
            self.kernel_opens.release(handle)  # a backing id must not leak either
            # The last open of a file unlinked meanwhile? Asked before the close, so that
            # this open's descriptor can answer for the inode's if that one was evicted.
            # An open without one (NO_DESCRIPTOR) whose inode's was evicted since is not
            # asked: reopening would evict another's, and the file's idle backing id and
            # inode go at their expiry or FORGET as for any file deleted underneath.
            unlinked = (node.opens == 0 and node.lookups > 0
                        and (handle.fd >= 0 or node.cached_fd >= 0)
                        and self.inodes.unlinked(node, handle.fd))
            if handle.fd < 0:
                pass  # lost in a crash (qosfs.passthrough.recovery): nothing to close
            elif self.io.mode is IoMode.THREADS:
                # A network client flushes and reports deferred write errors at close.
                await self.io.blocking(handle.charge.flow.threads, odirect.close_file, handle.fd,
                                       handle.buffered)
            else:
                # Local filesystems do not wait for the disk at close, and the inode table's
                # O_PATH descriptor keeps the inode, so this is never the last reference
                # that frees an unlinked file's blocks. Inline: the thread hop was 28% of
                # the daemon's CPU per file of a warm small-file loader on ext4
                # (bench/opcost.py: 4,696 -> 14,230 files/s, passthrough_hp 12,994).
                odirect.close_file(handle.fd, handle.buffered)
        if unlinked:
            self.inodes.let_go_unlinked(node)

    @fuse_handler
    async def fsync(self, fh: int, datasync: bool) -> None:
        handle = self.files[fh]
        await self.io.blocking(handle.charge.flow.threads,
                               os.fdatasync if datasync else os.fsync,
                               self.handles.descriptor(handle))

    # ----------------------------------------------------------------- directories

    @fuse_handler
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        node = self.inodes.get(inode)
        await self._admit_meta(node, ctx)
        owner = self.handles.claim(ctx.uid)
        try:
            fd = await self._meta_opening(odirect.reopen, node,
                                          os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except BaseException:
            self.handles.unclaim(owner)
            raise
        return self.handles.add_dir(fd, node, owner)

    @fuse_handler
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        handle = self.dirs[fh]
        if start_id == 0 or not handle.listed:
            # A snapshot per pass keeps offsets stable while entries come and go.
            handle.names = await self._meta(_list_names, handle.fd)
            handle.listed = True
        names = handle.names
        # Each entry's name resolved inline unless metadata calls go to threads, as in
        # lookup: the coroutine frames of _meta_opening and BackingIO.meta were ~10% of
        # the daemon's CPU in a `find` over a big tree.
        resolve_inline = None if self.io.mode is IoMode.THREADS else self._resolve_inline
        listed = self.inodes.listed
        for index in range(start_id, len(names)):
            name = names[index]
            if index < 2:  # "." and "..": listed like the backing store, never counted
                if not pyfuse3.readdir_reply(token, name, self._dot_entry(handle, name),
                                             index + 1):
                    break
                continue
            try:
                if resolve_inline is not None:
                    fd, st = resolve_inline(handle.fd, name)
                else:
                    fd, st = await self._meta_opening(self.inodes.resolve, handle.fd, name)
            except OSError as exc:
                if exc.errno in FD_SHORTAGE:
                    raise  # not an entry that went away: the listing must not skip it
                continue  # removed since the snapshot
            # A batch may hold a thousand entries (the kernel's readdir buffer is up to
            # max_pages): ~15 ms of work that would stall every other class's requests,
            # so let them run every few entries, and trim the descriptor cache as we go.
            # Both are safe: this loop holds no inode descriptor across entries.
            if index & _READDIR_YIELD_MASK == 0:
                await trio.lowlevel.checkpoint()
            self.inodes.trim()
            nodeid = listed(fd, st)  # a file past the objects kept: a cold row
            if nodeid >= 0:
                entry = self._entries.of_listed(nodeid, handle.inode, name, st)
            else:
                # As a lookup's: its path derived from the directory's (no /proc read
                # when the entry's timeouts go by path, as the default policy's do).
                inode = self._adopt(handle.inode, name, fd, st)
                nodeid, entry = inode.nodeid, self._entry(inode, st)
            if not pyfuse3.readdir_reply(token, name, entry, index + 1):
                self.inodes.forget(nodeid, 1)  # not sent: the kernel holds no reference
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
        os.close(self.handles.pop_dir(fh).fd)

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
        admission = self.qos.getxattr_admission(name, ctx.pid)
        if admission == XATTR_CANARY:
            raise FUSEError(errno.ENODATA)  # the latency canary: only its round trip matters
        node = self.inodes.get(inode)
        if admission == XATTR_CHARGED:
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


def _close_dup(fd: int) -> None:
    os.close(os.dup(fd))


def _list_names(fd: int) -> list[bytes]:
    return [b".", b".."] + [os.fsencode(name) for name in os.listdir(fd)]
