"""PathBook: inode paths from /proc, memoized, derived from parents, invalidated."""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from qosfs.passthrough import paths
from qosfs.passthrough.inodes import InodeTable
from qosfs.passthrough.paths import PathBook


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    clock = [1000.0]
    monkeypatch.setattr(paths, "_monotonic", lambda: clock[0])
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_bytes(b"x")
    root_fd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    table = InodeTable(root_fd)

    def inode(parent, name: bytes):
        return table.adopt(*table.resolve(parent.fd, name))

    a = inode(table.root, b"a")
    b = inode(a, b"b")
    f = inode(b, b"f")
    yield SimpleNamespace(top=tmp_path, book=PathBook(root_fd, table.root), root=table.root,
                          a=a, b=b, f=f, clock=clock)
    os.close(root_fd)


def test_paths_are_read_from_proc_then_memoized(tree) -> None:
    top, book, clock = tree.top, tree.book, tree.clock
    assert book.relpath_until(tree.root) == ("", math.inf)  # the root never moves
    assert book.relpath(tree.f) == "a/b/f"
    os.rename(top / "a" / "b" / "f", top / "a" / "g")  # underneath, behind our back
    assert book.relpath(tree.f) == "a/b/f"  # trusted for a while ...
    clock[0] += paths.PATH_MEMO_SECONDS
    assert book.relpath(tree.f) == "a/g"  # ... then read again


def test_a_rename_through_the_mount_invalidates_every_path_at_once(tree) -> None:
    top, book = tree.top, tree.book
    assert (book.relpath(tree.b), book.relpath(tree.f)) == ("a/b", "a/b/f")
    os.rename(top / "a", top / "z")  # moves a whole subtree
    book.renamed()
    assert (book.relpath(tree.b), book.relpath(tree.f)) == ("z/b", "z/b/f")


def test_a_child_path_is_derived_from_its_parent_and_keeps_the_parents_deadline(
        tree, monkeypatch: pytest.MonkeyPatch) -> None:
    top, book, clock = tree.top, tree.book, tree.clock
    assert book.relpath(tree.b) == "a/b"
    clock[0] += paths.PATH_MEMO_SECONDS / 2
    with monkeypatch.context() as patch:  # undo only this: the fixture's clock stays
        patch.setattr(book, "_read", lambda inode: pytest.fail("read /proc"))
        book.note_child(tree.b, b"f", tree.f)
        book.note_child(tree.root, b"a", tree.a)
        assert (book.relpath(tree.f), book.relpath(tree.a)) == ("a/b/f", "a")
    clock[0] += paths.PATH_MEMO_SECONDS / 2  # the parent's path was read a second ago
    os.rename(top / "a" / "b" / "f", top / "a" / "b" / "h")
    assert book.relpath(tree.f) == "a/b/h"


def test_a_deleted_object_keeps_its_last_path(tree) -> None:
    top, book = tree.top, tree.book
    os.unlink(top / "a" / "b" / "f")
    assert book.relpath(tree.f) == "a/b/f"


def test_a_derived_path_is_trusted_as_long_as_the_kernel_trusts_its_name(
        tree, monkeypatch: pytest.MonkeyPatch) -> None:
    top, book, clock = tree.top, tree.book, tree.clock
    assert book.relpath(tree.b) == "a/b"
    book.note_child(tree.b, b"f", tree.f)
    book.trust_entry(tree.f, 60.0)  # the entry_timeout the lookup's reply gives
    book.trust_entry(tree.f, 0.5)  # never shortened
    os.rename(top / "a" / "b" / "f", top / "a" / "b" / "h")  # underneath
    clock[0] += 59.0  # callers still reach it by the name they looked up, so does QoS
    with monkeypatch.context() as patch:
        patch.setattr(book, "_read", lambda inode: pytest.fail("read /proc"))
        assert book.relpath(tree.f) == "a/b/f"
    clock[0] += 1.0  # the kernel looks the name up again, and the path is read again
    assert book.relpath(tree.f) == "a/b/h"


def test_trusting_an_entry_does_not_revive_a_path_from_before_a_rename(tree) -> None:
    top, book = tree.top, tree.book
    book.note_child(tree.b, b"f", tree.f)
    os.rename(top / "a" / "b" / "f", top / "a" / "g")
    book.renamed()  # through the mount: every memo is stale
    book.trust_entry(tree.f, 60.0)
    assert book.relpath(tree.f) == "a/g"
