"""What the kernel is told of an inode (its entry attributes and their timeouts), and
the inodes it learns of through names (lookup, create, mknod...)."""

from __future__ import annotations

import os

import pyfuse3

from qosfs.passthrough.inode import Inode
from qosfs.passthrough.inodes import InodeTable
from qosfs.passthrough.meta_calls import MetaCalls
from qosfs.passthrough.paths import PathBook
from qosfs.qos.interface import FilesystemQos


class Entries:
    """The entries of one mount: the mount's timeouts (*entry_timeout*, *attr_timeout*),
    or those the QoS engine gives an object's path."""

    __slots__ = ("_attr_timeout", "_calls", "_entry_timeout", "_inodes", "_learn_paths",
                 "_paths", "_qos")

    def __init__(self, inodes: InodeTable, paths: PathBook, qos: FilesystemQos, calls: MetaCalls,
                 entry_timeout: float, attr_timeout: float) -> None:
        self._inodes = inodes
        self._paths = paths
        self._qos = qos
        self._calls = calls
        self._entry_timeout = entry_timeout
        self._attr_timeout = attr_timeout
        self._learn_paths = qos.needs_paths

    def of(self, inode: Inode, st: os.stat_result, named: bool = False,
           ) -> pyfuse3.EntryAttributes:
        """The entry of *inode*; *named*: the reply to a lookup or creation of a name,
        which the kernel trusts for the entry timeout given, and so does the inode's path
        derived from that name (:meth:`qosfs.passthrough.paths.PathBook.trust_entry`)."""
        entry_timeout, attr_timeout = self._entry_timeout, self._attr_timeout
        by_path = self._qos.cache_timeouts  # by the classes' paths, if the policy says
        if by_path is not None:
            entry_timeout, attr_timeout = self._by_path(by_path(self._paths.relpath(inode)))
        if named and self._learn_paths:
            self._paths.trust_entry(inode, entry_timeout)
        return self._attributes(inode.nodeid, st, entry_timeout, attr_timeout)

    def of_listed(self, nodeid: int, parent: Inode, name: bytes, st: os.stat_result,
                  ) -> pyfuse3.EntryAttributes:
        """The entry of *parent*'s *name*, node id *nodeid*, listed without an inode
        object (:meth:`InodeTable.listed <qosfs.passthrough.inodes.InodeTable.
        listed>`): its timeouts go by the path derived from the parent's."""
        entry_timeout, attr_timeout = self._entry_timeout, self._attr_timeout
        by_path = self._qos.cache_timeouts
        if by_path is not None:
            entry_timeout, attr_timeout = self._by_path(
                by_path(self._paths.child_path(parent, name)[0]))
        return self._attributes(nodeid, st, entry_timeout, attr_timeout)

    def _by_path(self, timeouts: tuple[float | None, float | None]) -> tuple[float, float]:
        """The (entry, attribute) timeouts the policy gave a path, the mount's where
        it gave none."""
        entry, attr = timeouts
        return (self._entry_timeout if entry is None else entry,
                self._attr_timeout if attr is None else attr)

    @staticmethod
    def _attributes(nodeid: int, st: os.stat_result, entry_timeout: float,
                    attr_timeout: float) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = nodeid
        e.generation = 0
        e.entry_timeout = entry_timeout
        e.attr_timeout = attr_timeout
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

    def negative(self) -> pyfuse3.EntryAttributes:
        """A name that does not exist: an entry the kernel may cache for entry_timeout."""
        e = pyfuse3.EntryAttributes()
        e.st_ino = 0
        e.entry_timeout = self._entry_timeout
        return e

    def adopt(self, parent: Inode, name: bytes, fd: int, st: os.stat_result) -> Inode:
        """The inode for *parent*'s entry *name* (opened as *fd*), its path noted for the
        QoS engine so that the open which usually follows need not read it from /proc."""
        inode = self._inodes.adopt(fd, st, (parent, name))
        if self._learn_paths:
            self._paths.note_child(parent, name, inode)
        return inode

    async def adopt_new(self, parent: Inode, name: bytes) -> pyfuse3.EntryAttributes:
        """The entry of *parent*'s *name*, just made."""
        fd, st = await self._calls.opening(self._inodes.resolve, parent, name)
        return self.of(self.adopt(parent, name, fd, st), st, named=True)
