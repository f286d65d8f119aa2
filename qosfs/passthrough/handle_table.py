"""The handle table: every open file and directory of the mount, by the ``fh`` the kernel
was given, and the one record of an open file that outlives the process.

The table hands out ``fh`` numbers (in sequence, never reused while the process lives:
:class:`~qosfs.passthrough.handles.FileHandle` says why), holds the open files, the
directories and the *lost* opens (a dead predecessor's that could not be reopened: their
requests answer ESTALE), counts each open against its uid's
:class:`~qosfs.passthrough.handles.OpenQuota`, and keeps each open's record in the crash
journal (:mod:`qosfs.passthrough.journal`) while it is open.

An open file is written down in one format, :class:`OpenRecord`, wherever it must outlive
the process: the crash journal writes it at every open, the handover
(:mod:`qosfs.passthrough.transfer`) sends it to a successor, and crash recovery
(:mod:`qosfs.passthrough.recovery`) reads it back. Its saved form is a plain tuple
(``marshal`` and JSON both take it); the journal's on-disk layout of it is unchanged.

A successor fills the table through :class:`Tables`, the parts of a filesystem that a
takeover sets up (a :class:`~qosfs.passthrough.filesystem.Filesystem`), never through the
FUSE operations.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from qosfs.passthrough.handles import (
    NO_DESCRIPTOR,
    SHARES_BACKING_ID,
    DirHandle,
    FileHandle,
    OpenQuota,
)
from qosfs.passthrough.inode import Inode
from qosfs.passthrough.inodes import InodeTable
from qosfs.passthrough.intents import ExactlyOnce
from qosfs.passthrough.journal import SessionJournal
from qosfs.passthrough.kernel_opens import KernelOpens
from qosfs.passthrough.meta_calls import FD_SHORTAGE
from qosfs.passthrough.odirect import dio_mask_of, reopen
from qosfs.qos.charge import OpenCharge
from qosfs.qos.interface import FilesystemQos

# Flags the kernel handles itself, or that made or emptied the file: an open is reopened
# without them (a successor's reopen must never create or truncate).
OPEN_DROP = os.O_CREAT | os.O_EXCL | os.O_NOCTTY | os.O_NOFOLLOW


class OpenRecord(NamedTuple):
    """An open file as written down for a successor process (crash journal, handover).

    ``save`` gives the plain tuple that is written; ``load`` reads one back (a tuple from
    the journal, or the list JSON made of it). A tuple, not a dict: the journal writes one
    at every open, where a dict cost 5-25 us more."""

    fh: int  # what the kernel knows the open by
    inode: int  # the inode's journal slot (journal), or its record index (handover)
    flags: int  # what reopens it: its flags less those that made or emptied the file;
    #             O_DIRECT set only if the open is direct
    flow: Sequence[Any]  # the engine's flow_key of its charge's flow
    charge: Sequence[int]  # OpenCharge.state_values
    owner: int  # the uid its OpenQuota share is counted against (-1: none)
    fsuid: int
    kill_priv: bool
    kernel: int  # FileHandle.kernel
    backing_id: int | None  # the kernel passthrough id it shares, if PASSED_THROUGH or
    #                         JOINED (SHARES_BACKING_ID)

    def save(self) -> tuple[Any, ...]:
        """The record as written: a plain tuple."""
        return tuple(self)

    @classmethod
    def load(cls, values: Sequence[Any]) -> OpenRecord:
        """A record from `save`'s tuple (or a JSON list of it)."""
        fh, inode, flags, flow, charge, owner, fsuid, kill_priv, kernel, backing_id = values
        return cls(int(fh), int(inode), int(flags), list(flow), tuple(charge), int(owner),
                   int(fsuid), bool(kill_priv), int(kernel),
                   None if backing_id is None else int(backing_id))

    @property
    def direct(self) -> bool:
        return bool(self.flags & os.O_DIRECT)


class HandleTable:
    """The open files and directories of one mount (see the module docstring).

    ``files`` is read by every read and write (the operations hold the same dict);
    ``lost`` holds the opens a dead predecessor left that could not be reopened.
    """

    __slots__ = ("_inodes", "_kernel_opens", "_qos", "dirs", "files", "journal", "lost",
                 "next_fh", "quota")

    def __init__(self, quota: OpenQuota, qos: FilesystemQos, inodes: InodeTable,
                 kernel_opens: KernelOpens, files: dict[int, FileHandle]) -> None:
        self.quota = quota
        self._qos = qos
        self._inodes = inodes
        self._kernel_opens = kernel_opens  # the backing ids of passed-through opens
        self.files = files  # empty: kernel_opens reads it too (recent_file)
        self.dirs: dict[int, DirHandle] = {}
        self.lost: dict[int, FileHandle] = {}
        self.next_fh = 1
        self.journal: SessionJournal | None = None  # attach_journal

    # ----------------------------------------------------------------- opens

    def claim(self, uid: int) -> int:
        """Count an open of *uid* before making it (ENFILE past its share); returns the
        owner to give `add_file` or `add_dir`, or to `unclaim` if the open fails."""
        return self.quota.claim(uid)

    def unclaim(self, owner: int) -> None:
        """Give back what `claim` counted (an open that failed, or one released)."""
        self.quota.release(owner)

    def _take_fh(self) -> int:
        fh = self.next_fh
        self.next_fh = fh + 1
        return fh

    def add_file(self, fd: int, direct: bool, charge: OpenCharge, node: Inode,
                 kill_priv: bool, fsuid: int, owner: int) -> FileHandle:
        """A new open of *node* as *fd* (its journal record: `write_down`, once the
        kernel passthrough decided what it is)."""
        node.opens += 1
        if fd >= 0:
            node.open_fd = fd
        if not node.opened:
            self._inodes.opened(node)
        fh = self._take_fh()
        handle = self.files[fh] = self._handle(fd, direct, charge, node, kill_priv, fsuid,
                                               owner, -1, 0, fh)
        return handle

    def descriptor(self, handle: FileHandle) -> int:
        """*handle*'s backing descriptor, opened now if its open was made without one
        (NO_DESCRIPTOR: a passed-through open sharing its inode's backing id), with the
        open's flags; it is the handle's from then on, closed at its release. Raises
        the OSError of the open (ESTALE for an object gone underneath), never EMFILE for
        want of what the daemon's own cache holds (as :meth:`MetaCalls.opening
        <qosfs.passthrough.meta_calls.MetaCalls.opening>`: shed, then once more)."""
        if handle.fd != NO_DESCRIPTOR:
            return handle.fd
        try:
            fd = self._open_object(handle.inode, handle.open_flags | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno not in FD_SHORTAGE or not self._inodes.relieve():
                raise
            fd = self._open_object(handle.inode, handle.open_flags | os.O_CLOEXEC)
        handle.fd = fd
        return fd

    def _open_object(self, node: Inode, flags: int) -> int:
        """*node*'s object opened with *flags*: through its descriptor, or by its handle
        if that was evicted (as the operations' open does)."""
        by_handle = self._inodes.handle_to_open(node)
        try:
            return (reopen(node.fd, flags) if by_handle is None
                    else self._inodes.open_by_handle(by_handle, flags))
        except OSError as exc:
            self._inodes.check_gone(node, exc)
            raise

    @staticmethod
    def _handle(fd: int, direct: bool, charge: OpenCharge, node: Inode, kill_priv: bool,
                fsuid: int, owner: int, buffered: int, kernel: int, fh: int) -> FileHandle:
        """The one place a FileHandle is made (a new open, a predecessor's restored)."""
        return FileHandle(fd, direct, charge, node, kill_priv, fsuid, owner,
                          dio_mask_of(fd) if direct and fd >= 0 else 0, buffered, kernel, fh)

    def add_dir(self, fd: int, node: Inode, owner: int) -> int:
        """A new open of directory *node* as *fd*; returns its fh."""
        fh = self._take_fh()
        handle = self.dirs[fh] = DirHandle(fd, node, owner=owner, fh=fh)
        journal = self.journal
        if journal is not None:
            handle.jslot = journal.put_dir(fh, self._inodes.slot_of(node), owner)
            journal.next_fh(self.next_fh)
        return fh

    def pop_file(self, fh: int) -> FileHandle:
        """Take *fh*'s open out of the table (lost or not) and out of the journal
        (KeyError if there is none); its owner is the caller's to `unclaim`."""
        handle = self.files.pop(fh, None)
        if handle is None:
            handle = self.lost.pop(fh)  # not reopened after a crash: only bookkeeping
        if handle.jslot >= 0 and self.journal is not None:
            self.journal.free(handle.jslot)
        return handle

    def pop_dir(self, fh: int) -> DirHandle:
        """Take *fh*'s directory out of the table and the journal, its quota share given
        back (the caller closes it)."""
        handle = self.dirs.pop(fh)
        if handle.jslot >= 0 and self.journal is not None:
            self.journal.free(handle.jslot)
        self.quota.release(handle.owner)
        return handle

    def charges_of(self, inode: Inode) -> list[OpenCharge]:
        """The charges of *inode*'s open files."""
        if not inode.opens:
            return []
        return [handle.charge for handle in self.files.values() if handle.inode is inode]

    def inodes_held(self) -> list[Inode]:
        """The inodes open files (lost ones too) and directories hold."""
        return ([h.inode for h in self.files.values()] + [h.inode for h in self.lost.values()]
                + [d.inode for d in self.dirs.values()])

    # ----------------------------------------------------------------- records

    def record(self, handle: FileHandle, flags: int, inode: int) -> OpenRecord:
        """*handle*'s record, opened with *flags*, its inode named *inode*."""
        reopen = (flags & ~(OPEN_DROP | os.O_TRUNC)) | os.O_CLOEXEC
        if not handle.direct:
            reopen &= ~os.O_DIRECT
        kernel = handle.kernel
        charge = handle.charge
        return OpenRecord(
            handle.fh, inode, reopen, self._qos.flow_key(charge.flow), charge.state_values(),
            handle.owner, handle.fsuid, handle.kill_priv, kernel,
            self._kernel_opens.kernel.backing_id(handle.inode.nodeid)
            if kernel in SHARES_BACKING_ID else None)

    def write_down(self, handle: FileHandle, flags: int) -> None:
        """Journal a new open *handle* made with *flags* (nothing without a journal). A few
        us per open, none per read or write."""
        journal = self.journal
        if journal is None:
            return
        handle.jslot = journal.put_file(
            self.record(handle, flags, self._inodes.slot_of(handle.inode)).save())
        journal.next_fh(self.next_fh)

    def attach_journal(self, journal: SessionJournal) -> None:
        """Write every open down in *journal* and keep them written (the inode table is
        attached first: records name inodes by slot)."""
        self.journal = journal
        # Their flags are their descriptors' now; a lost one (no descriptor since a crash)
        # is written down too, so its release after another crash is still known.
        for handle in [*self.files.values(), *self.lost.values()]:
            self.write_down(handle, fcntl.fcntl(handle.fd, fcntl.F_GETFL)
                            if handle.fd >= 0 else os.O_RDONLY)
        for dir_handle in self.dirs.values():
            dir_handle.jslot = journal.put_dir(dir_handle.fh, self._inodes.slot_of(
                dir_handle.inode), dir_handle.owner)
        journal.next_fh(self.next_fh)

    def restore_file(self, record: OpenRecord, node: Inode, fd: int,
                     buffered: int = -1) -> FileHandle:
        """A predecessor's open, from its *record*, as *fd* on *node* (-1: it could not be
        reopened: it goes to ``lost``), counted against its owner's share (past it if need
        be: it is open already) and in its flow, where its charge stood."""
        flow = self._qos.flow_from_key(record.flow)
        charge = OpenCharge.restore(self._qos, flow, node,
                                    OpenCharge.state_from_values(record.charge))
        node.opens += 1
        if fd >= 0:
            node.open_fd = fd
        if not node.opened:
            self._inodes.opened(node)
        self.quota.adopt(record.owner)
        handle = self._handle(fd, record.direct, charge, node, record.kill_priv,
                              record.fsuid, record.owner, buffered, record.kernel, record.fh)
        (self.files if fd >= 0 else self.lost)[record.fh] = handle
        return handle

    def restore_dir(self, fh: int, fd: int, node: Inode, owner: int,
                    names: list[bytes] | None = None, listed: bool = False) -> None:
        """A predecessor's open directory, as *fd*."""
        self.quota.adopt(owner)
        self.dirs[fh] = DirHandle(fd, node, names if names is not None else [], listed,
                                  owner, fh)

    def number_after(self, next_fh: int) -> None:
        """Hand out no fh below *next_fh* (the kernel may hold any of a predecessor's)."""
        self.next_fh = max(self.next_fh, next_fh, max([*self.files, *self.dirs, 0]) + 1)

    # ----------------------------------------------------------------- shutdown

    def close_all(self) -> None:
        """Close every open's descriptors (the kernel connection is gone)."""
        held = [h.buffered for h in self.files.values() if h.buffered >= 0]
        fds = ([h.fd for h in self.files.values() if h.fd >= 0]
               + [h.fd for h in self.dirs.values()])
        for h in self.files.values():
            h.inode.open_fd = -1
        for fd in fds + held:
            try:
                os.close(fd)
            except OSError:
                pass
        self.files.clear()
        self.dirs.clear()


class Tables(Protocol):
    """What a takeover fills in a new, idle filesystem (the handover's import, crash
    recovery) and what a handover exports: :class:`~qosfs.passthrough.filesystem.Filesystem`
    is one."""

    @property
    def inodes(self) -> InodeTable: ...

    @property
    def handles(self) -> HandleTable: ...

    @property
    def kernel_opens(self) -> KernelOpens: ...

    @property
    def once(self) -> ExactlyOnce: ...
