"""The inode table on a temporary tree: node ids, the kernel's lookup counts, the bounded
descriptor cache and reopening by file handle or by name, and '..' without a path walk."""

from __future__ import annotations

import errno
import logging
import os
import resource
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyfuse3
import pytest

from qosfs.passthrough import fdcache as fdcache_module
from qosfs.passthrough import inodes as inodes_module
from qosfs.passthrough.fdcache import default_fd_budget
from qosfs.passthrough.inode import Inode
from qosfs.passthrough.inodes import InodeTable
from tests.inprocess_fs import open_fds

BUDGET = 8  # the cache's smallest capacity


@dataclass
class Tree:
    path: Path
    table: InodeTable

    @property
    def root(self) -> Inode:
        return self.table.root

    def look(self, parent: Inode, name: str) -> Inode:
        """What a LOOKUP does: resolve one name under *parent*, count one reference."""
        fd, st = InodeTable.resolve(parent.fd, os.fsencode(name))
        return self.table.adopt(fd, st, (parent, os.fsencode(name)))

    def look_path(self, path: str) -> Inode:
        node = self.root
        for name in path.split("/"):
            node = self.look(node, name)
        return node


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Tree]:
    """An inode table over an empty directory; closing it gives back every descriptor."""
    before = open_fds()
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    table = InodeTable(fd, BUDGET)
    yield Tree(tmp_path, table)
    table.close_all()
    os.close(fd)
    assert open_fds() == before


@pytest.fixture
def handles(tree: Tree) -> Tree:
    if not tree.table.handles:
        pytest.skip("no file handles here (not root, or the filesystem exports none)")
    return tree


@pytest.fixture
def names_only(tree: Tree) -> Tree:
    """A table that reopens evicted inodes by name, as on a source without handles."""
    tree.table.handles = False
    return tree


def expect_logged(caplog: pytest.LogCaptureFixture) -> None:
    for record in caplog.records:
        record.expected = True


def stale(node: Inode) -> bool:
    """Whether using *node*'s descriptor answers ESTALE."""
    try:
        node.fd  # noqa: B018 (the property reopens)
    except OSError as exc:
        assert exc.errno == errno.ESTALE
        return True
    return False


def test_adopt_names_objects_by_inode_number_and_counts_lookups(tree: Tree) -> None:
    (tree.path / "f").write_bytes(b"")
    st = os.stat(tree.path / "f")
    node = tree.look(tree.root, "f")
    assert (node.nodeid, node.key, node.lookups) == (st.st_ino, (st.st_dev, st.st_ino), 1)
    fds = open_fds()
    assert tree.look(tree.root, "f") is node and node.lookups == 2
    assert open_fds() == fds  # the second descriptor was closed, not kept
    assert tree.table.get(node.nodeid) is node and tree.table.find(st) is node
    assert tree.table.find(os.stat(tree.path)) is tree.root
    assert tree.table.get(pyfuse3.ROOT_INODE) is tree.root and len(tree.table) == 2
    os.link(tree.path / "f", tree.path / "g")
    assert tree.look(tree.root, "g") is node and node.lookups == 3  # hard links: one node


def test_forget_drops_the_inode_and_its_descriptor_with_the_last_reference(
        tree: Tree, caplog: pytest.LogCaptureFixture) -> None:
    (tree.path / "f").write_bytes(b"")
    st = os.stat(tree.path / "f")
    node = tree.look(tree.root, "f")
    tree.look(tree.root, "f")
    held = tree.table.fds_held
    tree.table.forget(node.nodeid, 1)
    assert tree.table.get(node.nodeid) is node and tree.table.fds_held == held
    tree.table.forget(node.nodeid, 1)
    assert node.stale and node.cached_fd == -1 and tree.table.fds_held == held - 1
    assert tree.table.find(st) is None and len(tree.table) == 1
    with pytest.raises(KeyError):
        tree.table.get(node.nodeid)
    tree.table.forget(pyfuse3.ROOT_INODE, 5)  # the root is never let go
    assert tree.table.get(pyfuse3.ROOT_INODE) is tree.root
    tree.table.forget(node.nodeid, 1)  # unknown now: logged, nothing raised
    assert [r.getMessage() for r in caplog.records] == [f"forget for unknown inode {node.nodeid}"]
    expect_logged(caplog)


def test_the_descriptor_cache_keeps_its_budget_and_reopens_by_handle(handles: Tree) -> None:
    table = handles.table
    for i in range(20):
        (handles.path / f"f{i}").write_bytes(b"")
    nodes = [handles.look(handles.root, f"f{i}") for i in range(20)]
    assert len(table.cache) == 20 and table.cache.over  # adding never evicts
    fds = open_fds()
    table.get(nodes[0].nodeid)  # where a request starts, the cache is trimmed
    assert len(table.cache) == BUDGET and open_fds() == fds - (20 - BUDGET)
    evicted = [n for n in nodes if n.cached_fd < 0]
    assert len(evicted) == 20 - BUDGET and table.cache.evictions == len(evicted)
    for node in evicted:
        assert os.fstat(node.fd).st_ino == node.nodeid  # reopened from its handle
    assert table.reopens == len(evicted) and len(table.cache) == 20
    table.trim()
    assert len(table.cache) == BUDGET


def test_relieve_sheds_half_the_cached_descriptors(
        handles: Tree, caplog: pytest.LogCaptureFixture) -> None:
    for i in range(BUDGET):
        (handles.path / f"f{i}").write_bytes(b"")
        handles.look(handles.root, f"f{i}")
    assert handles.table.relieve() and len(handles.table.cache) == BUDGET // 2
    handles.table.cache.shrink(0)
    assert not handles.table.relieve()  # nothing left to shed: not worth a retry
    expect_logged(caplog)


def test_a_handle_follows_a_rename_underneath_and_a_deleted_object_is_stale(
        handles: Tree) -> None:
    (handles.path / "f").write_bytes(b"")
    (handles.path / "g").write_bytes(b"")
    f, g = handles.look(handles.root, "f"), handles.look(handles.root, "g")
    handles.table.cache.shrink(0)
    os.rename(handles.path / "f", handles.path / "moved")
    os.unlink(handles.path / "g")
    assert os.fstat(f.fd).st_ino == f.nodeid  # same object, wherever it went
    assert stale(g) and g.stale


def test_a_files_handle_is_taken_at_eviction_and_a_directorys_at_lookup(
        handles: Tree) -> None:
    (handles.path / "d").mkdir()
    (handles.path / "f").write_bytes(b"")
    d, f = handles.look(handles.root, "d"), handles.look(handles.root, "f")
    assert d.handle is not None  # lookup_parent revives directories by it
    assert f.handle is None and f.handle_due and f.entry == (handles.root, b"f")
    handles.table.cache.shrink(0)
    assert f.handle is not None and not f.handle_due and f.entry is None
    os.rename(handles.path / "f", handles.path / "moved")  # the old name is gone...
    assert os.fstat(f.fd).st_ino == f.nodeid  # ...and the handle still finds the file


def test_a_file_whose_handle_cannot_be_taken_at_eviction_reopens_by_name(
        handles: Tree, monkeypatch: pytest.MonkeyPatch) -> None:
    (handles.path / "f").write_bytes(b"")
    f = handles.look(handles.root, "f")

    def refuse(fd: int) -> tuple[bytes, int]:
        raise OSError(errno.EOPNOTSUPP, "no handles")

    monkeypatch.setattr(inodes_module.syscalls, "handle_of_fd", refuse)
    handles.table.cache.shrink(0)
    assert f.handle is None and not f.handle_due and f.entry == (handles.root, b"f")
    assert os.fstat(f.fd).st_ino == f.nodeid  # reopened by its name
    os.rename(handles.path / "f", handles.path / "moved")
    handles.table.cache.shrink(0)
    assert stale(f)  # its name holds nothing now: the kernel looks it up again


def test_without_handles_an_inode_reopens_by_its_name_if_it_still_holds_it(
        names_only: Tree) -> None:
    tree = names_only
    for name in ("same", "renamed", "replaced"):
        (tree.path / name).write_bytes(b"")
    same, renamed, replaced = (tree.look(tree.root, n)
                               for n in ("same", "renamed", "replaced"))
    assert same.handle is None and same.entry == (tree.root, b"same")
    tree.table.cache.shrink(0)
    os.rename(tree.path / "renamed", tree.path / "elsewhere")
    (tree.path / "new").write_bytes(b"another object")  # made while the old one exists:
    os.replace(tree.path / "new", tree.path / "replaced")  # another inode number
    assert os.fstat(same.fd).st_ino == same.nodeid
    assert stale(renamed) and stale(replaced)  # the kernel must look the names up again
    # A rename through the mount tells the table the new name.
    tree.table.cache.shrink(0)
    os.rename(tree.path / "same", tree.path / "new")
    tree.table.renamed(tree.root, b"new")
    assert same.entry == (tree.root, b"new") and os.fstat(same.fd).st_ino == same.nodeid


def test_lookup_parent_answers_from_the_table_and_revives_a_forgotten_parent(
        handles: Tree) -> None:
    (handles.path / "a" / "b").mkdir(parents=True)
    table = handles.table
    a = handles.look(handles.root, "a")
    b = handles.look(a, "b")
    assert b.parent is a and a.parent is handles.root
    assert table.lookup_parent(b) is a and a.lookups == 2
    lookups = handles.root.lookups
    assert table.lookup_parent(handles.root) is handles.root  # the root's '..': itself
    assert handles.root.lookups == lookups + 1
    assert table.parent_nodeid(b) == a.nodeid
    assert table.parent_nodeid(handles.root) == pyfuse3.ROOT_INODE
    table.forget(a.nodeid, 2)
    revived = table.lookup_parent(b)  # opened again by a's file handle
    assert revived is not a and revived.nodeid == a.nodeid and revived.lookups == 1
    assert revived.parent is handles.root and table.find(os.stat(handles.path / "a")) is revived


def test_without_a_handle_a_forgotten_parent_is_stale(names_only: Tree) -> None:
    (names_only.path / "a" / "b").mkdir(parents=True)
    a = names_only.look(names_only.root, "a")
    b = names_only.look(a, "b")
    names_only.table.forget(a.nodeid, 1)
    with pytest.raises(OSError) as raised:
        names_only.table.lookup_parent(b)
    assert raised.value.errno == errno.ESTALE


def test_renamed_moves_a_directory_under_its_new_parent(tree: Tree) -> None:
    for path in ("a/b", "c"):
        (tree.path / path).mkdir(parents=True)
    a, c = tree.look(tree.root, "a"), tree.look(tree.root, "c")
    b = tree.look(a, "b")
    os.rename(tree.path / "a" / "b", tree.path / "c" / "b")  # what RENAME just did
    tree.table.renamed(c, b"b")
    assert b.parent is c and tree.table.lookup_parent(b) is c
    tree.table.renamed(c, b"missing")  # gone already: nothing to learn


def test_an_unlinked_file_nobody_has_open_is_let_go_at_once(tree: Tree) -> None:
    for name in ("gone", "open", "linked"):
        (tree.path / name).write_bytes(b"x" * 4096)
    os.link(tree.path / "linked", tree.path / "other-name")
    gone, held, linked = (tree.look(tree.root, n) for n in ("gone", "open", "linked"))
    held.opens = 1
    for name in ("gone", "open", "linked"):
        os.unlink(tree.path / name)
    fds = open_fds()
    for node in (gone, held, linked):
        tree.table.release_unlinked(node)
    assert gone.stale and gone.cached_fd == -1 and open_fds() == fds - 1  # blocks freed
    assert not held.stale and not linked.stale  # still open; still named elsewhere
    with pytest.raises(OSError) as raised:
        tree.table.get(gone.nodeid)  # the kernel may still use the node id: ESTALE
    assert raised.value.errno == errno.ESTALE
    tree.table.forget(gone.nodeid, 1)  # and forget it later, cleanly
    assert len(tree.table) == 3


@pytest.mark.parametrize(("soft", "budget"), [
    (1024, 256), (100, fdcache_module.MIN_FD_BUDGET), (10**7, fdcache_module.MAX_FD_BUDGET),
    (resource.RLIM_INFINITY, fdcache_module.MAX_FD_BUDGET),
])
def test_the_default_budget_is_a_quarter_of_the_descriptor_limit_within_bounds(
        monkeypatch: pytest.MonkeyPatch, soft: int, budget: int) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _: (soft, resource.RLIM_INFINITY))
    assert default_fd_budget() == budget


def test_close_all_closes_every_descriptor(tree: Tree, caplog: pytest.LogCaptureFixture,
                                           ) -> None:
    caplog.set_level(logging.INFO)
    (tree.path / "d").mkdir()
    for i in range(12):
        (tree.path / "d" / f"f{i}").write_bytes(b"")
        tree.look_path(f"d/f{i}")
    tree.table.close_all()
    assert len(tree.table) == 1 and len(tree.table.cache) == 0 and tree.table.pinned == 0
    # (the fixture checks that every descriptor is closed)
