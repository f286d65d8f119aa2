"""Where an inode is in the tree, for classification by path -- cheaply.

The QoS engine classifies opens and metadata requests by the object's path relative to the
mount root. The authoritative answer is the inode's O_PATH descriptor's /proc link, which
follows renames made anywhere, but reading it costs ~4 us: as much as the whole rest of
the QoS machinery on a create (bench: metadata). So each inode memoizes its path:

* read from /proc when nothing fresher is known;
* derived from the parent's memoized path plus the name when the kernel looks up or
  creates a child (the name the caller used: for a hard-linked file, the link opened);
* trusted for at most :data:`PATH_MEMO_SECONDS` after it was read from /proc (a derived
  path inherits its parent's deadline, or, if longer, the entry timeout the kernel is
  given for the name: :meth:`PathBook.trust_entry`), and until the next rename through
  the mount, which may move whole subtrees and so bumps :attr:`PathBook.epoch` for all
  of them.

A rename made directly on the backing store is therefore seen within a second, the
staleness the kernel's own entry cache (entry_timeout 1 s) already has; under a class
whose ``entry_timeout`` is longer (the default policy's datasets: 60 s), when the kernel
looks the name up again, as callers see it.
"""

from __future__ import annotations

import os
import sys
import time

from qosfs.passthrough.inode import Inode

# How long a path read from /proc is trusted: the kernel's default entry_timeout.
PATH_MEMO_SECONDS = 1.0
_DELETED = " (deleted)"
_FS_ENCODING = sys.getfilesystemencoding()
_monotonic = time.monotonic
_INF = float("inf")


class PathBook:
    """Paths of inodes relative to the mount root, memoized per inode (``Inode.path_memo``).

    Args:
        root_fd: The descriptor of the backing root directory.
        root: The root inode (its path is "").
    """

    def __init__(self, root_fd: int, root: Inode) -> None:
        self.root = root
        self._prefix = os.readlink(f"/proc/self/fd/{root_fd}").rstrip("/") + "/"
        self.epoch = 0  # bumped by renames through the mount: every memo before is stale

    def renamed(self) -> None:
        """A rename through the mount happened (or may have): forget every memoized path."""
        self.epoch += 1

    def relpath(self, inode: Inode) -> str:
        """The object's current path relative to the mount root ("" for the root)."""
        return self.relpath_until(inode)[0]

    def relpath_until(self, inode: Inode) -> tuple[str, float]:
        """The object's path and the ``time.monotonic()`` until which it is trusted (the
        root's, for ever); what is derived from it (a child's path, the QoS engine's
        classification) is trusted no longer."""
        if inode is self.root:
            return "", _INF
        memo = inode.path_memo
        now = _monotonic()
        if memo is not None and memo[0] == self.epoch and now < memo[1]:
            return memo[2], memo[1]
        path, deadline = self._read(inode), now + PATH_MEMO_SECONDS
        inode.path_memo = (self.epoch, deadline, path)
        return path, deadline

    def note_child(self, parent: Inode, name: bytes, child: Inode) -> None:
        """*child* is *parent*'s entry *name*: derive its path from the parent's.

        Called at every lookup and create (when the engine classifies), so that the open
        which usually follows does not read /proc; the parent's path is read from /proc
        at most once per directory per second.
        """
        path, deadline = self.child_path(parent, name)
        child.path_memo = (self.epoch, deadline, path)

    def child_path(self, parent: Inode, name: bytes) -> tuple[str, float]:
        """The path of *parent*'s entry *name*, derived from the parent's, and the
        ``time.monotonic()`` until which it is trusted (as :meth:`relpath_until`)."""
        base, deadline = self.relpath_until(parent)
        if parent is self.root:
            deadline = _monotonic() + PATH_MEMO_SECONDS
        leaf = name.decode(_FS_ENCODING, "surrogateescape")  # os.fsdecode, inlined
        return (f"{base}/{leaf}" if base else leaf), deadline

    def trust_entry(self, inode: Inode, seconds: float) -> None:
        """The kernel was just told to trust *inode*'s name, from which its path was
        derived (:meth:`note_child`), for *seconds*: callers reach the inode by that
        name, without a lookup, for as long, so the path they used is trusted for as long
        too (never shortened). Otherwise a loader that opens each file of its dataset
        once an epoch, past a second, re-read every path from /proc and classified every
        open again: the /proc read reopened the inode's evicted descriptor, which evicted
        another's."""
        memo = inode.path_memo
        if memo is not None and memo[0] == self.epoch:
            deadline = _monotonic() + seconds
            if deadline > memo[1]:
                inode.path_memo = (memo[0], deadline, memo[2])

    def _read(self, inode: Inode) -> str:
        try:
            path = os.readlink(inode.proc_path)
        except OSError:
            return ""
        path = path.removesuffix(_DELETED)
        return path[len(self._prefix):] if path.startswith(self._prefix) else ""
