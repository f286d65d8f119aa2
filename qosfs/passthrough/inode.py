"""One backing object the kernel knows, as an object: :class:`Inode`.

The table that makes, finds, folds and lets go of them is :mod:`qosfs.passthrough.inodes`
(its docstring says how an inode is named, by handle or by name, and why its descriptor
is only cached); this module is the record itself, which every layer above the table
holds (open files, paths, page-cache stamps, the QoS memo).
"""

from __future__ import annotations

from typing import Any, Protocol

from qosfs.passthrough.journal import SessionJournal


class Table(Protocol):
    """What an inode asks of its table (:class:`qosfs.passthrough.inodes.InodeTable`)."""

    journal: SessionJournal | None

    def reopen(self, inode: Inode) -> int: ...


class Inode:
    """A backing object the kernel currently knows.

    ``fd`` is an ``O_PATH`` descriptor on it, valid until the next request handler
    yields (it may be evicted from the cache and reopened later): read it where it is
    used, never keep it across an ``await`` that runs other requests.
    """

    __slots__ = (
        "_table",
        "cache_stamp",
        "cached_fd",
        "entry",
        "handle",
        "handle_due",
        "jslot",
        "key",
        "lookups",
        "nodeid",
        "open_fd",
        "opened",
        "opens",
        "parent",
        "path_memo",
        "qos_memo",
        "referenced",
        "slot",
        "stale",
    )

    def __init__(self, table: Table, nodeid: int, key: tuple[int, int], lookups: int,
                 handle: bytes | None, fd: int) -> None:
        self._table = table
        self.nodeid = nodeid
        self.key = key  # (st_dev, st_ino) of the backing object
        self.lookups = lookups
        self.opens = 0  # open file handles on it (an unlinked file must stay reachable)
        # The descriptor of one of those opens (-1: none known): what `stat_fd` answers
        # with while the inode's own was evicted. Set at open, cleared before its close.
        self.open_fd = -1
        self.opened = False  # opened since it was last made an object (InodeTable.opened)
        self.handle = handle  # None: reopened by entry instead (or never evicted)
        # The handle is to be taken when the descriptor is evicted (see the module
        # docstring); meanwhile ``entry`` is set, as for an inode without a handle.
        self.handle_due = False
        # Without a handle: (parent inode, name) it was last looked up as, to reopen it.
        self.entry: tuple[Inode, bytes] | None = None
        # A directory's parent, as the kernel last looked it up (``..`` without a path
        # walk: see the module docstring); None for the root and for non-directories.
        self.parent: Inode | None = None
        self.cached_fd = fd
        self.referenced = True  # CLOCK bit (qosfs.passthrough.fdcache)
        self.slot = -1  # ring slot in the fd cache, -1 if not there
        self.stale = False  # let go of (unlinked, or gone): every use answers ESTALE
        # Its path, memoized for classification (qosfs.passthrough.paths).
        self.path_memo: tuple[int, float, str] | None = None
        # (size, mtime_ns, ctime_ns) of the backing file when the kernel's page cache of
        # it was last known good (qosfs.passthrough.operations: keep_cache); None after a
        # write through us.
        self.cache_stamp: tuple[int, int, int] | None = None
        # The QoS layer's slot, opaque here (qosfs.qos.interface.Classified), dropped
        # with the inode.
        self.qos_memo: Any = None
        # Its slot in the session journal (qosfs.passthrough.journal), -1 if none.
        self.jslot = -1

    def __del__(self) -> None:
        # The record lives as long as the object: a forgotten directory that a known
        # inode still names as its parent or entry must be found again after a crash.
        if self.jslot >= 0:
            journal = self._table.journal
            if journal is not None:
                journal.free(self.jslot)

    @property
    def fd(self) -> int:
        """An ``O_PATH`` descriptor on the object (see the class docstring for its life)."""
        fd = self.cached_fd
        if fd >= 0:
            self.referenced = True
            return fd
        return self._table.reopen(self)

    @property
    def stat_fd(self) -> int:
        """A descriptor to ``fstat`` the object by, for a call made at once on the event
        loop's thread (never one in a worker thread: an open's descriptor is closed at its
        release, not deferred as the cache's are): its own if cached, else that of one of
        its opens, else its own reopened. Python's ``open()`` stats every file it opens,
        and the GETATTR that sends (after a read on a writable mount) reopened an evicted
        descriptor, evicting another inode's, at every file of a loader's epoch."""
        if self.cached_fd < 0 and self.open_fd >= 0:
            return self.open_fd
        return self.fd

    @property
    def proc_path(self) -> str:
        """A path that reopens exactly this object (the /proc magic link does not re-resolve)."""
        return f"/proc/self/fd/{self.fd}"

    def __repr__(self) -> str:
        return (f"<Inode {self.nodeid} lookups={self.lookups} opens={self.opens} "
                f"fd={self.cached_fd}{' stale' if self.stale else ''}>")
