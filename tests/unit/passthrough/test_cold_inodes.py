"""The compact table of cold inodes, and the inode table folding into it: every node id
found again by id and by key with its count and its way to reopen, rows reused and
given back, an inode in use never folded, and the journal still enough after a crash."""

from __future__ import annotations

import errno
import gc
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from qosfs.passthrough.cold_inodes import DUE, HANDLE, KEYED, ColdInodes, fold
from qosfs.passthrough.inode import Inode
from qosfs.passthrough.inode_takeover import export_inodes, import_inodes, rebuild_inodes
from qosfs.passthrough.inodes import InodeTable
from qosfs.passthrough.journal import INODE, SessionJournal, read_journal
from tests.inprocess_fs import open_fds

SYNTHETIC = 1 << 62
HOT = 8


def add(cold: ColdInodes, nodeid: int, *, dev: int = 2049, ino: int | None = None,
        lookups: int = 1, keyed: bool = True, blob: bytes | None = b"h") -> None:
    cold.add(nodeid, dev, nodeid if ino is None else ino, lookups, -1,
             HANDLE | (KEYED if keyed else 0), None, blob, None)


# ---------------------------------------------------------------------- the arrays


def test_a_row_is_found_by_node_id_and_by_key_and_taken_back_whole() -> None:
    cold = ColdInodes()
    ref = object()
    cold.add(12, 2049, 34, 3, -1, DUE | KEYED, ref, b"name", (1, 2, 3))
    row = cold.find_id(12)
    assert row >= 0 and cold.find_key(2049, 34) == row and len(cold) == 1
    assert cold.find_id(34) == -1 and cold.find_key(2050, 34) == -1
    assert cold.lookups(row) == 3 and cold.nodeid(row) == 12
    assert cold.take(row) == (12, 2049, 34, 3, -1, DUE | KEYED, ref, b"name", (1, 2, 3))
    assert len(cold) == 0 and cold.find_id(12) == -1 and cold.find_key(2049, 34) == -1


def test_a_row_not_keyed_is_found_by_node_id_only() -> None:
    cold = ColdInodes()
    add(cold, 5, keyed=False)
    assert cold.find_id(5) >= 0 and cold.find_key(2049, 5) == -1


def test_many_rows_grow_the_indexes_and_survive_removals_in_any_order() -> None:
    """Linear probing with backward-shift deletion: every row left is still found,
    whatever was removed around it (consecutive ids, synthetic ones, other devices)."""
    rng = random.Random(4)
    ids = list(range(2, 20002)) + [SYNTHETIC + i for i in range(3000)]
    cold = ColdInodes()
    for i in ids:
        add(cold, i, dev=2049 if i < SYNTHETIC else 77, ino=i % SYNTHETIC, lookups=i % 7 + 1)
    assert len(cold) == len(ids)
    rng.shuffle(ids)
    gone, kept = ids[:15000], ids[15000:]
    for i in gone:
        cold.take(cold.find_id(i))
    assert len(cold) == len(kept)
    for i in kept:
        row = cold.find_id(i)
        assert row >= 0 and cold.nodeid(row) == i and cold.lookups(row) == i % 7 + 1
        assert cold.find_key(2049 if i < SYNTHETIC else 77, i % SYNTHETIC) == row
    assert all(cold.find_id(i) == -1 for i in gone)


def test_freed_rows_are_reused_the_end_given_back_and_all_when_empty() -> None:
    cold = ColdInodes()
    for i in range(2, 102):
        add(cold, i)
    cold.take(cold.find_id(50))
    add(cold, 500)
    assert cold.find_id(500) == 48  # the freed row, not a new one
    for i in range(1000, 11000):
        add(cold, i)
    last = list(range(10000, 11000))
    random.Random(2).shuffle(last)
    for i in last:  # the last rows, in any order: the arrays shrink
        cold.take(cold.find_id(i))
    assert repr(cold) == "<ColdInodes 9100 in 9100 rows>"
    for i in range(1000, 1100):  # rows in the middle: reused, not given back
        cold.take(cold.find_id(i))
    add(cold, 7)
    assert repr(cold) == "<ColdInodes 9001 in 9100 rows>"
    rest = [*range(2, 50), *range(51, 102), 500, *range(1100, 10000), 7]
    assert all(cold.find_id(i) >= 0 for i in rest)
    for i in rest:
        cold.take(cold.find_id(i))
    assert repr(cold) == "<ColdInodes 0 in 0 rows>"


def test_a_row_keeps_the_handle_or_name_only_where_its_record_does_not() -> None:
    cold = ColdInodes()
    cold.add(7, 1, 7, 1, 3, HANDLE | KEYED, None, None, None)  # the journal has it
    cold.add(8, 1, 8, 1, -1, HANDLE | KEYED, None, b"handle", None)
    assert cold.take(cold.find_id(7))[7] is None
    assert cold.take(cold.find_id(8))[7] == b"handle"


# ---------------------------------------------------------------------- the inode table


@pytest.fixture
def src(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    before = open_fds()
    (tmp_path / "src").mkdir()
    fd = os.open(tmp_path / "src", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    yield tmp_path / "src", fd
    os.close(fd)
    assert open_fds() == before


def walk(table: InodeTable, root: Path, names: list[str]) -> dict[str, int]:
    """A LOOKUP of each name under the root, as request handlers do (nothing kept)."""
    ids = {}
    for name in names:
        table.trim()
        fd, st = InodeTable.resolve(table.root.fd, os.fsencode(name))
        ids[name] = table.adopt(fd, st, (table.root, os.fsencode(name))).nodeid
    table.trim()
    return ids


def content(node: Inode) -> bytes:
    fd = os.open(node.proc_path, os.O_RDONLY)
    try:
        return os.pread(fd, 8, 0)
    finally:
        os.close(fd)


def files(root: Path, n: int) -> list[str]:
    names = [f"f{i:04d}" for i in range(n)]
    for name in names:
        (root / name).write_bytes(name.encode())
    return names


@pytest.mark.parametrize("handles", [True, False])
def test_inodes_nothing_uses_are_folded_and_come_back_as_they_were(
        src: tuple[Path, int], handles: bool) -> None:
    root, fd = src
    names = files(root, 100)
    table = InodeTable(fd, 8, hot_limit=HOT)
    if handles and not table.handles:
        pytest.skip("no file handles here")
    table.handles = handles
    try:
        ids = walk(table, root, names)
        assert len(table.by_id) <= 2 * HOT + 1 and len(table.cold) >= 100 - 2 * HOT
        assert len(table) == 101 and table.fds_held <= 8 + 2 + 1
        walk(table, root, names[:50])  # looked up again: thawed, counted
        for name, nodeid in ids.items():
            node = table.get(nodeid)
            assert node.nodeid == nodeid == os.stat(root / name).st_ino
            assert node.lookups == (2 if name in names[:50] else 1)
            assert content(node) == name.encode()
            table.trim()
        for name, nodeid in ids.items():
            table.forget(nodeid, 2 if name in names[:50] else 1)
        assert len(table) == 1 and len(table.cold) == 0
    finally:
        table.close_all()


def test_an_inode_in_use_is_never_folded(src: tuple[Path, int]) -> None:
    """A request handler, an open file, a child naming it: they keep this very object."""
    root, fd = src
    names = files(root, 60)
    (root / "d").mkdir()
    table = InodeTable(fd, 8, hot_limit=HOT)
    try:
        held = table.get(walk(table, root, ["f0000"])["f0000"])
        opened = table.get(walk(table, root, ["f0001"])["f0001"])
        opened.opens += 1
        memo = table.get(walk(table, root, ["d"])["d"])
        walk(table, root, names)
        assert table.get(held.nodeid) is held and table.get(opened.nodeid) is opened
        assert table.get(memo.nodeid) is memo
        assert table.cold.find_id(held.nodeid) == -1
        assert len(table.cold) > 0
    finally:
        table.close_all()


def open_once(table: InodeTable, nodeid: int) -> Inode:
    """What an open and its release do to the inode, as the handle table does them."""
    node = table.get(nodeid)
    node.opens += 1
    if not node.opened:
        table.opened(node)
    node.opens -= 1
    return node


def opened_objects(table: InodeTable) -> int:
    return sum(node.opened for node in table.by_id.values())


def test_opened_inodes_stay_objects_while_a_stat_walk_folds_the_rest(
        src: tuple[Path, int]) -> None:
    """A loader's working set (files it opens) is not thawed and folded at every open
    by the lookups around it; the inodes only looked up still fold past hot_limit."""
    root, fd = src
    names = files(root, 120)
    table = InodeTable(fd, 8, hot_limit=HOT, opened_limit=20)
    try:
        ids = walk(table, root, names)
        working = [ids[name] for name in names[:15]]
        for nodeid in working:
            open_once(table, nodeid)
        fold(table)  # the opens made room since the last fold: nothing to fold, no error
        for _ in range(3):  # the loader's epochs, with a stat walk of everything between
            walk(table, root, names)
            for nodeid in working:
                assert table.cold.find_id(nodeid) == -1, nodeid  # never folded
                open_once(table, nodeid)
        assert table.opened_hot == opened_objects(table) == 15
        assert len(table.by_id) <= 15 + 2 * HOT + 1
        assert len(table.cold) >= 120 - 15 - 2 * HOT
    finally:
        table.close_all()
    assert table.opened_hot == 0


def test_opened_inodes_past_their_limit_fold_oldest_first_and_are_counted_exactly(
        src: tuple[Path, int]) -> None:
    root, fd = src
    names = files(root, 100)
    table = InodeTable(fd, 8, hot_limit=HOT, opened_limit=20)
    try:
        ids = walk(table, root, names)
        for name in names:  # an epoch of a loader whose set is larger than the room
            open_once(table, ids[name])
            table.trim()
            assert table.opened_hot == opened_objects(table)
        assert 20 <= table.opened_hot <= 20 + 2 * HOT
        assert len(table.by_id) <= 20 + 2 * HOT + 1
        assert table.cold.find_id(ids[names[0]]) >= 0  # the oldest went first
        assert table.cold.find_id(ids[names[-1]]) == -1
        thawed = table.get(ids[names[0]])  # a fresh object: not opened until it is again
        assert not thawed.opened
        for name in names:
            table.forget(ids[name], 1)
        assert table.opened_hot == 0 and len(table) == 1
    finally:
        table.close_all()


def test_a_cold_inode_gone_underneath_answers_estale(src: tuple[Path, int]) -> None:
    root, fd = src
    names = files(root, 40)
    table = InodeTable(fd, 8, hot_limit=HOT)
    try:
        ids = walk(table, root, names)
        assert table.cold.find_id(ids["f0000"]) >= 0
        os.unlink(root / "f0000")
        with pytest.raises(OSError) as raised:
            table.get(ids["f0000"]).fd  # noqa: B018 (the property reopens)
        assert raised.value.errno == errno.ESTALE
    finally:
        table.close_all()


def test_a_table_with_cold_inodes_is_rebuilt_from_its_journal(
        src: tuple[Path, int], tmp_path: Path) -> None:
    root, fd = src
    names = files(root, 80)
    table = InodeTable(fd, 8, hot_limit=HOT)
    journal = SessionJournal(str(tmp_path / "j"))
    journal.session({"source": str(root)})
    table.attach_journal(journal)
    successor = InodeTable(fd, 8)
    try:
        ids = walk(table, root, names)
        walk(table, root, names[::2])
        table.forget(ids["f0001"], 1)  # cold: forgotten in its row and its record
        assert len(table.cold) > 60
        records = list(read_journal(journal.path).of_kind(INODE))
        assert len(records) == 79
        rebuild_inodes(successor, records)
        for i, name in enumerate(names):
            if name == "f0001":
                assert ids[name] not in successor.by_id
                continue
            node = successor.get(ids[name])
            assert node.lookups == (2 if i % 2 == 0 else 1)
            assert content(node) == name.encode()
            successor.trim()
        for name, nodeid in ids.items():
            if name != "f0001":
                table.forget(nodeid, 2 if names.index(name) % 2 == 0 else 1)
        gc.collect()
        assert journal.used == 0 and len(table) == 1
    finally:
        table.close_all()
        successor.close_all()
        journal.close(remove=True)


def test_a_cold_inode_renamed_through_the_mount_is_reopened_by_its_new_name(
        src: tuple[Path, int]) -> None:
    root, fd = src
    names = files(root, 40)
    table = InodeTable(fd, 8, hot_limit=HOT)
    table.handles = False
    try:
        ids = walk(table, root, names)
        assert table.cold.find_id(ids["f0002"]) >= 0
        os.rename(root / "f0002", root / "renamed")
        table.renamed(table.root, b"renamed")
        node: Inode = table.get(ids["f0002"])
        assert node.entry is not None and node.entry[1] == b"renamed"
        assert content(node) == b"f0002"
    finally:
        table.close_all()


def test_a_table_with_cold_inodes_is_handed_over_whole(src: tuple[Path, int]) -> None:
    """A planned handover exports every inode the kernel knows, cold ones included, and
    the successor answers each node id with the same file and count."""
    root, fd = src
    names = files(root, 60)
    table = InodeTable(fd, 8, hot_limit=HOT)
    successor = InodeTable(fd, 8, hot_limit=HOT)
    try:
        ids = walk(table, root, names)
        walk(table, root, names[:10])
        assert len(table.cold) > 40
        fds: list[int] = []
        payload, _ = export_inodes(table, fds)
        import_inodes(successor, payload, [os.dup(f) for f in fds])
        for i, name in enumerate(names):
            node = successor.get(ids[name])
            assert node.lookups == (2 if i < 10 else 1) and content(node) == name.encode()
            successor.trim()
        assert len(successor.cold) > 40 and len(successor) == 61
    finally:
        table.close_all()
        successor.close_all()


def test_cold_inodes_outlive_their_journal_ending_and_go_to_the_next_one(
        src: tuple[Path, int], tmp_path: Path) -> None:
    """A handover ends this process's journal (a successor replaced the file); taken
    back, the process attaches a new one: its cold inodes, whose names and handles only
    the old journal held, are all written down in the new one."""
    root, fd = src
    names = files(root, 50)
    path = str(tmp_path / "j")
    table = InodeTable(fd, 8, hot_limit=HOT)
    first = SessionJournal(path)
    first.session({"source": str(root)})
    table.attach_journal(first)
    try:
        ids = walk(table, root, names)
        assert len(table.cold) > 30
        first.close(remove=False)
        SessionJournal(path).close(remove=False)  # the successor's, renamed over it
        second = SessionJournal(path)
        second.session({"source": str(root)})
        table.attach_journal(second)
        records = {r.nodeid: r for r in read_journal(path).of_kind(INODE)}
        assert set(records) == set(ids.values())
        for name, nodeid in ids.items():
            assert content(table.get(nodeid)) == name.encode()
            table.trim()
        second.close(remove=True)
    finally:
        table.close_all()



def relist(table: InodeTable, name: str) -> int:
    """A listing's entry for *name* under the root, as readdir takes it: the node id if
    it is counted in a cold row, else adopted (the object's node id, negated)."""
    table.trim()
    fd, st = InodeTable.resolve(table.root.fd, os.fsencode(name))
    nodeid = table.listed(fd, st)
    if nodeid >= 0:
        return nodeid
    return -table.adopt(fd, st, (table.root, os.fsencode(name))).nodeid


def test_a_listing_counts_files_past_the_objects_kept_in_rows(
        src: tuple[Path, int], tmp_path: Path) -> None:
    """A first listing: objects up to the hot limit, then a cold row per new file; a
    second: each cold file counted in its row. No thaw, no descriptor kept, each count
    in its journal record (a successor rebuilt from it agrees), every node id the
    file's inode number. A file replaced underneath by one with its inode number is
    never taken for it; an object stays an object."""
    root, fd = src
    names = files(root, 60)
    table = InodeTable(fd, 8, hot_limit=HOT)
    if not table.handles:
        pytest.skip("no file handles here")
    journal = SessionJournal(str(tmp_path / "j"))
    journal.session({"source": str(root)})
    table.attach_journal(journal)
    successor = InodeTable(fd, 8)
    try:
        fds = open_fds()
        first = {name: relist(table, name) for name in names}
        # Objects up to the limit (the root is one), then rows.
        assert sum(nodeid < 0 for nodeid in first.values()) == HOT - 1
        assert {abs(n) for n in first.values()} == {os.stat(root / n).st_ino for n in names}
        assert len(table.cold) == 60 - (HOT - 1) and table.thaws == 0
        assert open_fds() <= fds + 8
        cold = [name for name in names if first[name] > 0]
        assert [relist(table, name) for name in cold] == [first[name] for name in cold]
        assert table.thaws == 0 and open_fds() <= fds + 8
        hot = next(name for name in names if first[name] < 0)
        assert relist(table, hot) == first[hot]  # an object: adopt counts it
        rebuild_inodes(successor, list(read_journal(journal.path).of_kind(INODE)))
        for name in names:
            node = successor.get(abs(first[name]))
            assert node.lookups == (2 if name in cold or name == hot else 1), name
            assert content(node) == name.encode()
            successor.trim()
        for name in names[:20]:  # and in this table, thawed by a request
            assert content(table.get(abs(first[name]))) == name.encode()
            table.trim()
        # Replaced underneath: ext4 and tmpfs give the new file the freed number.
        victim = cold[-1]
        os.unlink(root / victim)
        (root / victim).write_bytes(b"new")
        replaced = relist(table, victim)
        if os.stat(root / victim).st_ino == first[victim]:
            assert replaced < 0 and -replaced != first[victim]  # adopted: a new node id
            assert content(table.get(-replaced)) == b"new"
    finally:
        table.close_all()
        successor.close_all()
        journal.close(remove=True)
