"""Operations called directly (no mount): error translation and inode bookkeeping."""

from __future__ import annotations

import errno
import fcntl
import inspect
import logging
import mmap
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pyfuse3
import pytest
import trio

from qosfs.core import syscalls
from qosfs.daemon.fs_assembly import build_filesystem
from qosfs.passthrough import odirect
from qosfs.passthrough.backing_io import BackingIO, IoMode
from qosfs.passthrough.filesystem import Filesystem
from qosfs.passthrough.kernel import KernelPassthrough
from qosfs.passthrough.operations import FsOptions, PassthroughOperations
from qosfs.policy.loading import parse_policy
from qosfs.qos.engine import PolicyQos
from qosfs.qos.interface import PassThroughQos


class _Ctx:
    uid = os.getuid()
    gid = os.getgid()
    pid = os.getpid()
    umask = 0o022


def _fs(root: Path) -> Filesystem:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    return build_filesystem(fd, IoMode.INLINE, PassThroughQos(), FsOptions())


def _ops(root: Path) -> PassthroughOperations:
    return _fs(root).ops


def test_backing_errors_become_their_own_errno(tmp_path: Path) -> None:
    ops = _ops(tmp_path)

    async def main() -> None:
        entry = await ops.lookup(pyfuse3.ROOT_INODE, b"missing", _Ctx())
        assert entry.st_ino == 0  # negative entry, cacheable
        with pytest.raises(pyfuse3.FUSEError) as info:
            await ops.rmdir(pyfuse3.ROOT_INODE, b"missing", _Ctx())
        assert info.value.errno == errno.ENOENT
        with pytest.raises(pyfuse3.FUSEError) as info:
            await ops.mkdir(pyfuse3.ROOT_INODE, b"x" * 300, 0o755, _Ctx())
        assert info.value.errno == errno.ENAMETOOLONG

    trio.run(main)


def test_unexpected_exception_is_logged_and_answered_eio(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    fs = _fs(tmp_path)
    ops = fs.ops
    (tmp_path / "f").write_text("x")

    def broken(*args: object) -> None:
        raise ValueError("bug")

    monkeypatch.setattr(ops.inodes, "resolve", broken)

    async def main() -> None:
        for _ in range(3):
            with pytest.raises(pyfuse3.FUSEError) as info:
                await ops.lookup(pyfuse3.ROOT_INODE, b"f", _Ctx())
            assert info.value.errno == errno.EIO

    with caplog.at_level(logging.ERROR):
        trio.run(main)
    records = [r for r in caplog.records if "unexpected failure in lookup" in r.getMessage()]
    assert len(records) == 1  # once per kind; the rest are counted
    for r in records:
        r.expected = True  # type: ignore[attr-defined]
    assert fs.resources()["internal_errors"] == {"lookup": {"ValueError": 3}}


class _Broken:
    """Stands for every part of the filesystem's state: any use of it raises, as a bug
    would (attribute, item, call)."""

    def __getattr__(self, name: str) -> object:
        raise ValueError(f"bug reading {name}")

    def __getitem__(self, key: object) -> object:
        raise ValueError(f"bug looking {key!r} up")


def _handler_args(fn: object) -> list[object]:
    """Plausible arguments for a pyfuse3 handler, by parameter name."""
    by_name: dict[str, object] = {
        "ctx": _Ctx(), "attr": pyfuse3.EntryAttributes(), "fields": pyfuse3.SetattrFields(),
        "inode_list": [(5, 1)], "token": None, "datasync": False, "fh": 5,
    }
    args: list[object] = []
    for name in inspect.signature(fn).parameters:  # type: ignore[arg-type]
        if name in by_name:
            args.append(by_name[name])
        elif "name" in name or name in ("target", "value", "buf"):
            args.append(b"x")
        else:
            args.append(1)
    return args


HANDLERS = sorted(name for name in vars(PassthroughOperations)
                  if not name.startswith("_") and callable(getattr(pyfuse3.Operations, name,
                                                                   None)))


def test_every_handler_answers_an_unexpected_exception_with_eio(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Only FUSEError may leave a handler: anything else ends pyfuse3's main loop and the
    mount with it (every caller then gets ENOTCONN)."""
    assert {"read", "write", "forget", "release", "readdir", "statfs"} <= set(HANDLERS)
    ops = _ops(tmp_path)
    ops.inodes = ops.files = ops.dirs = ops.handles = ops.io = _Broken()  # type: ignore[assignment]

    async def main() -> None:
        for name in HANDLERS:
            handler = getattr(ops, name)
            if name == "forget":  # no request to answer: it must not raise at all
                await handler(*_handler_args(handler))
                continue
            with pytest.raises(pyfuse3.FUSEError) as info:
                await handler(*_handler_args(handler))
            assert info.value.errno == errno.EIO, name

    with caplog.at_level(logging.ERROR):
        trio.run(main)
    assert ops.failures.counts() == {name: {"ValueError": 1} for name in HANDLERS}
    for r in caplog.records:
        r.expected = True  # type: ignore[attr-defined]


def test_a_bookkeeping_bug_after_the_syscall_still_answers_with_the_data(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The bytes moved: failing the request would tell the caller they had not."""
    ops = _ops(tmp_path)
    (tmp_path / "f").write_bytes(b"x" * 8192)

    async def main() -> None:
        entry = await ops.lookup(pyfuse3.ROOT_INODE, b"f", _Ctx())
        info = await ops.open(entry.st_ino, os.O_RDWR, _Ctx())
        ops.files[info.fh].charge.flow.stats = _Broken()  # type: ignore[assignment]
        assert bytes(await ops.read(info.fh, 0, 4)) == b"xxxx"
        assert await ops.write(info.fh, 0, b"yy") == 2
        await ops.release(info.fh)

    with caplog.at_level(logging.ERROR):
        trio.run(main)
    assert (tmp_path / "f").read_bytes()[:3] == b"yyx"
    assert ops.failures.counts() == {"read": {"ValueError": 1}, "write": {"ValueError": 1}}
    for r in caplog.records:
        r.expected = True  # type: ignore[attr-defined]


def test_hard_links_share_one_inode_and_forget_releases_it(tmp_path: Path) -> None:
    ops = _ops(tmp_path)
    (tmp_path / "a").write_text("x")
    os.link(tmp_path / "a", tmp_path / "b")

    async def main() -> None:
        a = await ops.lookup(pyfuse3.ROOT_INODE, b"a", _Ctx())
        b = await ops.lookup(pyfuse3.ROOT_INODE, b"b", _Ctx())
        assert a.st_ino == b.st_ino == os.stat(tmp_path / "a").st_ino
        assert len(ops.inodes) == 2  # root + one shared inode
        await ops.forget([(a.st_ino, 2)])
        assert len(ops.inodes) == 1

    trio.run(main)


def test_names_never_lead_the_daemon_out_of_the_tree(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    os.chmod(outside, 0o755)
    os.symlink(outside, root / "out")
    ops = _ops(root)

    async def main() -> None:
        up = await ops.lookup(pyfuse3.ROOT_INODE, b"..", _Ctx())
        assert up.st_ino == pyfuse3.ROOT_INODE  # '..' of the root is the root
        link = await ops.lookup(pyfuse3.ROOT_INODE, b"out", _Ctx())
        assert stat.S_ISLNK(link.st_mode)  # the link itself: the kernel follows it, not us
        for attempt in (
            ops.lookup(link.st_ino, b"x", _Ctx()),
            ops.mkdir(link.st_ino, b"x", 0o755, _Ctx()),
            ops.mknod(link.st_ino, b"x", stat.S_IFIFO | 0o644, 0, _Ctx()),
            ops.symlink(link.st_ino, b"x", b"y", _Ctx()),
            ops.create(link.st_ino, b"x", 0o644, os.O_WRONLY, _Ctx()),
            ops.rename(pyfuse3.ROOT_INODE, b"out", link.st_ino, b"x", 0, _Ctx()),
        ):
            with pytest.raises(pyfuse3.FUSEError) as info:
                await attempt
            assert info.value.errno in (errno.ENOTDIR, errno.ENOENT), attempt
        # Changes to the link itself (fchmodat2 AT_SYMLINK_NOFOLLOW, lsetxattr, lchown)
        # reach the link, never its target outside.
        attr = pyfuse3.EntryAttributes()
        attr.st_mode, attr.st_uid, attr.st_size = 0o777, 4242, 0
        fields = SimpleNamespace(update_size=False, update_mode=True, update_uid=False,
                                 update_gid=False, update_atime=False, update_mtime=False)
        with pytest.raises(pyfuse3.FUSEError) as info:
            await ops.setattr(link.st_ino, attr, fields, None, _Ctx())
        assert info.value.errno == errno.EOPNOTSUPP
        with pytest.raises(pyfuse3.FUSEError) as info:
            await ops.setxattr(link.st_ino, b"user.x", b"1", _Ctx())
        assert info.value.errno == errno.EPERM
        if os.geteuid() == 0:
            fields.update_mode, fields.update_uid = False, True
            await ops.setattr(link.st_ino, attr, fields, None, _Ctx())
            assert os.lstat(root / "out").st_uid == 4242 and outside.stat().st_uid == 0
        assert os.listdir(outside) == [] and stat.S_IMODE(outside.stat().st_mode) == 0o755
        assert os.listxattr(outside) == []

    trio.run(main)


@pytest.mark.parametrize("code", [errno.EIO, errno.EACCES, errno.ENOSPC, errno.EDQUOT])
def test_backing_errors_on_the_data_path_reach_the_caller_and_leave_handles_sound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    # As root on tmpfs the backing store never refuses with EACCES, and EIO needs a
    # failing device (test_faults shrinks a loop device): here every data-path syscall
    # fails on demand, and the errno must come back unchanged, nothing else raised.
    ops = _ops(tmp_path)
    (tmp_path / "f").write_bytes(b"x" * 8192)

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(code, os.strerror(code))

    async def main() -> None:
        entry = await ops.lookup(pyfuse3.ROOT_INODE, b"f", _Ctx())
        info = await ops.open(entry.st_ino, os.O_RDWR, _Ctx())
        with monkeypatch.context() as patched:
            for name in ("read", "write", "blocking"):
                patched.setattr(ops.io, name, fail)
            # release closes inline on a local filesystem, in a thread on a network one
            patched.setattr(odirect, "close_file", fail)
            for call in (ops.read(info.fh, 0, 4096), ops.write(info.fh, 0, b"y" * 4096),
                         ops.fsync(info.fh, False), ops.fsync(info.fh, True)):
                with pytest.raises(pyfuse3.FUSEError) as raised:
                    await call
                assert raised.value.errno == code
            with pytest.raises(pyfuse3.FUSEError) as raised:
                await ops.release(info.fh)  # close() reporting a deferred error (NFS)
            assert raised.value.errno == code
        assert info.fh not in ops.files  # released all the same
        os.close(info.fh)  # (the patched close did not: a real close frees it even failing)
        info = await ops.open(entry.st_ino, os.O_RDWR, _Ctx())  # and the file still works
        assert bytes(await ops.read(info.fh, 0, 4)) == b"xxxx"
        await ops.release(info.fh)

    trio.run(main)


def test_requests_o_direct_refuses_go_to_one_buffered_twin_closed_at_release(
        tmp_path: Path) -> None:
    # The kernel writes a mapping's last page back up to EOF only, on whichever writable
    # open it picks, O_DIRECT or not (tests/mount/test_odirect.py shows the data loss).
    ops = _ops(tmp_path)

    async def main() -> None:
        info, _ = await ops.create(pyfuse3.ROOT_INODE, b"f", 0o644, os.O_RDWR | os.O_DIRECT,
                                   _Ctx())
        handle = ops.files[info.fh]
        if not handle.direct:
            pytest.skip("the temporary directory refuses O_DIRECT")
        align = syscalls.dio_offset_align(handle.fd) or mmap.PAGESIZE
        assert handle.dio_mask == align - 1 and not align & (align - 1)
        assert await ops.write(info.fh, 0, b"a" * 4096) == 4096  # aligned: O_DIRECT
        assert bytes(await ops.read(info.fh, 0, 4096)) == b"a" * 4096
        assert handle.buffered == -1  # not opened until needed
        assert await ops.write(info.fh, 4096, b"tail") == 4
        twin = handle.buffered
        assert twin >= 0 and not fcntl.fcntl(twin, fcntl.F_GETFL) & os.O_DIRECT
        assert bytes(await ops.read(info.fh, 4090, 10)) == b"aaaaaatail"
        assert handle.buffered == twin  # one per open, kept
        await ops.release(info.fh)
        for fd in (handle.fd, twin):
            with pytest.raises(OSError) as closed:
                os.fstat(fd)
            assert closed.value.errno == errno.EBADF
        assert (tmp_path / "f").read_bytes() == b"a" * 4096 + b"tail"

    trio.run(main)


CHARGED_POLICY = """
[classes.ckpt]
paths = ["ckpt/**"]
write_bandwidth = "1GiB/s"
write_iops = 100000
detect_streaming_writes = "64MiB"
"""


def test_writes_and_renames_are_reported_to_the_opens_charge(tmp_path: Path) -> None:
    """The wiring of qosfs.qos.charge (tested on its own in tests/unit/qos/test_charge.py):
    a split write costs one op, a rename re-charges the bytes written under a name that said
    nothing and moves the open still writing, and release leaves no open counted."""
    (tmp_path / "ckpt").mkdir()
    engine = PolicyQos(parse_policy(CHARGED_POLICY))
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    ops = build_filesystem(fd, IoMode.INLINE, engine, FsOptions()).ops
    tail = mmap.PAGESIZE * 256

    async def main() -> None:
        info, _ = await ops.create(pyfuse3.ROOT_INODE, b".tmp1", 0o644, os.O_WRONLY, _Ctx())
        charge = ops.files[info.fh].charge
        assert await ops.write(info.fh, 0, b"a" * (tail - 48)) == tail - 48
        assert await ops.write(info.fh, tail - 48, b"b" * 48) == 48
        assert charge.flow.stats.write_ops == 1  # one caller write, split by the kernel
        ckpt = await ops.lookup(pyfuse3.ROOT_INODE, b"ckpt", _Ctx())
        await ops.rename(pyfuse3.ROOT_INODE, b".tmp1", ckpt.st_ino, b"w.pt", 0, _Ctx())
        assert engine.rename_charges == {"ckpt": tail}
        assert charge.flow.open_files == 1 and "ckpt" in repr(charge.flow)
        await ops.release(info.fh)

    trio.run(main)
    assert (tmp_path / "ckpt" / "w.pt").stat().st_size == tail
    assert all(flow.open_files == 0 for flow in engine._flows.values())
    assert engine.counters().rename_charged_bytes == {"ckpt": tail}


def test_passthrough_that_cannot_work_is_not_negotiated_and_says_why(tmp_path: Path) -> None:
    fs = _fs(tmp_path)
    ops = fs.ops
    ops.kernel_opens.kernel = KernelPassthrough(SimpleNamespace())  # pyfuse3 without the patch
    ops.kernel_opens.request(ops, 0)
    assert not vars(ops).get("enable_passthrough")  # INIT will not ask the kernel
    status = fs.resources()["passthrough"]
    assert status["state"] == "unavailable" and "patch" in status["reason"]
    assert status["registered"] == status["live_backing_ids"] == 0
    off = _ops(tmp_path)
    off.kernel_opens.off("turned off (--no-passthrough)")
    assert off.kernel_opens.status()["reason"] == "turned off (--no-passthrough)"


PREFETCH_POLICY = """
[classes.capped]
paths = ["capped/**"]
read_bandwidth = "1GiB/s"
[classes.free]
paths = ["free/**"]
"""


@pytest.mark.parametrize(("qos", "path", "flags", "reads_ahead"), [
    ("none", "f", os.O_RDONLY, True),
    ("none", "f", os.O_RDWR, True),
    ("none", "f", os.O_WRONLY, False),  # nothing will read it
    ("policy", "free/f", os.O_RDONLY, True),
    ("policy", "capped/f", os.O_RDONLY, False),  # no byte read before its admission
    ("policy", "capped/f", os.O_RDWR, False),
])
def test_an_open_reads_a_small_file_ahead_only_for_reads_no_cap_holds_back(
        tmp_path: Path, qos: str, path: str, flags: int, reads_ahead: bool) -> None:
    """A daemon-served open of a small file on a local disk starts reading it, so that its
    READ finds the pages in and takes no thread hop (qosfs.passthrough.backing_io); not for
    a write-only open, nor for a class whose reads are capped, nor at a reopen whose
    cached pages the kernel keeps."""
    for sub in ("free", "capped"):
        (tmp_path / sub).mkdir()
    (tmp_path / path).write_bytes(b"x" * 112 * 1024)
    engine = PassThroughQos() if qos == "none" else PolicyQos(parse_policy(PREFETCH_POLICY))
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    io = BackingIO(IoMode.NOWAIT)
    fs = build_filesystem(fd, io, engine, FsOptions())
    ops = fs.ops

    async def main() -> None:
        parent = pyfuse3.ROOT_INODE
        *dirs, name = path.encode().split(b"/")
        for d in dirs:
            parent = (await ops.lookup(parent, d, _Ctx())).st_ino
        entry = await ops.lookup(parent, name, _Ctx())
        for _ in range(2):  # the second open keeps the kernel's pages: nothing to read
            info = await ops.open(entry.st_ino, flags, _Ctx())
            await ops.release(info.fh)

    trio.run(main)
    assert io.prefetches == (1 if reads_ahead else 0)
    assert fs.resources()["backing_prefetches"] == io.prefetches
