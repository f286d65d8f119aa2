"""Cold small files read through the daemon (``--no-qos``) on a local disk: the open starts
reading the file (:meth:`qosfs.passthrough.backing_io.BackingIO.prefetch`), so that its
READ is served on the loop, without a worker thread.

Before, every such READ missed the page cache and took a thread hop, whose cost grows
with the requests in flight (the worker waits for the GIL and a CPU, its result for the
loop): ``--no-qos`` got no faster, or slower, from 4 to 16 threads while the bare disk
kept scaling. The figures themselves are ``python -m bench coldscale``'s; here the
daemon's own count of thread hops says whether the path is the one that scales."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from qosfs.control.ctl import Client
from qosfs.passthrough.backing_io import IoMode, backing_mount, choose_io_mode
from tests.mounting import QosfsMount
from tests.waiting import wait_for

pytestmark = [pytest.mark.mount, pytest.mark.root]

SIZE = 112 * 1024  # a loader's sample (MLPerf Storage's ResNet-like shape)
PAGES = SIZE // mmap.PAGESIZE


class Cold:
    """Small files on the disk, evicted from the page cache, and a ``--no-qos`` mount, apart
    from the source or over it (*in_place*, as systemd and the DaemonSet mount)."""

    def __init__(self, tmp: Path, count: int, in_place: bool) -> None:
        self.src, self.sock = tmp / "src", tmp / "ctl.sock"
        self.mnt = self.src if in_place else tmp / "mnt"
        self.src.mkdir(exist_ok=True)
        self.mnt.mkdir(exist_ok=True)
        # The source's files as they are underneath, also once a mount in place covers
        # them: through a descriptor of the directory opened before mounting.
        self.under = os.open(self.src, os.O_RDONLY | os.O_DIRECTORY)
        fstype = backing_mount(self.under)[0]
        if choose_io_mode(fstype) is not IoMode.NOWAIT:
            os.close(self.under)
            pytest.skip(f"needs a local disk for {tmp}, not {fstype}")
        self.names = [f"s{i:04d}.bin" for i in range(count)]
        self.data = {name: os.urandom(SIZE) for name in self.names}
        for name, data in self.data.items():
            path = self.backing(name)
            with open(path, "wb") as f:
                f.write(data)
                os.fsync(f.fileno())  # clean pages: DONTNEED drops them
            evict(path)
            assert resident(path) == 0, f"{path}: its pages would not leave the cache"
        self.mount = QosfsMount(self.src, self.mnt, "--no-qos", "--socket", str(self.sock))

    def backing(self, name: str) -> Path:
        """The file *name* in the source, not through the mount."""
        return Path(f"/proc/self/fd/{self.under}/{name}")

    def counts(self) -> tuple[int, int]:
        """The daemon's worker-thread hops and read-ahead opens so far."""
        with Client(str(self.sock)) as client:
            status = client.request({"cmd": "status"})
        return status["backing_thread_hops"], status["backing_prefetches"]


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident(path: Path) -> int:
    """How many pages of the file *path* are in the page cache (mincore of a mapping that
    is never touched, so it faults nothing in)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), SIZE, flags=mmap.MAP_PRIVATE,
                                          prot=mmap.PROT_READ | mmap.PROT_WRITE) as view:
        vec = (ctypes.c_ubyte * PAGES)()
        addr = ctypes.addressof(ctypes.c_char.from_buffer(view))
        if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(SIZE), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return sum(v & 1 for v in vec)


def read_whole(path: Path) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.read(SIZE + 1)


@pytest.fixture
def cold(tmp_tree: Path, request: pytest.FixtureRequest) -> Iterator[Cold]:
    count, in_place = request.param
    files = Cold(tmp_tree, count, in_place)
    try:
        with files.mount:
            yield files
    finally:
        os.close(files.under)


@pytest.mark.parametrize("cold", [(32, False), (32, True)], indirect=True,
                         ids=["apart", "in-place"])
def test_an_open_reads_a_cold_small_file_ahead_and_its_read_takes_no_thread(
        cold: Cold) -> None:
    hops, prefetches = cold.counts()
    fds = [os.open(cold.mnt / name, os.O_RDONLY) for name in cold.names]
    try:
        # Opened, nothing read: the disk delivers the files all the same.
        wait_for("every open's file to come into the page cache",
                 lambda: [n for n in cold.names if resident(cold.backing(n)) < PAGES],
                 until=lambda missing: not missing)
        for fd, name in zip(fds, cold.names, strict=True):
            assert os.pread(fd, SIZE + 1, 0) == cold.data[name]
    finally:
        for fd in fds:
            os.close(fd)
    # Every READ found its pages in: served on the loop, no worker thread.
    assert cold.counts() == (hops, prefetches + len(cold.names))


@pytest.mark.parametrize("cold", [(480, False), (480, True)], indirect=True,
                         ids=["apart", "in-place"])
def test_cold_small_files_read_by_16_threads_take_almost_no_thread_hops(cold: Cold) -> None:
    """The shape that stopped scaling: each caller's open, READ and release in turn. With
    16 callers the open-to-READ gap is many requests of the loop long, far more than the
    disk takes; before, each file's READ took one hop (1.0 per file at every thread
    count), now few do (0.01-0.11 per file in ten runs here, with the files' metadata
    cached: the loop is then at its fastest). Half is generous, and fails the old path."""
    hops, _ = cold.counts()
    parts = [cold.names[i::16] for i in range(16)]
    wrong: list[str] = []

    def reader(part: list[str]) -> None:
        wrong.extend(n for n in part if read_whole(cold.mnt / n) != cold.data[n])

    threads = [threading.Thread(target=reader, args=(part,)) for part in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong
    per_file = (cold.counts()[0] - hops) / len(cold.names)
    assert per_file < 0.5, f"{per_file:.2f} thread hops per cold file at 16 threads"
