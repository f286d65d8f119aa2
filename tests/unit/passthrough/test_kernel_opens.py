"""qosfs.passthrough.kernel_opens through the operations called directly (no mount), with
a stand-in for pyfuse3's passthrough API: which opens are passed through, and which
one ``recent_file`` names for a class."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pyfuse3
import pytest
import trio

from qosfs.daemon.fs_assembly import build_filesystem
from qosfs.passthrough import handle_table, kernel
from qosfs.passthrough.backing_io import IoMode
from qosfs.passthrough.handles import JOINED, NO_DESCRIPTOR, PASSED_THROUGH, SERVED
from qosfs.passthrough.kernel import Capability, KernelPassthrough, served_join_support
from qosfs.passthrough.operations import FsOptions, PassthroughOperations
from qosfs.policy.loading import parse_policy
from qosfs.qos.engine import PolicyQos
from tests.unit.test_kernel_passthrough import FakeBinding

POLICY = """
[classes.data]
paths = ["data/**"]
passthrough = "reads"

[classes.plain]
paths = ["plain/**"]
passthrough = "off"
"""
# The same, with a read cap on data: what `ctl set` or a reload may do while it is open.
CAPPED = POLICY.replace('passthrough = "reads"', 'passthrough = "reads"\nread_bandwidth = "1GiB/s"')


class _Ctx:
    uid = os.getuid()
    gid = os.getgid()
    pid = os.getpid()
    umask = 0o022


@pytest.fixture
def ops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PassthroughOperations]:
    """Operations over data/a, data/b and plain/c whose passthrough was asked for and
    accepted at INIT (the stand-in binding says negotiated)."""
    monkeypatch.setattr(kernel, "has_cap_sys_admin", lambda: True)
    for name in ("data/a", "data/b", "plain/c"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * 100)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    fs = build_filesystem(fd, IoMode.INLINE, PolicyQos(parse_policy(POLICY)), FsOptions())
    fs.kernel_opens.kernel = KernelPassthrough(FakeBinding())
    fs.kernel_opens.request(fs.ops, 0)
    yield fs.ops
    fs.close_all()


async def _lookup(ops: PassthroughOperations, path: str) -> int:
    node = pyfuse3.ROOT_INODE
    for name in path.split("/"):
        node = (await ops.lookup(node, name.encode(), _Ctx())).st_ino
    return node


async def _open(ops: PassthroughOperations, path: str, flags: int) -> pyfuse3.FileInfo:
    return await ops.open(await _lookup(ops, path), flags, _Ctx())


def test_recent_file_is_the_last_open_passed_through_while_it_is_open(
        ops: PassthroughOperations) -> None:
    kernel_opens = ops.kernel_opens

    async def main() -> None:
        assert kernel_opens.active()
        assert kernel_opens.recent_file("data") is None
        first = await _open(ops, "data/a", os.O_RDONLY)
        assert kernel_opens.recent_file("data") == ops.files[first.fh].fd
        second = await _open(ops, "data/b", os.O_RDONLY)
        assert second.backing_id > 0  # passed through: the reply carries its id
        assert kernel_opens.recent_file("data") == ops.files[second.fh].fd
        await ops.release(second.fh)
        assert kernel_opens.recent_file("data") is None  # the last one, released
        await ops.release(first.fh)
        assert kernel_opens.status()["opens"] == {"data": 2}

    trio.run(main)


def test_a_released_opens_reused_descriptor_is_not_taken_for_it(
        ops: PassthroughOperations) -> None:
    """The backing descriptor number of a released open comes back for the next open: a
    daemon-served one on the same descriptor must not pass for the released one (nor
    get its fh: fh numbers are never reused)."""

    async def main() -> None:
        plain = await _lookup(ops, "plain/c")  # its inode descriptors taken before
        passed = await _open(ops, "data/a", os.O_RDONLY)
        passed_fd = ops.files[passed.fh].fd
        await ops.release(passed.fh)
        served = await ops.open(plain, os.O_RDONLY, _Ctx())
        assert ops.files[served.fh].fd == passed_fd  # the lowest free descriptor, reused
        assert served.fh != passed.fh
        assert ops.kernel_opens.recent_file("data") is None
        await ops.release(served.fh)

    trio.run(main)


def test_a_daemon_served_open_is_never_the_recent_file(ops: PassthroughOperations) -> None:
    kernel_opens = ops.kernel_opens

    async def main() -> None:
        plain = await _open(ops, "plain/c", os.O_RDONLY)  # its class opts out
        writer = await _open(ops, "data/b", os.O_WRONLY)  # a write open of the class
        assert not hasattr(plain, "backing_id") or plain.backing_id == 0
        assert kernel_opens.recent_file("plain") is None
        assert kernel_opens.recent_file("data") is None
        assert kernel_opens.status()["opens"] == {}
        await ops.release(plain.fh)
        await ops.release(writer.fh)

    trio.run(main)


def test_release_gives_the_backing_id_back(ops: PassthroughOperations) -> None:
    binding = FakeBinding()
    ops.kernel_opens.kernel = KernelPassthrough(binding)

    async def main() -> None:
        info = await _open(ops, "data/a", os.O_RDONLY)
        assert binding.open_ids == {info.backing_id}
        nodeid = ops.files[info.fh].inode.nodeid
        await ops.release(info.fh)
        # Kept idle for the next open of the file, which takes it without registering.
        assert binding.open_ids == {info.backing_id}
        status = ops.kernel_opens.status()
        assert (status["live_backing_ids"], status["idle_backing_ids"]) == (0, 1)
        again = await _open(ops, "data/a", os.O_RDONLY)
        assert again.backing_id == info.backing_id
        assert ops.kernel_opens.status()["reused_backing_ids"] == 1
        await ops.release(again.fh)
        await ops.forget([(nodeid, 1)])  # the kernel forgot the inode: the id goes too
        assert binding.open_ids == set()
        status = ops.kernel_opens.status()
        assert (status["live_backing_ids"], status["idle_backing_ids"]) == (0, 0)

    trio.run(main)


def test_the_sweep_closes_many_due_ids_in_batches(
        ops: PassthroughOperations, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ids that fell due together are closed EXPIRE_BATCH at a time by the sweep, with
    other tasks run between two batches, and a release closes a few of them only."""
    from qosfs.passthrough import kernel_opens

    monkeypatch.setattr(kernel_opens, "EXPIRE_BATCH", 8)
    monkeypatch.setattr(kernel_opens, "IDLE_SWEEP_EVERY", 0)  # each turn of the loop
    binding = FakeBinding()
    kp = ops.kernel_opens.kernel = KernelPassthrough(binding)
    for inode in range(1000, 1030):
        kp.register(inode, fd=inode)
        kp.unregister(inode, now=0.0)
    monkeypatch.setattr(kernel_opens, "_monotonic", lambda: 1e6)  # all of them due
    open_seen: list[int] = []

    async def main() -> None:
        info = await _open(ops, "data/a", os.O_RDONLY)
        await ops.release(info.fh)
        assert len(binding.open_ids) == 31 - kernel_opens.EXPIRE_PER_RELEASE
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(ops.kernel_opens.run)
                nursery.start_soon(watch_ids, nursery)

    async def watch_ids(nursery: trio.Nursery) -> None:
        while len(binding.open_ids) > 1:  # data/a's, idle since "now": not due
            open_seen.append(len(binding.open_ids))
            await trio.sleep(0)
        nursery.cancel_scope.cancel()

    trio.run(main)
    # 29, then 8 fewer a batch: some batch's outcome seen by another task (trio runs
    # the runnable tasks in a random order, so not necessarily every one).
    assert set(open_seen) & {21, 13, 5}, open_seen
    assert len(binding.open_ids) == 1


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_an_open_that_takes_its_inodes_backing_id_opens_no_descriptor(
        ops: PassthroughOperations, tmp_path: Path) -> None:
    """A read-only open passed through with a backing id its inode holds (live beside
    another open, or kept idle since the last release) needs no descriptor of the
    daemon's: none is opened, until a request names the open and needs one (fsync,
    fchmod), which then is the open's until its release. The recent file of its class
    is its inode's descriptor, the same file."""
    binding = FakeBinding()
    ops.kernel_opens.kernel = KernelPassthrough(binding)
    backing = os.stat(tmp_path / "data/a")

    async def main() -> None:
        first = await _open(ops, "data/a", os.O_RDONLY)  # registers its own descriptor
        assert ops.files[first.fh].fd >= 0
        before = _descriptors()
        beside = await _open(ops, "data/a", os.O_RDONLY)  # shares the live id
        await ops.release(first.fh)
        again = await _open(ops, "data/a", os.O_RDONLY | os.O_NOATIME)  # shares it too
        assert _descriptors() == before - 1  # first's closed, none opened
        for info in (beside, again):
            handle = ops.files[info.fh]
            assert info.backing_id == first.backing_id
            assert (handle.fd, handle.kernel) == (NO_DESCRIPTOR, PASSED_THROUGH)
        recent = ops.kernel_opens.recent_file("data")
        assert recent is not None and os.fstat(recent).st_ino == backing.st_ino
        await ops.fsync(again.fh, False)  # needs a descriptor: opened now, the open's
        handle = ops.files[again.fh]
        assert handle.fd >= 0 and os.fstat(handle.fd).st_ino == backing.st_ino
        assert _descriptors() == before
        await ops.release(again.fh)
        await ops.release(beside.fh)
        assert _descriptors() == before - 1
        status = ops.kernel_opens.status()
        assert (status["live_backing_ids"], status["idle_backing_ids"]) == (0, 1)
        assert binding.open_ids == {first.backing_id}

    trio.run(main)


def test_an_open_made_without_a_descriptor_never_gets_emfile_for_the_daemons_cache(
        ops: PassthroughOperations, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The descriptor an fsync opens for such an open is no exception to the rule that
    a caller never sees EMFILE because of the daemon's cached inode descriptors: they
    are shed and the open tried once more."""
    ops.kernel_opens.kernel = KernelPassthrough(FakeBinding())
    real_reopen = handle_table.reopen
    refusals = [errno.EMFILE]

    def short_once(fd: int, flags: int) -> int:
        if refusals:
            raise OSError(refusals.pop(), "out of descriptors")
        return real_reopen(fd, flags)

    async def main() -> None:
        await ops.release((await _open(ops, "data/a", os.O_RDONLY)).fh)
        await _lookup(ops, "data/b")  # a second cached inode descriptor to shed
        again = await _open(ops, "data/a", os.O_RDONLY)
        assert ops.files[again.fh].fd == NO_DESCRIPTOR
        monkeypatch.setattr(handle_table, "reopen", short_once)
        shed = ops.inodes.relieve
        relieved: list[bool] = []
        monkeypatch.setattr(ops.inodes, "relieve", lambda: relieved.append(shed()) or True)
        await ops.fsync(again.fh, False)
        assert relieved == [True] and not refusals
        assert ops.files[again.fh].fd >= 0
        await ops.release(again.fh)

    trio.run(main)
    [shed_warning] = [r for r in caplog.records if "out of file descriptors" in r.getMessage()]
    shed_warning.expected = True  # type: ignore[attr-defined]


def test_an_open_that_cannot_pass_through_gets_its_descriptor_beside_an_idle_id(
        ops: PassthroughOperations, tmp_path: Path) -> None:
    """Once a cap keeps the class's reads in the daemon, an open of a file whose backing
    id is idle is served by the daemon: through a descriptor of its own."""
    ops.kernel_opens.kernel = KernelPassthrough(FakeBinding())

    async def main() -> None:
        first = await _open(ops, "data/a", os.O_RDONLY)
        await ops.release(first.fh)
        ops.qos.swap(parse_policy(CAPPED))  # data's reads are capped from now on
        served = await _open(ops, "data/a", os.O_RDONLY)
        handle = ops.files[served.fh]
        assert handle.kernel == SERVED and handle.fd >= 0
        assert await ops.read(served.fh, 0, 100) == b"x" * 100
        await ops.release(served.fh)

    trio.run(main)


def test_a_writer_joining_a_passed_through_inode_gets_direct_io_and_is_served(
        ops: PassthroughOperations) -> None:
    """The decision: a write open of an inode passed through now carries its backing id
    (or the kernel fails it) and direct_io (so its writes come to the daemon, capped);
    its release gives its share of the id back."""
    binding = FakeBinding()
    ops.kernel_opens.kernel = KernelPassthrough(binding)
    kernel_opens = ops.kernel_opens

    async def main() -> None:
        reader = await _open(ops, "data/a", os.O_RDONLY)
        writer = await _open(ops, "data/a", os.O_WRONLY)
        assert (reader.backing_id, reader.direct_io) == (writer.backing_id, False)
        assert writer.direct_io and not writer.keep_cache
        assert ops.files[reader.fh].kernel == PASSED_THROUGH
        assert ops.files[writer.fh].kernel == JOINED
        assert kernel_opens.recent_file("data") == ops.files[reader.fh].fd
        status = kernel_opens.status()
        assert status["joins"] == "served"
        assert status["served_write_joins"] == {"data": 1}
        assert status["opens"] == {"data": 1}  # the joined one is not passed through
        assert status["uncapped_write_opens"] == {} and status["capped_uncapped_opens"] == {}
        ops.qos.swap(parse_policy(CAPPED))  # data's reads are capped from now on
        capped = await _open(ops, "data/a", os.O_RDONLY)
        assert capped.backing_id == reader.backing_id and capped.direct_io
        assert ops.files[capped.fh].kernel == JOINED
        assert kernel_opens.status()["served_read_joins"] == {"data": 1}
        await ops.release(reader.fh)
        await ops.release(capped.fh)
        assert binding.open_ids == {writer.backing_id}  # the writer still holds it
        await ops.release(writer.fh)
        assert binding.open_ids == {writer.backing_id}  # idle, kept for the next open
        assert kernel_opens.status()["live_backing_ids"] == 0
        writer = await _open(ops, "data/a", os.O_WRONLY)  # beside an idle id: plain
        assert not getattr(writer, "backing_id", 0) and ops.files[writer.fh].kernel == SERVED
        reader = await _open(ops, "data/a", os.O_RDONLY)  # a served open stands in the way
        assert not getattr(reader, "backing_id", 0)
        for fh in (writer.fh, reader.fh):
            await ops.release(fh)

    trio.run(main)


def test_a_writer_alone_is_served_plain(ops: PassthroughOperations) -> None:
    async def main() -> None:
        writer = await _open(ops, "data/a", os.O_WRONLY)
        assert getattr(writer, "backing_id", 0) == 0
        assert ops.kernel_opens.status()["served_write_joins"] == {}
        await ops.release(writer.fh)

    trio.run(main)


def test_without_served_joins_a_capped_join_goes_uncapped_and_is_counted(
        ops: PassthroughOperations, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Where the kernel does not take direct_io beside a backing id, today's behaviour:
    the join is passed through, uncapped, counted per class, and apart if a cap bounded
    it (a reader of a class whose reads a cap bounds since the file was passed
    through)."""
    monkeypatch.setattr(kernel, "served_join_support",
                        lambda: Capability(False, "Linux 6.8 does not ...", "kernel"))
    ops.kernel_opens.kernel = KernelPassthrough(FakeBinding())
    kernel_opens = ops.kernel_opens

    async def main() -> None:
        reader = await _open(ops, "data/a", os.O_RDONLY)
        writer = await _open(ops, "data/a", os.O_WRONLY)
        assert writer.backing_id == reader.backing_id and not writer.direct_io
        assert ops.files[writer.fh].kernel == PASSED_THROUGH
        status = kernel_opens.status()
        assert (status["joins"], status["joins_blocked_by"]) == ("uncapped", "kernel")
        assert status["uncapped_write_opens"] == {"data": 1}
        assert status["capped_uncapped_opens"] == {}  # data caps nothing
        ops.qos.swap(parse_policy(CAPPED))  # data's reads are capped from now on
        capped = await _open(ops, "data/a", os.O_RDONLY)
        assert capped.backing_id == reader.backing_id and not capped.direct_io
        status = kernel_opens.status()
        assert status["uncapped_read_opens"] == {"data": 1}
        assert status["capped_uncapped_opens"] == {"data": 1}
        for info in (reader, writer, capped):
            await ops.release(info.fh)

    trio.run(main)
    logged = [r for r in caplog.records if "uncapped, because Linux 6.8" in r.getMessage()]
    assert len(logged) == 2  # the first of each class and access
    for record in logged:
        record.expected = True  # type: ignore[attr-defined]


def test_served_joins_need_linux_6_9() -> None:
    assert served_join_support("6.18.44-fc-v657").available
    assert served_join_support("6.9.0").available
    old = served_join_support("6.8.12-generic")
    assert not old.available and old.by == "kernel" and "6.8.12" in old.reason
