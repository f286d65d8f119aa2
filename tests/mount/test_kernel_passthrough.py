"""Kernel FUSE passthrough through real mounts (qosfs.passthrough.kernel), with a minimal
filesystem of the tests' own (tests/mount/passthrough_fs.py) that reports what reached the
daemon: a passed-through open is read by the kernel alone, its backing id is released at
release, a refused registration and a pyfuse3 without passthrough fall back to reads
served by the daemon, and the caller never sees an error."""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyfuse3
import pytest
import xxhash

from tests.mounting import QosfsMount

pytestmark = [pytest.mark.mount, pytest.mark.root]

MiB = 1 << 20

if not getattr(pyfuse3, "PASSTHROUGH_SUPPORTED", False):
    pytest.skip("pyfuse3 without kernel passthrough: `make deps` builds it "
                "(deploy/libfuse/build.sh)", allow_module_level=True)


def stats(mountpoint: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((mountpoint / ".stats").read_bytes())
    return result


def digest(data: bytes) -> str:
    return xxhash.xxh64(data).hexdigest()


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "data.bin").write_bytes(os.urandom(8 * MiB))
    (src / "small.bin").write_bytes(os.urandom(4096))
    return src


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Callable[..., QosfsMount]]:
    started: list[QosfsMount] = []

    def start(src: Path, name: str, *args: str) -> QosfsMount:
        mnt = tmp_path / name
        mnt.mkdir()
        m = QosfsMount(src, mnt, *args, entry=("-m", "tests.mount.passthrough_fs"))
        started.append(m.start())
        return m

    yield start
    for m in reversed(started):  # the upper of a stack first
        m.stop()


def passthrough_mount(mount: Callable[..., QosfsMount], src: Path, name: str = "mnt",
                      *args: str) -> QosfsMount:
    m = mount(src, name, *args)
    s = stats(m.mountpoint)
    if not s["available"]:
        pytest.skip(f"kernel passthrough unavailable here: {s['reason']}")
    return m


def test_passed_through_reads_never_reach_the_daemon(
        mount: Callable[..., QosfsMount], source: Path) -> None:
    m = passthrough_mount(mount, source)
    expected = (source / "data.bin").read_bytes()
    path = m.mountpoint / "data.bin"

    with open(path, "rb") as f:
        assert stats(m.mountpoint)["live"] == 1
        assert digest(f.read()) == digest(expected)
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
            assert digest(mapped[:]) == digest(expected)

    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, MiB)  # page-aligned, as O_DIRECT wants
        assert os.preadv(fd, [buf], 2 * MiB) == MiB
        assert digest(buf[:]) == digest(expected[2 * MiB:3 * MiB])
    finally:
        os.close(fd)

    s = stats(m.mountpoint)
    assert s["reads"] == 0, "a passed-through read reached the daemon"
    assert s["live"] == 0 and s["open_files"] == 0
    assert s["registered"] == 2 and s["refused"] == 0


def test_opens_of_one_inode_share_an_id_and_nothing_leaks(
        mount: Callable[..., QosfsMount], source: Path) -> None:
    m = passthrough_mount(mount, source)
    path = m.mountpoint / "small.bin"
    expected = digest((source / "small.bin").read_bytes())
    pid = stats(m.mountpoint)["pid"]
    baseline = open_fds(pid)

    first, second = os.open(path, os.O_RDONLY), os.open(path, os.O_RDONLY)
    assert stats(m.mountpoint)["live"] == 1  # one id for the inode, two opens on it
    os.close(first)
    assert digest(os.pread(second, 4096, 0)) == expected  # the shared id still serves
    os.close(second)
    assert stats(m.mountpoint)["live"] == 0

    for _ in range(10_000):
        fd = os.open(path, os.O_RDONLY)
        try:
            assert len(os.pread(fd, 4096, 0)) == 4096
        finally:
            os.close(fd)

    s = stats(m.mountpoint)
    assert s["live"] == 0 and s["open_files"] == 0 and s["reads"] == 0
    assert s["registered"] == 10_001 and s["refused"] == 0
    assert open_fds(pid) == baseline


def test_a_refused_registration_falls_back_to_daemon_reads(
        mount: Callable[..., QosfsMount], source: Path) -> None:
    # A passthrough FUSE mount is stacked one deep: a daemon over it that negotiated
    # depth 0 is refused (ELOOP), one that negotiated depth 1 is not.
    lower = passthrough_mount(mount, source, "lower")
    expected = digest((source / "data.bin").read_bytes())

    shallow = passthrough_mount(mount, lower.mountpoint, "shallow", "--stack-depth", "0")
    assert digest((shallow.mountpoint / "data.bin").read_bytes()) == expected
    s = stats(shallow.mountpoint)
    assert s["refused"] >= 1 and s["last_refusal"] == "ELOOP"
    assert s["registered"] == 0 and s["reads"] > 0 and s["live"] == 0

    deep = passthrough_mount(mount, lower.mountpoint, "deep", "--stack-depth", "1")
    assert digest((deep.mountpoint / "data.bin").read_bytes()) == expected
    s = stats(deep.mountpoint)
    assert s["refused"] == 0 and s["registered"] == 1 and s["reads"] == 0


@pytest.mark.parametrize(("flag", "reason"), [
    ("--unpatched", "lacks the passthrough patch"),
    ("--no-passthrough", "did not accept passthrough"),
])
def test_without_passthrough_the_daemon_serves_reads(
        mount: Callable[..., QosfsMount], source: Path, flag: str, reason: str) -> None:
    m = mount(source, "mnt", flag)
    expected = (source / "data.bin").read_bytes()
    with open(m.mountpoint / "data.bin", "rb") as f:
        assert digest(f.read()) == digest(expected)
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
            assert digest(mapped[:]) == digest(expected)
    s = stats(m.mountpoint)
    assert not s["available"] and reason in s["reason"]
    assert s["reads"] > 0 and s["registered"] == 0 and s["refused"] == 0 and s["live"] == 0


def test_an_inode_the_daemon_serves_is_not_passed_through_meanwhile(
        mount: Callable[..., QosfsMount], source: Path) -> None:
    # The kernel fails an open that mixes modes on one inode (EIO): the interface keeps
    # them apart. O_NONBLOCK marks an open the daemon must serve (see passthrough_fs).
    m = passthrough_mount(mount, source)
    path = m.mountpoint / "data.bin"
    expected = digest((source / "data.bin").read_bytes()[:MiB])

    served = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    eligible = os.open(path, os.O_RDONLY)  # declined: the daemon serves the inode
    assert digest(os.pread(eligible, MiB, 0)) == expected
    s = stats(m.mountpoint)
    assert s["declined"] == 1 and s["live"] == 0 and s["reads"] > 0
    os.close(served)
    os.close(eligible)

    passed = os.open(path, os.O_RDONLY)
    shared = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # shares the id, not served
    reads_before = stats(m.mountpoint)["reads"]
    assert digest(os.pread(shared, MiB, 0)) == expected
    assert stats(m.mountpoint)["reads"] == reads_before
    os.close(passed)
    os.close(shared)
    s = stats(m.mountpoint)
    assert s["live"] == 0 and s["open_files"] == 0 and s["registered"] == 1


def test_an_open_that_joins_with_direct_io_is_served_by_the_daemon(
        mount: Callable[..., QosfsMount], source: Path) -> None:
    # FOPEN_PASSTHROUGH | FOPEN_DIRECT_IO: the kernel accepts the open beside a passed-
    # through one, sends its reads to the daemon, and maps the backing file for mmap.
    m = passthrough_mount(mount, source, "mnt", "--served-joins")
    path = m.mountpoint / "data.bin"
    expected = (source / "data.bin").read_bytes()

    passed = os.open(path, os.O_RDONLY)
    joined = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert stats(m.mountpoint)["live"] == 1  # one id, shared
        assert digest(os.pread(passed, MiB, 0)) == digest(expected[:MiB])
        assert stats(m.mountpoint)["reads"] == 0  # the passed-through open: the kernel
        assert digest(os.pread(joined, MiB, MiB)) == digest(expected[MiB:2 * MiB])
        assert stats(m.mountpoint)["reads"] > 0  # the joined one: the daemon
        with mmap.mmap(joined, 0, prot=mmap.PROT_READ) as mapped:  # the backing file's
            assert digest(mapped[:]) == digest(expected)
        reads = stats(m.mountpoint)["reads"]
        assert digest(os.pread(passed, MiB, 3 * MiB)) == digest(expected[3 * MiB:4 * MiB])
        assert stats(m.mountpoint)["reads"] == reads
    finally:
        os.close(joined)
        os.close(passed)
    s = stats(m.mountpoint)
    assert s["live"] == 0 and s["open_files"] == 0 and s["registered"] == 1
