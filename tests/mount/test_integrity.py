"""Data integrity through real mounts: xxhash digests of large files, many writers."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

pytestmark = pytest.mark.mount

CHUNK = 1 << 20


def _digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


WRITER = r"""
import os, sys, xxhash
path, size, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rnd = __import__("random").Random(seed)
h = xxhash.xxh3_128()
with open(path, "wb") as f:
    left = size
    while left:
        n = min(left, rnd.choice([4096, 65536, 1 << 20, 3 * 1000 + 7]))
        block = rnd.randbytes(n)
        f.write(block)
        h.update(block)
        left -= n
    f.flush()
    os.fsync(f.fileno())
print(h.hexdigest())
"""


def test_parallel_writers_land_intact_in_source(qmount) -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(qmount.mountpoint / f"w{i}"),
                          str(48 * CHUNK + i * 12345), str(i)], stdout=subprocess.PIPE, text=True)
        for i in range(4)
    ]
    expected = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    for i, digest in enumerate(expected):
        assert _digest(qmount.source / f"w{i}") == digest
        assert _digest(qmount.mountpoint / f"w{i}") == digest


def test_files_written_underneath_read_back_intact(qmount) -> None:
    for i in range(3):
        with open(qmount.source / f"u{i}", "wb") as f:
            f.write(os.urandom(20 * CHUNK + 777 * i))
    for i in range(3):
        assert _digest(qmount.mountpoint / f"u{i}") == _digest(qmount.source / f"u{i}")


def test_random_offset_rewrites_match_a_model(qmount) -> None:
    import random

    rnd = random.Random(7)
    model = bytearray(4 * CHUNK)
    path = qmount.mountpoint / "model"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.pwrite(fd, bytes(model), 0)
        for _ in range(300):
            off = rnd.randrange(0, len(model) - 1)
            data = rnd.randbytes(rnd.randrange(1, min(200_000, len(model) - off)))
            os.pwrite(fd, data, off)
            model[off:off + len(data)] = data
            if rnd.random() < 0.2:
                r_off = rnd.randrange(0, len(model))
                assert os.pread(fd, 70_000, r_off) == bytes(model[r_off:r_off + 70_000])
    finally:
        os.close(fd)
    assert (qmount.source / "model").read_bytes() == bytes(model)


def test_o_direct_reads_and_writes(qmount) -> None:
    path = qmount.mountpoint / "direct"
    payload = os.urandom(8 * CHUNK)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    try:
        buf = mmap.mmap(-1, 8 * CHUNK)  # page aligned, as O_DIRECT callers use
        buf[:] = payload
        assert os.pwritev(fd, [buf], 0) == len(payload)
        # An unaligned user buffer: the kernel and the daemon must cope, not crash.
        try:
            os.pwrite(fd, payload[1:4097], 4096)
        except OSError:
            pass
        else:
            payload = payload[:4096] + payload[1:4097] + payload[8192:]
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, 8 * CHUNK)
        assert os.preadv(fd, [buf], 0) == len(payload)
        assert bytes(buf) == payload
        try:
            os.pread(fd, 100, 3)  # unaligned size and offset: whatever the backing says
        except OSError:
            pass
    finally:
        os.close(fd)
    assert (qmount.source / "direct").read_bytes() == payload
    assert (qmount.mountpoint / "direct").read_bytes() == payload  # daemon still serving


def test_fsync_and_fdatasync_succeed_and_data_is_underneath(qmount) -> None:
    path = qmount.mountpoint / "synced"
    with open(path, "wb") as f:
        f.write(b"x" * 100_000)
        f.flush()
        os.fsync(f.fileno())
        os.fdatasync(f.fileno())
    dfd = os.open(qmount.mountpoint, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    assert (qmount.source / "synced").stat().st_size == 100_000


def test_mmap_shared_write_reaches_source(qmount) -> None:
    path = qmount.mountpoint / "mapped"
    path.write_bytes(b"\0" * 8192)
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 8192)
        m[100:105] = b"hello"
        m.flush()
        m.close()
    assert (qmount.source / "mapped").read_bytes()[100:105] == b"hello"
