"""The filesystem's state handed to a successor (qosfs.passthrough.transfer), in one process:
operations B, built on a duplicate of A's root, takes over A's exported tables with
duplicates of the descriptors (what SCM_RIGHTS gives), and answers the kernel's node ids
and file handles as A would have, with the same charges."""

from __future__ import annotations

import os
from pathlib import Path

import pyfuse3
import pytest
import trio

from qosfs.daemon.filesystem import build_filesystem
from qosfs.passthrough.backing_io import IoMode
from qosfs.passthrough.operations import FsOptions, PassthroughOperations
from qosfs.passthrough.transfer import export_state, import_state
from qosfs.policy.loading import parse_policy
from qosfs.qos.engine import PolicyQos
from qosfs.qos.interface import PassThroughQos, QosEngine

POLICY = """
[classes.ckpt]
paths = ["ckpt/**"]
write_bandwidth = "1GiB/s"
"""


class _Ctx:
    uid = os.getuid()
    gid = os.getgid()
    pid = os.getpid()
    umask = 0o022


def _ops(root_fd: int, engine: QosEngine, budget: int = 0) -> PassthroughOperations:
    return build_filesystem(root_fd, IoMode.INLINE, engine, FsOptions(fd_budget=budget))


def _hand_over(a: PassthroughOperations, engine: QosEngine) -> PassthroughOperations:
    payload, fds = export_state(a)
    received = [os.dup(fd) for fd in fds]  # other numbers, as a successor gets them
    b = _ops(os.dup(a.inodes.root.fd), engine)
    import_state(b, payload, received)
    return b


@pytest.mark.parametrize("with_policy", [True, False], ids=["policy", "no-qos"])
def test_a_successor_answers_the_same_node_ids_and_file_handles(
        tmp_path: Path, with_policy: bool) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "a").write_bytes(b"A" * 10000)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_bytes(b"x")

    def engine() -> QosEngine:
        return PolicyQos(parse_policy(POLICY)) if with_policy else PassThroughQos()

    a = _ops(os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY), engine())
    ctx = _Ctx()

    async def main() -> None:
        ckpt = await a.lookup(pyfuse3.ROOT_INODE, b"ckpt", ctx)
        entry = await a.lookup(ckpt.st_ino, b"a", ctx)
        await a.lookup(ckpt.st_ino, b"a", ctx)  # two kernel references
        reader = await a.open(entry.st_ino, os.O_RDONLY, ctx)
        writer = await a.open(entry.st_ino, os.O_WRONLY, ctx)
        d = await a.lookup(pyfuse3.ROOT_INODE, b"d", ctx)
        listing = await a.opendir(d.st_ino, ctx)
        b_engine = engine()
        b = _hand_over(a, b_engine)

        # The same fh reads and writes the same file, through other descriptors.
        assert b.files[reader.fh].fd != a.files[reader.fh].fd
        assert bytes(await b.read(reader.fh, 0, 4)) == b"AAAA"
        assert await b.write(writer.fh, 0, b"BB") == 2
        assert (tmp_path / "ckpt" / "a").read_bytes()[:4] == b"BBAA"
        # The same charge: the class at open and the open counted in its flow once.
        flow = b.files[writer.fh].charge.flow
        assert flow.class_name == a.files[writer.fh].charge.flow.class_name
        assert flow.open_files == 2  # the reader and the writer, neither counted twice
        if with_policy:
            assert flow.class_name == "ckpt"
        # The node ids, their lookup counts and the open count on the inode.
        node = b.inodes.get(entry.st_ino)
        assert node.lookups == 2 and node.opens == 2
        assert (await b.getattr(entry.st_ino, ctx)).st_size == 10000
        assert b.inodes.lookup_parent(b.inodes.get(ckpt.st_ino)) is b.inodes.root
        # A new open never takes an fh the kernel holds from the predecessor.
        again = await b.open(entry.st_ino, os.O_RDONLY, ctx)
        assert again.fh not in (reader.fh, writer.fh, listing)
        # The open directory lists on from its handle.
        assert listing in b.dirs and b.dirs[listing].inode is b.inodes.get(d.st_ino)
        for fh in (reader.fh, writer.fh, again.fh):
            await b.release(fh)
        await b.releasedir(listing)
        assert flow.open_files == 0 and node.opens == 0
        await b.forget([(entry.st_ino, 2)])
        with pytest.raises(KeyError):
            b.inodes.get(entry.st_ino)
        a.close_all()  # the predecessor's own descriptors; B's stay open
        assert (await b.lookup(ckpt.st_ino, b"a", ctx)).st_ino == entry.st_ino
        b.close_all()

    trio.run(main)


def test_evicted_and_forgotten_inodes_travel_with_what_reopens_them(tmp_path: Path) -> None:
    """A small descriptor budget: most inodes have no descriptor left, only a file handle
    (or a name); the successor reopens them the same way."""
    for i in range(40):
        (tmp_path / f"f{i}").write_bytes(b"%d" % i)
    a = _ops(os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY), PassThroughQos(), budget=8)
    ctx = _Ctx()

    async def main() -> None:
        ids = [(await a.lookup(pyfuse3.ROOT_INODE, b"f%d" % i, ctx)).st_ino for i in range(40)]
        a.inodes.trim()
        assert a.inodes.fds_held < 40
        b = _hand_over(a, PassThroughQos())
        a.close_all()
        for i, nodeid in enumerate(ids):
            info = await b.open(nodeid, os.O_RDONLY, ctx)
            assert bytes(await b.read(info.fh, 0, 8)) == b"%d" % i
            await b.release(info.fh)
        b.close_all()

    trio.run(main)
