"""One FUSE connection served by two processes (bench.core.floorfs, which bench.clones
measures for docs/architecture.md's "Past one core"): the second process reads a clone of
the first's descriptor (FUSE_DEV_IOC_CLONE) and adopts the session the first initialised,
each request is answered by whichever process read it, and what a reader gets through
the mount is the tree underneath, byte for byte. One process alone is the floor daemon
of ``bench smallfiles``."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyfuse3
import pytest
import xxhash

from bench.core.epochs import make_tree
from bench.core.floorfs import MAX_WORKERS, clone_fuse_fd, clonefs, served_counts
from tests.mounting import is_mounted

pytestmark = [pytest.mark.mount, pytest.mark.root]

if not getattr(pyfuse3, "PASSTHROUGH_SUPPORTED", False) or \
        getattr(pyfuse3, "init_adopted", None) is None:
    pytest.skip("pyfuse3 without passthrough or adopt: `make deps` builds it "
                "(deploy/libfuse/build.sh)", allow_module_level=True)


def digest(path: Path) -> str:
    return xxhash.xxh64(path.read_bytes()).hexdigest()


def test_two_processes_answer_one_mount_and_readers_get_the_tree(tmp_path: Path) -> None:
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    names = make_tree(src, 300, 8192)
    mnt.mkdir()
    with clonefs(src, mnt, tmp_path, workers=2, burn_us=0, poll_us=50) as (pids, shared):
        assert len(pids) == 2 and len(set(pids)) == 2
        served = [0, 0]
        deadline = time.monotonic() + 60
        # The kernel gives each request to whichever process reads first: read the tree
        # from several threads until both have answered some (first pass, usually).
        while min(served) == 0:
            assert time.monotonic() < deadline, f"requests per process: {served}"
            with ThreadPoolExecutor(8) as pool:
                got = list(pool.map(lambda n: digest(mnt / n), names))
            assert got == [digest(src / n) for n in names]
            served = served_counts(shared, 2)
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("2\n")  # forget the dentries: the next pass looks up again
        assert sum(served_counts(shared, MAX_WORKERS)[2:]) == 0
    assert not is_mounted(mnt)
    for pid in pids:  # both processes ended with the connection
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"


def test_a_clone_of_a_descriptor_that_is_no_connection_is_refused() -> None:
    fd = os.open("/dev/fuse", os.O_RDWR)
    try:
        with pytest.raises(OSError):
            clone_fuse_fd(fd)
    finally:
        os.close(fd)


def test_one_process_alone_serves_the_tree_and_passes_its_reads_to_the_kernel(
        tmp_path: Path) -> None:
    """The ``pyfuse3`` side of ``bench smallfiles``: the floor daemon on its own."""
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    names = make_tree(src, 200, 64 * 1024)
    mnt.mkdir()
    with clonefs(src, mnt, tmp_path, workers=1, burn_us=0, poll_us=50) as (pids, shared):
        assert len(pids) == 1
        before = _read_bytes(pids[0])
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda n: digest(mnt / n), names))
        assert got == [digest(src / n) for n in names]
        # LOOKUP, OPEN and RELEASE at least, per file, reached it; the bytes did not.
        assert served_counts(shared, 1)[0] >= 3 * len(names)
        assert _read_bytes(pids[0]) - before < len(names) * 64 * 1024 // 10
    assert not is_mounted(mnt)


def _read_bytes(pid: int) -> int:
    """What process *pid* has read with read calls so far (its requests from /dev/fuse
    too), from /proc/PID/io."""
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(io["rchar"])
