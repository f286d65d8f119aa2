"""Open files and directories: what a FUSE file handle stands for.

Everything a read or write needs is resolved at open and kept here, so the hot path is a
dict lookup (by the ``fh`` the kernel was given) and an attribute read (an open the
kernel passes through keeps its handle for release, fsync and setattr, but no read or
write of it reaches the daemon): the
backing descriptor (one per open, never shared, because the open's flags matter),
whether it was opened ``O_DIRECT`` and the alignment that asks for, and the open's QoS
charge (:class:`qosfs.qos.charge.OpenCharge`: the flow its requests are admitted by, and
what may move it to another).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field

from qosfs.passthrough.inode import Inode
from qosfs.qos.charge import OpenCharge


@dataclass(slots=True, eq=False)
class FileHandle:
    """An open regular file.

    ``fh`` is what the kernel knows the open by, a number the handle table hands out in
    sequence and never reuses while the process lives, not the backing descriptor's number:
    a successor process (``qosfs upgrade``) must answer the kernel's ``fh``
    with descriptors it received under other numbers, and a number of its own must never
    collide with one the kernel still holds from the predecessor."""

    fd: int
    direct: bool  # backing fd has O_DIRECT: buffers must be aligned
    charge: OpenCharge  # what its requests are charged to (the flow), made at open
    inode: Inode
    kill_priv: bool = False  # clear setuid/setgid on the first write (unprivileged writer)
    fsuid: int = 0  # writes run with this fsuid when not 0 (see qosfs.daemon.privileges)
    owner: int = -1  # the uid whose OpenQuota it counts against (-1: none)
    # A request whose offset or length has a bit of dio_mask set cannot be served O_DIRECT
    # (0: any request can; qosfs.passthrough.odirect.buffered): it goes to ``buffered``, the
    # same file reopened without O_DIRECT at the first such request (-1: not yet).
    dio_mask: int = 0
    buffered: int = -1
    # Kernel passthrough (qosfs.passthrough.kernel): NOT_COUNTED (not asked for on this
    # mount), SERVED (the daemon serves it; counted as a plain open of the inode),
    # PASSED_THROUGH (the kernel reads and writes the backing file itself: no READ or
    # WRITE of this handle ever reaches the daemon; its release gives the backing id back)
    # or JOINED (it shares the backing id of an inode passed through now, as the kernel
    # wants, but with direct_io: its READs and WRITEs reach the daemon, admitted and
    # capped as a SERVED one's; its release gives its share of the id back).
    kernel: int = 0
    fh: int = -1  # the kernel's file handle (the handle table's files key)
    jslot: int = -1  # its record in the session journal (qosfs.passthrough.journal)
    # The flags of an open made without a descriptor (``fd`` is NO_DESCRIPTOR): what
    # HandleTable.descriptor opens it with if a request ever needs one.
    open_flags: int = 0


#: FileHandle.fd of an open the kernel passes through with a backing id its inode
#: already had: no request of it needs a descriptor of the daemon's, so none is opened
#: unless one does (an fsync, a SETATTR naming it, a handover: HandleTable.descriptor).
#: Distinct from -1, an open lost in a crash.
NO_DESCRIPTOR = -2

# FileHandle.kernel
NOT_COUNTED, SERVED, PASSED_THROUGH, JOINED = 0, 1, 2, 3
#: The FileHandle.kernel values whose open holds a share of its inode's backing id.
SHARES_BACKING_ID = (PASSED_THROUGH, JOINED)


@dataclass(slots=True, eq=False)
class DirHandle:
    """An open directory; the listing is a snapshot taken at offset 0 so offsets are stable."""

    fd: int
    inode: Inode
    names: list[bytes] = field(default_factory=list)
    listed: bool = False
    owner: int = -1  # the uid whose OpenQuota it counts against (-1: none)
    fh: int = -1  # the kernel's handle of the listing (the handle table's dirs key)
    jslot: int = -1  # its record in the session journal (qosfs.passthrough.journal)


class OpenQuota:
    """How many files and directories one uid may hold open through the daemon.

    Every open through the mount holds one of the daemon's descriptors, or may come to
    (one made without, NO_DESCRIPTOR, opens it at an fsync, say). Without a share
    per user, one user holding many files open (a careless job, or a hostile one with a
    high ``ulimit -n``) would exhaust the daemon's limit and every other user's opens and
    lookups would fail. Past its share a uid gets ``ENFILE`` ("too many open files in
    system": the shared table is full for it), as from a full system file table. Root is
    not counted (it could raise the daemon's limit anyway).
    """

    __slots__ = ("_by_uid", "per_uid", "refused")

    def __init__(self, per_uid: int) -> None:
        self.per_uid = per_uid
        self.refused = 0
        self._by_uid: dict[int, int] = {}

    def claim(self, uid: int) -> int:
        """Count one open for *uid*; returns the owner to record in the handle."""
        if uid == 0:
            return -1
        held = self._by_uid.get(uid, 0)
        if held >= self.per_uid:
            self.refused += 1
            raise OSError(errno.ENFILE, os.strerror(errno.ENFILE))
        self._by_uid[uid] = held + 1
        return uid

    def adopt(self, owner: int) -> None:
        """Count an open a predecessor process made for *owner* (-1: none), past the
        share if need be: it is open already, refusing it now would help nobody."""
        if owner >= 0:
            self._by_uid[owner] = self._by_uid.get(owner, 0) + 1

    def release(self, owner: int) -> None:
        if owner < 0:
            return
        held = self._by_uid[owner] - 1
        if held:
            self._by_uid[owner] = held
        else:
            del self._by_uid[owner]

    def held(self, uid: int) -> int:
        return self._by_uid.get(uid, 0)
