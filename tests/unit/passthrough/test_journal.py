"""The session journal a killed daemon leaves for its successor: records read back as
written, torn ones ignored, and an inode table written down through lookups, forgets and
renames rebuilt by a fresh table with the same node ids, counts and ways to reopen."""

from __future__ import annotations

import gc
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from qosfs.passthrough import journal as journal_module
from qosfs.passthrough.inode import Inode
from qosfs.passthrough.inode_takeover import rebuild_inodes
from qosfs.passthrough.inodes import InodeTable
from qosfs.passthrough.journal import (
    DIR,
    FILE,
    HEADER_SIZE,
    INODE,
    IS_DIR,
    NO_SLOT,
    ROOT_SLOT,
    SLOT_SIZE,
    STALE,
    Journal,
    JournalError,
    JournalFull,
    SessionJournal,
    read_journal,
)
from qosfs.passthrough.recovery import _signed
from tests.inprocess_fs import open_fds

SESSION = {"source": "/src", "mountpoint": "/mnt", "init": {"max_write": 1 << 20}}
BUDGET = 8  # the descriptor cache's smallest capacity


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[SessionJournal]:
    j = SessionJournal(str(tmp_path / "session.journal"))
    j.session(SESSION)
    yield j
    j.close(remove=True)


def put_node(j: SessionJournal, nodeid: int, *, lookups: int = 1, handle: bytes | None = None,
             name: bytes = b"", entry: int = NO_SLOT, parent: int = NO_SLOT,
             is_dir: bool = False, slot: int = -1) -> int:
    return j.put_inode(slot, nodeid, 2049, nodeid, lookups, is_dir, handle, entry, name,
                       parent)


def slot_at(slot: int) -> int:
    return HEADER_SIZE + slot * SLOT_SIZE


def poke(path: str, at: int, data: bytes) -> None:
    """Change bytes of the file the way a kill in mid-write leaves them."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, at)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- the file format


def test_records_of_every_kind_read_back_as_written(journal: SessionJournal) -> None:
    handle = bytes(range(1, 29))  # an ext4-sized file handle
    d = put_node(journal, 100, lookups=3, handle=handle, parent=ROOT_SLOT, is_dir=True)
    f = put_node(journal, 101, lookups=2, name=b"weights.bin", entry=d)
    extra = (["train", "t1", 0], (0, 4096, -1, 0, 0, 0, 0), 7, 0, False, 1, None)
    o = journal.put_file((5, f, os.O_RDWR | os.O_CLOEXEC, *extra))
    od = journal.put_dir(6, ROOT_SLOT, -1)  # an owner of -1: no quota owner
    journal.next_fh(7)
    back = read_journal(journal.path)
    assert back.session == SESSION and back.next_fh == 7
    assert set(back.records) == {d, f, o, od} and len({d, f, o, od}) == 4
    rd, rf, ro, rod = (back.records[s] for s in (d, f, o, od))
    assert (rd.kind, rd.flags, rd.nodeid, rd.ino, rd.lookups, rd.handle, rd.name,
            rd.parent_slot, rd.entry_slot) == (INODE, IS_DIR, 100, 100, 3, handle, b"",
                                               ROOT_SLOT, NO_SLOT)
    assert (rf.kind, rf.flags, rf.nodeid, rf.lookups, rf.handle, rf.name, rf.entry_slot,
            rf.parent_slot) == (INODE, 0, 101, 2, b"", b"weights.bin", d, NO_SLOT)
    assert (ro.kind, ro.nodeid, ro.entry_slot, ro.aux, ro.extra) == (
        FILE, 5, f, os.O_RDWR | os.O_CLOEXEC, extra)
    assert (rod.kind, rod.nodeid, rod.entry_slot) == (DIR, 6, ROOT_SLOT)
    assert _signed(rod.aux) == -1  # what recovery makes of the stored owner
    assert [r.slot for r in back.of_kind(INODE)] == [d, f]


def test_a_freed_record_is_gone_and_its_slot_is_reused(journal: SessionJournal) -> None:
    a, b = put_node(journal, 10), put_node(journal, 11)
    journal.free(a)
    assert set(read_journal(journal.path).records) == {b} and journal.used == 1
    c = put_node(journal, 12)
    assert c == a  # the free list first: the file does not grow with churn
    back = read_journal(journal.path)
    assert back.records[c].nodeid == 12 and back.records[b].nodeid == 11


@pytest.mark.parametrize("tear", ["checksum", "body", "name", "lengths"])
def test_a_torn_record_is_ignored(journal: SessionJournal, tear: str) -> None:
    kept = put_node(journal, 10, name=b"kept", entry=ROOT_SLOT)
    torn = put_node(journal, 11, name=b"torn", entry=ROOT_SLOT)
    at = slot_at(torn)
    if tear == "checksum":  # the checksum itself half written
        poke(journal.path, at + 8, b"\x5a")
    elif tear == "body":  # the body rewritten after its checksum: nodeid
        poke(journal.path, at + 12 + 16, struct.pack("<Q", 99))
    elif tear == "name":  # the variable part changed
        poke(journal.path, at + 12 + journal_module._BODY.size, b"X")
    else:  # a name length no slot can hold
        poke(journal.path, at + 12 + 2, struct.pack("<H", SLOT_SIZE))
    assert set(read_journal(journal.path).records) == {kept}


class Killed(Exception):
    """The process died here (the mapping keeps what was written)."""


@pytest.mark.parametrize("killed_in", ["scratch", "slot", "neither"])
def test_a_record_rewritten_in_place_is_never_lost_to_a_kill(
        journal: SessionJournal, monkeypatch: pytest.MonkeyPatch, killed_in: str) -> None:
    """A rename rewrites the inode's record in its own slot. Before, the slot was invalid
    while it changed, and a kill then lost the record (its node id answered ESTALE after
    recovery). Now a kill leaves the old record or the new one, whole."""
    parent = put_node(journal, 10, is_dir=True, parent=ROOT_SLOT)
    node = put_node(journal, 11, lookups=4, name=b"old", entry=parent)
    journal.count(node, 5)
    fills = []
    real_write = SessionJournal._write

    def write(self: SessionJournal, slot: int, *record: Any) -> None:
        fills.append(slot)
        if (killed_in, len(fills)) in (("scratch", 1), ("slot", 2)):
            at = slot_at(slot)  # torn: invalid, a body without its name
            journal_module._CHECK.pack_into(self._map, at + 8, 0)
            journal_module._BODY.pack_into(self._map, at + journal_module._BODY_AT, 1, 0,
                                           len(record[-3]), 0, 0, *record[2:8])
            raise Killed
        real_write(self, slot, *record)

    monkeypatch.setattr(SessionJournal, "_write", write)
    try:
        put_node(journal, 11, lookups=5, name=b"new-name", entry=parent, slot=node)
    except Killed:
        pass
    assert fills[:2] == [0, node][:len(fills)]  # the scratch first, then the slot
    back = read_journal(journal.path).records
    assert set(back) == {parent, node}
    expected = b"old" if killed_in == "scratch" else b"new-name"
    assert (back[node].name, back[node].nodeid, back[node].lookups,
            back[node].entry_slot) == (expected, 11, 5, parent)


def as_version(journal: SessionJournal, magic: bytes, slots: list[int]) -> list[int]:
    """Rewrite *journal*'s file as a daemon of a version with 512-byte slots wrote it:
    the records of *slots* one to a slot from that version's first one (the intent ring
    after the scratch slot for 03). Returns their slots there."""
    old = 512
    first = {b"QOSFSJ03": 1 + journal_module.RING_SIZE // old, b"QOSFSJ02": 1,
             b"QOSFSJ01": 0}[magic]
    with open(journal.path, "rb") as f:
        data = f.read()
    out = bytearray(data[:HEADER_SIZE] + bytes((first + len(slots)) * old))
    out[0:8] = magic
    out[8:12] = struct.pack("<I", old)
    for i, slot in enumerate(slots):
        at = HEADER_SIZE + (first + i) * old
        out[at:at + old] = data[slot_at(slot):slot_at(slot) + old]
    Path(journal.path).write_bytes(out)
    return [first + i for i in range(len(slots))]


@pytest.mark.parametrize("magic", [b"QOSFSJ01", b"QOSFSJ02", b"QOSFSJ03"])
def test_a_journal_of_a_version_with_512_byte_slots_is_read(
        journal: SessionJournal, magic: bytes) -> None:
    """A daemon of a previous version that crashed left its records one to a 512-byte
    slot: its successor of this version takes its mount over all the same."""
    d = put_node(journal, 10, lookups=7, handle=b"h" * 16, parent=ROOT_SLOT, is_dir=True)
    f = put_node(journal, 11, lookups=2, name=b"n" * 200, entry=d)  # a span of 3 here
    journal.next_fh(9)
    new_d, new_f = as_version(journal, magic, [d, f])
    back = read_journal(journal.path)
    assert set(back.records) == {new_d, new_f} and back.next_fh == 9
    assert (back.records[new_d].handle, back.records[new_d].lookups) == (b"h" * 16, 7)
    assert (back.records[new_f].name, back.records[new_f].lookups) == (b"n" * 200, 2)


def test_records_longer_than_a_slot_span_several_and_read_back(
        journal: SessionJournal) -> None:
    short = put_node(journal, 10, name=b"a", entry=ROOT_SLOT)
    long = put_node(journal, 11, name=b"b" * 255, handle=b"h" * 128, entry=ROOT_SLOT)
    after = put_node(journal, 12, name=b"c", entry=ROOT_SLOT)
    assert after - long == journal_module.span_of(255 + 128) > 1
    back = read_journal(journal.path).records
    assert set(back) == {short, long, after}
    assert (back[long].name, back[long].handle) == (b"b" * 255, b"h" * 128)
    journal.free(long)
    assert set(read_journal(journal.path).records) == {short, after}
    reused = put_node(journal, 13, name=b"d" * 255, handle=b"g" * 128, entry=ROOT_SLOT)
    assert reused == long  # a freed span of the same length is taken again
    assert read_journal(journal.path).records[reused].name == b"d" * 255


def test_a_record_renamed_longer_than_its_span_moves_and_keeps_its_slot(
        journal: SessionJournal) -> None:
    """Other records (children, open files) name an inode's slot: a rename that no
    longer fits moves the bytes, never the slot, and the lookup count stays there."""
    node = put_node(journal, 11, lookups=3, name=b"short", entry=ROOT_SLOT)
    blocker = put_node(journal, 12, name=b"next", entry=ROOT_SLOT)
    opened = journal.put_file((5, node, os.O_RDONLY))
    assert put_node(journal, 11, lookups=3, name=b"x" * 250, entry=ROOT_SLOT,
                    slot=node) == node
    journal.count(node, 4)
    back = read_journal(journal.path).records
    assert set(back) == {node, blocker, opened}
    assert (back[node].name, back[node].lookups, back[node].nodeid) == (b"x" * 250, 4, 11)
    assert back[opened].entry_slot == node
    put_node(journal, 11, lookups=4, name=b"y", entry=ROOT_SLOT, slot=node)  # shorter again
    back = read_journal(journal.path).records
    assert set(back) == {node, blocker, opened} and back[node].name == b"y"
    journal.free(node)
    assert set(read_journal(journal.path).records) == {blocker, opened}
    assert journal.used == 2


def test_freeing_the_last_records_gives_their_pages_back(journal: SessionJournal) -> None:
    slots = [put_node(journal, 1000 + i, name=b"n%d" % i, entry=ROOT_SLOT)
             for i in range(20000)]
    grown = os.stat(journal.path).st_blocks
    for slot in slots:
        journal.free(slot)
    assert journal.used == 0
    assert os.stat(journal.path).st_blocks * 512 < (grown * 512) // 10
    assert put_node(journal, 7, name=b"again", entry=ROOT_SLOT) == slots[0]
    assert read_journal(journal.path).records[slots[0]].name == b"again"


def test_the_lookup_count_changes_without_invalidating_the_record(
        journal: SessionJournal) -> None:
    slot = put_node(journal, 10, lookups=1, name=b"f", entry=ROOT_SLOT)
    for count in (2, 40, 0):
        journal.count(slot, count)
        rec = read_journal(journal.path).records[slot]
        assert (rec.lookups, rec.nodeid, rec.name) == (count, 10, b"f")
    put_node(journal, 10, lookups=5, name=b"g", entry=ROOT_SLOT, slot=slot)  # rewritten
    rec = read_journal(journal.path).records[slot]
    assert (rec.lookups, rec.name) == (5, b"g")


def test_the_file_grows_past_its_first_size_and_keeps_every_record(
        journal: SessionJournal) -> None:
    initial = journal_module._INITIAL_SLOTS
    first = os.stat(journal.path).st_size
    slots = [put_node(journal, 1000 + i, name=b"n%d" % i, entry=ROOT_SLOT)
             for i in range(initial + 10)]
    assert os.stat(journal.path).st_size > first == HEADER_SIZE + initial * SLOT_SIZE
    journal.count(slots[3], 9)  # stores before and after the growth land in the file
    journal.count(slots[-1], 8)
    records = read_journal(journal.path).records
    assert len(records) == initial + 10
    assert all(records[s].nodeid == 1000 + i and records[s].name == b"n%d" % i
               for i, s in enumerate(slots))
    assert (records[slots[3]].lookups, records[slots[-1]].lookups) == (9, 8)


def test_an_oversize_record_is_refused_and_writes_nothing(journal: SessionJournal) -> None:
    with pytest.raises(JournalFull):
        put_node(journal, 10, handle=b"h" * 128, name=b"n" * 400, entry=ROOT_SLOT)
    with pytest.raises(JournalFull):
        journal.put_file((3, ROOT_SLOT, 0, "x" * journal_module.MAX_RECORD))
    with pytest.raises(JournalFull):
        journal.session({"source": "s" * HEADER_SIZE})
    longest = put_node(journal, 11, handle=b"h" * 128, name=b"n" * 255, entry=ROOT_SLOT)
    assert read_journal(journal.path).records[longest].name == b"n" * 255  # NAME_MAX fits


def test_a_journal_without_its_session_is_refused(tmp_path: Path) -> None:
    j = SessionJournal(str(tmp_path / "j"))
    try:
        put_node(j, 10)
        with pytest.raises(JournalError, match="never initialised"):
            read_journal(j.path)
    finally:
        j.close(remove=False)
    assert os.path.exists(tmp_path / "j")
    SessionJournal(str(tmp_path / "j")).close(remove=True)
    assert not os.path.exists(tmp_path / "j")


@pytest.mark.parametrize("content", [b"", b"QOSFSJ01", b"\0" * HEADER_SIZE * 2,
                                     b"#!/bin/sh\n" * 1000])
def test_a_file_that_is_not_a_journal_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "other"
    path.write_bytes(content)
    with pytest.raises(JournalError):
        read_journal(str(path))


def test_another_slot_size_is_refused(journal: SessionJournal) -> None:
    poke(journal.path, 8, struct.pack("<I", SLOT_SIZE * 2))
    with pytest.raises(JournalError, match="version"):
        read_journal(journal.path)


# ---------------------------------------------------------------------- the inode table


@dataclass
class Source:
    """A directory with a journaled inode table over it, as a serving daemon has."""

    path: Path
    root_fd: int
    table: InodeTable
    journal: SessionJournal
    successors: list[InodeTable]  # tables rebuilt from the journal, closed at the end

    def look(self, parent: Inode, name: str) -> Inode:
        """What a LOOKUP does: resolve one name under *parent*, count one reference."""
        fd, st = InodeTable.resolve(parent.fd, os.fsencode(name))
        return self.table.adopt(fd, st, (parent, os.fsencode(name)))

    def read(self) -> Journal:
        return read_journal(self.journal.path)

    def successor(self) -> tuple[InodeTable, dict[int, Inode]]:
        """A fresh table, as a restarted daemon makes, rebuilt from the journal."""
        table = InodeTable(self.root_fd, BUDGET)
        table.handles = self.table.handles
        self.successors.append(table)
        return table, rebuild_inodes(table, list(self.read().of_kind(INODE)))


@pytest.fixture
def source(tmp_path: Path) -> Iterator[Source]:
    before = open_fds()
    (tmp_path / "src").mkdir()
    root_fd = os.open(tmp_path / "src", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    table = InodeTable(root_fd, BUDGET)
    journal = SessionJournal(str(tmp_path / "session.journal"))
    journal.session(SESSION)
    table.attach_journal(journal)
    src = Source(tmp_path / "src", root_fd, table, journal, [])
    yield src
    for t in (table, *src.successors):
        t.close_all()
    journal.close(remove=True)
    os.close(root_fd)
    assert open_fds() == before


@pytest.fixture
def handles(source: Source) -> Source:
    if not source.table.handles:
        pytest.skip("no file handles here (not root, or the filesystem exports none)")
    return source


@pytest.fixture
def names_only(source: Source) -> Source:
    """A table that reopens evicted inodes by name, as on a source without handles."""
    source.table.handles = False
    return source


def known(table: InodeTable) -> dict[int, int]:
    """Node id -> lookup count of every inode the kernel holds (the root aside)."""
    return {n: i.lookups for n, i in table.by_id.items() if i is not table.root}


@pytest.mark.parametrize("kind", ["handles", "names_only"])
def test_a_rebuilt_table_has_the_same_node_ids_and_counts(
        request: pytest.FixtureRequest, kind: str) -> None:
    src: Source = request.getfixturevalue(kind)
    for path in ("a/b", "c"):
        (src.path / path).mkdir(parents=True)
    for path in ("a/f", "a/b/g", "c/h", "top"):
        (src.path / path).write_bytes(path.encode())
    a, c = src.look(src.table.root, "a"), src.look(src.table.root, "c")
    b = src.look(a, "b")
    f, g, h = src.look(a, "f"), src.look(b, "g"), src.look(c, "h")
    top = src.look(src.table.root, "top")
    for _ in range(3):
        src.look(a, "f")  # counted again: one store each
    src.look(src.table.root, "a")
    src.table.forget(g.nodeid, 1)  # the kernel forgot it: its record goes with it
    src.table.forget(f.nodeid, 2)
    src.table.lookup_parent(b)  # a '..' counts a reference to a
    del g
    gc.collect()
    os.rename(src.path / "top", src.path / "c" / "moved")  # a RENAME through the mount
    src.table.renamed(c, b"moved")
    before = known(src.table)
    assert before == {a.nodeid: 3, b.nodeid: 1, c.nodeid: 1, f.nodeid: 2, h.nodeid: 1,
                      top.nodeid: 1}
    table, _ = src.successor()
    assert known(table) == before
    for nodeid in before:
        new = table.get(nodeid)
        assert os.fstat(new.fd).st_ino == nodeid  # reopened: the very same object
    new_b = table.get(b.nodeid)
    assert new_b.parent is table.get(a.nodeid) and table.get(a.nodeid).parent is table.root
    assert table.lookup_parent(new_b) is table.get(a.nodeid)
    assert table.get(top.nodeid).entry in (None, (table.get(c.nodeid), b"moved"))


def test_an_evicted_file_is_reopened_by_its_handle_after_a_rename_underneath(
        handles: Source) -> None:
    (handles.path / "f").write_bytes(b"data")
    f = handles.look(handles.table.root, "f")
    assert f.handle is None and f.handle_due  # taken at eviction, not at lookup
    rec = handles.read().records[f.jslot]
    assert (rec.handle, rec.name, rec.entry_slot) == (b"", b"f", ROOT_SLOT)
    handles.table.cache.shrink(0)  # evicted: its handle is taken and written down
    assert f.handle is not None
    rec = handles.read().records[f.jslot]
    assert (rec.handle, rec.name) == (f.handle, b"")
    os.rename(handles.path / "f", handles.path / "elsewhere")  # not through the mount
    table, _ = handles.successor()
    new = table.get(f.nodeid)
    assert new.handle == f.handle and new.cached_fd < 0
    assert os.fstat(new.fd).st_ino == f.nodeid and table.reopens == 1


def test_a_file_known_by_name_is_reopened_by_that_name_and_checked(
        names_only: Source) -> None:
    src = names_only
    (src.path / "d").mkdir()
    for name in ("kept", "replaced"):
        (src.path / "d" / name).write_bytes(name.encode())
    d = src.look(src.table.root, "d")
    kept, replaced = src.look(d, "kept"), src.look(d, "replaced")
    (src.path / "d" / "new").write_bytes(b"another object")  # another inode number
    os.replace(src.path / "d" / "new", src.path / "d" / "replaced")
    table, _ = src.successor()
    new_kept = table.get(kept.nodeid)
    assert new_kept.handle is None and new_kept.entry == (table.get(d.nodeid), b"kept")
    assert os.fstat(new_kept.fd).st_ino == kept.nodeid
    stale = table.get(replaced.nodeid)
    with pytest.raises(OSError, match="Stale"):
        stale.fd  # noqa: B018 (the property reopens): its name holds another object now


def test_an_inode_frees_its_record_when_it_dies_but_not_while_named_as_a_parent(
        source: Source) -> None:
    (source.path / "a" / "b").mkdir(parents=True)
    (source.path / "a" / "f").write_bytes(b"")
    a = source.look(source.table.root, "a")
    b, f = source.look(a, "b"), source.look(a, "f")
    a_slot, b_slot, f_slot = a.jslot, b.jslot, f.jslot
    assert {a_slot, b_slot, f_slot} <= set(source.read().records)
    source.table.forget(f.nodeid, 1)
    del f
    gc.collect()
    assert f_slot not in source.read().records and source.journal.used == 2
    source.table.forget(a.nodeid, 1)  # forgotten, but b's parent: '..' must find it
    a_nodeid = a.nodeid
    del a
    gc.collect()
    records = source.read().records
    assert records[a_slot].lookups == 0 and records[a_slot].nodeid == a_nodeid
    assert records[b_slot].parent_slot == a_slot
    table, nodes = source.successor()
    assert a_nodeid not in known(table)  # the kernel does not hold it...
    new_b = table.get(b.nodeid)
    assert new_b.parent is nodes[a_slot]  # ...but b's '..' revives it by its handle
    if source.table.handles:
        assert table.lookup_parent(new_b).nodeid == a_nodeid
    source.table.forget(b.nodeid, 1)
    del b
    gc.collect()
    assert source.read().records == {} and source.journal.used == 0


@pytest.mark.parametrize("kind", ["handles", "names_only"])
def test_a_node_id_let_go_stays_stale_after_a_crash(request: pytest.FixtureRequest,
                                                    kind: str) -> None:
    """A file unlinked through the mount is let go while the kernel still holds its node
    id (ESTALE from then on). Its inode number may be reused at once by a new file of
    the same name (ext4 does): the rebuilt table must not take the old node id for it."""
    src: Source = request.getfixturevalue(kind)
    (src.path / "ckpt").write_bytes(b"old")
    old = src.look(src.table.root, "ckpt")
    os.unlink(src.path / "ckpt")
    src.table.release_unlinked(old)
    assert old.stale and src.read().records[old.jslot].flags & STALE
    (src.path / "ckpt").write_bytes(b"new")
    new = src.look(src.table.root, "ckpt")
    assert new.nodeid != old.nodeid
    table, _ = src.successor()
    with pytest.raises(OSError, match="Stale"):
        table.get(old.nodeid)  # as before the crash
    assert os.fstat(table.get(new.nodeid).fd).st_ino == new.key[1]
    fd, st = InodeTable.resolve(table.root.fd, b"ckpt")
    assert table.adopt(fd, st, (table.root, b"ckpt")).nodeid == new.nodeid
