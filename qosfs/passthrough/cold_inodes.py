"""The inodes the kernel knows and nothing uses now, packed in arrays: ~70 bytes each.

A dataset walk leaves the kernel holding every inode it stat'ed (until the entry and
attribute timeouts let it forget them), most of which nobody touches again. As Python
objects they cost ~650 bytes each (the :class:`~qosfs.passthrough.inode.Inode` with its
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
inode changes its count here, and its last one frees the row. A listing (READDIRPLUS)
counts its files here without making objects of them (:func:`listed`): a cold one in
its row, a new one past ``hot_limit`` objects as a new row. Rows are reused, the
indexes shrink as they empty, the arrays from their end, and all of it goes (the C heap
trimmed) when the last cold inode does, so the memory goes back when the kernel
forgets. Nothing here takes time in proportion to the number of cold inodes (an index
grows by 1/256th at a time): the event loop never stalls on a million of them.

Example:
    >>> cold = ColdInodes()
    >>> cold.add(12, 2049, 12, 1, -1, HANDLE | KEYED, None, b"handle", None)
    >>> row = cold.find_id(12)
    >>> cold.find_key(2049, 12) == row, cold.take(row)[0], len(cold)
    (True, 12, 0)
"""

from __future__ import annotations

import array
import itertools
import logging
import os
import stat
import sys
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from qosfs.core.syscalls import trim_heap
from qosfs.passthrough.fdcache import FdCache
from qosfs.passthrough.journal import NO_SLOT, JournalFull, SessionJournal
from qosfs.qos.charge import InodeCharge

log = logging.getLogger(__name__)

HANDLE = 1  # the blob is the file handle (else the name it reopens by, under ref)
DUE = 2  # the handle is still to be taken (Inode.handle_due)
KEYED = 4  # the table's entry for its (device, inode number)

_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: node ids are often consecutive
_M64 = (1 << 64) - 1
FOLD_BATCH = 64  # objects past hot_limit that start a fold (~0.5 ms of work)
_SHARDS = 256  # of an index: a hash's low byte picks one
_SHARD_MASK = _SHARDS - 1
_MIN_BITS = 3  # of a shard's table

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


class _Index:
    """Row numbers by a 64-bit hash: 256 linear-probing tables (the hash's low byte picks
    one, its top bits the place, as Fibonacci hashing wants), each grown and shrunk on
    its own, so that a resize moves 1/256 of the rows (a million cold inodes: a pause
    of ~4,000 row moves, never of a million). Deletion shifts back (no tombstones)."""

    __slots__ = ("bits", "counts", "tables")

    def __init__(self) -> None:
        self.tables = [_empty(_MIN_BITS) for _ in range(_SHARDS)]
        self.bits = array.array("B", [_MIN_BITS]) * _SHARDS
        self.counts = array.array("i", [0]) * _SHARDS

    def table(self, h: int) -> tuple[array.array[int], int, int]:
        """The table for hash *h*, its mask, and *h*'s home place in it."""
        shard = h & _SHARD_MASK
        bits = self.bits[shard]
        return self.tables[shard], (1 << bits) - 1, h >> (64 - bits)

    def insert(self, h: int, row: int, hash_of: Callable[[int], int]) -> None:
        shard = h & _SHARD_MASK
        count = self.counts[shard] + 1
        self.counts[shard] = count
        if 2 * count > (1 << self.bits[shard]):
            self._resize(shard, self.bits[shard] + 1, hash_of)
        table, mask, at = self.table(h)
        while table[at] >= 0:
            at = (at + 1) & mask
        table[at] = row

    def remove(self, h: int, row: int, hash_of: Callable[[int], int]) -> None:
        shard = h & _SHARD_MASK
        table, mask, at = self.table(h)
        shift = 64 - self.bits[shard]
        while table[at] != row:
            at = (at + 1) & mask
        hole = at
        while True:
            at = (at + 1) & mask
            moved = table[at]
            if moved < 0:
                break
            if ((at - (hash_of(moved) >> shift)) & mask) >= ((at - hole) & mask):
                table[hole] = moved
                hole = at
        table[hole] = -1
        count = self.counts[shard] - 1
        self.counts[shard] = count
        if self.bits[shard] > _MIN_BITS and 8 * count < (1 << self.bits[shard]):
            self._resize(shard, self.bits[shard] - 1, hash_of)

    def _resize(self, shard: int, bits: int, hash_of: Callable[[int], int]) -> None:
        table = _empty(bits)
        mask, shift = len(table) - 1, 64 - bits
        for row in self.tables[shard]:
            if row >= 0:
                at = hash_of(row) >> shift
                while table[at] >= 0:
                    at = (at + 1) & mask
                table[at] = row
        self.tables[shard] = table
        self.bits[shard] = bits


class ColdInodes:
    """Cold inodes by node id and by (device, inode number); see the module docstring."""

    __slots__ = ("_blobs", "_by_id", "_by_key", "_count", "_dev", "_flags",
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
        self._by_id = _Index()
        self._by_key = _Index()

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        return f"<ColdInodes {self._count} in {len(self._flags)} rows>"

    # ------------------------------------------------------------------ hashing

    def _id_hash(self, row: int) -> int:
        return (self._nodeid[row] * _MIX) & _M64

    def _key_hash(self, row: int) -> int:
        return ((self._ino[row] ^ (self._dev[row] << 40)) * _MIX) & _M64

    def find_id(self, nodeid: int) -> int:
        """The row of *nodeid*, or -1."""
        table, mask, at = self._by_id.table((nodeid * _MIX) & _M64)
        ids = self._nodeid
        while True:
            row = table[at]
            if row < 0 or ids[row] == nodeid:
                return row
            at = (at + 1) & mask

    def find_key(self, dev: int, ino: int) -> int:
        """The row keyed by (*dev*, *ino*), or -1."""
        table, mask, at = self._by_key.table(((ino ^ (dev << 40)) * _MIX) & _M64)
        inos, devs = self._ino, self._dev
        while True:
            row = table[at]
            if row < 0 or (inos[row] == ino and devs[row] == dev):
                return row
            at = (at + 1) & mask

    # ------------------------------------------------------------------ rows

    def add(self, nodeid: int, dev: int, ino: int, lookups: int, jslot: int, flags: int,
            ref: Any, blob: bytes | None, stamp: tuple[int, int, int] | None) -> None:
        """Fold an inode in (*flags*: HANDLE, DUE, KEYED). Its handle or name, *blob*, is
        None where its journal record (*jslot*) holds it."""
        flags |= 8  # a row in use has a flag set, whatever the inode's are
        free, rows = self._free, len(self._flags)
        while free:  # an entry past the end (cut off by take) is stale
            row = free.pop()
            if row < rows and not self._flags[row]:
                break
        else:
            row = -1
        if row >= 0:
            self._nodeid[row], self._dev[row], self._ino[row] = nodeid, dev, ino
            self._lookups[row], self._jslot[row], self._flags[row] = lookups, jslot, flags
            self._ref[row] = ref
        else:
            row = rows
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
        self._by_id.insert(self._id_hash(row), row, self._id_hash)
        if flags & KEYED:
            self._by_key.insert(self._key_hash(row), row, self._key_hash)

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
        self._by_id.remove(self._id_hash(row), row, self._id_hash)
        if self._flags[row] & KEYED:
            self._by_key.remove(self._key_hash(row), row, self._key_hash)
        self._flags[row] = 0
        self._ref[row] = None
        self._stamps.pop(row, None)
        self._blobs.pop(row, None)
        self._count -= 1
        if row == len(self._flags) - 1:
            self._cut()
        else:
            self._free.append(row)
        return record

    def rows(self) -> Iterator[int]:
        """The rows in use."""
        flags = self._flags
        return (row for row in range(len(flags)) if flags[row])

    def _cut(self) -> None:
        """Free rows at the end go (the arrays shrink); none left: all given back."""
        if not self._count:
            self._reset()
            trim_heap()  # the arrays were large: the C heap keeps their pages otherwise
            return
        flags = self._flags
        while not flags[-1]:
            for column in (self._nodeid, self._dev, self._ino, self._lookups, self._jslot,
                           flags, self._ref):
                column.pop()
        if len(self._free) > 2 * len(flags):  # mostly stale entries: keep the valid ones
            rows = len(flags)
            self._free = array.array("i", (r for r in self._free if r < rows and not flags[r]))


# ---------------------------------------------------------------- the inode table's use


class InodeTable(Protocol):
    """What folding needs of :class:`qosfs.passthrough.inodes.InodeTable` (its inodes
    are :class:`~qosfs.passthrough.inode.Inode` objects: Any here, as the table's module
    imports this one)."""

    by_id: dict[int, Any]
    by_key: dict[tuple[int, int], Any]
    cold: ColdInodes
    hot_limit: int
    opened_limit: int
    opened_hot: int
    hot_peak: int
    thaws: int
    fold_at: int
    root: Any
    cache: FdCache
    journal: SessionJournal | None

    def evicting(self, entry: Any, fd: int) -> None: ...

    def make(self, nodeid: int, key: tuple[int, int], lookups: int,
             handle: bytes | None) -> Any: ...

    def handle_of(self, fd: int, st: os.stat_result) -> bytes | None: ...

    def new_nodeid(self, st: os.stat_result) -> int: ...


def fold(table: InodeTable) -> None:
    """Fold *table*'s oldest inodes nothing uses into its ``cold``, down to ``hot_limit``
    objects, plus those opened through the mount while fewer than ``opened_limit`` are
    (called every FOLD_BATCH past that: a short pause each time). The opened ones are
    passed over while there is room for them, so a loader's working set is not thawed
    and folded again at every open; a stat walk opens nothing. An inode is
    folded only if no other object refers to it: no open file
    or listing, no request handler (a local variable), no inode naming it as parent
    or entry (counted exactly by its reference count), and if it needs no descriptor
    of its own (a pinned one) and is not stale; its descriptor is evicted first
    (its file handle taken, as at any eviction) and its path memo dropped, as is
    the QoS layer's memo when it is only a memo."""
    room = table.hot_limit + min(table.opened_hot, table.opened_limit)
    excess = len(table.by_id) - room
    table.hot_peak = max(table.hot_peak, len(table.by_id))
    keyed, by_id = table.by_key, table.by_id
    # Opens since the last fold may have made room: then excess is negative, nothing to do.
    for inode in list(itertools.islice(by_id.values(), 4 * max(excess, 0))):  # oldest first
        if excess <= 0:
            break
        if inode.opened and table.opened_hot <= table.opened_limit:
            by_id[inode.nodeid] = by_id.pop(inode.nodeid)  # room for it: passed over
            continue
        memo: InodeCharge | None = inode.qos_memo
        # References: by_id, the list, this loop (_UNUSED), by_key, the descriptor
        # cache. Any other is a user: it must keep seeing this very object.
        is_keyed = keyed.get(inode.key) is inode
        if (inode.opens or inode.stale or inode.parent is not None
                or inode is table.root or (memo is not None and not memo.settled)
                or (inode.handle is None and inode.entry is None)
                or sys.getrefcount(inode) != _UNUSED + is_keyed + (inode.slot >= 0)):
            by_id[inode.nodeid] = by_id.pop(inode.nodeid)  # kept: the next pass starts past it
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
        if inode.opened:
            table.opened_hot -= 1
        excess -= 1
    table.fold_at = max(room, len(by_id)) + min(FOLD_BATCH, table.hot_limit)


def thaw(table: InodeTable, row: int, nodeid: int) -> Any:
    """The cold inode in *row* as an object again (KeyError for -1: unknown)."""
    if row < 0:
        raise KeyError(nodeid)
    nodeid, dev, ino, lookups, jslot, flags, ref, blob, stamp = table.cold.take(row)
    table.thaws += 1
    blob = _blob_of(table.journal, jslot, flags, blob)
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


def _blob_of(journal: SessionJournal | None, jslot: int, flags: int,
             blob: bytes | None) -> bytes | None:
    """A cold row's handle (HANDLE in *flags*) or name: its own *blob*, or else what its
    journal record holds (None if neither has it)."""
    if blob is None and jslot >= 0 and journal is not None:
        name, handle = journal.name_and_handle(jslot)
        blob = handle if flags & HANDLE else name
    return blob


def listed(table: InodeTable, fd: int, st: os.stat_result) -> int:
    """A listing's entry (READDIRPLUS) counted without an inode object where that is
    safe: its node id, *fd* closed; -1, *fd* left to the caller, for the table's
    ``adopt``. Taken without an object are a file that is not a directory and

    - known and folded cold: one more kernel reference in its row and its record, once
      the name is seen to hold the object its handle names (``adopt``'s check: a reused
      inode number is another object);
    - not known, while the table holds its ``hot_limit`` objects already: a cold row at
      once, its handle taken now, where an object would only have its descriptor
      cached (evicting another's) until the next fold folds it.

    A `find` over a big tree otherwise made or thawed an object per entry for the next
    fold to fold: ~45% of the daemon's CPU per entry. A directory keeps its parent in
    its object (``lookup_parent``), so it is always adopted."""
    if stat.S_ISDIR(st.st_mode):
        return -1
    key = (st.st_dev, st.st_ino)
    if key in table.by_key:
        return -1
    journal = table.journal
    if journal is not None and journal.closed:
        return -1  # a handover in progress: cold rows are being thawed (thaw_all)
    row = table.cold.find_key(*key)
    if row >= 0:
        nodeid = _count_listed(table, row, fd, st, journal)
    elif len(table.by_id) >= table.hot_limit:
        nodeid = _add_listed(table, key, fd, st, journal)
    else:
        return -1
    if nodeid >= 0:
        os.close(fd)
    return nodeid


def _count_listed(table: InodeTable, row: int, fd: int, st: os.stat_result,
                  journal: SessionJournal | None) -> int:
    """:func:`listed` of the cold file in *row*: its node id, or -1."""
    cold = table.cold
    nodeid, _, _, lookups, jslot, flags, _, blob, _ = cold.record(row)
    if flags & (HANDLE | DUE) != HANDLE:
        return -1  # known by name: adopt checks and updates the name
    blob = _blob_of(journal, jslot, flags, blob)
    if blob is None or table.handle_of(fd, st) != blob:
        return -1
    cold.set_lookups(row, lookups + 1)
    if journal is not None and jslot >= 0:
        journal.count(jslot, lookups + 1)
    return nodeid


def _add_listed(table: InodeTable, key: tuple[int, int], fd: int, st: os.stat_result,
                journal: SessionJournal | None) -> int:
    """:func:`listed` of a file not known: a new cold row (and record) with one
    reference, as a fold would leave it; its node id, or -1."""
    handle = table.handle_of(fd, st)
    if handle is None:
        return -1  # reopened by name: an object keeps the name
    nodeid = table.new_nodeid(st)
    jslot = -1
    if journal is not None:
        try:
            jslot = journal.put_inode(-1, nodeid, key[0], key[1], 1, False, handle,
                                      NO_SLOT, b"", NO_SLOT)
        except JournalFull:
            return -1
    table.cold.add(nodeid, key[0], key[1], 1, jslot, HANDLE | KEYED, None,
                   None if jslot >= 0 else handle, None)
    return nodeid


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
