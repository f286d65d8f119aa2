"""The filesystem's state handed to a successor (qosfs.passthrough.transfer), in one process:
operations B, built on a duplicate of A's root, takes over A's exported tables with
duplicates of the descriptors (what SCM_RIGHTS gives), and answers the kernel's node ids
and file handles as A would have, with the same charges; and a payload of the build
before (handover protocol 1) is taken over the same way."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any

import pyfuse3
import pytest
import trio

from qosfs.daemon.fs_assembly import build_filesystem
from qosfs.daemon.takeover.offer import PROTOCOL
from qosfs.passthrough.backing_io import IoMode
from qosfs.passthrough.filesystem import Filesystem
from qosfs.passthrough.handle_table import OpenRecord
from qosfs.passthrough.handles import PASSED_THROUGH, SERVED
from qosfs.passthrough.odirect import dio_mask_of
from qosfs.passthrough.operations import FsOptions
from qosfs.passthrough.transfer import export_state, import_state, open_record_v1
from qosfs.policy.loading import parse_policy
from qosfs.qos.engine import PolicyQos
from qosfs.qos.interface import PassThroughQos, QosEngine

MiB = 1 << 20
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


def _fs(root_fd: int, engine: QosEngine, budget: int = 0) -> Filesystem:
    return build_filesystem(root_fd, IoMode.INLINE, engine, FsOptions(fd_budget=budget))


def _hand_over(a: Filesystem, engine: QosEngine) -> Filesystem:
    payload, fds = export_state(a)
    received = [os.dup(fd) for fd in fds]  # other numbers, as a successor gets them
    b = _fs(os.dup(a.inodes.root.fd), engine)
    import_state(b, payload, received, PROTOCOL)
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

    fs_a = _fs(os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY), engine())
    a = fs_a.ops
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
        fs_b = _hand_over(fs_a, b_engine)
        b = fs_b.ops

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
        fs_a.close_all()  # the predecessor's own descriptors; B's stay open
        assert (await b.lookup(ckpt.st_ino, b"a", ctx)).st_ino == entry.st_ino
        fs_b.close_all()

    trio.run(main)


def test_evicted_and_forgotten_inodes_travel_with_what_reopens_them(tmp_path: Path) -> None:
    """A small descriptor budget: most inodes have no descriptor left, only a file handle
    (or a name); the successor reopens them the same way."""
    for i in range(40):
        (tmp_path / f"f{i}").write_bytes(b"%d" % i)
    fs_a = _fs(os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY), PassThroughQos(), budget=8)
    a = fs_a.ops
    ctx = _Ctx()

    async def main() -> None:
        ids = [(await a.lookup(pyfuse3.ROOT_INODE, b"f%d" % i, ctx)).st_ino for i in range(40)]
        a.inodes.trim()
        assert a.inodes.fds_held < 40
        fs_b = _hand_over(fs_a, PassThroughQos())
        b = fs_b.ops
        fs_a.close_all()
        for i, nodeid in enumerate(ids):
            info = await b.open(nodeid, os.O_RDONLY, ctx)
            assert bytes(await b.read(info.fh, 0, 8)) == b"%d" % i
            await b.release(info.fh)
        fs_b.close_all()

    trio.run(main)


def test_a_protocol_1_payload_of_the_build_before_is_taken_over(tmp_path: Path) -> None:
    """``qosfs upgrade`` from the build before: its commit payload (protocol 1), written
    here as that build's export_state wrote it (each open file a dict of its fields), is
    taken over by a fresh filesystem: every open comes out as that build had it (its
    dio_mask included), and as this build's own export writes it."""
    (tmp_path / "ckpt").mkdir()
    data = bytes(range(256)) * 64  # 16 KiB
    (tmp_path / "ckpt" / "a.bin").write_bytes(data)
    (tmp_path / "ckpt" / "p.bin").write_bytes(b"p" * 4096)
    a_st = os.stat(tmp_path / "ckpt" / "a.bin")
    p_st = os.stat(tmp_path / "ckpt" / "p.bin")
    d_st = os.stat(tmp_path / "ckpt")
    root_st = os.stat(tmp_path)
    reader = os.open(tmp_path / "ckpt" / "a.bin", os.O_RDONLY | os.O_CLOEXEC)
    try:
        direct = os.open(tmp_path / "ckpt" / "a.bin", os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        os.close(reader)
        pytest.skip("no O_DIRECT on this filesystem")
    twin = os.open(tmp_path / "ckpt" / "a.bin", os.O_RDWR | os.O_CLOEXEC)
    passed = os.open(tmp_path / "ckpt" / "p.bin", os.O_RDONLY | os.O_CLOEXEC)
    uid = os.getuid()
    dio_mask = dio_mask_of(direct)  # what the build before computed at open, and carried

    def inode(nodeid: int, st: os.stat_result, parent: int, name: bytes | None) -> dict[str, Any]:
        return {"nodeid": nodeid, "key": [st.st_dev, st.st_ino], "lookups": 1,
                "handle": None, "handle_due": False,
                "entry": None if name is None else [parent, name.hex()], "parent": parent,
                "stale": False, "known": True, "keyed": True, "cache_stamp": None,
                "fd": -1, "pinned": False}

    def charge(**state: int) -> dict[str, int]:
        return {"scattered": 0, "split_bytes": 0, "split_end": -1, "split_ops": 0,
                "stream_left": 0, "stream_limit": 0, "stream_off": 0, **state}

    def old_file(fh: int, fd: int, buffered: int, is_direct: bool, inode: int,
                 kernel: int, **rest: Any) -> dict[str, Any]:
        return {"fh": fh, "fd": fd, "buffered": buffered, "direct": is_direct,
                "inode": inode, "kill_priv": False, "fsuid": 0, "owner": uid,
                "dio_mask": dio_mask if is_direct else 0, "kernel": kernel,
                "flow": ["ckpt", None, uid], "charge": charge(), **rest}

    payload = json.loads(json.dumps({  # what travelled: JSON
        "inodes": {"records": [inode(1, root_st, -1, None), inode(7, d_st, 0, b"ckpt"),
                               inode(8, a_st, 1, b"a.bin"), inode(9, p_st, 1, b"p.bin")],
                   "next_synthetic": 1 << 40, "reopens": 3},
        "files": [
            old_file(3, 0, -1, False, 2, SERVED),
            old_file(4, 1, 2, True, 2, SERVED, kill_priv=True, fsuid=1234, owner=-1,
                     charge=charge(split_end=MiB, split_bytes=4096, split_ops=2,
                                   stream_left=60 * MiB, stream_limit=64 * MiB,
                                   stream_off=MiB)),
            old_file(6, 3, -1, False, 3, PASSED_THROUGH)],
        "dirs": [], "next_fh": 11, "open_refused": 2,
        "passthrough": {"on": True, "off_reason": "", "stack_depth": 0,
                        "opens": {"ckpt": 1}, "uncapped_reads": {}, "uncapped_writes": {},
                        "recent": {"ckpt": 6},
                        "kernel": {"ids": [[9, 17, 1]], "plain": [[8, 2]], "declined": 0,
                                   "registered": 1, "refused": 0, "last_refusal": ""}}}))
    sent = [reader, direct, twin, passed]
    received = [os.dup(fd) for fd in sent]  # other numbers, as SCM_RIGHTS gives them
    for fd in sent:
        os.close(fd)
    fs_b = _fs(os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY), PolicyQos(parse_policy(POLICY)))
    import_state(fs_b, payload, received, 1)
    b = fs_b.ops

    files = b.files
    assert sorted(files) == [3, 4, 6] and b.handles.lost == {}
    r, d, p = files[3], files[4], files[6]
    assert (r.fd, r.direct, r.dio_mask, r.buffered, r.kernel) == (received[0], False, 0, -1,
                                                                 SERVED)
    assert (d.fd, d.direct, d.dio_mask, d.buffered, d.kernel) == (received[1], True, dio_mask,
                                                                 received[2], SERVED)
    assert dio_mask > 0
    assert (d.kill_priv, d.fsuid, d.owner, d.fh) == (True, 1234, -1, 4)
    assert (r.kill_priv, r.fsuid, r.owner, r.fh) == (False, 0, uid, 3)
    assert (p.fd, p.direct, p.kernel, p.fh) == (received[3], False, PASSED_THROUGH, 6)
    node = b.inodes.get(8)
    assert r.inode is node and d.inode is node and node.opens == 2
    assert p.inode is b.inodes.get(9) and p.inode.opens == 1
    assert r.charge.flow is d.charge.flow is p.charge.flow
    assert r.charge.flow.class_name == "ckpt" and r.charge.flow.open_files == 3
    assert d.charge.export_state() == payload["files"][1]["charge"] and d.charge.watching
    assert r.charge.export_state() == charge()
    assert b.handles.quota.refused == 2 and b.handles.next_fh == 11
    assert b.kernel_opens.kernel.backing_id(9) == 17

    # Each open's record is the one this build's export writes of it.
    for rec in payload["files"]:
        handle = files[rec["fh"]]
        record = open_record_v1(rec, handle.fd, 17 if rec["fh"] == 6 else None)
        assert record == b.handles.record(handle, fcntl.fcntl(handle.fd, fcntl.F_GETFL),
                                          rec["inode"])
        assert record.direct == rec["direct"]
        assert record.flags & os.O_ACCMODE == (os.O_RDWR if rec["direct"] else os.O_RDONLY)
    # The 1-record reader takes the backing id from the payload's passthrough state.
    assert [OpenRecord.load(f["open"]).backing_id
            for f in export_state(fs_b)[0]["files"]] == [None, None, 17]

    async def main() -> None:
        assert bytes(await b.read(3, 4096, 8)) == data[4096:4104]
        assert bytes(await b.read(4, 0, 4096)) == data[:4096]  # aligned: O_DIRECT
        assert bytes(await b.read(4, 5, 3)) == data[5:8]  # unaligned: the buffered twin
        assert await b.write(4, 0, b"new!") == 4
        assert (tmp_path / "ckpt" / "a.bin").read_bytes()[:4] == b"new!"

    trio.run(main)
    fs_b.close_all()
