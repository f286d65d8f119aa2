"""Kernel passthrough in the product (``passthrough = "reads"``), through real qosfs
mounts, on both paths: one mount passes read-only opens of the passthrough classes to the
kernel, the other (``--no-passthrough``) serves every read in the daemon as before. The
data, mmap, a reader beside a writer (both orders), truncation while open and a
``cache = "direct"`` class behave the same on both; a passed-through open's reads never
reach the daemon, nothing leaks over thousands of opens, and a registration the kernel
refuses falls back to the daemon without the caller noticing."""

from __future__ import annotations

import mmap
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyfuse3
import pytest
import xxhash

from qosfs.control.ctl import Client, call
from tests.mounting import ROOT, QosfsMount
from tests.waiting import wait_for

pytestmark = [pytest.mark.mount, pytest.mark.root]

MiB = 1 << 20
POLICY = """
[classes.capped]
paths = ["capped/**"]
passthrough = "reads"         # a read cap keeps it in the daemon all the same
read_bandwidth = "1GiB/s"
[classes.direct]
paths = ["direct/**"]
passthrough = "reads"
cache = "direct"
[classes.data]
paths = ["data/**"]
passthrough = "reads"
"""


def digest(data: bytes) -> str:
    return xxhash.xxh64(data).hexdigest()


class Mounted:
    """A qosfs mount of the policy above, with or without kernel passthrough."""

    def __init__(self, tmp: Path, passthrough: bool, source: Path | None = None,
                 name: str = "mnt", policy_text: str = POLICY, in_place: bool = False) -> None:
        """In place: ``tmp/src`` is mounted over itself, and ``src`` (where the tests
        put and check backing files) is ``tmp/view``, a bind mount of it the caller
        took before."""
        self.passthrough = passthrough
        self.sock = tmp / f"{name}.sock"
        if in_place:
            self.src, self.mnt = tmp / "view", tmp / "src"
        else:
            self.src = source if source is not None else tmp / "src"
            self.mnt = tmp / name
            self.mnt.mkdir()
            if source is None:
                for d in ("", "data", "capped", "direct"):
                    (self.src / d).mkdir(exist_ok=True)
        policy = tmp / "policy.toml"
        policy.write_text(policy_text)
        args = ["--policy", str(policy), "--socket", str(self.sock)]
        self.mount = QosfsMount(self.mnt if in_place else self.src, self.mnt, *args,
                                *(() if passthrough else ("--no-passthrough",)))

    def status(self) -> dict[str, Any]:
        return call(str(self.sock), {"cmd": "status"})

    def kernel(self) -> dict[str, Any]:
        entry: dict[str, Any] = self.status()["passthrough"]
        return entry

    def read_bytes(self, cls: str) -> int:
        level = next(lv for lv in self.status()["levels"]
                     if lv["level"] == "class" and lv["name"] == cls)
        return int(level["read_bytes"])

    def daemon_fds(self) -> int:
        assert self.mount.proc is not None
        return len(os.listdir(f"/proc/{self.mount.proc.pid}/fd"))


@pytest.fixture(params=["passthrough", "fallback", "passthrough-inplace"])
def mounted(request: pytest.FixtureRequest, tmp_tree: Path) -> Iterator[Mounted]:
    """Passthrough and the daemon's own reads, source -> mountpoint; and passthrough on
    a mount in place (as systemd and the DaemonSet run it), whose backing files are the
    covered directory's: the tests see that tree through a bind mount taken before."""
    passthrough = request.param.startswith("passthrough")
    if passthrough and not getattr(pyfuse3, "PASSTHROUGH_SUPPORTED", False):
        pytest.skip("pyfuse3 without kernel passthrough: `make deps` builds it")
    in_place = request.param.endswith("inplace")
    if in_place:
        covered, view = tmp_tree / "src", tmp_tree / "view"
        for d in ("", "data", "capped", "direct"):
            (covered / d).mkdir(exist_ok=True)
        view.mkdir()
        subprocess.run(["mount", "--bind", str(covered), str(view)], check=True)
    m = Mounted(tmp_tree, passthrough, in_place=in_place)
    try:
        with m.mount:
            if passthrough and m.kernel()["state"] != "active":
                pytest.skip(f"kernel passthrough unavailable here: {m.kernel()['reason']}")
            if not passthrough:
                assert m.kernel()["state"] == "unavailable"
                assert m.kernel()["reason"] == "turned off (--no-passthrough)"
            yield m
    finally:
        if in_place:
            subprocess.run(["umount", str(tmp_tree / "view")], check=False)


def put(m: Mounted, rel: str, size: int) -> bytes:
    data = os.urandom(size)
    (m.src / rel).write_bytes(data)
    return data


def test_reads_equal_the_backing_file_and_reach_the_daemon_only_without_passthrough(
        mounted: Mounted) -> None:
    data = put(mounted, "data/a.bin", 8 * MiB + 123)
    assert digest((mounted.mnt / "data/a.bin").read_bytes()) == digest(data)
    with open(mounted.mnt / "data/a.bin", "rb", buffering=0) as f:  # random offsets too
        for off in (0, 4095, 1 << 20, len(data) - 7):
            assert os.pread(f.fileno(), 4096, off) == data[off:off + 4096]
    kernel = mounted.kernel()
    if mounted.passthrough:
        assert mounted.read_bytes("data") == 0  # the kernel read it all
        # The second open took the first one's backing id, kept idle since its release.
        assert kernel["opens"]["data"] == 2 and kernel["registered"] == 1
        assert kernel["reused_backing_ids"] == 1
        assert kernel["live_backing_ids"] == 0 and kernel["idle_backing_ids"] == 1
    else:
        assert mounted.read_bytes("data") >= len(data)
        assert kernel["opens"] == {} and kernel["registered"] == 0


def test_explain_says_who_serves_a_read_on_this_mount(mounted: Mounted) -> None:
    with Client(str(mounted.sock)) as client:
        served = client.request({"cmd": "explain", "path": "data/x", "op": "read",
                                 "uid": 1000, "gid": 1000, "env": {}, "cgroups": []}
                                )["served_by"]
    if mounted.passthrough:
        assert served["by"] == "kernel" and served["passthrough"] is True
    else:
        assert served == {"by": "daemon", "passthrough": False, "page_cache": "used",
                          "reason": "kernel passthrough unavailable on this mount: "
                                    "turned off (--no-passthrough)"}


def test_a_read_capped_class_is_served_by_the_daemon(mounted: Mounted) -> None:
    data = put(mounted, "capped/c.bin", 2 * MiB)
    assert digest((mounted.mnt / "capped/c.bin").read_bytes()) == digest(data)
    assert mounted.read_bytes("capped") >= len(data)
    assert "capped" not in mounted.kernel()["opens"]


def test_mmap_reads_the_file(mounted: Mounted) -> None:
    data = put(mounted, "data/m.bin", 3 * MiB + 5)
    with open(mounted.mnt / "data/m.bin", "rb") as f, \
            mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        assert digest(mapped[:]) == digest(data)
        assert mapped[MiB:MiB + 10] == data[MiB:MiB + 10]


def test_a_reader_sees_a_writer_that_opened_after_it(mounted: Mounted) -> None:
    data = bytearray(put(mounted, "data/rw.bin", MiB))
    path = mounted.mnt / "data/rw.bin"
    reader = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(reader, 4096, 0) == data[:4096]
        writer = os.open(path, os.O_WRONLY)  # joins the passed-through inode, direct_io
        try:
            assert os.pwrite(writer, b"x" * 4096, 8192) == 4096
            data[8192:12288] = b"x" * 4096
        finally:
            os.close(writer)
        assert os.pread(reader, 3 * 4096, 4096) == data[4096:4 * 4096]
    finally:
        os.close(reader)
    assert (mounted.src / "data/rw.bin").read_bytes() == data
    kernel = mounted.kernel()
    assert kernel["served_write_joins"] == ({"data": 1} if mounted.passthrough else {})
    assert kernel["uncapped_write_opens"] == {}


def test_a_reader_that_opens_after_a_writer_is_served_by_the_daemon(mounted: Mounted) -> None:
    data = bytearray(put(mounted, "data/wr.bin", MiB))
    path = mounted.mnt / "data/wr.bin"
    writer = os.open(path, os.O_WRONLY)
    try:
        reader = os.open(path, os.O_RDONLY)  # declined: the daemon serves the inode
        try:
            os.pwrite(writer, b"y" * 100, 10)
            data[10:110] = b"y" * 100
            assert os.pread(reader, 200, 0) == data[:200]
        finally:
            os.close(reader)
    finally:
        os.close(writer)
    kernel = mounted.kernel()
    assert kernel["declined"] == (1 if mounted.passthrough else 0)
    assert kernel["opens"] == {}
    # Once the writer is gone, the next reader is passed through again.
    assert digest(path.read_bytes()) == digest(bytes(data))
    if mounted.passthrough:
        wait_for("the writer's release", lambda: mounted.kernel()["opens"].get("data") == 1)


def test_truncate_while_open(mounted: Mounted) -> None:
    data = put(mounted, "data/t.bin", 2 * MiB)
    path = mounted.mnt / "data/t.bin"
    with open(path, "rb", buffering=0) as f:
        assert f.read(4096) == data[:4096]
        os.truncate(path, 5000)
        assert os.fstat(f.fileno()).st_size == 5000
        assert os.pread(f.fileno(), 8192, 0) == data[:5000]
        assert os.pread(f.fileno(), 4096, MiB) == b""
    assert (mounted.src / "data/t.bin").stat().st_size == 5000


def test_a_direct_io_class(mounted: Mounted) -> None:
    data = put(mounted, "direct/d.bin", 4 * MiB + 1)
    assert digest((mounted.mnt / "direct/d.bin").read_bytes()) == digest(data)
    if mounted.passthrough:
        assert mounted.kernel()["opens"]["direct"] == 1
        assert mounted.read_bytes("direct") == 0
    else:
        assert mounted.read_bytes("direct") >= len(data)


def _open_many(m: Mounted, count: int) -> None:
    data = put(m, "data/small.bin", 4096)
    other = put(m, "data/other.bin", 100)
    path, other_path = str(m.mnt / "data/small.bin"), str(m.mnt / "data/other.bin")
    m.mnt.joinpath("data/small.bin").read_bytes()  # every inode looked up once before
    m.mnt.joinpath("data/other.bin").read_bytes()
    before = m.daemon_fds()
    for i in range(count):
        fd = os.open(path if i % 2 else other_path, os.O_RDONLY)
        try:
            assert os.read(fd, 8192) == (data if i % 2 else other)
        finally:
            os.close(fd)
    wait_for("every release", lambda: m.status()["file_handles"] == 0)
    kernel = m.kernel()
    assert kernel["live_backing_ids"] == 0
    assert m.daemon_fds() <= before + 2  # nothing held per open
    if m.passthrough:
        # One registration per file, kept idle between its opens and taken back by each.
        assert kernel["registered"] <= 2 and kernel["idle_backing_ids"] == 2
        assert kernel["registered"] + kernel["reused_backing_ids"] >= count
        assert m.read_bytes("data") == 0  # warm-up reads included
        # When the kernel forgets the inodes (memory pressure, here forced), their idle
        # ids are closed with them.
        def forgotten() -> bool:
            Path("/proc/sys/vm/drop_caches").write_text("2")
            return m.kernel()["idle_backing_ids"] == 0

        wait_for("the idle ids closed at FORGET", forgotten, timeout=30, interval=0.5)


def test_a_working_set_of_ten_thousand_files_keeps_its_backing_ids(mounted: Mounted) -> None:
    """A loader's files between two epochs: each registered once, every later open takes
    its idle id back (past 8,192 files the oldest were closed and registered again at
    each open, before IDLE_LIMIT followed the inode table's room for opened files)."""
    if not mounted.passthrough:
        pytest.skip("no backing ids without kernel passthrough")
    files = 10_000
    top = mounted.src / "data" / "set"
    top.mkdir()
    for i in range(files):
        (top / f"s{i:05d}").write_bytes(b"%05d" % i)
    names = [mounted.mnt / "data" / "set" / f"s{i:05d}" for i in range(files)]

    def epoch() -> None:
        for i, path in enumerate(names):
            fd = os.open(path, os.O_RDONLY)
            try:
                assert os.read(fd, 16) == b"%05d" % i
            finally:
                os.close(fd)
        wait_for("every release", lambda: mounted.status()["file_handles"] == 0)

    epoch()
    first = mounted.kernel()
    assert first["idle_backing_ids"] == files
    epoch()
    second = mounted.kernel()
    assert second["registered"] == first["registered"], (first, second)
    assert second["reused_backing_ids"] - first["reused_backing_ids"] == files


def test_no_descriptor_or_backing_id_leaks_over_thousands_of_opens(mounted: Mounted) -> None:
    _open_many(mounted, 5000)


@pytest.mark.slow
def test_no_descriptor_or_backing_id_leaks_over_100k_opens(mounted: Mounted) -> None:
    _open_many(mounted, 100_000)


def test_a_refused_registration_falls_back_to_the_daemon(tmp_tree: Path) -> None:
    """The kernel refuses the backing files (ELOOP, as for a source stacked deeper than
    negotiated; tests/faultinject.py): every open is served by the daemon, unnoticed."""
    if not getattr(pyfuse3, "PASSTHROUGH_SUPPORTED", False):
        pytest.skip("pyfuse3 without kernel passthrough: `make deps` builds it")
    m = Mounted(tmp_tree, True)
    m.mount.entry = [str(ROOT / "tests/faultinject.py"), "--fault", "register=ELOOP", "--"]
    data = put(m, "data/r.bin", 2 * MiB)
    with m.mount:
        if m.kernel()["state"] != "active":
            pytest.skip(f"kernel passthrough unavailable here: {m.kernel()['reason']}")
        for _ in range(2):  # refused at every open, served by the daemon each time
            assert digest((m.mnt / "data/r.bin").read_bytes()) == digest(data)
        kernel = m.kernel()
        assert kernel["refused"] == 2 and kernel["last_refusal"] == "ELOOP"
        assert kernel["registered"] == 0 and kernel["opens"] == {}
        assert kernel["live_backing_ids"] == 0
        assert m.read_bytes("data") >= len(data)  # the second from the page cache


def test_unlinking_a_file_read_through_the_kernel_gives_its_space_back(
        mounted: Mounted) -> None:
    """A passed-through file's backing id is kept idle after its last close, and holds
    the file as an open descriptor would: ``rm`` through the mount must still free its
    blocks at once, as it does natively."""
    size = 64 * MiB
    data = put(mounted, "data/gone.bin", size)
    path = mounted.mnt / "data/gone.bin"
    assert digest(path.read_bytes()) == digest(data)
    if mounted.passthrough:
        assert mounted.kernel()["idle_backing_ids"] == 1
    os.sync()

    def free() -> int:
        st = os.statvfs(mounted.src)
        return st.f_bfree * st.f_frsize

    before = free()
    path.unlink()

    def freed() -> bool:
        os.sync()
        return free() - before >= size * 0.9

    wait_for("the blocks freed", freed, timeout=20, interval=0.2)
    assert mounted.kernel()["idle_backing_ids"] == 0


def test_a_buffered_reader_beside_an_o_direct_one_reads_unaligned(mounted: Mounted) -> None:
    """Opens of one inode share its backing id whatever their flags, beside each other or
    one after the other (the id kept idle): the kernel gives each passed-through open a
    backing file of its own with the open's flags, so an unaligned read of a buffered
    open works beside an O_DIRECT one, and after it."""
    data = put(mounted, "data/dio.bin", MiB)
    path = str(mounted.mnt / "data/dio.bin")
    buf = mmap.mmap(-1, 64 * 1024)
    direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.preadv(direct, [buf], 0) == len(buf)
        assert buf[:] == data[:len(buf)]
        beside = os.open(path, os.O_RDONLY)
        try:
            assert os.pread(beside, 7, 3) == data[3:10]
        finally:
            os.close(beside)
    finally:
        os.close(direct)
    after = os.open(path, os.O_RDONLY)  # the id is idle now, taken back by this open
    try:
        assert os.pread(after, 5, 4099) == data[4099:4104]
    finally:
        os.close(after)
    if mounted.passthrough:
        kernel = mounted.kernel()
        assert kernel["opens"]["data"] == 3 and kernel["registered"] == 1
        assert kernel["served_read_joins"] == {}
