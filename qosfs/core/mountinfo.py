"""The kernel's table of mounts (``/proc/self/mountinfo``), parsed in one place.

The daemon reads it at start, for the backing filesystem's type and options (by device
number) and for whether the source lies in a qosfs mount (by path, then by device), and
at exit, for what is mounted on its mountpoint. By path means without a system call on a
path whose FUSE server may be gone or hung.
"""

from __future__ import annotations

import os
from typing import NamedTuple

__all__ = ["QOSFS_FSTYPE", "MountEntry", "containing", "lies_within", "mounts"]

MOUNTINFO = "/proc/self/mountinfo"
QOSFS_FSTYPE = "fuse.qosfs"  # the type of a qosfs mount in the table (subtype=qosfs)


class MountEntry(NamedTuple):
    """One line of mountinfo: what the daemon needs of it. (A NamedTuple: ``qosfs ctl
    --socket MOUNTPOINT`` imports this module, and :mod:`dataclasses` would cost it ~6 ms
    of its start.)"""

    dev: str  # "major:minor"
    mountpoint: str  # with the kernel's octal escapes (\\040 for a space) decoded
    options: frozenset[str]  # per-mount options: nosuid, nodev, noexec, ro...
    fstype: str


def mounts(path: str = MOUNTINFO) -> list[MountEntry]:
    """Every mount, in the kernel's order (a later one on the same path is on top);
    empty if the table cannot be read."""
    entries = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 6 or " - " not in line:
                    continue
                entries.append(MountEntry(
                    dev=fields[2],
                    mountpoint=fields[4].encode().decode("unicode_escape"),
                    options=frozenset(fields[5].split(",")),
                    fstype=line.split(" - ", 1)[1].split()[0],
                ))
    except OSError:
        return []
    return entries


def mount_type(path: str) -> str | None:
    """The filesystem type mounted exactly at *path*, or None if nothing is.

    *path* must be absolute and already resolved: this function makes no system call on
    it, because the daemon asks after its own loop stopped, when a stat() of its own
    mountpoint would wait for ever for an answer nobody is left to give.
    """
    target = os.path.normpath(path)
    found = None
    for entry in mounts():
        if entry.mountpoint == target:
            found = entry.fstype  # the last one is on top
    return found


def lies_within(path: str, top: str) -> bool:
    """Whether *path* is the directory *top* or below it, by the strings alone (both
    absolute and normalized: no system call, so a hung mount on either cannot block)."""
    return path == top or path.startswith(top.rstrip("/") + "/")


def containing(path: str, entries: list[MountEntry]) -> MountEntry | None:
    """The mount *path* lies in, read from the table alone: of the mounts whose mountpoint
    is *path* or a directory above it, the deepest, and of several on that same path the
    last listed (the one on top). *path* must be absolute and normalized; symlinks in it
    are not resolved (that would take a system call on it)."""
    found = None
    depth = -1
    for entry in entries:
        top = entry.mountpoint
        if lies_within(path, top) and len(top) >= depth:
            found, depth = entry, len(top)
    return found



def resolve_without_touching(path: str) -> str:
    """*path* made absolute and resolved, with no system call on its last component (its
    parent is resolved): a mountpoint whose daemon died while its connection is kept
    (qosfs.daemon.takeover.keeper) would not answer a stat until a new daemon serves it."""
    path = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
