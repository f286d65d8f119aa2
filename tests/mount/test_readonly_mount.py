"""A read-only mount (``qosfs mount -o ro``), as docs/performance.md suggests for a mount
that only serves datasets: reads come back exact, every change is refused with EROFS as
the kernel refuses it on any read-only mount, and a file read through it is stat'ed
again without a round trip to the daemon, where a read-write mount sends a GETATTR
(a read invalidates the FUSE inode's cached atime unless the superblock is read-only)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import xxhash

from bench.core.fuse_trace import FuseTrace, tracing_unavailable
from tests.mounting import QosfsMount

pytestmark = [pytest.mark.mount, pytest.mark.root]

FILES = 40


def _tree(src: Path) -> dict[str, str]:
    (src / "data").mkdir(parents=True)
    digests = {}
    for i in range(FILES):
        body = os.urandom(64 * 1024 + i)
        (src / "data" / f"f{i:02d}").write_bytes(body)
        digests[f"f{i:02d}"] = xxhash.xxh64_hexdigest(body)
    return digests


def _read_all(data: Path) -> dict[str, str]:
    return {name: xxhash.xxh64_hexdigest((data / name).read_bytes())
            for name in sorted(os.listdir(data))}


def _getattrs_of_stats_after_reads(mnt: Path, pid: int) -> int:
    """GETATTRs the kernel sent for a stat of each file just read (the reads first)."""
    data = mnt / "data"
    names = sorted(os.listdir(data))
    for name in names:
        os.stat(data / name)  # attributes cached from here on
    with FuseTrace(mnt, pid) as trace:
        for name in names:
            fd = os.open(data / name, os.O_RDONLY)
            try:
                os.read(fd, 4096)
            finally:
                os.close(fd)
        trace.take()
        for name in names:
            os.stat(data / name)
        return trace.take().get("GETATTR", 0)


@pytest.mark.parametrize("in_place", [False, True], ids=["separate", "in-place"])
def test_a_read_only_mount_reads_exactly_refuses_changes_and_keeps_attributes(
        tmp_tree: Path, in_place: bool) -> None:
    src = tmp_tree / "src"
    mnt = src if in_place else tmp_tree / "mnt"
    digests = _tree(src)
    mnt.mkdir(exist_ok=True)
    with QosfsMount(src, mnt, "-o", "ro") as m:
        assert _read_all(mnt / "data") == digests
        for attempt in (lambda: os.open(mnt / "data" / "f00", os.O_WRONLY),
                        lambda: os.open(mnt / "data" / "new", os.O_WRONLY | os.O_CREAT, 0o644),
                        lambda: os.unlink(mnt / "data" / "f01"),
                        lambda: os.mkdir(mnt / "data" / "d"),
                        lambda: os.rename(mnt / "data" / "f02", mnt / "data" / "g02")):
            with pytest.raises(OSError) as refused:
                attempt()
            assert refused.value.errno == errno.EROFS
        why = tracing_unavailable()
        if why is None:
            assert m.proc is not None
            assert _getattrs_of_stats_after_reads(mnt, m.proc.pid) == 0
    assert _read_all(src / "data") == digests  # nothing changed underneath
    if why is not None:
        pytest.skip(f"the round trips were not counted: {why}")
    with QosfsMount(src, mnt) as m:  # the same on a read-write mount: one per file
        assert m.proc is not None
        assert _getattrs_of_stats_after_reads(mnt, m.proc.pid) == FILES
