"""A dead daemon's tables rebuilt from its journal (qosfs.passthrough.recovery), in one
process: operations A write their journal as they serve, A's descriptors are closed as
its death closes them, and operations B, new and idle, rebuilt from what A left, answer
the kernel's node ids and file handles as A would have."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pyfuse3
import pytest
import trio

from qosfs.daemon.fs_assembly import build_filesystem
from qosfs.passthrough.backing_io import IoMode
from qosfs.passthrough.filesystem import Filesystem
from qosfs.passthrough.journal import SessionJournal, read_journal
from qosfs.passthrough.operations import FsOptions
from qosfs.passthrough.recovery import rebuild
from qosfs.policy.loading import parse_policy
from qosfs.qos.engine import PolicyQos
from tests.inprocess_fs import Caller, open_fds

POLICY = """
[classes.ckpt]
paths = ["ckpt/**"]
write_bandwidth = "1GiB/s"
"""


def _fs(root_fd: int) -> Filesystem:
    return build_filesystem(root_fd, IoMode.INLINE, PolicyQos(parse_policy(POLICY)),
                            FsOptions(fd_budget=0))


def test_a_successor_rebuilt_from_the_journal_serves_the_same_ids_and_handles(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = tmp_path / "src"
    (src / "ckpt").mkdir(parents=True)
    (src / "ckpt" / "a").write_bytes(b"A" * 10000)
    (src / "ckpt" / "doomed").write_bytes(b"D" * 100)
    (src / "d").mkdir()
    before = open_fds()
    a_root = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    b_root = os.dup(a_root)
    fs_a = _fs(a_root)
    a = fs_a.ops
    journal = SessionJournal(str(tmp_path / "session.journal"))
    journal.session({"pid": 1})
    fs_a.attach_journal(journal)
    ctx = Caller()
    owner = Caller(uid=4243)

    async def main() -> None:
        ckpt = await a.lookup(pyfuse3.ROOT_INODE, b"ckpt", ctx)
        entry = await a.lookup(ckpt.st_ino, b"a", ctx)
        await a.lookup(ckpt.st_ino, b"a", ctx)  # two kernel references
        doomed = await a.lookup(ckpt.st_ino, b"doomed", ctx)
        reader = await a.open(entry.st_ino, os.O_RDONLY, ctx)
        writer = await a.open(entry.st_ino, os.O_WRONLY | os.O_TRUNC, ctx)
        assert await a.write(writer.fh, 0, b"fresh") == 5
        gone = await a.open(doomed.st_ino, os.O_RDONLY, ctx)
        d = await a.lookup(pyfuse3.ROOT_INODE, b"d", ctx)
        listing = await a.opendir(d.st_ino, owner)
        released = await a.open(entry.st_ino, os.O_RDONLY, ctx)
        await a.release(released.fh)  # its record goes with it
        os.unlink(src / "ckpt" / "doomed")  # unlinked while open, underneath
        dir_owner = a.dirs[listing].owner
        left = read_journal(journal.path)  # what a kill -9 leaves, then its death:
        fs_a.close_all()  # every descriptor the dead process had is closed
        journal.close(remove=True)

        fs_b = _fs(b_root)
        b = fs_b.ops
        rebuilt = rebuild(fs_b, left)
        assert (rebuilt.open_files, rebuilt.lost_files, rebuilt.open_dirs) == (3, 1, 1)
        assert set(b.files) == {reader.fh, writer.fh} and set(b.handles.lost) == {gone.fh}
        assert b.handles.next_fh > max(reader.fh, writer.fh, gone.fh, listing, released.fh)
        # The same node ids, counts and opens; nothing reopened O_TRUNC.
        node = b.inodes.get(entry.st_ino)
        assert (node.lookups, node.opens) == (2, 2)
        assert bytes(await b.read(reader.fh, 0, 8)) == b"fresh"
        assert await b.write(writer.fh, 5, b"more") == 4
        assert (src / "ckpt" / "a").read_bytes() == b"freshmore"
        flow = b.files[writer.fh].charge.flow
        assert flow.class_name == "ckpt" and flow.open_files == 3  # the lost one too
        # The open whose file died with the dead process answers ESTALE, never a hang.
        with pytest.raises(pyfuse3.FUSEError) as raised:
            await b.read(gone.fh, 0, 10)
        assert raised.value.errno == errno.ESTALE
        await b.release(gone.fh)
        # The open directory keeps its fh and owner; its listing is taken again.
        assert b.dirs[listing].inode is b.inodes.get(d.st_ino)
        assert b.dirs[listing].owner == dir_owner
        for fh in (reader.fh, writer.fh):
            await b.release(fh)
        await b.releasedir(listing)
        assert flow.open_files == 0 and node.opens == 0
        fs_b.close_all()

    try:
        trio.run(main)
    finally:
        for record in caplog.records:  # the lost open is logged, as it should be
            record.expected = True
    assert any("cannot be reopened" in r.getMessage() for r in caplog.records)
    os.close(a_root)
    os.close(b_root)
    assert open_fds() == before
