"""Reads the kernel serves for passed-through opens are counted, through real qosfs
mounts (qosfs.passthrough.read_counting): fio's buffered and O_DIRECT reads show in
``ctl stats``' read bytes and ops of their class, exactly enough to be within 2% of what
fio read (source -> mountpoint and in place, ext4 and XFS); two users reading one file
are each counted to their own tenant; two mounts of one source count only the reads
made through each, and neither counts the same file's reads through overlayfs; an mmap
reader works and ``ctl status`` says its pages are not counted; a backing filesystem
whose reads cannot be counted (tmpfs) is said per class, never shown as a silent 0."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyfuse3
import pytest
import xxhash

from qosfs.control.ctl import call
from tests.mounting import QosfsMount, as_user, scratch_fs
from tests.waiting import wait_for

pytestmark = [pytest.mark.mount, pytest.mark.root]

MiB = 1 << 20
POLICY = """
[tenants.alpha]
uids = ["2001"]
[tenants.beta]
uids = ["2002"]

[classes.data]
paths = ["data/**"]
passthrough = "reads"
"""

if not getattr(pyfuse3, "PASSTHROUGH_SUPPORTED", False):
    pytest.skip("pyfuse3 without kernel passthrough: `make deps` builds it",
                allow_module_level=True)


class Mounted:
    """A qosfs mount of the policy above over *src* (in place: over itself)."""

    def __init__(self, tmp: Path, src: Path, in_place: bool = False) -> None:
        self.src = src
        self.mnt = src if in_place else tmp / "mnt"
        self.mnt.mkdir(exist_ok=True)
        self.view = tmp / "view" if in_place else src  # where the backing files are seen
        self.sock = tmp / "qosfs.sock"
        policy = tmp / "policy.toml"
        policy.write_text(POLICY)
        self.mount = QosfsMount(src, self.mnt, "--policy", str(policy),
                                "--socket", str(self.sock))

    def request(self, cmd: str) -> dict[str, Any]:
        return call(str(self.sock), {"cmd": cmd})

    def counting(self) -> dict[str, Any]:
        entry: dict[str, Any] = self.request("status")["passthrough"]["read_counting"]
        return entry

    def account(self, tenant: str | None = None) -> tuple[int, int]:
        """(read bytes, read ops) of class data for *tenant*, in ``ctl stats``."""
        for a in self.request("stats")["accounts"]:
            if a["class"] == "data" and a["tenant"] == tenant:
                return a["read_bytes"], a["read_ops"]
        return 0, 0


@pytest.fixture
def mounted(request: pytest.FixtureRequest, tmp_tree: Path) -> Iterator[Mounted]:
    """A mount of ``tmp_tree/src``, source -> mountpoint or in place (the backing tree
    then seen through a bind mount taken before)."""
    in_place = getattr(request, "param", "") == "inplace"
    src = tmp_tree / "src"
    (src / "data").mkdir(parents=True)
    if in_place:
        (tmp_tree / "view").mkdir()
        subprocess.run(["mount", "--bind", str(src), str(tmp_tree / "view")], check=True)
    m = Mounted(tmp_tree, src, in_place)
    try:
        with m.mount:
            status = m.request("status")["passthrough"]
            if status["state"] != "active":
                pytest.skip(f"kernel passthrough unavailable here: {status['reason']}")
            if m.counting()["state"] != "on":
                pytest.skip(f"reads are not counted here: {m.counting()['reason']}")
            yield m
    finally:
        if in_place:
            subprocess.run(["umount", str(tmp_tree / "view")], check=False)


def fio(path: Path, *args: str) -> tuple[int, int]:
    """(bytes, reads) fio read from *path*."""
    if shutil.which("fio") is None:
        pytest.skip("fio is not installed (`make deps` installs it)")
    out = subprocess.run(["fio", "--name=r", f"--filename={path}", "--ioengine=psync",
                          "--output-format=json", *args], check=True, capture_output=True,
                         timeout=120).stdout
    job = json.loads(out)["jobs"][0]["read"]
    return int(job["io_bytes"]), int(job["total_ios"])


def wait_counted(m: Mounted, expected: tuple[int, int],
                 tenant: str | None = None) -> tuple[int, int]:
    """The class's (bytes, ops) once the daemon added the kernel's counts (every 0.5 s),
    failing if they stay off *expected* by more than 2%."""
    def close(seen: tuple[int, int]) -> bool:
        return all(abs(s - e) <= 0.02 * e for s, e in zip(seen, expected, strict=True))
    return wait_for("the kernel's reads in ctl stats", lambda: m.account(tenant),
                    until=close, timeout=10)


@pytest.mark.parametrize("mounted", ["", "inplace"], indirect=True, ids=["source", "inplace"])
def test_fio_reads_served_by_the_kernel_are_in_their_class_read_bytes(
        mounted: Mounted) -> None:
    data = os.urandom(24 * MiB)
    (mounted.view / "data/fio.bin").write_bytes(data)
    path = mounted.mnt / "data/fio.bin"
    got = [fio(path, "--rw=randread", "--bs=4k", "--invalidate=0", "--io_size=32m"),
           fio(path, "--rw=randread", "--bs=128k", "--io_size=48m"),
           fio(path, "--rw=read", "--bs=1m", "--direct=1", "--io_size=48m")]
    expected = (sum(b for b, _ in got), sum(n for _, n in got))
    wait_counted(mounted, expected)
    kernel = mounted.request("status")["passthrough"]
    assert kernel["opens"]["data"] >= 3 and kernel["live_backing_ids"] == 0
    # Served by the kernel indeed: the daemon read none of it itself.
    counted = mounted.counting()
    assert abs(counted["read_bytes"]["data"] - expected[0]) <= 0.02 * expected[0]
    assert xxhash.xxh64(path.read_bytes()).hexdigest() == xxhash.xxh64(data).hexdigest()


def test_two_users_reading_one_file_are_each_counted_to_their_tenant(
        mounted: Mounted) -> None:
    data = os.urandom(6 * MiB + 100)
    (mounted.view / "data/shared.bin").write_bytes(data)
    path = mounted.mnt / "data/shared.bin"
    holder = os.open(path, os.O_RDONLY)  # the file stays passed through across both
    try:
        for uid in (2001, 2002, 2002):  # one read of the whole file each
            out = subprocess.run(["dd", f"if={path}", "bs=16M"], check=True,
                                 capture_output=True, timeout=60,
                                 preexec_fn=as_user(uid)).stdout
            assert out == data
    finally:
        os.close(holder)
    assert wait_counted(mounted, (len(data), 1), tenant="alpha") == (len(data), 1)
    assert wait_counted(mounted, (2 * len(data), 2), tenant="beta") == (2 * len(data), 2)
    assert mounted.account() == (0, 0)  # root read nothing


@pytest.mark.parametrize("mounted", ["", "inplace"], indirect=True, ids=["source", "inplace"])
def test_reads_of_the_backing_file_outside_the_mount_are_not_counted(
        mounted: Mounted) -> None:
    """While a file is passed through (so watched), another process reads the backing file
    itself (a backup of the source, a digest of the tree underneath): buffered and
    O_DIRECT. Those reads are not the mount's and are left out; the mount's are counted."""
    data = os.urandom(8 * MiB)
    (mounted.view / "data/both.bin").write_bytes(data)
    path = mounted.mnt / "data/both.bin"
    assert not mounted.counting()["attached"]  # nothing watched: no cost to other reads
    holder = os.open(path, os.O_RDONLY)  # watched from here to its release
    try:
        wait_for("the file watched", lambda: mounted.counting()["watched"], until=bool,
                 timeout=10)
        assert mounted.counting()["attached"]
        backing = mounted.view / "data/both.bin"
        for _ in range(3):
            assert xxhash.xxh64(backing.read_bytes()).digest() == xxhash.xxh64(data).digest()
        fio(backing, "--rw=read", "--bs=1m", "--direct=1")
        assert mounted.account() == (0, 0)
        assert os.pread(holder, len(data), 0) == data  # the mount's own read
        # Counted by the time the read returned, and folded in before ctl stats answers
        # (ControlService.before_snapshot): no waiting for the next drain.
        assert mounted.account() == (len(data), 1)
    finally:
        os.close(holder)


def test_each_of_two_mounts_of_one_source_counts_only_the_reads_made_through_it(
        mounted: Mounted, tmp_tree: Path) -> None:
    """Two mounts of one source with the same file open: both watch its backing inode,
    which is all a read's program sees. Each counts the reads made through it and none
    of the other's (their credentials hold the reading mount's session keyring); before,
    both counted every read."""
    data = os.urandom(8 * MiB)
    (mounted.view / "data/twice.bin").write_bytes(data)
    (tmp_tree / "second").mkdir()
    other = Mounted(tmp_tree / "second", mounted.src)
    with other.mount:
        if other.counting()["state"] != "on":
            pytest.skip(f"reads are not counted here: {other.counting()['reason']}")
        assert "another mount" not in other.counting()["reason"]
        held = [os.open(m.mnt / "data/twice.bin", os.O_RDONLY) for m in (mounted, other)]
        try:
            for m in (mounted, other):
                wait_for("the file watched", lambda m=m: m.counting()["watched"],
                         until=bool, timeout=10)
            assert os.pread(held[0], len(data), 0) == data
            assert mounted.account() == (len(data), 1)
            assert other.account() == (0, 0)
            for _ in range(2):
                assert os.pread(held[1], len(data), 0) == data
            assert other.account() == (2 * len(data), 2)
            assert mounted.account() == (len(data), 1)
        finally:
            for fd in held:
                os.close(fd)


def test_reads_of_the_same_file_through_overlayfs_are_not_counted(
        mounted: Mounted, tmp_tree: Path) -> None:
    """overlayfs reads a lower file with credentials of its own in force, as a passed-
    through read does; only this mount's credentials (its session keyring) count."""
    data = os.urandom(4 * MiB)
    (mounted.view / "data/lower.bin").write_bytes(data)
    overlay = tmp_tree / "overlay"
    for d in ("upper", "work", "overlay"):
        (tmp_tree / d).mkdir()
    done = subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                           f"lowerdir={mounted.src},upperdir={tmp_tree / 'upper'},"
                           f"workdir={tmp_tree / 'work'}", str(overlay)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode:
        pytest.skip(f"overlayfs cannot be mounted here: {done.stderr.strip()}")
    try:
        holder = os.open(mounted.mnt / "data/lower.bin", os.O_RDONLY)  # watched
        try:
            wait_for("the file watched", lambda: mounted.counting()["watched"], until=bool,
                     timeout=10)
            assert (overlay / "data/lower.bin").read_bytes() == data
            assert mounted.account() == (0, 0)
            assert os.pread(holder, len(data), 0) == data
            assert mounted.account() == (len(data), 1)
        finally:
            os.close(holder)
    finally:
        if subprocess.run(["umount", str(overlay)], check=False).returncode:
            subprocess.run(["umount", "-l", str(overlay)], check=False)


def test_an_mmap_reader_reads_and_status_says_its_pages_are_not_counted(
        mounted: Mounted) -> None:
    import mmap
    data = os.urandom(3 * MiB)
    (mounted.view / "data/mapped.bin").write_bytes(data)
    with open(mounted.mnt / "data/mapped.bin", "rb") as f, \
            mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        assert mapped[:] == data
    assert "mmap are not counted" in mounted.counting()["reason"]
    text = subprocess.run([sys.executable, "-m", "qosfs", "ctl", "--socket",
                           str(mounted.sock), "status"], check=True, capture_output=True,
                          text=True, timeout=30).stdout
    assert "reads served by the kernel: counted" in text
    assert "mmap are not counted" in text


def test_a_backing_tmpfs_is_said_not_counted_for_the_class(tmp_tree: Path) -> None:
    src = tmp_tree / "src"
    src.mkdir()
    with scratch_fs(src, "tmpfs", "size=64m"):
        (src / "data").mkdir()
        (src / "data/t.bin").write_bytes(os.urandom(MiB))
        m = Mounted(tmp_tree, src)
        with m.mount:
            if m.request("status")["passthrough"]["state"] != "active":
                pytest.skip("kernel passthrough unavailable here")
            assert len((m.mnt / "data/t.bin").read_bytes()) == MiB
            counting = m.counting()
            reasons = counting["uncounted_opens"].get("data", {})
            assert sum(reasons.values()) == 1, counting
            assert any("tmpfs" in r for r in reasons), reasons
            text = subprocess.run([sys.executable, "-m", "qosfs", "ctl", "--socket",
                                   str(m.sock), "status"], check=True, capture_output=True,
                                  text=True, timeout=30).stdout
            assert "class data: 1 opens passed through NOT COUNTED: tmpfs" in text


@pytest.fixture
def xfs_source(tmp_tree: Path) -> Iterator[Path]:
    """``tmp_tree/src``: an XFS of its own on a loop device."""
    if shutil.which("mkfs.xfs") is None or shutil.which("losetup") is None:
        pytest.skip("needs mkfs.xfs and losetup (xfsprogs: `make deps` installs it)")
    image = tmp_tree / "xfs.img"
    with open(image, "wb") as f:
        f.truncate(400 * MiB)
    loop = subprocess.run(["losetup", "-f", "--show", str(image)], check=True,
                          capture_output=True, text=True, timeout=30).stdout.strip()
    src = tmp_tree / "src"
    src.mkdir()
    try:
        subprocess.run(["mkfs.xfs", "-q", loop], check=True, capture_output=True, timeout=60)
        subprocess.run(["mount", loop, str(src)], check=True, timeout=30)
        try:
            (src / "data").mkdir()
            yield src
        finally:
            if subprocess.run(["umount", str(src)], check=False).returncode:
                subprocess.run(["umount", "-l", str(src)], check=False)
    finally:
        subprocess.run(["losetup", "-d", loop], check=False)


def test_fio_reads_of_an_xfs_backing_file_are_counted(tmp_tree: Path,
                                                       xfs_source: Path) -> None:
    (xfs_source / "data/fio.bin").write_bytes(os.urandom(16 * MiB))
    m = Mounted(tmp_tree, xfs_source)
    with m.mount:
        if m.request("status")["passthrough"]["state"] != "active" \
                or m.counting()["state"] != "on":
            pytest.skip("kernel passthrough or its counting unavailable here")
        path = m.mnt / "data/fio.bin"
        got = [fio(path, "--rw=randread", "--bs=4k", "--invalidate=0", "--io_size=16m"),
               fio(path, "--rw=read", "--bs=1m", "--direct=1", "--io_size=32m")]
        wait_counted(m, (sum(b for b, _ in got), sum(n for _, n in got)))
        assert m.counting()["uncounted_opens"] == {}
