"""Which passed-through files are watched, and what the kernel read is added to whom:
with stand-in programs (the real ones: test_read_probes.py, and through mounts:
tests/mount/test_passthrough_counting.py)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import trio

from qosfs.passthrough import read_counting
from qosfs.passthrough.handles import FileHandle
from qosfs.passthrough.read_counting import KernelReadCounting
from qosfs.passthrough.read_probes import ReadProbes
from qosfs.qos.accounting import FlowStats


class FakeProbes:
    """The programs' tables: ``counts`` is what the kernel would have counted."""

    mode = "fake"
    attach_error = ""
    attached = True

    def __init__(self, room: int = 100) -> None:
        self.watched: dict[tuple[int, int], int] = {}
        self.counts: dict[tuple[int, int], tuple[int, int]] = {}
        self.room = room

    def watch(self, st_dev: int, ino: int, slot: int) -> bool:
        if len(self.watched) >= self.room:
            return False
        self.watched[st_dev, ino] = slot
        return True

    def unwatch(self, st_dev: int, ino: int) -> None:
        del self.watched[st_dev, ino]

    def read(self, path: Path, uid: int, nbytes: int) -> None:
        """A read the kernel served, as the programs count it."""
        st = os.stat(path)
        slot = self.watched.get((st.st_dev, st.st_ino))
        if slot is not None:
            b, n = self.counts.get((slot, uid), (0, 0))
            self.counts[slot, uid] = (b + nbytes, n + 1)

    def totals(self, slots: Iterable[int] | None = None,
               ) -> dict[tuple[int, int], tuple[int, int]]:
        return dict(self.counts)

    def changed_totals(self, slots: Iterable[int]) -> dict[tuple[int, int], tuple[int, int]]:
        return dict(self.counts)  # all of them: a superset of the changed ones

    def forget(self, slot: int, uids: Iterable[int]) -> None:
        for uid in uids:
            self.counts.pop((slot, uid), None)

    def lost_totals(self) -> tuple[int, int]:
        return (0, 0)

    def close(self) -> None:
        pass


def flow(cls: str, uid: int | None) -> Any:
    return SimpleNamespace(class_name=cls, uid=uid, stats=FlowStats())


def handle(path: Path, nodeid: int, f: Any) -> FileHandle:
    fd = os.open(path, os.O_RDONLY)
    st = os.fstat(fd)  # the inode's key, as its lookup found it
    return cast(FileHandle, SimpleNamespace(
        fd=fd, inode=SimpleNamespace(nodeid=nodeid, key=(st.st_dev, st.st_ino)),
        charge=SimpleNamespace(flow=f)))


@pytest.fixture(autouse=True)
def every_filesystem_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in programs see any filesystem the test's files are on."""
    monkeypatch.setattr(KernelReadCounting, "_why_not", lambda self, dev: None)


def test_the_kernels_reads_go_to_the_readers_own_open_and_only_once(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x")
    probes = FakeProbes()
    counting = KernelReadCounting(cast(ReadProbes, probes))
    alice, bob = flow("data", 1000), flow("data", 1001)
    h1, h2 = handle(path, 5, alice), handle(path, 5, bob)
    counting.watch(h1)
    counting.watch(h2)
    assert len(probes.watched) == 1  # one slot per file, whoever opened it
    probes.read(path, 1000, 4096)
    probes.read(path, 1001, 8192)
    probes.read(path, 0, 100)  # a uid without an open of it: the first open's flow
    counting.drain()
    counting.drain()  # nothing new: nothing added twice
    assert (alice.stats.read_bytes, alice.stats.read_ops) == (4096 + 100, 2)
    assert (bob.stats.read_bytes, bob.stats.read_ops) == (8192, 1)
    assert counting.status()["read_bytes"] == {"data": 4096 + 8192 + 100}
    for h in (h1, h2):
        os.close(h.fd)


def test_a_file_is_watched_until_its_backing_id_is_closed_and_its_slot_reused_after(
        tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"a")
    b.write_bytes(b"b")
    probes = FakeProbes()
    counting = KernelReadCounting(cast(ReadProbes, probes))
    f = flow("data", 0)
    h1, h2 = handle(a, 5, f), handle(a, 5, f)
    counting.watch(h1)
    counting.watch(h2)
    counting.release(h1)
    assert probes.watched  # one open left
    counting.forget(5)  # an id still in use is not closed: nothing happens
    assert probes.watched
    probes.read(a, 0, 10)
    counting.release(h2)
    assert probes.watched  # idle, with its backing id: the next open costs no update
    h3 = handle(a, 5, f)
    counting.watch(h3)
    probes.read(a, 0, 5)
    counting.release(h3)
    assert list(probes.watched.values()) == [1]  # the same slot all along
    counting.forget(5)  # the idle id was closed
    assert not probes.watched
    counting.drain()  # what it read before its id was closed still counts
    assert f.stats.read_bytes == 15
    assert not probes.counts  # its slot's counts are gone, the slot free again
    hb = handle(b, 6, f)
    counting.watch(hb)
    assert list(probes.watched.values()) == [1]
    probes.read(b, 0, 20)
    counting.drain()
    assert f.stats.read_bytes == 35
    for h in (h1, h2, h3, hb):
        os.close(h.fd)


def test_the_service_frees_many_retired_slots_in_batches_and_counts_them_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass over many files retires them together (their idle ids expire together):
    the drain service counts what each read first, then frees their slots a batch at a
    time, and other tasks run between two batches, so the loop never stalls for all."""
    monkeypatch.setattr(read_counting, "RETIRE_BATCH", 10)
    monkeypatch.setattr(read_counting, "DRAIN_EVERY", 0)  # each turn of the loop
    probes = FakeProbes(room=100)
    counting = KernelReadCounting(cast(ReadProbes, probes))
    f = flow("data", 0)
    handles = []
    for i in range(35):
        path = tmp_path / f"f{i}"
        path.write_bytes(b"x")
        h = handle(path, 100 + i, f)
        counting.watch(h)
        probes.read(path, 0, 10)
        counting.release(h)
        counting.forget(100 + i)  # its idle backing id expired
        handles.append(h)
    assert not probes.watched and len(counting._retired) == 35
    free_seen: list[int] = []

    async def main() -> None:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(counting.run)
                nursery.start_soon(watch_free, nursery)

    async def watch_free(nursery: trio.Nursery) -> None:
        while len(counting._free) < 35:
            free_seen.append(len(counting._free))
            await trio.sleep(0)
        free_seen.append(len(counting._free))
        nursery.cancel_scope.cancel()

    trio.run(main)
    assert f.stats.read_bytes == 350  # every file's reads, counted before its slot went
    assert not probes.counts and counting.status()["watched"] == 0
    # Between two batches another task ran (trio runs the runnable tasks in a random
    # order: not necessarily between every two).
    assert set(free_seen) & {10, 20, 30}, free_seen
    for h in handles:
        os.close(h.fd)


def test_what_cannot_be_counted_is_counted_as_such_per_class_and_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x")
    off = KernelReadCounting(None, "no BPF here")
    h = handle(path, 5, flow("data", 0))
    off.watch(h)
    assert off.status()["uncounted_opens"] == {"data": {"no BPF here": 1}}
    assert off.status()["state"] == "off"

    full = KernelReadCounting(cast(ReadProbes, FakeProbes(room=0)))
    full.watch(h)
    assert full.status()["uncounted_opens"] == {
        "data": {"the table of watched files is full": 1}}

    monkeypatch.setattr(KernelReadCounting, "_why_not", lambda self, dev: "tmpfs: unseen")
    unseen = KernelReadCounting(cast(ReadProbes, FakeProbes()))
    unseen.watch(h)
    unseen.watch(h)
    assert unseen.status()["uncounted_opens"] == {"data": {"tmpfs: unseen": 2}}
    os.close(h.fd)


def test_tmpfs_is_not_a_filesystem_whose_reads_are_counted() -> None:
    assert "tmpfs" not in read_counting.COUNTED_FILESYSTEMS
    assert {"ext4", "xfs"} <= read_counting.COUNTED_FILESYSTEMS
