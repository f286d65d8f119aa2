"""qosfs.passthrough.kernel_opens through the operations called directly (no mount), with
a stand-in for pyfuse3's passthrough API: which opens are passed through, and which
one ``recent_file`` names for a class."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pyfuse3
import pytest
import trio

from qosfs.daemon.fs_assembly import build_filesystem
from qosfs.passthrough import kernel
from qosfs.passthrough.backing_io import IoMode
from qosfs.passthrough.kernel import KernelPassthrough
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
        await ops.release(info.fh)
        assert binding.open_ids == set()
        assert ops.kernel_opens.status()["live_backing_ids"] == 0

    trio.run(main)
