"""Ownership as a native filesystem would give it, although the daemon acts as root.

The daemon creates and writes as root, so the backing store would make every new object
root's and keep the setuid/setgid bits a non-root writer's write clears. :class:`Ownership`
puts both right: a new object is given to its caller (:meth:`Ownership.give_to_caller`),
and the first write of an unprivileged writer clears the bits (:func:`kill_priv`). With
``write_as_caller``, a non-root opener's writes run with its fsuid (root's reserve:
:mod:`qosfs.daemon.privileges`).
"""

from __future__ import annotations

import os
import stat

import pyfuse3

from qosfs.passthrough.inode import Inode

SUID_SGID = stat.S_ISUID | stat.S_ISGID


class Ownership:
    """The ownership emulation of one mount (*as_root*: the daemon runs as root)."""

    __slots__ = ("_as_root", "_write_as_caller")

    def __init__(self, as_root: bool, write_as_caller: bool = False) -> None:
        self._as_root = as_root
        self._write_as_caller = write_as_caller

    def give_to_caller(self, parent: Inode, name: bytes, ctx: pyfuse3.RequestContext,
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
        if mode & SUID_SGID and not stat.S_ISLNK(mode):
            os.chmod(name, stat.S_IMODE(mode), dir_fd=parent.fd)

    def of_open(self, node: Inode, accmode: int,
                ctx: pyfuse3.RequestContext) -> tuple[bool, int]:
        """For a new open of *node*: whether its first write must clear setuid/setgid
        (an unprivileged writer of such a file), and the fsuid its writes run with."""
        kill = False
        if accmode != os.O_RDONLY and ctx.uid != 0:
            kill = bool(os.fstat(node.fd).st_mode & SUID_SGID)
        return kill, ctx.uid if self._write_as_caller else 0


def kill_priv(fd: int) -> None:
    """Clear setuid (and group-exec setgid) as the kernel does when a non-root user writes.

    The daemon writes as root, which keeps those bits, so it clears them itself.
    """
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        return
    kill = stat.S_ISUID | (stat.S_ISGID if mode & stat.S_IXGRP else 0)
    if mode & kill:
        os.chmod(f"/proc/self/fd/{fd}", stat.S_IMODE(mode) & ~kill)
