"""The inode table: which backing object each FUSE node id stands for.

Every inode the kernel knows holds one ``O_PATH`` file descriptor on the backing object
(as libfuse's passthrough_ll does). That makes every operation relative to a descriptor
instead of a path, so

* mounting in place over the source works (the paths are hidden by our own mount, the
  descriptors are not),
* renames underneath do not confuse us, and
* a backing inode cannot be freed (and its number reused) while the kernel still knows it.

Node ids are the backing ``st_ino`` for objects on the source's own device, so ``ls -i``
shows the same numbers as the directory underneath and they stay stable for the life of
the mount. Objects on other devices (submounts inside the source) or whose number would
collide get a synthetic id from a high range.

The table only holds inodes the kernel has looked up and not yet forgotten: memory is
bounded by the kernel's inode cache, not by the size of the tree.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass
from typing import Any

import pyfuse3

log = logging.getLogger(__name__)

_SYNTHETIC_BASE = 1 << 62  # above any real st_ino we expect; collisions are checked anyway
_LOOKUP_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(slots=True, eq=False)
class Inode:
    """A backing object the kernel currently knows."""

    nodeid: int
    fd: int  # O_PATH descriptor, owned by the table
    key: tuple[int, int]  # (st_dev, st_ino) of the backing object
    lookups: int
    opens: int = 0  # open file handles on it (an unlinked file must stay reachable)
    # Memos for classification, dropped with the inode: its path (qosfs.paths) and how
    # the QoS engine last classified a request on it (qosfs.scheduler.PolicyQos).
    path_memo: tuple[int, float, str] | None = None
    qos_memo: Any = None

    @property
    def proc_path(self) -> str:
        """A path that reopens exactly this object (the /proc magic link does not re-resolve)."""
        return f"/proc/self/fd/{self.fd}"


class InodeTable:
    """Maps node ids to backing objects and counts the kernel's references."""

    def __init__(self, root_fd: int) -> None:
        st = os.fstat(root_fd)
        self.root_dev = st.st_dev
        self.root = Inode(pyfuse3.ROOT_INODE, root_fd, (st.st_dev, st.st_ino), 1)
        self._by_id: dict[int, Inode] = {pyfuse3.ROOT_INODE: self.root}
        self._by_key: dict[tuple[int, int], Inode] = {self.root.key: self.root}
        self._next_synthetic = _SYNTHETIC_BASE

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, nodeid: int) -> Inode:
        """The inode for a node id the kernel gave us; ESTALE if it was let go."""
        inode = self._by_id[nodeid]
        if inode.fd < 0:
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE))
        return inode

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

    def adopt(self, fd: int, st: os.stat_result) -> Inode:
        """Count one kernel reference to the object behind *fd*, taking ownership of *fd*.

        If the object is already known (another name, a hard link), *fd* is closed and the
        known inode is returned, so hard links share one node id.
        """
        key = (st.st_dev, st.st_ino)
        inode = self._by_key.get(key)
        if inode is not None:
            os.close(fd)
            inode.lookups += 1
            return inode
        nodeid = st.st_ino if st.st_dev == self.root_dev else 0
        if nodeid <= pyfuse3.ROOT_INODE or nodeid in self._by_id:
            nodeid = self._next_synthetic
            self._next_synthetic += 1
        inode = Inode(nodeid, fd, key, 1)
        self._by_id[nodeid] = inode
        self._by_key[key] = inode
        return inode

    def nodeid_of(self, st: os.stat_result) -> int:
        """The node id an object has or would get, without counting a reference."""
        inode = self._by_key.get((st.st_dev, st.st_ino))
        if inode is not None:
            return inode.nodeid
        return st.st_ino if st.st_dev == self.root_dev and st.st_ino > 1 else 0

    def find(self, st: os.stat_result) -> Inode | None:
        """The known inode for a backing object, if the kernel knows it."""
        return self._by_key.get((st.st_dev, st.st_ino))

    def release_unlinked(self, inode: Inode) -> None:
        """Let go of a file whose last name is gone and that nobody has open.

        Our O_PATH descriptor would otherwise keep its blocks allocated until the kernel
        gets round to forgetting it, so ``rm`` would not free space as it does natively.
        The node id stays valid (the kernel may still forget it); any later use of it
        answers ESTALE.
        """
        if inode is self.root or inode.opens or inode.fd < 0:
            return
        if os.fstat(inode.fd).st_nlink:
            return
        if self._by_key.get(inode.key) is inode:
            del self._by_key[inode.key]
        os.close(inode.fd)
        inode.fd = -1

    def forget(self, nodeid: int, count: int) -> None:
        """Drop *count* kernel references; close the descriptor when none remain."""
        inode = self._by_id.get(nodeid)
        if inode is None:
            log.warning("forget for unknown inode %d", nodeid)
            return
        inode.lookups -= count
        if inode.lookups > 0 or inode is self.root:
            return
        del self._by_id[nodeid]
        if self._by_key.get(inode.key) is inode:
            del self._by_key[inode.key]
        if inode.fd >= 0:
            os.close(inode.fd)

    def close_all(self) -> None:
        """Close every descriptor (after unmount, when the kernel will send no more forgets)."""
        for inode in self._by_id.values():
            if inode is not self.root and inode.fd >= 0:
                os.close(inode.fd)
        self._by_id = {pyfuse3.ROOT_INODE: self.root}
        self._by_key = {self.root.key: self.root}
