"""The page cache under ``--cache auto``: kept across opens while the backing file is
unchanged (close-to-open, as NFS), dropped when it changed, never a way around a read cap."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qosfs.control.ctl import Client
from tests.mounting import QosfsMount, as_user

pytestmark = pytest.mark.mount

MiB = 1 << 20
POLICY = """
[classes.capped-reader]
uids = [4242]
read_bandwidth = "4MiB/s"
burst = "1MiB"
[classes.writer]
paths = ["w/**"]
ops = ["write"]
write_bandwidth = "1GiB/s"
[classes.data]
paths = ["**"]
passthrough = "off"   # the daemon's page cache is what is tested, not the kernel's reads
"""


class Mount:
    def __init__(self, tmp: Path) -> None:
        self.src, self.mnt, self.sock = tmp / "src", tmp / "mnt", tmp / "ctl.sock"
        for d in (self.src, self.mnt, self.src / "w"):
            d.mkdir()
            d.chmod(0o777)
        policy = tmp / "policy.toml"
        policy.write_text(POLICY)
        self.mount = QosfsMount(self.src, self.mnt, "--policy", str(policy),
                                "--socket", str(self.sock))

    def reads(self, cls: str) -> tuple[int, int]:
        """(read requests, bytes) the daemon served for class *cls* so far."""
        with Client(str(self.sock)) as client:
            status: dict[str, Any] = client.request({"cmd": "status"})
        level = next(lv for lv in status["levels"]
                     if lv["level"] == "class" and lv["name"] == cls)
        return level["read_ops"], level["read_bytes"]


@pytest.fixture
def mounted(tmp_tree: Path) -> Iterator[Mount]:
    m = Mount(tmp_tree)
    with m.mount:
        yield m


def read_through(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_an_unchanged_file_is_served_from_the_cache_at_the_next_open(mounted: Mount) -> None:
    (mounted.src / "sample").write_bytes(b"a" * 4 * MiB)
    assert read_through(mounted.mnt / "sample") == b"a" * 4 * MiB
    ops, nbytes = mounted.reads("data")
    assert nbytes >= 4 * MiB
    for _ in range(3):
        assert read_through(mounted.mnt / "sample") == b"a" * 4 * MiB
    assert mounted.reads("data") == (ops, nbytes)  # not one read reached the daemon


@pytest.mark.parametrize("how", ["same size", "appended", "truncated"])
def test_a_file_changed_underneath_is_read_fresh_after_the_next_open(mounted: Mount,
                                                                     how: str) -> None:
    backing, path = mounted.src / "sample", mounted.mnt / "sample"
    backing.write_bytes(b"a" * 2 * MiB)
    assert read_through(path) == b"a" * 2 * MiB
    new = {"same size": b"b" * 2 * MiB, "appended": b"a" * 2 * MiB + b"c",
           "truncated": b"a" * MiB}[how]
    with open(backing, "r+b") as f:  # rewritten in place: same inode, maybe same size
        f.write(new)
        f.truncate(len(new))
    time.sleep(1.1)  # past attr_timeout, so the kernel asks for the new size
    assert read_through(path) == new


def test_writes_through_the_mount_are_seen_at_the_next_open(mounted: Mount) -> None:
    path = mounted.mnt / "w" / "state"
    path.write_bytes(b"a" * 2 * MiB)
    assert read_through(path) == b"a" * 2 * MiB
    # A write-only open of a capped class bypasses the page cache (direct I/O), so the
    # kernel's cached pages are not updated by it: the next open must drop them.
    with open(path, "wb", buffering=0) as f:
        f.write(b"b" * 2 * MiB)
    assert read_through(path) == b"b" * 2 * MiB
    with open(path, "r+b", buffering=0) as f:  # and through the page cache, in place
        f.write(b"c" * MiB)
    assert read_through(path) == b"c" * MiB + b"b" * MiB


@pytest.mark.root
def test_a_read_capped_class_never_reads_past_its_cap_from_the_cache(mounted: Mount) -> None:
    (mounted.src / "shared").write_bytes(b"s" * 8 * MiB)
    os.chmod(mounted.src / "shared", 0o644)
    for _ in range(2):  # cached, and kept, for the uncapped class
        assert read_through(mounted.mnt / "shared") == b"s" * 8 * MiB
    start = time.monotonic()
    subprocess.run(["dd", f"if={mounted.mnt / 'shared'}", "of=/dev/null", "bs=1M",
                    "status=none"], check=True, preexec_fn=as_user(4242))
    took = time.monotonic() - start
    assert took >= (8 - 1) / 4 * 0.85  # 8 MiB at 4 MiB/s less the burst: ~1.75 s
    assert mounted.reads("capped-reader")[1] >= 8 * MiB  # every byte went through us


def test_a_class_can_let_the_kernel_trust_names_and_attributes_longer(
        tmp_tree: Path) -> None:
    """attr_timeout/entry_timeout by the classes' paths: a dataset tree that does not
    change while a job reads it skips the lookups and getattrs a 1 s timeout costs."""
    src, mnt, sock = tmp_tree / "src", tmp_tree / "mnt", tmp_tree / "ctl.sock"
    for d in (src / "data", src / "scratch", mnt):
        d.mkdir(parents=True)
    policy = tmp_tree / "policy.toml"
    policy.write_text('[classes.datasets]\npaths = ["data/**"]\nentry_timeout = "60s"\n'
                      'attr_timeout = "60s"\n')
    for top in ("data", "scratch"):
        (src / top / "f").write_bytes(b"x")
    with QosfsMount(src, mnt, "--policy", str(policy), "--socket", str(sock)):
        assert os.stat(mnt / "data" / "f").st_size == os.stat(mnt / "scratch" / "f").st_size == 1
        assert not (mnt / "data" / "new").exists()  # a miss, which the kernel caches
        for top in ("data", "scratch"):  # changed underneath, by another node say
            with open(src / top / "f", "ab") as f:
                f.write(b"yy")
        (src / "data" / "new").write_bytes(b"n")
        time.sleep(1.5)  # past the mount's 1 s
        assert os.stat(mnt / "scratch" / "f").st_size == 3
        assert os.stat(mnt / "data" / "f").st_size == 1  # trusted for 60 s
        # Misses keep the mount's timeout: files that appear in a dataset are seen.
        assert (mnt / "data" / "new").read_bytes() == b"n"
        os.truncate(mnt / "data" / "f", 0)  # a change through the mount is seen at once
        assert os.stat(mnt / "data" / "f").st_size == 0
