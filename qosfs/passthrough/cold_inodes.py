"""The inodes the kernel knows and nothing uses now, packed in arrays: ~70 bytes each.

A dataset walk leaves the kernel holding every inode it stat'ed (until the entry and
attribute timeouts let it forget them), most of which nobody touches again. As Python
objects they cost ~650 bytes each (the :class:`~qosfs.passthrough.inodes.Inode` with its
slots, its key and entry tuples, two dict entries, the handle); here a record is a row
of parallel arrays (node id, device, inode number, lookup count, journal slot, flags)
and the object that names it (the directory it reopens by name under), found through two
open-addressing indexes of row numbers (by node id, and by (device, inode number))
rather than dicts of int objects. Its file handle, or the name it reopens by, is read
back from its record in the session journal (:mod:`qosfs.passthrough.journal`), which
holds them anyway: no object per cold inode at all (one only for an inode that has no
record, without a journal).

The inode table (:mod:`qosfs.passthrough.inodes`) folds an inode in here once nothing
but the table holds it (no open file, no request in progress, no descriptor cached) and
takes it out as an object again (thaws it) when a request names it; FORGET of a cold
inode changes its count here, and its last one frees the row. Rows are reused, the
indexes shrink as they empty and the arrays are compacted when mostly free (the C heap
trimmed then), so the memory goes back when the kernel forgets.

Example:
    >>> cold = ColdInodes()
    >>> cold.add(12, 2049, 12, 1, -1, HANDLE | KEYED, None, b"handle", None)
    >>> row = cold.find_id(12)
    >>> cold.find_key(2049, 12) == row, cold.take(row)[0], len(cold)
    (True, 12, 0)
"""

from __future__ import annotations

import array
import logging
import sys
from collections.abc import Iterator
from typing import Any, Protocol

from qosfs.core.syscalls import trim_heap
from qosfs.passthrough.fdcache import FdCache
from qosfs.passthrough.journal import SessionJournal
from qosfs.qos.charge import InodeCharge

log = logging.getLogger(__name__)

HANDLE = 1  # the blob is the file handle (else the name it reopens by, under ref)
DUE = 2  # the handle is still to be taken (Inode.handle_due)
KEYED = 4  # the table's entry for its (device, inode number)

_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: node ids are often consecutive
_M64 = (1 << 64) - 1
_MIN_BITS = 10
_COMPACT_MIN = 4096  # rows below which free ones are simply reused

# One cold inode, as take() and record() return it.
Row = tuple[int, int, int, int, int, int, Any, "bytes | None",
            "tuple[int, int, int] | None"]


def _references_when_unused() -> int:
    """What ``sys.getrefcount`` says of an object held by one dict, in :func:`fold`'s
    loop over a list of the dict's values (which of these count is the interpreter's
    business: measured, not assumed)."""
    probe = {0: object()}
    for item in list(probe.values()):
        return sys.getrefcount(item)
    raise AssertionError("unreachable")


_UNUSED = _references_when_unused()


def _empty(bits: int) -> array.array[int]:
    return array.array("i", [-1]) * (1 << bits)


class ColdInodes:
    """Cold inodes by node id and by (device, inode number); see the module docstring."""

    __slots__ = ("_bits", "_blobs", "_by_id", "_by_key", "_count", "_dev", "_flags",
                 "_free", "_ino", "_jslot", "_lookups", "_nodeid", "_ref", "_stamps")

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._nodeid = array.array("Q")
        self._dev = array.array("Q")
        self._ino = array.array("Q")
        self._lookups = array.array("q")
        self._jslot = array.array("i")
        self._flags = array.array("B")  # 0: a free row
        self._ref: list[Any] = []  # the directory an inode known by name reopens under
        self._blobs: dict[int, bytes] = {}  # handle or name of a row without a record
        self._stamps: dict[int, tuple[int, int, int]] = {}  # Inode.cache_stamp, if any
        self._free = array.array("i")
        self._count = 0
        self._bits = _MIN_BITS
        self._by_id = _empty(_MIN_BITS)
        self._by_key = _empty(_MIN_BITS)

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        return f"<ColdInodes {self._count} in {len(self._flags)} rows>"

    # ------------------------------------------------------------------ hashing

    def _id_home(self, nodeid: int) -> int:
        return ((nodeid * _MIX) & _M64) >> (64 - self._bits)

    def _key_home(self, dev: int, ino: int) -> int:
        return (((ino ^ (dev << 40)) * _MIX) & _M64) >> (64 - self._bits)

    def find_id(self, nodeid: int) -> int:
        """The row of *nodeid*, or -1."""
        table, ids = self._by_id, self._nodeid
        mask = len(table) - 1
        at = self._id_home(nodeid)
        while True:
            row = table[at]
            if row < 0 or ids[row] == nodeid:
                return row
            at = (at + 1) & mask

    def find_key(self, dev: int, ino: int) -> int:
        """The row keyed by (*dev*, *ino*), or -1."""
        table, inos, devs = self._by_key, self._ino, self._dev
        mask = len(table) - 1
        at = self._key_home(dev, ino)
        while True:
            row = table[at]
            if row < 0 or (inos[row] == ino and devs[row] == dev):
                return row
            at = (at + 1) & mask

    def _index(self, row: int) -> None:
        mask = (1 << self._bits) - 1
        at = self._id_home(self._nodeid[row])
        while self._by_id[at] >= 0:
            at = (at + 1) & mask
        self._by_id[at] = row
        if self._flags[row] & KEYED:
            at = self._key_home(self._dev[row], self._ino[row])
            while self._by_key[at] >= 0:
                at = (at + 1) & mask
            self._by_key[at] = row

    def _unindex(self, row: int) -> None:
        """Delete *row* from the indexes (linear probing with backward shift: no
        tombstones). Written out for each index: this runs at every thaw."""
        shift = 64 - self._bits
        mask = (1 << self._bits) - 1
        ids, table = self._nodeid, self._by_id
        at = ((ids[row] * _MIX) & _M64) >> shift
        while table[at] != row:
            at = (at + 1) & mask
        hole = at
        while True:
            at = (at + 1) & mask
            moved = table[at]
            if moved < 0:
                break
            if ((at - (((ids[moved] * _MIX) & _M64) >> shift)) & mask) >= ((at - hole) & mask):
                table[hole] = moved
                hole = at
        table[hole] = -1
        if not self._flags[row] & KEYED:
            return
        devs, inos, table = self._dev, self._ino, self._by_key
        at = (((inos[row] ^ (devs[row] << 40)) * _MIX) & _M64) >> shift
        while table[at] != row:
            at = (at + 1) & mask
        hole = at
        while True:
            at = (at + 1) & mask
            moved = table[at]
            if moved < 0:
                break
            home = (((inos[moved] ^ (devs[moved] << 40)) * _MIX) & _M64) >> shift
            if ((at - home) & mask) >= ((at - hole) & mask):
                table[hole] = moved
                hole = at
        table[hole] = -1

    def _reindex(self, bits: int) -> None:
        self._bits = bits
        self._by_id = _empty(bits)
        self._by_key = _empty(bits)
        for row in self.rows():
            self._index(row)

    # ------------------------------------------------------------------ rows

    def add(self, nodeid: int, dev: int, ino: int, lookups: int, jslot: int, flags: int,
            ref: Any, blob: bytes | None, stamp: tuple[int, int, int] | None) -> None:
        """Fold an inode in (*flags*: HANDLE, DUE, KEYED). Its handle or name, *blob*, is
        None where its journal record (*jslot*) holds it."""
        flags |= 8  # a row in use has a flag set, whatever the inode's are
        if self._free:
            row = self._free.pop()
            self._nodeid[row], self._dev[row], self._ino[row] = nodeid, dev, ino
            self._lookups[row], self._jslot[row], self._flags[row] = lookups, jslot, flags
            self._ref[row] = ref
        else:
            row = len(self._flags)
            self._nodeid.append(nodeid)
            self._dev.append(dev)
            self._ino.append(ino)
            self._lookups.append(lookups)
            self._jslot.append(jslot)
            self._flags.append(flags)
            self._ref.append(ref)
        if stamp is not None:
            self._stamps[row] = stamp
        if blob is not None:
            self._blobs[row] = blob
        self._count += 1
        if 2 * self._count > (1 << self._bits):
            self._reindex(self._bits + 1)  # indexes this row too
        else:
            self._index(row)

    def lookups(self, row: int) -> int:
        return self._lookups[row]

    def set_lookups(self, row: int, lookups: int) -> int:
        """Set *row*'s lookup count; returns its journal slot (-1: none)."""
        self._lookups[row] = lookups
        return self._jslot[row]

    def nodeid(self, row: int) -> int:
        return self._nodeid[row]

    def record(self, row: int) -> Row:
        """(nodeid, dev, ino, lookups, jslot, flags, ref, blob, cache stamp) of *row*;
        blob None if its journal record holds it."""
        return (self._nodeid[row], self._dev[row], self._ino[row], self._lookups[row],
                self._jslot[row], self._flags[row] & 7, self._ref[row],
                self._blobs.get(row), self._stamps.get(row))

    def take(self, row: int) -> Row:
        """Remove *row* and return what :meth:`record` does (to thaw it, or forget it)."""
        record = self.record(row)
        self._unindex(row)
        self._flags[row] = 0
        self._ref[row] = None
        self._stamps.pop(row, None)
        self._blobs.pop(row, None)
        self._free.append(row)
        self._count -= 1
        self._shrink()
        return record

    def rows(self) -> Iterator[int]:
        """The rows in use."""
        flags = self._flags
        return (row for row in range(len(flags)) if flags[row])

    def _shrink(self) -> None:
        """Give memory back: smaller indexes as they empty, arrays compacted when three
        quarters of their rows are free."""
        count = self._count
        if not count:
            if len(self._flags):
                self._reset()  # all forgotten: start afresh
                trim_heap()
            return
        rows = len(self._flags)
        if rows > _COMPACT_MIN and 4 * count < rows:
            self._compact()
        elif self._bits > _MIN_BITS and 8 * count < (1 << self._bits):
            self._reindex(self._bits - 1)

    def _compact(self) -> None:
        live = list(self.rows())
        self._nodeid = array.array("Q", (self._nodeid[r] for r in live))
        self._dev = array.array("Q", (self._dev[r] for r in live))
        self._ino = array.array("Q", (self._ino[r] for r in live))
        self._lookups = array.array("q", (self._lookups[r] for r in live))
        self._jslot = array.array("i", (self._jslot[r] for r in live))
        self._flags = array.array("B", (self._flags[r] for r in live))
        self._ref = [self._ref[r] for r in live]
        self._stamps = {new: self._stamps[old] for new, old in enumerate(live)
                        if old in self._stamps}
        self._blobs = {new: self._blobs[old] for new, old in enumerate(live)
                       if old in self._blobs}
        self._free = array.array("i")
        bits = _MIN_BITS
        while (1 << bits) < 2 * len(live):
            bits += 1
        self._reindex(bits)
        trim_heap()


# ---------------------------------------------------------------- the inode table's use


class InodeTable(Protocol):
    """What folding needs of :class:`qosfs.passthrough.inodes.InodeTable` (its inodes
    are :class:`~qosfs.passthrough.inodes.Inode` objects: Any here, as that module
    imports this one)."""

    by_id: dict[int, Any]
    by_key: dict[tuple[int, int], Any]
    cold: ColdInodes
    hot_limit: int
    hot_peak: int
    fold_at: int
    root: Any
    cache: FdCache
    journal: SessionJournal | None

    def evicting(self, entry: Any, fd: int) -> None: ...

    def make(self, nodeid: int, key: tuple[int, int], lookups: int,
             handle: bytes | None) -> Any: ...


def fold(table: InodeTable) -> None:
    """Fold *table*'s oldest inodes nothing uses into its ``cold``, down to ``hot_limit``
    objects. An inode is folded only if no other object refers to it: no open file
    or listing, no request handler (a local variable), no inode naming it as parent
    or entry (counted exactly by its reference count), and if it needs no descriptor
    of its own (a pinned one) and is not stale; its descriptor is evicted first
    (its file handle taken, as at any eviction) and its path memo dropped, as is
    the QoS layer's memo when it is only a memo."""
    excess = len(table.by_id) - table.hot_limit
    table.hot_peak = max(table.hot_peak, len(table.by_id))
    keyed = table.by_key
    for inode in list(table.by_id.values()):  # oldest first
        if excess <= 0:
            break
        memo: InodeCharge | None = inode.qos_memo
        if (inode.opens or inode.stale or inode.parent is not None
                or inode is table.root or (memo is not None and not memo.settled)
                or (inode.handle is None and inode.entry is None)):
            continue
        # References: by_id, the list, this loop (_UNUSED), by_key, the descriptor
        # cache. Any other is a user: it must keep seeing this very object.
        is_keyed = keyed.get(inode.key) is inode
        if sys.getrefcount(inode) != _UNUSED + is_keyed + (inode.slot >= 0):
            continue
        if inode.slot >= 0:
            table.evicting(inode, inode.cached_fd)
            table.cache.drop(inode)
        entry = inode.entry
        handle = inode.handle
        # Its record holds its handle or name (every change of them rewrites it), so
        # the row keeps neither: thaw reads them back.
        journal = table.journal
        journaled = inode.jslot >= 0 and journal is not None and not journal.closed
        blob = None if journaled else handle if entry is None else entry[1]
        table.cold.add(inode.nodeid, inode.key[0], inode.key[1], inode.lookups,
                      inode.jslot, (HANDLE if handle is not None else 0)
                      | (DUE if inode.handle_due else 0) | (KEYED if is_keyed else 0),
                      None if entry is None else entry[0], blob, inode.cache_stamp)
        inode.jslot = -1  # the row owns the record now
        del table.by_id[inode.nodeid]
        if is_keyed:
            del keyed[inode.key]
        excess -= 1
    table.fold_at = max(2 * table.hot_limit, len(table.by_id) + table.hot_limit)


def thaw(table: InodeTable, row: int, nodeid: int) -> Any:
    """The cold inode in *row* as an object again (KeyError for -1: unknown)."""
    if row < 0:
        raise KeyError(nodeid)
    nodeid, dev, ino, lookups, jslot, flags, ref, blob, stamp = table.cold.take(row)
    if blob is None and jslot >= 0 and table.journal is not None:
        name, handle = table.journal.name_and_handle(jslot)
        blob = handle if flags & HANDLE else name
    inode = table.make(nodeid, (dev, ino), lookups, blob if flags & HANDLE else None)
    if ref is not None:
        inode.entry = (ref, blob) if blob is not None else None
    inode.handle_due = bool(flags & DUE)
    inode.jslot = jslot
    inode.cache_stamp = stamp
    table.by_id[nodeid] = inode
    if flags & KEYED:
        table.by_key[inode.key] = inode
    return inode


def forget_cold(table: InodeTable, nodeid: int, count: int) -> None:
    """FORGET of a cold inode: its count, and its row and record when none is left."""
    row = table.cold.find_id(nodeid)
    if row < 0:
        log.warning("forget for unknown inode %d", nodeid)
        return
    left = table.cold.lookups(row) - count
    jslot = table.cold.set_lookups(row, left)
    journal = table.journal
    if left > 0:
        if jslot >= 0 and journal is not None:
            journal.count(jslot, left)
        return
    table.cold.take(row)
    if jslot >= 0 and journal is not None:
        journal.free(jslot)
