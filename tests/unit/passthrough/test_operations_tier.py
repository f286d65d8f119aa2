"""The pass-through's handlers called in-process on a temporary backing tree, no mount:
each request's effect is checked on the backing files, and every descriptor it took is
accounted for. Run under both engines: without QoS, and with a policy that classifies
and admits every request."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyfuse3
import pytest

from qosfs.core import syscalls
from qosfs.passthrough.operations import FsOptions
from qosfs.policy.loading import default_policy
from qosfs.qos.engine import PolicyQos
from tests.inprocess_fs import ENGINES, Caller, Fields, InProcessFs, open_fds

ROOT = pyfuse3.ROOT_INODE
RW_CREATE = os.O_RDWR | os.O_CREAT
FILE_MODE = stat.S_IFREG | 0o644


@pytest.fixture(params=sorted(ENGINES))
def fs(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[InProcessFs]:
    """The filesystem over an empty backing directory; when the test is done, closing it
    must give back every descriptor it ever took."""
    backing = tmp_path / "backing"
    backing.mkdir()
    before = open_fds()
    fs = InProcessFs(backing, ENGINES[request.param]())
    yield fs
    fs.close()
    assert open_fds() == before


async def errno_of(request: object) -> int:
    """The errno a handler answered (it must fail)."""
    with pytest.raises(pyfuse3.FUSEError) as raised:
        await request  # type: ignore[misc]
    return raised.value.errno


def test_lookup_and_getattr_show_the_backing_object(fs: InProcessFs) -> None:
    (fs.root / "data").mkdir()
    (fs.root / "data" / "f").write_bytes(b"x" * 100)
    ops, ctx = fs.ops, fs.ctx

    async def main() -> None:
        entry = await fs.lookup("data/f")
        st = os.lstat(fs.root / "data" / "f")
        assert (entry.st_ino, entry.st_mode, entry.st_size) == (st.st_ino, st.st_mode, 100)
        assert entry.entry_timeout == entry.attr_timeout == 1.0
        attr = await ops.getattr(entry.st_ino, ctx)
        assert (attr.st_ino, attr.st_mtime_ns, attr.st_nlink) == (st.st_ino, st.st_mtime_ns, 1)
        missing = await ops.lookup(ROOT, b"missing", ctx)
        assert missing.st_ino == 0 and missing.entry_timeout == 1.0  # a negative entry
        again = await fs.lookup("data/f")
        assert again.st_ino == entry.st_ino
        assert ops.inodes.get(entry.st_ino).lookups == 2  # what the kernel will forget
        data = (await fs.lookup("data")).st_ino
        await ops.forget([(entry.st_ino, 2), (data, 3)])
        assert len(ops.inodes) == 1 and ops.inodes.fds_held == 2  # the root, the mount

    fs.run(main)


def test_create_write_read_release_move_the_bytes_of_the_backing_file(
        fs: InProcessFs) -> None:
    ops, ctx = fs.ops, fs.ctx
    backing = fs.root / "f"

    async def main() -> None:
        info, entry = await ops.create(ROOT, b"f", stat.S_IFREG | 0o640, RW_CREATE, ctx)
        assert entry.st_ino == backing.stat().st_ino
        assert stat.S_IMODE(backing.stat().st_mode) == 0o640
        assert await ops.write(info.fh, 0, b"hello") == 5
        assert await ops.write(info.fh, 10, b"world") == 5
        assert backing.read_bytes() == b"hello" + bytes(5) + b"world"  # acknowledged: there
        assert bytes(await ops.read(info.fh, 0, 4096)) == b"hello" + bytes(5) + b"world"
        assert bytes(await ops.read(info.fh, 12, 100)) == b"rld"  # short only at EOF
        assert bytes(await ops.read(info.fh, 100, 10)) == b""
        assert (await ops.getattr(entry.st_ino, ctx)).st_size == 15
        await ops.release(info.fh)
        assert ops.files == {}

        reader = await ops.open(entry.st_ino, os.O_RDONLY, ctx)
        assert bytes(await ops.read(reader.fh, 0, 5)) == b"hello"
        assert await errno_of(ops.write(reader.fh, 0, b"x")) == errno.EBADF
        truncating = await ops.open(entry.st_ino, os.O_WRONLY | os.O_TRUNC, ctx)
        assert backing.stat().st_size == 0
        for fh in (reader.fh, truncating.fh):
            await ops.release(fh)
        await ops.forget([(entry.st_ino, 1)])

    fs.run(main)


@pytest.mark.skipif(os.geteuid() != 0, reason="the daemon gives objects away as root")
def test_created_objects_belong_to_their_caller(fs: InProcessFs) -> None:
    user = Caller(uid=4321, gid=4321)
    ops = fs.ops

    async def main() -> None:
        info, _ = await ops.create(ROOT, b"f", FILE_MODE, RW_CREATE, user)
        await ops.release(info.fh)
        await ops.mkdir(ROOT, b"d", stat.S_IFDIR | 0o755, user)
        await ops.symlink(ROOT, b"l", b"f", user)

    fs.run(main)
    for name in ("f", "d", "l"):
        st = os.lstat(fs.root / name)
        assert (st.st_uid, st.st_gid) == (4321, 4321), name


def test_setattr_truncates_chmods_and_sets_times_with_or_without_an_open_file(
        fs: InProcessFs) -> None:
    backing = fs.root / "f"
    backing.write_bytes(b"x" * 100)
    ops, ctx = fs.ops, fs.ctx

    async def main() -> None:
        ino = (await fs.lookup("f")).st_ino
        attr = pyfuse3.EntryAttributes()
        attr.st_size = 10
        assert (await ops.setattr(ino, attr, Fields(update_size=True), None, ctx)).st_size == 10
        info = await ops.open(ino, os.O_RDWR, ctx)
        attr.st_size = 3
        assert (await ops.setattr(ino, attr, Fields(update_size=True), info.fh, ctx)
                ).st_size == 3
        attr.st_mode = stat.S_IFREG | 0o600
        await ops.setattr(ino, attr, Fields(update_mode=True), info.fh, ctx)
        await ops.release(info.fh)
        attr.st_mode = stat.S_IFREG | 0o604
        await ops.setattr(ino, attr, Fields(update_mode=True), None, ctx)
        attr.st_atime_ns, attr.st_mtime_ns = 10**18, 2 * 10**18
        out = await ops.setattr(ino, attr, Fields(update_atime=True, update_mtime=True),
                                None, ctx)
        assert (out.st_atime_ns, out.st_mtime_ns) == (10**18, 2 * 10**18)

    fs.run(main)
    st = backing.stat()
    assert (st.st_size, stat.S_IMODE(st.st_mode)) == (3, 0o604)
    assert (st.st_atime_ns, st.st_mtime_ns) == (10**18, 2 * 10**18)


def test_namespace_changes_reach_the_backing_tree(fs: InProcessFs) -> None:
    ops, ctx = fs.ops, fs.ctx
    (fs.root / "a").write_bytes(b"A")
    (fs.root / "b").write_bytes(b"B")

    async def main() -> None:
        d = await ops.mkdir(ROOT, b"d", stat.S_IFDIR | 0o755, ctx)
        assert stat.S_ISDIR(d.st_mode) and (fs.root / "d").is_dir()
        info, _ = await ops.create(d.st_ino, b"f", FILE_MODE, RW_CREATE, ctx)
        await ops.release(info.fh)
        await ops.rename(d.st_ino, b"f", ROOT, b"g", 0, ctx)
        assert (fs.root / "g").is_file() and not (fs.root / "d" / "f").exists()
        a, b = await fs.lookup("a"), await fs.lookup("b")
        assert await errno_of(ops.rename(ROOT, b"a", ROOT, b"b", syscalls.RENAME_NOREPLACE,
                                         ctx)) == errno.EEXIST
        await ops.rename(ROOT, b"a", ROOT, b"b", syscalls.RENAME_EXCHANGE, ctx)
        assert (fs.root / "a").read_bytes() == b"B" and (fs.root / "b").read_bytes() == b"A"
        assert (await fs.lookup("a")).st_ino == b.st_ino  # the objects moved, not the data
        assert (await fs.lookup("b")).st_ino == a.st_ino
        link = await ops.link(a.st_ino, ROOT, b"hard", ctx)
        assert link.st_ino == a.st_ino and link.st_nlink == 2
        sym = await ops.symlink(ROOT, b"sym", b"g", ctx)
        assert await ops.readlink(sym.st_ino, ctx) == b"g"
        fifo = await ops.mknod(ROOT, b"fifo", stat.S_IFIFO | 0o644, 0, ctx)
        assert stat.S_ISFIFO(os.lstat(fs.root / "fifo").st_mode) and stat.S_ISFIFO(fifo.st_mode)
        (fs.root / "d" / "x").write_bytes(b"")
        assert await errno_of(ops.rmdir(ROOT, b"d", ctx)) == errno.ENOTEMPTY
        os.unlink(fs.root / "d" / "x")
        await ops.rmdir(ROOT, b"d", ctx)
        for name in (b"g", b"hard", b"sym", b"fifo"):
            await ops.unlink(ROOT, name, ctx)
        assert sorted(os.listdir(fs.root)) == ["a", "b"]

    fs.run(main)


def test_an_object_changed_underneath_answers_estale_and_is_left_alone(
        fs: InProcessFs) -> None:
    """The kernel checked permissions on what it looked up: acting as root on whatever
    the name holds now would skip that check (``PassthroughOperations._looked_up``)."""
    ops, ctx = fs.ops, fs.ctx
    victim = fs.root / "victim"
    victim.write_bytes(b"old")
    (fs.root / "a").write_bytes(b"a")
    (fs.root / "dir").mkdir()

    async def main() -> None:
        for name in ("victim", "a", "dir"):
            await fs.lookup(name)
        (fs.root / "new").write_bytes(b"new")
        os.replace(fs.root / "new", victim)  # another object under the looked-up name
        os.rmdir(fs.root / "dir")
        (fs.root / "dir").mkdir()
        for attempt in (ops.unlink(ROOT, b"victim", ctx),
                        ops.rename(ROOT, b"victim", ROOT, b"moved", 0, ctx),
                        ops.rename(ROOT, b"a", ROOT, b"victim", syscalls.RENAME_EXCHANGE, ctx),
                        ops.rmdir(ROOT, b"dir", ctx)):
            assert await errno_of(attempt) == errno.ESTALE
        assert victim.read_bytes() == b"new" and (fs.root / "dir").is_dir()
        await fs.lookup("victim")  # the kernel looks the name up again: now it may act
        await ops.unlink(ROOT, b"victim", ctx)
        assert not victim.exists()

    fs.run(main)


class Listing:
    """Stands for the kernel's readdir buffer: takes *room* entries, then is full."""

    def __init__(self, room: int = 1 << 30) -> None:
        self.room = room
        self.entries: list[tuple[bytes, int, int]] = []  # name, node id, next offset

    def reply(self, token: object, name: bytes, attr: pyfuse3.EntryAttributes,
              next_id: int) -> bool:
        if len(self.entries) >= self.room:
            return False
        self.entries.append((name, attr.st_ino, next_id))
        return True

    @property
    def names(self) -> list[bytes]:
        return [name for name, _, _ in self.entries]


def test_readdir_offsets_stay_stable_while_entries_come_and_go(
        fs: InProcessFs, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in "abcdef":
        (fs.root / name).write_bytes(b"")
    ops, ctx = fs.ops, fs.ctx

    async def read_from(fh: int, offset: int, listing: Listing) -> Listing:
        monkeypatch.setattr(pyfuse3, "readdir_reply", listing.reply)
        await ops.readdir(fh, offset, None)  # type: ignore[arg-type]
        return listing

    async def main() -> None:
        fh = await ops.opendir(ROOT, ctx)
        first = await read_from(fh, 0, Listing(room=4))
        assert first.names[:2] == [b".", b".."]
        assert [ino for _, ino, _ in first.entries[:2]] == [ROOT, ROOT]  # the root's '..'
        listed = first.names[2:]
        rest = sorted({b"a", b"b", b"c", b"d", b"e", b"f"} - set(listed))
        os.unlink(fs.root / os.fsdecode(rest[0]))  # gone before its turn came
        (fs.root / "new").write_bytes(b"")  # came after the pass began
        second = await read_from(fh, first.entries[-1][2], Listing())
        # On from where the first batch stopped: nothing twice, nothing skipped but what
        # went away, nothing that came since (a pass lists one snapshot).
        assert sorted(second.names) == rest[1:]
        # Each entry sent counts one lookup; the one the full buffer refused, none.
        for name, ino, _ in first.entries[2:] + second.entries:
            assert ops.inodes.get(ino).lookups == 1, name
        assert len(ops.inodes) == 1 + len(listed) + len(second.names)
        fresh = await read_from(fh, 0, Listing())  # a new pass: a new snapshot
        assert b"new" in fresh.names and rest[0] not in fresh.names
        await ops.releasedir(fh)
        assert ops.dirs == {}

    fs.run(main)


def test_dotdot_comes_from_the_inode_table_and_follows_renames(fs: InProcessFs) -> None:
    for path in ("a/b", "c"):
        (fs.root / path).mkdir(parents=True)
    ops, ctx = fs.ops, fs.ctx

    async def main() -> None:
        a, b, c = [await fs.lookup(p) for p in ("a", "a/b", "c")]
        up = await ops.lookup(b.st_ino, b"..", ctx)
        assert up.st_ino == a.st_ino and ops.inodes.get(a.st_ino).lookups == 3  # one more
        await ops.rename(a.st_ino, b"b", c.st_ino, b"b", 0, ctx)
        assert (await ops.lookup(b.st_ino, b"..", ctx)).st_ino == c.st_ino
        listing = Listing()
        fh = await ops.opendir(b.st_ino, ctx)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(pyfuse3, "readdir_reply", listing.reply)
            await ops.readdir(fh, 0, None)  # type: ignore[arg-type]
        await ops.releasedir(fh)
        assert listing.entries[1][:2] == (b"..", c.st_ino)
        # The kernel forgets c: a '..' from b opens it again by its file handle.
        await ops.forget([(c.st_ino, ops.inodes.get(c.st_ino).lookups)])
        again = await ops.lookup(b.st_ino, b"..", ctx)
        assert again.st_ino == c.st_ino == os.stat(fs.root / "c").st_ino
        assert (await ops.lookup(ROOT, b"..", ctx)).st_ino == ROOT  # never above the root

    fs.run(main)


def _small_budget_fs(tmp_path: Path, files: int) -> InProcessFs:
    """*files* files f0.. (each holding its number) served with 8 inode descriptors;
    skips where inodes have no file handles."""
    for i in range(files):
        (tmp_path / f"f{i}").write_bytes(b"%d" % i)
    fs = InProcessFs(tmp_path, ENGINES["policy"](), FsOptions(fd_budget=8))
    if not fs.ops.inodes.handles:
        fs.close()
        pytest.skip("no file handles here (not root, or the filesystem exports none)")
    return fs


def test_evicted_inode_descriptors_reopen_by_handle(tmp_path: Path) -> None:
    """A tree larger than the descriptor budget: every inode still answers, through a
    descriptor reopened from its file handle, and the cache stays within the budget."""
    before = open_fds()
    fs = _small_budget_fs(tmp_path, 40)
    ops, ctx = fs.ops, fs.ctx

    async def main() -> None:
        nodes = [(await fs.lookup(f"f{i}")).st_ino for i in range(40)]
        for i, ino in enumerate(nodes):  # each request starts by trimming the cache
            assert (await ops.getattr(ino, ctx)).st_ino == (tmp_path / f"f{i}").stat().st_ino
            assert len(ops.inodes.cache) <= 8 + 1
        assert ops.inodes.reopens >= 30
        info = await ops.open(nodes[0], os.O_RDONLY, ctx)
        assert bytes(await ops.read(info.fh, 0, 10)) == b"0"
        await ops.release(info.fh)
        await ops.forget([(ino, 1) for ino in nodes])
        assert len(ops.inodes) == 1 and ops.inodes.fds_held == 2

    fs.run(main)
    fs.close()
    assert open_fds() == before


def test_an_evicted_inode_is_opened_straight_from_its_handle(tmp_path: Path) -> None:
    """An open of an inode whose descriptor was evicted opens the file from its handle,
    and caches no descriptor for it (that would evict another inode's); a file gone
    underneath answers ESTALE from then on."""
    fs = _small_budget_fs(tmp_path, 20)
    ops, ctx = fs.ops, fs.ctx

    async def main() -> None:
        nodes = [(await fs.lookup(f"f{i}")).st_ino for i in range(20)]
        await ops.getattr(nodes[-1], ctx)  # a request trims the cache to its budget
        evicted = [ino for ino in nodes if ops.inodes.get(ino).cached_fd < 0]
        assert len(evicted) >= 10
        cached = {ino for ino in nodes if ops.inodes.get(ino).cached_fd >= 0}
        reopens = ops.inodes.reopens
        for ino in evicted:
            info = await ops.open(ino, os.O_RDONLY, ctx)
            assert bytes(await ops.read(info.fh, 0, 10)) == b"%d" % nodes.index(ino)
            # Python's open() stats what it opened: the open's descriptor answers.
            st = await ops.getattr(ino, ctx)
            assert st.st_size == len(b"%d" % nodes.index(ino))
            await ops.release(info.fh)
        assert ops.inodes.reopens == reopens  # no descriptor reopened, none evicted
        assert {ino for ino in nodes if ops.inodes.get(ino).cached_fd >= 0} == cached
        assert all(ops.inodes.get(ino).open_fd == -1 for ino in evicted)
        await ops.getattr(evicted[1], ctx)  # not open: its own descriptor, reopened
        assert ops.inodes.reopens == reopens + 1
        gone = evicted[0]
        os.unlink(tmp_path / f"f{nodes.index(gone)}")
        for _ in range(2):
            with pytest.raises(pyfuse3.FUSEError) as err:
                await ops.open(gone, os.O_RDONLY, ctx)
            assert err.value.errno == errno.ESTALE
        assert ops.inodes.by_id[gone].stale  # let go of: the table's get answers ESTALE

    fs.run(main)
    fs.close()


def test_every_descriptor_is_given_back_when_the_kernel_lets_go(fs: InProcessFs) -> None:
    ops, ctx = fs.ops, fs.ctx
    (fs.root / "d").mkdir()

    async def main() -> None:
        baseline = open_fds()  # trio's own descriptors included
        d = await fs.lookup("d")
        files = []
        for i in range(5):
            info, entry = await ops.create(d.st_ino, b"f%d" % i, FILE_MODE, RW_CREATE, ctx)
            await ops.write(info.fh, 0, b"x" * 100)
            second = await ops.open(entry.st_ino, os.O_RDONLY, ctx)
            files += [info.fh, second.fh]
        fh = await ops.opendir(d.st_ino, ctx)
        listing = Listing()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(pyfuse3, "readdir_reply", listing.reply)
            await ops.readdir(fh, 0, None)  # type: ignore[arg-type]
        assert open_fds() > baseline + 10
        await ops.releasedir(fh)
        for f in files:
            await ops.release(f)
        assert ops.files == {} and ops.dirs == {}
        # Each name was looked up twice (create, readdir), the directory once.
        await ops.forget([(ino, 2) for name, ino, _ in listing.entries if name[0] == ord("f")])
        await ops.forget([(d.st_ino, 1)])
        assert len(ops.inodes) == 1 and ops.inodes.fds_held == 2
        assert open_fds() == baseline

    fs.run(main)


def test_a_uid_past_its_share_of_open_files_gets_enfile(fs: InProcessFs) -> None:
    (fs.root / "f").write_bytes(b"x")
    ops, root = fs.ops, Caller(uid=0, gid=0)
    user = Caller(uid=4321, gid=4321)
    ops.handles.quota.per_uid = 2

    async def main() -> None:
        ino = (await fs.lookup("f")).st_ino
        held = [(await ops.open(ino, os.O_RDONLY, user)).fh,
                (await ops.open(ino, os.O_RDONLY, user)).fh]
        fds = open_fds()
        assert await errno_of(ops.open(ino, os.O_RDONLY, user)) == errno.ENFILE
        assert await errno_of(ops.opendir(ROOT, user)) == errno.ENFILE
        assert await errno_of(ops.create(ROOT, b"new", FILE_MODE, RW_CREATE, user)
                              ) == errno.ENFILE
        assert not (fs.root / "new").exists() and open_fds() == fds  # nothing taken
        assert ops.handles.quota.refused == 3
        other = await ops.open(ino, os.O_RDONLY, root)  # root is not counted
        await ops.release(held.pop())
        held.append((await ops.open(ino, os.O_RDONLY, user)).fh)  # room again
        for fh in [*held, other.fh]:
            await ops.release(fh)
        assert ops.handles.quota.held(4321) == 0

    fs.run(main)


def test_unaligned_requests_on_an_o_direct_open_go_through_one_buffered_twin(
        fs: InProcessFs) -> None:
    ops, ctx = fs.ops, fs.ctx

    async def main() -> None:
        info, _ = await ops.create(ROOT, b"f", FILE_MODE, RW_CREATE | os.O_DIRECT, ctx)
        if not fcntl.fcntl(ops.files[info.fh].fd, fcntl.F_GETFL) & os.O_DIRECT:
            await ops.release(info.fh)
            pytest.skip("the temporary directory refuses O_DIRECT")
        assert await ops.write(info.fh, 0, b"a" * 4096) == 4096  # aligned: O_DIRECT itself
        fds = open_fds()
        assert await ops.write(info.fh, 4096, b"tail") == 4  # EINVAL under O_DIRECT
        assert open_fds() == fds + 1  # the twin, opened at the first such request
        assert bytes(await ops.read(info.fh, 4090, 10)) == b"aaaaaatail"
        assert bytes(await ops.read(info.fh, 0, 4096)) == b"a" * 4096
        assert open_fds() == fds + 1  # one per open, kept
        await ops.release(info.fh)
        assert open_fds() == fds - 1  # both closed

    fs.run(main)
    assert (fs.root / "f").read_bytes() == b"a" * 4096 + b"tail"


def test_a_listing_derives_its_entries_paths_and_reads_none_from_proc(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a policy whose cache timeouts go by path (the default's datasets: 60 s), a
    READDIRPLUS entry's timeouts come from its path derived from the directory's, as a
    lookup's do: not one readlink of /proc per entry (a `find` over a big tree paid one
    per file)."""
    backing = tmp_path / "backing"
    (backing / "data").mkdir(parents=True)
    names = [f"f{i:03d}" for i in range(40)]
    for name in names:
        (backing / "data" / name).write_bytes(b"x")
    fs = InProcessFs(backing, PolicyQos(default_policy()))
    real_readlink = os.readlink
    read_from_proc: list[str] = []

    def readlink(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path).startswith("/proc/"):
            read_from_proc.append(str(path))
        return real_readlink(path, *args, **kwargs)

    timeouts: dict[bytes, tuple[float, float]] = {}

    def reply(token: object, name: bytes, attr: pyfuse3.EntryAttributes, next_id: int) -> bool:
        timeouts[name] = (attr.entry_timeout, attr.attr_timeout)
        return True

    async def main() -> None:
        data = await fs.lookup("data")
        fh = await fs.ops.opendir(data.st_ino, fs.ctx)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(os, "readlink", readlink)
            patch.setattr(pyfuse3, "readdir_reply", reply)
            await fs.ops.readdir(fh, 0, None)  # type: ignore[arg-type]
        await fs.ops.releasedir(fh)

    try:
        fs.run(main)
    finally:
        fs.close()
    assert read_from_proc == []
    assert {timeouts[os.fsencode(n)] for n in names} == {(60.0, 60.0)}
