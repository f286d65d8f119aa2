"""Replay I/O steps on one file through an O_DIRECT, a buffered and a mapped view of it.

Run as a script: ``python odirect_ops.py PATH`` with a JSON list of steps on stdin;
prints one JSON line: what each step observed, then the file's size and digest read
back through a fresh open. The same steps run on a plain ext4 directory and through
qosfs (tests/mount/test_odirect.py) must observe the same. In a child process so that a
hung mount fails the test by its timeout instead of hanging it.

The file is opened buffered first and O_DIRECT second: the kernel writes a shared
mapping's pages back through the newest writable open of the file, so writeback
reaches the daemon on the O_DIRECT open whichever descriptor the mapping came from.

Steps (offsets and lengths in bytes; O_DIRECT ones are multiples of ``BLOCK``, as ext4
demands, from page-aligned memory):

``["dwrite", off, length, byte]``, ``["dread", off, length]``
    pwritev/preadv on the O_DIRECT descriptor.
``["bwrite", off, length, byte]``, ``["bread", off, length]``
    pwrite/pread on the buffered descriptor.
``["mwrite", via, off, length, byte, flush]``, ``["mread", via, off, length]``
    a MAP_SHARED mapping of the whole file through descriptor *via* ("d" or "b"); *off*
    and *length* are taken modulo the file's size; *flush*: msync before unmapping.
``["truncate", via, size]``
    ftruncate.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import sys
from typing import Any

import xxhash

BLOCK = 4096


def _aligned(length: int, byte: int = 0) -> mmap.mmap:
    buf = mmap.mmap(-1, max(length, 1))
    if byte:
        buf.write(bytes([byte]) * length)
    return buf


def _digest(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def _step(step: list[Any], fds: dict[str, int]) -> Any:
    kind = step[0]
    if kind == "dwrite":
        _, off, length, byte = step
        return os.pwritev(fds["d"], [memoryview(_aligned(length, byte))[:length]], off)
    if kind == "dread":
        _, off, length = step
        buf = _aligned(length)
        n = os.preadv(fds["d"], [memoryview(buf)[:length]], off)
        return [n, _digest(buf[:n])]
    if kind == "bwrite":
        _, off, length, byte = step
        return os.pwrite(fds["b"], bytes([byte]) * length, off)
    if kind == "bread":
        _, off, length = step
        return _digest(os.pread(fds["b"], length, off))
    if kind == "truncate":
        _, via, size = step
        os.ftruncate(fds[via], size)
        return size
    size = os.fstat(fds["d"]).st_size
    if not size:
        return "empty"  # nothing to map
    via, off = step[1], step[2] % size
    length = min(step[3], size - off)
    with mmap.mmap(fds[via], size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
        if kind == "mread":
            return _digest(m[off:off + length])
        m[off:off + length] = bytes([step[4]]) * length
        if step[5]:
            m.flush()
    return [off, length]


def main() -> None:
    path, steps = sys.argv[1], json.load(sys.stdin)
    fds = {"b": os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)}
    fds["d"] = os.open(path, os.O_RDWR | os.O_DIRECT)
    seen: list[Any] = []
    for step in steps:
        try:
            seen.append(_step(step, fds))
        except OSError as exc:
            seen.append(errno.errorcode.get(exc.errno or 0, str(exc.errno)))
    for fd in fds.values():
        try:
            os.close(fd)  # writes back what mappings left dirty; may report its failure
        except OSError as exc:
            seen.append(["close", errno.errorcode.get(exc.errno or 0, str(exc.errno))])
    with open(path, "rb") as f:
        data = f.read()
    print(json.dumps({"steps": seen, "size": len(data), "digest": _digest(data)}))


if __name__ == "__main__":
    main()
