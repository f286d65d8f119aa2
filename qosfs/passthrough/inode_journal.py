"""How the inode table (:mod:`qosfs.passthrough.inodes`) is written down in the session
journal (:mod:`qosfs.passthrough.journal`) as it changes, for a successor after a crash:
every inode the kernel holds a node id of, and the inodes those name, with its count."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Protocol

from qosfs.passthrough.journal import NO_SLOT, ROOT_SLOT, JournalFull, SessionJournal

log = logging.getLogger(__name__)


class Inode(Protocol):
    """What is written down of :class:`qosfs.passthrough.inode.Inode` (its table,
    :mod:`qosfs.passthrough.inodes`, imports this module: the inodes it names are Any
    here)."""

    nodeid: int
    key: tuple[int, int]
    lookups: int
    handle: bytes | None
    stale: bool
    jslot: int
    entry: tuple[Any, bytes] | None
    parent: Any


class InodeJournaling:
    """The journal's side of :class:`~qosfs.passthrough.inodes.InodeTable` (its base)."""

    journal: SessionJournal | None
    root: Any
    by_id: dict[int, Any]
    by_key: dict[tuple[int, int], Any]

    def thaw_all(self) -> None:
        """Every cold inode as an object again (the table's)."""
        raise NotImplementedError

    def attach_journal(self, journal: SessionJournal, also: Iterable[Inode] = ()) -> None:
        """Write the table down in *journal* and keep it written from now on (a new
        mount's empty table, a successor's imported one, a recovered one, or this one
        again after a successor that failed replaced the file). *also*: inodes open
        files and directories hold."""
        self.thaw_all()
        seen: set[int] = set()
        todo = [*self.by_id.values(), *self.by_key.values(), *also]
        while todo:  # slots of a previous journal mean nothing in this one
            inode = todo.pop()
            if id(inode) in seen:
                continue
            seen.add(id(inode))
            inode.jslot = -1
            if inode.entry is not None:
                todo.append(inode.entry[0])
            if inode.parent is not None:
                todo.append(inode.parent)
        self.journal = journal
        journal.ending = self._journal_ending
        for inode in list(self.by_id.values()):
            self.write_down(inode)

    def _journal_ending(self, removed: bool) -> None:
        """The journal is closed: a handover ended this process's session (and may be
        taken back, when a new journal is attached): cold inodes, which keep their names
        and handles only in it, become objects first. *removed*: unmounted, nothing
        more is asked of the table."""
        if not removed:
            self.thaw_all()

    def write_down(self, inode: Inode) -> None:
        """(Re)write *inode*'s record, and first those of the inodes it names."""
        journal = self.journal
        if journal is None or inode is self.root:
            return
        entry = inode.entry
        parent = inode.parent
        try:
            entry_slot = NO_SLOT if entry is None else self.slot_of(entry[0])
            parent_slot = NO_SLOT if parent is None else self.slot_of(parent)
            inode.jslot = journal.put_inode(
                inode.jslot, inode.nodeid, inode.key[0], inode.key[1], inode.lookups,
                parent is not None, inode.handle, entry_slot,
                b"" if entry is None else entry[1], parent_slot, inode.stale)
        except JournalFull as exc:  # cannot happen with names <= 255 and handles <= 128
            log.error("inode %d not journaled: %s", inode.nodeid, exc)

    def slot_of(self, inode: Inode) -> int:
        """*inode*'s journal slot (written down first if need be); ROOT_SLOT for the root."""
        if inode is self.root:
            return ROOT_SLOT
        if inode.jslot < 0:
            self.write_down(inode)
        return inode.jslot

    def _journal_known(self, inode: Inode, moved: bool) -> None:
        """A known inode was looked up again: its count (and where it is, if it moved)."""
        if inode.jslot >= 0:
            if moved:
                self.write_down(inode)
            else:
                self.counted(inode)

    def _journal_stale(self, inode: Inode) -> None:
        """*inode* was let go while the kernel still holds its node id: a successor must
        answer ESTALE for it too, and never take it for the object now at its (device,
        inode number) or its name (a number the backing store reused)."""
        if inode.jslot >= 0:
            self.write_down(inode)

    def counted(self, inode: Inode) -> None:
        """*inode*'s lookup count changed: one store into its record."""
        if inode.jslot >= 0:
            journal = self.journal
            if journal is not None:
                journal.count(inode.jslot, inode.lookups)
