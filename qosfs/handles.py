"""Open files and directories: what a FUSE file handle stands for.

Everything a read or write needs is resolved at open and kept here, so the hot path is a
dict lookup and an attribute read: the backing descriptor (one per open, never shared,
because the open's flags matter), whether it was opened ``O_DIRECT``, and the QoS flow
the open was classified into.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qosfs.inodes import Inode


@dataclass(slots=True, eq=False)
class FileHandle:
    """An open regular file. The FUSE ``fh`` is the backing descriptor number."""

    fd: int
    direct: bool  # backing fd has O_DIRECT: buffers must be aligned
    flow: Any  # the QoS flow (class/tenant/user levels) chosen at open
    inode: Inode
    kill_priv: bool = False  # clear setuid/setgid on the first write (unprivileged writer)
    fsuid: int = 0  # writes run with this fsuid when not 0 (see qosfs.privileges)


@dataclass(slots=True, eq=False)
class DirHandle:
    """An open directory; the listing is a snapshot taken at offset 0 so offsets are stable."""

    fd: int
    inode: Inode
    names: list[bytes] = field(default_factory=list)
    listed: bool = False
