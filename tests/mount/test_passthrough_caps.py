"""Caps hold beside kernel passthrough, through real qosfs mounts: while a file is passed
through to the kernel for a reader, a writer of a write-capped class, or a reader of a
read-capped one, that opens it joins its backing id with direct_io, so its requests still
reach the daemon: its rate stays within its cap and its bytes are counted in its class,
the passed-through reader reads on natively and sees what was written, and mmap of the
joined open maps the backing file. Where the kernel cannot take direct_io beside a
backing id (a fault stands in for an older kernel), the join goes uncapped as before,
and ``ctl status`` and the metrics say so, and why."""

from __future__ import annotations

import mmap
import os
import re
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyfuse3
import pytest
import xxhash
from prometheus_client.parser import text_string_to_metric_families

from qosfs.control.ctl import call
from qosfs.control.kernel_status import format_passthrough
from tests.mounting import ROOT, QosfsMount, as_user
from tests.waiting import wait_for

pytestmark = [pytest.mark.mount, pytest.mark.root]

MiB = 1 << 20
CAP = 2 * MiB  # bytes/s, the writers' and the slow readers' cap
READER_UID = 4242
# One set of files (data/), three classes by who and what: writes are capped, uid 4242's
# reads are capped, everyone else's reads are passed through.
POLICY = f"""
[classes.writers]
paths = ["data/**"]
ops = ["write"]
write_bandwidth = "2MiB/s"
[classes.slow]
paths = ["data/**"]
uids = [{READER_UID}]
ops = ["read"]
passthrough = "reads"       # a read cap keeps its reads in the daemon all the same
read_bandwidth = "2MiB/s"
[classes.data]
paths = ["data/**"]
passthrough = "reads"
"""

if not getattr(pyfuse3, "PASSTHROUGH_SUPPORTED", False):
    pytest.skip("pyfuse3 without kernel passthrough: `make deps` builds it "
                "(deploy/libfuse/build.sh)", allow_module_level=True)


def digest(data: bytes) -> str:
    return xxhash.xxh64(data).hexdigest()


class Mounted:
    def __init__(self, mount: QosfsMount, src: Path, sock: Path) -> None:
        self.mount, self.src, self.mnt, self.sock = mount, src, mount.mountpoint, sock

    def status(self) -> dict[str, Any]:
        return call(str(self.sock), {"cmd": "status"})

    def kernel(self) -> dict[str, Any]:
        entry: dict[str, Any] = self.status()["passthrough"]
        return entry

    def counted(self, cls: str, key: str) -> int:
        level = next(lv for lv in self.status()["levels"]
                     if lv["level"] == "class" and lv["name"] == cls)
        return int(level[key])

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        found = wait_for("the metrics address in the log",
                         lambda: re.search(r"serving metrics on (http://\S+)", self.mount.log()),
                         timeout=5, interval=0.05)
        with urllib.request.urlopen(found[1], timeout=10) as response:
            text = response.read().decode()
        return {(s.name, frozenset((k, v) for k, v in s.labels.items() if k != "mount")):
                s.value for family in text_string_to_metric_families(text)
                for s in family.samples}


@pytest.fixture
def mounting(tmp_tree: Path) -> Iterator[Callable[..., Mounted]]:
    """Start a mount of ``tmp_tree/src``: on ``tmp_tree/mnt``, or *in_place* over itself
    (as systemd and the DaemonSet mount it), its backing files then seen through
    ``tmp_tree/view``, a bind mount taken before."""
    started: list[QosfsMount] = []
    views: list[Path] = []

    def start(*entry: str, in_place: bool = False) -> Mounted:
        src, mnt = tmp_tree / "src", tmp_tree / "mnt"
        for d in (src, src / "data", mnt):
            d.mkdir(mode=0o755, exist_ok=True)
        backing = src
        if in_place:
            backing, mnt = tmp_tree / "view", src
            backing.mkdir(exist_ok=True)
            subprocess.run(["mount", "--bind", str(src), str(backing)], check=True)
            views.append(backing)
        policy, sock = tmp_tree / "policy.toml", tmp_tree / "ctl.sock"
        policy.write_text(POLICY)
        m = QosfsMount(src, mnt, "--policy", str(policy), "--socket", str(sock),
                       "--metrics", "0", entry=entry or ("-m", "qosfs"))
        started.append(m.start())
        mounted = Mounted(m, backing, sock)
        if mounted.kernel()["state"] != "active":
            pytest.skip(f"kernel passthrough unavailable here: {mounted.kernel()['reason']}")
        return mounted

    yield start
    for m in started:
        m.stop()
    for view in views:
        subprocess.run(["umount", str(view)], check=False)


def put(m: Mounted, name: str, size: int) -> bytes:
    data = os.urandom(size)
    path = m.src / "data" / name
    path.write_bytes(data)
    path.chmod(0o644)
    return data


def write_timed(fd: int, total: int, chunk: int = 256 * 1024) -> float:
    """Write *total* bytes of new data from offset 0 in *chunk*s, then fsync; seconds."""
    block = os.urandom(chunk)
    start = time.monotonic()
    for off in range(0, total, chunk):
        assert os.pwrite(fd, block, off) == chunk
    os.fsync(fd)
    return time.monotonic() - start


@pytest.mark.parametrize("in_place", [False, True], ids=["source", "inplace"])
def test_a_capped_writer_beside_a_passed_through_reader_keeps_its_cap(
        mounting: Callable[..., Mounted], in_place: bool) -> None:
    m = mounting(in_place=in_place)
    put(m, "w.bin", 8 * MiB)
    path = m.mnt / "data/w.bin"
    reader = os.open(path, os.O_RDONLY)
    try:
        os.pread(reader, MiB, 0)
        assert m.kernel()["opens"] == {"data": 1}  # passed through
        writer = os.open(path, os.O_WRONLY)  # joins the backing id, with direct_io
        try:
            total = 3 * CAP  # three seconds' worth, one of them the bucket's burst
            took = write_timed(writer, total)
        finally:
            os.close(writer)
        rate = total / took
        # The burst (1 MiB) goes at once, the rest at the cap: ~2.5 s. Uncapped: ~0.05 s.
        assert took >= 2.0 and rate <= 1.3 * CAP, f"{rate / MiB:.2f} MiB/s for a 2 MiB/s cap"
        assert m.counted("writers", "write_bytes") == total  # the class counted them
        # The passed-through reader reads on, natively, and sees the new bytes.
        expected = (m.src / "data/w.bin").read_bytes()
        assert digest(os.pread(reader, len(expected) + 1, 0)) == digest(expected)
    finally:
        os.close(reader)
    kernel = m.kernel()
    assert kernel["joins"] == "served"
    assert kernel["served_write_joins"] == {"writers": 1}
    assert kernel["uncapped_write_opens"] == {} and kernel["capped_uncapped_opens"] == {}
    wait_for("the releases", lambda: m.kernel()["live_backing_ids"] == 0)


def test_a_capped_reader_joining_a_passed_through_file_is_capped(
        mounting: Callable[..., Mounted]) -> None:
    m = mounting()
    size = 3 * CAP
    data = put(m, "r.bin", size)
    path = m.mnt / "data/r.bin"
    passed = os.open(path, os.O_RDONLY)
    try:
        start = time.monotonic()
        out = subprocess.run(["dd", f"if={path}", "bs=256K", "status=none"],
                             check=True, capture_output=True, timeout=60,
                             preexec_fn=as_user(READER_UID)).stdout
        took = time.monotonic() - start
    finally:
        os.close(passed)
    assert digest(out) == digest(data)
    assert took >= 2.0 and size / took <= 1.3 * CAP, f"{size / took / MiB:.2f} MiB/s"
    assert m.counted("slow", "read_bytes") >= size
    kernel = m.kernel()
    assert kernel["served_read_joins"] == {"slow": 1} and kernel["opens"] == {"data": 1}
    assert kernel["uncapped_read_opens"] == {}


def test_mmap_of_a_joined_open_maps_the_file(mounting: Callable[..., Mounted]) -> None:
    m = mounting()
    data = put(m, "m.bin", 3 * MiB + 5)
    path = m.mnt / "data/m.bin"
    passed = os.open(path, os.O_RDONLY)
    joined = os.open(path, os.O_RDWR)  # a writer: joins with direct_io
    try:
        assert os.pwrite(joined, b"z" * 4096, MiB) == 4096  # through the daemon
        expected = data[:MiB] + b"z" * 4096 + data[MiB + 4096:]
        with mmap.mmap(joined, 0, prot=mmap.PROT_READ) as mapped:  # the backing file's
            assert digest(mapped[:]) == digest(expected)
        with mmap.mmap(passed, 0, prot=mmap.PROT_READ) as mapped:
            assert digest(mapped[:]) == digest(expected)
    finally:
        os.close(joined)
        os.close(passed)
    assert digest((m.src / "data/m.bin").read_bytes()) == digest(expected)
    assert m.kernel()["served_write_joins"] == {"writers": 1}


def test_where_the_kernel_cannot_serve_joins_they_go_uncapped_and_say_why(
        mounting: Callable[..., Mounted]) -> None:
    # A fault stands in for a kernel older than 6.9 (tests/faultinject.py).
    m = mounting(str(ROOT / "tests/faultinject.py"), "--fault", "joins=6.8.0", "--")
    put(m, "u.bin", 4 * MiB)
    path = m.mnt / "data/u.bin"
    reader = os.open(path, os.O_RDONLY)
    try:
        writer = os.open(path, os.O_WRONLY)  # joins uncapped: as before served joins
        try:
            took = write_timed(writer, 3 * CAP)
        finally:
            os.close(writer)
    finally:
        os.close(reader)
    assert took < 1.0  # uncapped (this is what the alert is for)
    assert m.counted("writers", "write_bytes") == 0  # the daemon never saw the bytes
    kernel = m.kernel()
    assert (kernel["joins"], kernel["joins_blocked_by"]) == ("uncapped", "kernel")
    assert kernel["uncapped_write_opens"] == {"writers": 1}
    assert kernel["capped_uncapped_opens"] == {"writers": 1}
    text = "\n".join(format_passthrough(kernel))
    assert "uncapped: Linux 6.8.0 does not take direct_io beside a backing id" in text
    assert "opens a cap bounded that went uncapped: writers 1" in text
    metrics = m.metrics()
    assert metrics[("qosfs_passthrough_joins_served", frozenset())] == 0
    assert metrics[("qosfs_passthrough_capped_uncapped_opens_total",
                    frozenset({("class", "writers"), ("reason", "kernel")}))] == 1
    assert metrics[("qosfs_passthrough_uncapped_opens_total",
                    frozenset({("class", "writers"), ("access", "write")}))] == 1
    assert "writing uncapped, because Linux 6.8.0" in m.mount.log()
