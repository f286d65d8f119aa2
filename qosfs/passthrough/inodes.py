"""The inode table: which backing object each FUSE node id stands for.

Every operation is relative to a descriptor on the backing object instead of a path (as
libfuse's passthrough_ll does), so

* mounting in place over the source works (the paths are hidden by our own mount, the
  descriptors are not), and
* renames underneath do not confuse us.

But the kernel may remember millions of inodes (a ``find`` over an ImageNet-sized tree),
and one descriptor each would exhaust the daemon's limit and answer EMFILE to every user.
So an inode is named by its *file handle* (``name_to_handle_at``, what NFS servers hand
out: it survives renames and carries the inode's generation, so a recycled inode number
is never mistaken for the old object), and its ``O_PATH`` descriptor is only *cached*:
at most ``fd_budget`` are open at once (:mod:`qosfs.passthrough.fdcache`), and an evicted one is
reopened with ``open_by_handle_at`` when next needed (~3 us). Where handles cannot be used
(a filesystem that exports none, such as ramfs; an object on a submount; no
CAP_DAC_READ_SEARCH), an evicted inode is reopened by the name the kernel last looked it up
as, relative to its parent's descriptor, and must still be the same (device, inode
number); if the name now holds something else (renamed or replaced underneath), the node
id answers ESTALE and the kernel looks the name up again, as an NFS client does. Only an
inode known by no name (the root) keeps its descriptor for good.

The daemon never resolves a path that could land on its own mount. Mounted in place,
the source's root directory is covered by the mount: a ``..`` walked from one of its
children through the backing tree steps onto the mount and asks the daemon itself (a
``stat`` there waits for ever for an answer only the waiting thread can give). So the
parent of a directory is taken from this table (:attr:`Inode.parent`, recorded where
the kernel looked the directory up), never from the backing store's ``..``; every other
name is resolved one component down from a descriptor, which stays on the source.

Node ids are the backing ``st_ino`` for objects on the source's own device, so ``ls -i``
shows the same numbers as the directory underneath and they stay stable for the life of
the mount. Objects on other devices (submounts inside the source) or whose number would
collide get a synthetic id from a high range.

A file's handle is taken only when its descriptor is first evicted (:meth:`InodeTable.
evicting`), not when it is looked up: ``name_to_handle_at`` cost 3 us on ext4 and 6 us
on tmpfs, a third of a lookup's handler time, and most files are looked up, opened and
forgotten without their descriptor ever being evicted. Until then the descriptor itself
pins the object (its inode number cannot be reused while it is open), and should taking
the handle fail at eviction, the file is reopened by name like one without a handle. A
directory's handle is still taken at once: :meth:`InodeTable.lookup_parent` revives a
forgotten directory by it, without a descriptor.

The table only holds inodes the kernel has looked up and not yet forgotten: memory is
bounded by the kernel's inode cache, not by the size of the tree. Only the inodes in use
lately are :class:`Inode` objects (at most ``hot_limit`` past the ones in use, and
``opened_limit`` more that were opened: a loader's working set); the rest are folded
into compact rows (:mod:`qosfs.passthrough.cold_inodes`, ~110 bytes each) and thawed
into an object again when a request names them.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable

import pyfuse3

from qosfs.core import syscalls
from qosfs.passthrough.cold_inodes import FOLD_BATCH, ColdInodes, fold, forget_cold, listed, thaw
from qosfs.passthrough.fdcache import CachedFd, DeferredClose, FdCache
from qosfs.passthrough.inode import Inode
from qosfs.passthrough.inode_journal import InodeJournaling
from qosfs.passthrough.journal import SessionJournal

log = logging.getLogger(__name__)

_SYNTHETIC_BASE = 1 << 62  # above any real st_ino we expect; collisions are checked anyway
_LOOKUP_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_REOPEN_FLAGS = os.O_PATH | os.O_CLOEXEC  # a handle names the object itself: no following
HOT_LIMIT = 2048  # Inode objects kept past those in use (the rest are folded: cold_inodes)
# Inodes opened through the mount stay objects up to this many more (~750 bytes each: at
# most ~24 MiB). A loader's working set is files it opens again each epoch; folded at
# 2,048, a 4,000-file set thawed and folded an inode per open: 8,900 files/s and 114 us
# of daemon CPU per file warm (tmpfs, 4 readers), against 14,900 and 65 us kept whole.
# A stat walk opens nothing, so its inodes still fold past HOT_LIMIT.
OPENED_LIMIT = 32768


def _ignore(nodeid: int) -> None:
    pass


def _stale() -> OSError:
    return OSError(errno.ESTALE, os.strerror(errno.ESTALE))


class InodeTable(InodeJournaling):
    """Maps node ids to backing objects and counts the kernel's references.

    Args:
        root_fd: The backing root directory (held open for the life of the mount).
        fd_budget: At most this many descriptors are held for inodes that have a handle.
        deferred_close: Given when worker threads run syscalls on inode descriptors
            (see :class:`qosfs.passthrough.fdcache.DeferredClose`); evicted descriptors
            close through it.
        hot_limit: How many inodes not in use stay objects (the latest used) before the
            rest are folded into :attr:`cold`.
        opened_limit: How many more may stay objects if they were opened (a loader's
            working set: see :data:`OPENED_LIMIT`).
    """

    def __init__(self, root_fd: int, fd_budget: int = 4096,
                 deferred_close: DeferredClose | None = None,
                 hot_limit: int = HOT_LIMIT, opened_limit: int = OPENED_LIMIT) -> None:
        st = os.fstat(root_fd)
        self.root_dev = st.st_dev
        # open_by_handle_at wants a real (not O_PATH) descriptor on the filesystem.
        self._mount_fd = os.open(f"/proc/self/fd/{root_fd}",
                                 os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.root = Inode(self, pyfuse3.ROOT_INODE, (st.st_dev, st.st_ino), 1, None, root_fd)
        # By node id, the inodes the kernel holds; by (device, inode number), the live
        # object's. A takeover fills them (qosfs.passthrough.inode_takeover). Those
        # nothing uses now may be folded into ``cold`` instead (cold_inodes.fold).
        self.by_id: dict[int, Inode] = {pyfuse3.ROOT_INODE: self.root}
        self.by_key: dict[tuple[int, int], Inode] = {self.root.key: self.root}
        self.cold = ColdInodes()
        self.hot_limit = hot_limit
        self.opened_limit = opened_limit
        self.opened_hot = 0  # objects with ``opened`` set (cold_inodes.fold)
        self.fold_at = hot_limit + min(FOLD_BATCH, hot_limit)  # objects that start a fold
        self.hot_peak = 0  # the most objects since by_id was last made anew (fold)
        self.next_synthetic = _SYNTHETIC_BASE
        close = deferred_close.retire if deferred_close is not None else os.close
        self._close = close
        self.cache = FdCache(fd_budget, close, self.evicting)
        self.pinned = 0  # descriptors held for inodes without a handle
        self.reopens = 0  # descriptors reopened from a handle (cache misses)
        self.thaws = 0  # cold inodes made objects again: rising fast, a working set past
        # the room for objects (ctl status: inode_thaws)
        # Where the table is written down for a successor after a crash (attach_journal).
        self.journal: SessionJournal | None = None
        # Told the node id of a file let go of by release_unlinked: what else keeps the
        # file must let go too (an idle backing id: qosfs.passthrough.kernel_opens).
        self.on_unlinked: Callable[[int], None] = _ignore
        self._root_mount_id, self.handles = _handles_usable(self._mount_fd)
        if not self.handles:
            log.warning("file handles unavailable on the source: one descriptor per inode "
                        "the kernel knows (a large tree may exhaust the descriptor limit)")

    def __len__(self) -> int:
        return len(self.by_id) + len(self.cold)

    @property
    def fds_held(self) -> int:
        """Descriptors held for inodes now (cached plus pinned, the root included)."""
        return len(self.cache) + self.pinned + 2  # the root, and the mount descriptor

    def get(self, nodeid: int) -> Inode:
        """The inode for a node id the kernel gave us; ESTALE if it was let go.

        Every request handler starts here, so this is where the descriptor cache is
        trimmed (:meth:`trim`).
        """
        inode = self.by_id.get(nodeid)
        if inode is None:
            inode = thaw(self, self.cold.find_id(nodeid), nodeid)
        if inode.stale:
            raise _stale()
        if self.cache.over:
            self.cache.trim()
        if len(self.by_id) > self.fold_at:
            fold(self)
        return inode

    def trim(self) -> None:
        """Evict cached descriptors down to the budget. Call only where a request starts,
        before it has taken any inode descriptor (:meth:`get` does, for its caller)."""
        if self.cache.over:
            self.cache.trim()
        if len(self.by_id) > self.fold_at:
            fold(self)

    # ----------------------------------------------------------------- cold inodes

    def opened(self, inode: Inode) -> None:
        """*inode* was opened (a file handle made on it): it is of a working set, kept an
        object while fewer than ``opened_limit`` such are (the caller checks the flag
        first: once per object, not per open)."""
        if self.by_id.get(inode.nodeid) is inode:  # not one let go of (stale) meanwhile
            inode.opened = True
            self.opened_hot += 1

    def known(self, key: tuple[int, int]) -> Inode | None:
        """The live inode for a (device, inode number), thawed if it was cold."""
        inode = self.by_key.get(key)
        if inode is None:
            row = self.cold.find_key(*key)
            if row >= 0:
                inode = thaw(self, row, self.cold.nodeid(row))
        return inode

    def thaw_all(self) -> None:
        """Every cold inode as an object again (a handover exports objects)."""
        for row in list(self.cold.rows()):
            thaw(self, row, self.cold.nodeid(row))

    @staticmethod
    def resolve(parent_fd: int, name: bytes) -> tuple[int, os.stat_result]:
        """Open *name* in the directory *parent_fd* as O_PATH and stat it.

        Pure syscalls, safe to run in a worker thread; pass the result to :meth:`adopt` on
        the event loop. Raises OSError from the backing store (ENOENT, EACCES, ...).
        """
        fd = os.open(name, _LOOKUP_FLAGS, dir_fd=parent_fd)
        try:
            return fd, os.fstat(fd)
        except OSError:
            os.close(fd)
            raise

    def make(self, nodeid: int, key: tuple[int, int], lookups: int,
             handle: bytes | None) -> Inode:
        """A new inode object of this table, without a descriptor (known to no table yet)."""
        return Inode(self, nodeid, key, lookups, handle, -1)

    def adopt(self, fd: int, st: os.stat_result,
              entry: tuple[Inode, bytes] | None = None) -> Inode:
        """Count one kernel reference to the object behind *fd*, taking ownership of *fd*.

        If the object is already known (another name, a hard link), the known inode is
        returned, so hard links share one node id; *fd* then refreshes its cached
        descriptor or is closed. *entry* is the (parent, name) it was looked up as.
        """
        key = (st.st_dev, st.st_ino)
        inode = self.known(key)
        handle = None
        due = False
        if inode is not None and not inode.stale:
            moved = False
            if entry is not None and stat.S_ISDIR(st.st_mode) and inode.parent is not entry[0]:
                inode.parent = entry[0]
                moved = True
            if inode.handle is None and entry is not None and inode.entry != entry:
                inode.entry = entry  # the name to reopen it by: the latest one
                moved = True
            if inode.cached_fd >= 0 or inode.handle is None:
                if inode.cached_fd >= 0:
                    os.close(fd)
                else:
                    self.cache.put(inode, fd)
                inode.lookups += 1
                self._journal_known(inode, moved)
                return inode
            handle = self.handle_of(fd, st)
            if handle == inode.handle:
                self.cache.put(inode, fd)  # it will be used next: keep this descriptor
                inode.lookups += 1
                self._journal_known(inode, moved)
                return inode
            # Same inode number, another generation: the known object is gone underneath
            # and its number was reused. The old node id answers ESTALE from now on.
            inode.stale = True
            self._journal_stale(inode)
        elif self.handles:
            if (entry is not None and st.st_dev == self.root_dev
                    and not stat.S_ISDIR(st.st_mode)):
                due = True  # a file's handle: at eviction, if ever (module docstring)
            else:
                handle = self.handle_of(fd, st)
        nodeid = self.new_nodeid(st)
        inode = Inode(self, nodeid, key, 1, handle, -1)
        if entry is not None and stat.S_ISDIR(st.st_mode):
            inode.parent = entry[0]
        self.by_id[nodeid] = inode
        self.by_key[key] = inode
        if handle is None and entry is None:
            inode.cached_fd = fd  # no way to reopen it: held for as long as it is known
            self.pinned += 1
        else:
            inode.entry = entry if handle is None else None
            inode.handle_due = due
            self.cache.put(inode, fd)
        if self.journal is not None:
            self.write_down(inode)
        return inode

    def listed(self, fd: int, st: os.stat_result) -> int:
        """A listing's entry counted without an inode object where that is safe: its
        node id, *fd* closed; -1, *fd* left to :meth:`adopt` (:func:`~qosfs.passthrough.
        cold_inodes.listed` says which, and why)."""
        return listed(self, fd, st)

    def new_nodeid(self, st: os.stat_result) -> int:
        """The node id of a new object: its inode number on the source's own device,
        else (or if that number is taken) the next synthetic one."""
        nodeid = st.st_ino if st.st_dev == self.root_dev else 0
        if (nodeid <= pyfuse3.ROOT_INODE or nodeid in self.by_id
                or self.cold.find_id(nodeid) >= 0):
            nodeid = self.next_synthetic
            self.next_synthetic += 1
        return nodeid

    def evicting(self, entry: CachedFd, fd: int) -> None:
        """The fd cache is about to close *entry*'s descriptor *fd*: take the file handle
        that was put off at lookup (see the module docstring). If it cannot be taken, the
        inode is reopened by its name, as on a source without handles."""
        if not isinstance(entry, Inode) or not entry.handle_due:
            return
        entry.handle_due = False
        try:
            handle, mount_id = syscalls.handle_of_fd(fd)
        except OSError:
            return
        if mount_id == self._root_mount_id:
            entry.handle, entry.entry = handle, None
            if entry.jslot >= 0:
                self.write_down(entry)  # reopened by handle after a crash too

    def handle_of(self, fd: int, st: os.stat_result) -> bytes | None:
        """The object's file handle, or None if it must keep its descriptor instead."""
        if not self.handles or st.st_dev != self.root_dev:
            return None  # a submount: its handles would need a descriptor on that mount
        try:
            handle, mount_id = syscalls.handle_of_fd(fd)
        except OSError:
            return None
        return handle if mount_id == self._root_mount_id else None

    def reopen(self, inode: Inode) -> int:
        """Open an evicted inode's descriptor again, from its handle or its name (and
        cache it); ESTALE if the object is gone or its name holds another now."""
        if inode.stale:
            raise _stale()
        try:
            if inode.handle is not None:
                fd = syscalls.open_by_handle(self._mount_fd, inode.handle, _REOPEN_FLAGS)
            elif inode.entry is not None:
                fd = self._reopen_by_name(inode, *inode.entry)
            else:
                raise _stale()
        except OSError as exc:
            self.check_gone(inode, exc)
            raise
        self.reopens += 1
        self.cache.put(inode, fd)
        return fd

    def handle_to_open(self, inode: Inode) -> bytes | None:
        """The handle to open *inode*'s object by for I/O (:meth:`open_by_handle`), if
        its descriptor was evicted; None: open it through its descriptor. Reopening the
        descriptor first would cache it and so evict another inode's: with a loader's
        working set past the budget, every open reopened one descriptor and closed
        another, where one system call that leaves the cache as it is does."""
        if inode.cached_fd >= 0 or inode.handle is None or inode.stale:
            return None
        return inode.handle  # not a reopen (``reopens``): no descriptor is cached

    def open_by_handle(self, handle: bytes, flags: int) -> int:
        """Open the object *handle* names with *flags* (no ``O_PATH`` descriptor, no
        table touched: safe in a worker thread). The caller passes what it raises to
        :meth:`check_gone`, on the loop's thread."""
        return syscalls.open_by_handle(self._mount_fd, handle, flags)

    def check_gone(self, inode: Inode, exc: OSError) -> None:
        """*exc* came from reopening *inode*'s object: if it says the object is gone
        (ESTALE, ENOENT), *inode* is let go of as stale and ESTALE raised."""
        if exc.errno in (errno.ESTALE, errno.ENOENT):
            inode.stale = True  # gone underneath, or moved where we cannot know
            self._journal_stale(inode)
            raise _stale() from None

    @staticmethod
    def _reopen_by_name(inode: Inode, parent: Inode, name: bytes) -> int:
        fd = os.open(name, _LOOKUP_FLAGS, dir_fd=parent.fd)
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        if (st.st_dev, st.st_ino) != inode.key:
            os.close(fd)
            raise _stale()
        return fd

    def renamed(self, parent: Inode, name: bytes) -> None:
        """*parent*'s entry *name* was just renamed to, through the mount: a directory's
        parent is *parent* from now on, and an inode reopened by name uses that name."""
        try:
            st = os.stat(name, dir_fd=parent.fd, follow_symlinks=False)
        except OSError:
            return
        inode = self.known((st.st_dev, st.st_ino))
        if inode is None:
            return
        if stat.S_ISDIR(st.st_mode):
            inode.parent = parent
        if inode.handle is None and inode.entry is not None:
            inode.entry = (parent, name)
        if inode.jslot >= 0:
            self.write_down(inode)

    def lookup_parent(self, inode: Inode) -> Inode:
        """The directory *inode* was last looked up in, with one kernel reference counted
        (a LOOKUP of ``..``); the root for the root. Never a path walk: see the module
        docstring.

        A parent the kernel has forgotten since is opened again by its file handle;
        without one (or if it is gone) the answer is ESTALE.
        """
        parent = inode.parent
        known = self.root if parent is None else self.known(parent.key)
        if known is not None and not known.stale:
            known.lookups += 1
            self.counted(known)
            return known
        assert parent is not None
        if parent.handle is None:
            raise _stale()
        try:
            fd = syscalls.open_by_handle(self._mount_fd, parent.handle, _REOPEN_FLAGS)
        except OSError as exc:
            if exc.errno in (errno.ESTALE, errno.ENOENT):
                raise _stale() from None
            raise
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        revived = self.adopt(fd, st)  # counts the reference
        revived.parent = parent.parent
        if revived.jslot >= 0:
            self.write_down(revived)
        return revived

    def parent_nodeid(self, inode: Inode) -> int:
        """The node id of *inode*'s parent directory, for the ``..`` entry of a listing;
        counts no reference and makes no system call."""
        parent = inode.parent
        if parent is None:
            return self.root.nodeid if inode is self.root else inode.nodeid
        known = self.known(parent.key)
        return known.nodeid if known is not None else parent.nodeid

    def relieve(self) -> bool:
        """The daemon is short of descriptors: close half of the cached ones.

        Returns whether any was closed (worth retrying the call that failed). Descriptors
        the caller took from inodes before are invalid afterwards: take them again.
        """
        dropped = self.cache.shrink(len(self.cache) // 2)
        if dropped:
            log.warning("out of file descriptors: closed %d cached inode descriptors "
                        "(%d left)", dropped, len(self.cache))
        return dropped > 0

    def find(self, st: os.stat_result) -> Inode | None:
        """The known inode for a backing object, if the kernel knows it."""
        return self.known((st.st_dev, st.st_ino))

    def release_unlinked(self, inode: Inode) -> None:
        """Let go of a file whose last name is gone and that nobody has open.

        Our O_PATH descriptor would otherwise keep its blocks allocated until the kernel
        gets round to forgetting it, so ``rm`` would not free space as it does natively.
        The node id stays valid (the kernel may still forget it); any later use of it
        answers ESTALE.
        """
        if self.unlinked(inode):
            self.let_go_unlinked(inode)

    def unlinked(self, inode: Inode, fd: int = -1) -> bool:
        """Whether *inode*'s object has lost its last name while the kernel still knows
        it (not the root, not open, not let go of already). Asked of the inode's own
        descriptor, or, if that was evicted, of *fd* when given (an open descriptor of
        the same object: a release's own, before its close), rather than reopening it,
        which would evict another inode's descriptor at every last release."""
        if inode is self.root or inode.opens or inode.stale:
            return False
        try:  # as Inode.stat_fd, with *fd* for the open's descriptor
            nlink = os.fstat(fd if inode.cached_fd < 0 and fd >= 0 else inode.fd).st_nlink
        except OSError as exc:
            return exc.errno == errno.ESTALE  # short of descriptors, say: try again later
        return nlink == 0

    def let_go_unlinked(self, inode: Inode) -> None:
        """:meth:`release_unlinked` once :meth:`unlinked` said so."""
        if self.by_key.get(inode.key) is inode:
            del self.by_key[inode.key]
        inode.stale = True
        self._journal_stale(inode)
        self._let_go(inode)
        self.on_unlinked(inode.nodeid)

    def _let_go(self, inode: Inode) -> None:
        if inode.slot >= 0:
            self.cache.drop(inode)
        elif inode.cached_fd >= 0:  # a pinned descriptor (no handle)
            self._close(inode.cached_fd)
            inode.cached_fd = -1
            self.pinned -= 1

    def forget(self, nodeid: int, count: int) -> None:
        """Drop *count* kernel references; close the descriptor when none remain."""
        inode = self.by_id.get(nodeid)
        if inode is None:
            forget_cold(self, nodeid, count)
            return
        inode.lookups -= count
        self.counted(inode)
        if inode.lookups > 0 or inode is self.root:
            return
        del self.by_id[nodeid]
        if inode.opened:
            self.opened_hot -= 1
        if self.by_key.get(inode.key) is inode:
            del self.by_key[inode.key]
        inode.stale = True
        self._let_go(inode)
        if len(self.by_id) < self.hot_peak >> 3:  # dicts never shrink by deletions
            self.by_id, self.by_key = dict(self.by_id), dict(self.by_key)
            self.hot_peak = len(self.by_id)

    def close_all(self) -> None:
        """Close every descriptor (after unmount, when the kernel will send no more forgets)."""
        self.cache.close_all()
        for inode in self.by_id.values():
            if inode is not self.root and inode.cached_fd >= 0:
                self._close(inode.cached_fd)
                inode.cached_fd = -1
        self.pinned = 0
        if self._mount_fd >= 0:
            os.close(self._mount_fd)
            self._mount_fd = -1
        self.by_id = {pyfuse3.ROOT_INODE: self.root}
        self.by_key = {self.root.key: self.root}
        self.opened_hot = 0
        self.cold = ColdInodes()  # no descriptors; their journal ends with the mount


def _handles_usable(mount_fd: int) -> tuple[int, bool]:
    """The source's mount id, and whether its objects can be reopened from handles here."""
    try:
        handle, mount_id = syscalls.handle_of_fd(mount_fd)
        os.close(syscalls.open_by_handle(mount_fd, handle, _REOPEN_FLAGS))
    except OSError as exc:
        log.info("file handles unusable on the source (%s)", exc.strerror)
        return -1, False
    return mount_id, True
