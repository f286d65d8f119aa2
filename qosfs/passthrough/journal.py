"""What a daemon that died leaves for the one that takes its mount over: the session
journal.

When the daemon is killed (``kill -9``, the OOM killer, a bug in a native library), the
kernel connection lives on in a keeper (:mod:`qosfs.daemon.takeover.keeper`) and keeps every node
id and file handle it was given. A restarted daemon must answer each of them with the same
backing object, or the job holding it breaks. A planned handover sends the tables over a
socket (:mod:`qosfs.passthrough.transfer`); a crash sends nothing, so the tables are
written down as they change, here:

* every inode the kernel holds a node id of (and every inode one of those names as its
  parent), with the kernel's lookup count, its file handle if it has one, and otherwise
  the (parent, name) it reopens by;
* every open file: its ``fh``, the inode, the open's flags (to reopen it), its owner, its
  QoS flow and charge, and whether the kernel passes it through (and the backing id);
* every open directory;
* every backing id registered with the kernel for passthrough, with its inode: an id kept
  idle after its last open is referenced by no open file's record, and a successor that
  did not know it would leave its file pinned in the kernel until the unmount.

The journal is a file in ``/run/qosfs`` (memory: it must outlive the process, not the
machine, whose reboot ends the mount anyway) mapped shared into the daemon: a record is a
fixed-size slot written with one ``struct.pack_into`` into the mapping, no system call,
and a kill loses nothing written (the page is the file's). A slot is 96 bytes, which holds
an inode's record with a file handle or a name of up to 36 bytes; a longer record takes
as many slots in a row as it needs (a span: at most 512 bytes, as before), and a reader
skips the rest of a span once its first slot is valid. A record rewritten longer than
its span moves to a new one and names the slot it stands for (other records name that
slot, which stays reserved for its lookup count). Slots are reused through free lists,
so the file never needs compacting; when the last slots in use are
freed (the kernel forgot its inodes), the pages past them are given back to ``/run``
(``MADV_REMOVE``). The file costs ~100 bytes per inode known at once (512 before 04).

Torn records: a slot is valid only if its checksum (xxh32 of its body) matches, and the
checksum is written after the body; a record torn by a kill is ignored, and the request
that was writing it was not answered yet (the kernel sends it again). The lookup count sits
outside the checksum and changes with one aligned 8-byte store per lookup or forget.

A record rewritten in place (an inode renamed, or let go) is not torn either, although
its slot is invalid while it changes: the new record is first written whole to slot 0, the
scratch slot, naming the slot it is for; then the slot itself; then the scratch is
cleared. A reader that finds the scratch valid takes it for that slot, so a kill at any
point leaves the old record or the new one, never neither (before, the inode's node id
answered ESTALE after such a kill). Records are written on the event loop's one thread,
so one scratch slot is enough.

Non-idempotent requests (rename, unlink, mkdir, ...) are written down too, by request
id: an intent before the system call and the outcome after it, in a ring of fixed size
after the scratch slot (:mod:`qosfs.passthrough.intents`), so that a successor answers a
request the kernel sends again with what the dead process did instead of doing it twice.

What is not written: an inode's descriptor (reopened from its handle or name), a listing's
snapshot (taken again), the buckets' balances and a streaming open's progress (the open's
charge restarts from where it stood at open).
"""

from __future__ import annotations

import array
import json
import marshal
import mmap
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import xxhash

from qosfs.passthrough.intents import RING_SIZE, IntentRing, read_ring

MAGIC = b"QOSFSJ04"  # 04: 96-byte slots, a longer record spans several
# Read too (a crash of the versions before this one), with 512-byte slots: the intent
# ring after the scratch slot (03); no intents, records from slot 1 (02) or 0 (01).
_MAGIC_512 = b"QOSFSJ03"
_MAGIC_BEFORE_RING = b"QOSFSJ02"
_MAGIC_BEFORE_SCRATCH = b"QOSFSJ01"
HEADER_SIZE = 4096
SLOT_SIZE = 96
_OLD_SLOT_SIZE = 512
MAX_RECORD = 512  # the longest record, its span included (a name of 255, a handle of 128)
_INITIAL_SLOTS = 16384  # 1.5 MiB of address space; the file is sparse until used
_PAGE = mmap.PAGESIZE
_GIVE_BACK = 64 * _PAGE  # pages freed at the end of the slots in use, given back at once

# Header: magic, slot size, next fh (an aligned 8-byte store per open), then the session
# state as JSON (written once, after INIT).
_HEAD = struct.Struct("<8sIxxxxQI")  # magic, slot_size, next_fh, state length
_NEXT_FH_AT = 16
_STATE_AT = 64

# Slot: lookups (outside the checksum) | checksum | body. The body: kind, flags, name
# length, handle length, extra length, entry slot, parent slot, nodeid (or fh), dev, ino,
# aux (open flags, owner), then name, handle and extra bytes.
_LOOKUPS = struct.Struct("<Q")
_CHECK = struct.Struct("<I")
_BODY = struct.Struct("<BBHHHiiQQQQ")
_BODY_AT = 12
_LENGTHS = struct.Struct("<BBHH")  # the body's first fields: kind, flags, name, handle
_VAR_AT = _BODY_AT + _BODY.size
_VAR_ROOM = MAX_RECORD - _VAR_AT

INODE, FILE, DIR, BACKING = 1, 2, 3, 4
IS_DIR = 1
STALE = 2  # let go of (unlinked, or replaced underneath): its node id answers ESTALE
ROOT_SLOT = -2  # a reference to the mount's root (never journaled: it is the source)
NO_SLOT = -1
_SCRATCH = 0  # the span a rewrite goes to first (its lookups field names the target)
_SCRATCH_SLOTS = -(-MAX_RECORD // SLOT_SIZE)  # room for the longest record
_RING_AT = HEADER_SIZE + _SCRATCH_SLOTS * SLOT_SIZE  # the intent ring, in place of slots
FIRST_SLOT = _SCRATCH_SLOTS + -(-RING_SIZE // SLOT_SIZE)  # the first record's
# Where the versions with 512-byte slots (03, 02, 01) put their ring and first record.
_OLD_RING_AT = HEADER_SIZE + _OLD_SLOT_SIZE
_OLD_FIRST = {_MAGIC_512: 1 + RING_SIZE // _OLD_SLOT_SIZE, _MAGIC_BEFORE_RING: 1,
              _MAGIC_BEFORE_SCRATCH: 0}


def span_of(room: int) -> int:
    """How many slots a record with *room* bytes of name, handle and extra takes."""
    return -(-(_VAR_AT + room) // SLOT_SIZE)


@dataclass(frozen=True, slots=True)
class Record:
    """One valid slot, as read back by a successor."""

    slot: int
    kind: int
    flags: int
    lookups: int
    entry_slot: int
    parent_slot: int
    nodeid: int  # a file's or directory's fh for FILE and DIR
    dev: int
    ino: int
    aux: int
    name: bytes
    handle: bytes
    extra: Any  # a FILE's record past its fh, slot and flags (saved()), else ()

    def saved(self) -> tuple[Any, ...]:
        """A FILE's record as it was saved (put_file's tuple: OpenRecord.load reads it)."""
        return (self.nodeid, self.entry_slot, self.aux, *self.extra)


class JournalFull(Exception):
    """A record does not fit a span (a name and handle longer than any seen in practice)."""


def _fits(room: int) -> int:
    """The span of a record with *room* variable bytes; JournalFull past MAX_RECORD."""
    if room > _VAR_ROOM:
        raise JournalFull(f"a record of {room} bytes (at most {_VAR_ROOM})")
    return span_of(room)


class SessionJournal:
    """The journal of one mount, open for writing by the daemon serving it.

    Args:
        path: The file (made or truncated: a new journal for a new session or a new
            process; a successor reads the old one with `read_journal` first).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        tmp = f"{path}.new"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            self._capacity = _INITIAL_SLOTS
            os.ftruncate(fd, HEADER_SIZE + self._capacity * SLOT_SIZE)
            self._map = mmap.mmap(fd, HEADER_SIZE + self._capacity * SLOT_SIZE)
        finally:
            os.close(fd)
        _HEAD.pack_into(self._map, 0, MAGIC, SLOT_SIZE, 1, 0)
        # Per slot: its span if a record starts there, 255 if a span covers it, 0 free.
        self._spans = bytearray(self._capacity)
        # Freed slots by span (1: most), lowest last; an entry is checked against _spans
        # when taken (a slot the end gave back and handed out again is still listed).
        self._free: dict[int, list[int]] = {}
        self._free_one = array.array("i")
        self._home: dict[int, int] = {}  # a slot whose record moved -> where it is now
        self._high = FIRST_SLOT  # slots below this have been handed out at least once
        self._touched = FIRST_SLOT  # slots below this may hold pages (given back: _high)
        self.intents = IntentRing(self._map, _RING_AT)
        self.used = 0
        self.ending: Callable[[bool], None] | None = None  # told at close (its reader)
        os.rename(tmp, path)  # whole or not at all: a reader never sees a half header

    # ------------------------------------------------------------------ slots

    def _take(self, span: int = 1) -> int:
        spans = self._spans
        stack = self._free_one if span == 1 else self._free.get(span)
        while stack:
            slot = stack.pop()
            if slot + span <= self._high and not any(spans[slot:slot + span]):
                break
        else:
            slot = self._high
            while slot + span > self._capacity:
                self._grow()
            self._high = slot + span
            self._touched = max(self._touched, self._high)
        spans[slot] = span
        if span > 1:
            spans[slot + 1:slot + span] = b"\xff" * (span - 1)
        self.used += 1
        return slot

    def _grow(self) -> None:
        """Double the file (mremap: the mapping keeps its contents)."""
        self._capacity *= 2
        self._map.resize(HEADER_SIZE + self._capacity * SLOT_SIZE)
        self._spans.extend(bytes(len(self._spans)))

    def free(self, slot: int) -> None:
        """The record in *slot* is gone (its checksum is cleared: never valid again)."""
        if self._map.closed:
            return
        moved = self._home.pop(slot, None)
        if moved is not None:
            self._release(moved)
        self._release(slot)
        self.used -= 1

    def _release(self, slot: int) -> None:
        m, spans = self._map, self._spans
        span = spans[slot]
        for at in range(slot, slot + span):  # no piece of it may pass for a record
            _CHECK.pack_into(m, HEADER_SIZE + at * SLOT_SIZE + 8, 0)
        spans[slot:slot + span] = bytes(span)
        if slot + span < self._high:
            if span == 1:
                self._free_one.append(slot)
            else:
                self._free.setdefault(span, []).append(slot)
            return
        high = slot  # the last slots in use: the end comes down
        while high > FIRST_SLOT and not spans[high - 1]:
            high -= 1
        self._high = high
        self._give_back()

    def _give_back(self) -> None:
        """Return the pages past the slots in use to the file system (``/run``'s memory)."""
        start = -(-(HEADER_SIZE + self._high * SLOT_SIZE) // _PAGE) * _PAGE
        end = HEADER_SIZE + self._touched * SLOT_SIZE
        if end - start < _GIVE_BACK and self._high > FIRST_SLOT:
            return
        if end > start:
            self._map.madvise(mmap.MADV_REMOVE, start, -(-(end - start) // _PAGE) * _PAGE)
        self._touched = self._high
        # Slots past the end are listed free no longer (they would be skipped anyway).
        high, spans = self._high, self._spans
        self._free_one = array.array("i", (s for s in self._free_one
                                           if s < high and not spans[s]))
        for span, stack in self._free.items():
            stack[:] = [s for s in stack if s + span <= high and not spans[s]]

    def _write(self, slot: int, kind: int, flags: int, entry_slot: int, parent_slot: int,
               nodeid: int, dev: int, ino: int, aux: int, name: bytes, handle: bytes,
               extra: bytes) -> None:
        room = len(name) + len(handle) + len(extra)
        at = HEADER_SIZE + slot * SLOT_SIZE
        m = self._map
        _CHECK.pack_into(m, at + 8, 0)  # invalid while the body changes
        _BODY.pack_into(m, at + _BODY_AT, kind, flags, len(name), len(handle), len(extra),
                        entry_slot, parent_slot, nodeid, dev, ino, aux)
        end = at + _VAR_AT + room
        m[at + _VAR_AT:end] = name + handle + extra
        _CHECK.pack_into(m, at + 8, xxhash.xxh32_intdigest(m[at + _BODY_AT:end]) or 1)

    # ------------------------------------------------------------------ records

    def put_inode(self, slot: int, nodeid: int, dev: int, ino: int, lookups: int,
                  is_dir: bool, handle: bytes | None, entry_slot: int, name: bytes,
                  parent_slot: int, stale: bool = False) -> int:
        """Write an inode's record (in *slot*, or a new one if it is -1); returns the slot."""
        flags = (IS_DIR if is_dir else 0) | (STALE if stale else 0)
        handle = handle or b""
        span = _fits(len(name) + len(handle))
        if slot < 0:
            slot = self._take(span)
            self.count(slot, lookups)
            self._write(slot, INODE, flags, entry_slot, parent_slot, nodeid, dev, ino, 0,
                        name, handle, b"")
            return slot
        # A rewrite (rename, let go): the new record goes whole to the scratch first, so
        # that a kill while the slot itself is invalid leaves it there to be read.
        scratch = HEADER_SIZE + _SCRATCH * SLOT_SIZE
        _LOOKUPS.pack_into(self._map, scratch, slot)
        self._write(_SCRATCH, INODE, flags, entry_slot, parent_slot, nodeid, dev, ino, 0,
                    name, handle, b"")
        self.count(slot, lookups)
        at = self._home.get(slot, slot)  # where its bytes are (moved: elsewhere)
        room = self._spans[at]
        if span > room:
            # Longer than its span (renamed to a longer name): the record moves to a new
            # span and says which slot it stands for (aux), as other records name that
            # slot, and the slot itself stays reserved for its lookup count.
            moved = self._take(span)
            self.used -= 1
            self._write(moved, INODE, flags, entry_slot, parent_slot, nodeid, dev, ino,
                        slot + 1, name, handle, b"")
            if at != slot:
                self._release(at)
            else:
                _CHECK.pack_into(self._map, HEADER_SIZE + at * SLOT_SIZE + 8, 0)
            self._home[slot] = moved
        else:
            self._write(at, INODE, flags, entry_slot, parent_slot, nodeid, dev, ino,
                        0 if at == slot else slot + 1, name, handle, b"")
            for rest in range(at + span, at + room):  # what the longer one left
                _CHECK.pack_into(self._map, HEADER_SIZE + rest * SLOT_SIZE + 8, 0)
        _CHECK.pack_into(self._map, scratch + 8, 0)
        return slot

    def name_and_handle(self, slot: int) -> tuple[bytes, bytes]:
        """The name and file handle the inode record of *slot* holds (a cold inode keeps
        them only here: :mod:`qosfs.passthrough.cold_inodes`)."""
        at = HEADER_SIZE + self._home.get(slot, slot) * SLOT_SIZE
        _, _, name_len, handle_len = _LENGTHS.unpack_from(self._map, at + _BODY_AT)
        var = at + _VAR_AT
        return (self._map[var:var + name_len],
                self._map[var + name_len:var + name_len + handle_len])

    def count(self, slot: int, lookups: int) -> None:
        """The kernel's lookup count of the inode in *slot* (one aligned 8-byte store)."""
        _LOOKUPS.pack_into(self._map, HEADER_SIZE + slot * SLOT_SIZE, lookups)

    def put_file(self, saved: tuple[Any, ...]) -> int:
        """Write an open file's record (:meth:`qosfs.passthrough.handle_table.OpenRecord.
        save`'s tuple: its fh, inode slot and flags go to the slot's own fields, the rest
        after them); returns its slot (free it at release)."""
        extra = marshal.dumps(saved[3:])
        slot = self._take(_fits(len(extra)))
        # marshal, not JSON: 10x cheaper per open (json.dumps with separators builds an
        # encoder per call), and the reader is this same Python (a journal another one
        # cannot read is refused whole: the connection is let go, never misread).
        self._write(slot, FILE, 0, saved[1], NO_SLOT, saved[0], 0, 0, saved[2], b"", b"",
                    extra)
        return slot

    def put_dir(self, fh: int, inode_slot: int, owner: int) -> int:
        """Write an open directory's record; returns its slot."""
        slot = self._take()
        self._write(slot, DIR, 0, inode_slot, NO_SLOT, fh, 0, 0, owner & 0xFFFFFFFFFFFFFFFF,
                    b"", b"", b"")
        return slot

    def put_backing(self, nodeid: int, backing_id: int) -> int:
        """Write a backing id's record (the inode it was registered for); returns its slot
        (free it when the id is closed). Once per registration, not per open."""
        slot = self._take()
        self._write(slot, BACKING, 0, NO_SLOT, NO_SLOT, nodeid, 0, 0, backing_id, b"", b"",
                    b"")
        return slot

    def next_fh(self, fh: int) -> None:
        """The next fh the operations will hand out (an aligned 8-byte store)."""
        _LOOKUPS.pack_into(self._map, _NEXT_FH_AT, fh)

    def session(self, state: dict[str, Any]) -> None:
        """The session's description (INIT state, source, mountpoint): once, after INIT."""
        data = json.dumps(state, separators=(",", ":")).encode()
        if _STATE_AT + len(data) > HEADER_SIZE:
            raise JournalFull(f"session state of {len(data)} bytes")
        self._map[_STATE_AT:_STATE_AT + len(data)] = data
        struct.pack_into("<I", self._map, 24, len(data))

    @property
    def closed(self) -> bool:
        return self._map.closed

    def close(self, remove: bool) -> None:
        """Unmap; *remove* the file too (the mount is gone: nothing to recover). Tells
        ``ending`` first, with *remove*, while the records can still be read (cold inodes
        keep their names and handles only here: :mod:`qosfs.passthrough.cold_inodes`)."""
        if self.ending is not None and not self._map.closed:
            self.ending(remove)
            self.ending = None
        if not self._map.closed:
            self._map.close()
        if remove:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


@dataclass(frozen=True, slots=True)
class Journal:
    """A journal as read back: the session and every valid record by slot."""

    session: dict[str, Any]
    next_fh: int
    records: dict[int, Record]
    ring: bytes = b""  # the intent ring as it was (a successor carries it over)
    outcomes: dict[int, int] = field(default_factory=dict)  # its requests: read_ring's

    def of_kind(self, kind: int) -> Iterator[Record]:
        return (r for r in self.records.values() if r.kind == kind)


class JournalError(Exception):
    """The file is not a journal this version reads."""


def _record_at(path: str, data: memoryview, at_slot: int, slot: int,
               slot_size: int) -> Record | None:
    """The record in slot *at_slot*, as the record of *slot* (its lookup count is that
    slot's; -1: of the slot it says it stands for, if it moved, else *at_slot*), or None
    if the slot holds no valid one."""
    at = HEADER_SIZE + at_slot * slot_size
    (check,) = _CHECK.unpack_from(data, at + 8)
    if not check:
        return None
    (kind, flags, name_len, handle_len, extra_len, entry_slot, parent_slot, nodeid, dev,
     ino, aux) = _BODY.unpack_from(data, at + _BODY_AT)
    room = name_len + handle_len + extra_len
    end = at + _VAR_AT + room
    if not kind or room > _VAR_ROOM or end > len(data):
        return None
    if (xxhash.xxh32_intdigest(data[at + _BODY_AT:end]) or 1) != check:
        return None  # torn by the kill: its request was never answered
    if slot < 0:
        slot, aux = (aux - 1, 0) if kind == INODE and aux else (at_slot, aux)
    var = at + _VAR_AT
    name = bytes(data[var:var + name_len])
    handle = bytes(data[var + name_len:var + name_len + handle_len])
    extra_raw = bytes(data[var + name_len + handle_len:end])
    (lookups,) = _LOOKUPS.unpack_from(data, HEADER_SIZE + slot * slot_size)
    try:
        extra = marshal.loads(extra_raw) if extra_raw else ()
    except (EOFError, ValueError, TypeError):
        raise JournalError(f"{path}: slot {at_slot} holds what this Python cannot read "
                           "(written by another version?)") from None
    return Record(slot, kind, flags, lookups, entry_slot, parent_slot, nodeid, dev, ino,
                  aux, name, handle, extra)


def _extra_len(data: memoryview, slot: int) -> int:
    (length,) = struct.unpack_from("<H", data, HEADER_SIZE + slot * SLOT_SIZE + _BODY_AT + 6)
    return int(length)


def read_journal(path: str) -> Journal:
    """Read the journal at *path* (a dead daemon's); JournalError if it is none."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < HEADER_SIZE:
        raise JournalError(f"{path}: {len(data)} bytes, no journal")
    magic, slot_size, next_fh, state_len = _HEAD.unpack_from(data, 0)
    if (magic, slot_size) != (MAGIC, SLOT_SIZE) and (
            magic not in _OLD_FIRST or slot_size != _OLD_SLOT_SIZE):
        raise JournalError(f"{path}: not a qosfs session journal of this version")
    scratch = None if magic == _MAGIC_BEFORE_SCRATCH else _SCRATCH
    first = FIRST_SLOT if magic == MAGIC else _OLD_FIRST[magic]
    ring_at = {MAGIC: _RING_AT, _MAGIC_512: _OLD_RING_AT}.get(magic)
    ring = data[ring_at:ring_at + RING_SIZE] if ring_at is not None else b""
    if not state_len:
        raise JournalError(f"{path}: the session was never initialised")
    session = json.loads(data[_STATE_AT:_STATE_AT + state_len])
    records: dict[int, Record] = {}
    view = memoryview(data)
    slots = (len(data) - HEADER_SIZE) // slot_size
    slot = first
    while slot < slots:
        record = _record_at(path, view, slot, -1 if magic == MAGIC else slot, slot_size)
        if record is None:
            slot += 1
            continue
        records[record.slot] = record
        # The rest of its span holds its bytes, not records (one slot of 512 before 04).
        slot += 1 if magic != MAGIC else span_of(
            len(record.name) + len(record.handle) + _extra_len(view, slot))
    if scratch is not None:
        (target,) = _LOOKUPS.unpack_from(data, HEADER_SIZE + scratch * slot_size)
        if first <= target < slots:  # a rewrite the kill interrupted: the new one wins
            rewritten = _record_at(path, view, scratch, target, slot_size)
            if rewritten is not None:
                records[target] = rewritten
    return Journal(session, next_fh, records, ring, read_ring(ring))
