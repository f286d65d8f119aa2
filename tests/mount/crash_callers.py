"""One caller of the crash-recovery test (tests/mount/test_crash_recovery.py), a process
of its own so that the test process holds nothing open under the mount when it starts the
new daemon (a forked child closing a FUSE file would wait on the dead mount).

``python -m tests.mount.crash_callers KIND PATH OPS [PAUSE]`` prints one JSON line per
call (its name and duration, or its errno) and a last ``{"done": ...}`` line, pausing PAUSE
seconds between calls (so that it is still in flight when the daemon is killed). KIND:

- ``read``: pread 64 KiB at seeded offsets of PATH, each block checked against the
  expected content (``expected_block``);
- ``write`` / ``parked``: write 64 KiB blocks at increasing offsets of PATH (O_CREAT) and
  fsync every 4; ``synced`` reports the length and xxh3 of what was fsync'd (a parked
  writer is the same in a capped class);
- ``meta``: create, stat, list, rename and unlink files in the directory PATH.

``python -m tests.mount.crash_callers once OP PATH [OTHER]`` makes one call OP on PATH
(``rename`` and ``link`` to OTHER, ``symlink`` PATH pointing to OTHER, ``create``: an
O_CREAT|O_EXCL open that then writes ``created`` through its descriptor) and reports it as
above: the caller whose request the daemon dies on in tests/mount/test_crash_recovery.py.
"""

from __future__ import annotations

import errno
import json
import os
import random
import stat
import sys
import time

import xxhash

BLOCK = 64 << 10


def expected_block(offset: int) -> bytes:
    """The content of the readers' file at *offset* (a multiple of BLOCK)."""
    return random.Random(offset).randbytes(BLOCK)


PAUSE = [0.0]  # seconds between calls (set once, from the command line)


def _emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def _timed(name: str, call, *args):  # type: ignore[no-untyped-def]
    """(True, *call*'s result), or (False, None) after an OSError; reported either way.
    ENOTCONN ends the caller (after its report)."""
    if PAUSE[0]:
        time.sleep(PAUSE[0])
    t0 = time.monotonic()
    try:
        result = call(*args)
    except OSError as exc:
        _emit(call=name, errno=exc.errno, took=time.monotonic() - t0)
        if exc.errno == errno.ENOTCONN:  # the connection is gone: nothing more to try
            _emit(done="ENOTCONN")
            sys.exit(0)
        return False, None
    _emit(call=name, took=time.monotonic() - t0)
    return True, result


def read(path: str, ops: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    rnd = random.Random(path)
    for _ in range(ops):
        offset = rnd.randrange(size // BLOCK) * BLOCK
        ok, block = _timed("pread", os.pread, fd, BLOCK, offset)
        if ok and block != expected_block(offset):
            _emit(call="pread", corrupt=offset)
    os.close(fd)


def write(path: str, ops: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    rnd = random.Random(path)
    digest = xxhash.xxh3_128()
    done = 0
    for i in range(ops):
        block = rnd.randbytes(BLOCK)
        ok, written = _timed("pwrite", os.pwrite, fd, block, done)
        if not ok or written != BLOCK:
            continue  # the block is written again at the same offset
        done += BLOCK
        digest.update(block)
        if i % 4 == 3 and _timed("fsync", os.fsync, fd)[0]:
            _emit(synced=done, digest=digest.hexdigest())
    os.fsync(fd)
    _emit(synced=done, digest=digest.hexdigest())
    os.close(fd)


def meta(path: str, ops: int) -> None:
    for i in range(ops):
        tmp, final = os.path.join(path, f"t{i}"), os.path.join(path, f"f{i}")
        ok, fd = _timed("create", os.open, tmp, os.O_WRONLY | os.O_CREAT, 0o644)
        if ok:
            os.write(fd, b"m" * 100)
            os.close(fd)
        _timed("stat", os.stat, tmp)
        _timed("listdir", os.listdir, path)
        _timed("rename", os.rename, tmp, final)
        _timed("unlink", os.unlink, final)


def _create(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    try:
        os.write(fd, b"created")
    finally:
        os.close(fd)


ONCE = {
    "rename": os.rename, "link": os.link, "symlink": lambda path, other: os.symlink(other, path),
    "unlink": os.unlink, "rmdir": os.rmdir, "mkdir": os.mkdir, "create": _create,
    "mknod": lambda path: os.mknod(path, 0o600 | stat.S_IFIFO),
}


def once(op: str, path: str, *other: str) -> None:
    _emit(started=op)
    _timed(op, ONCE[op], path, *other)
    _emit(done=op)


def main() -> None:
    if sys.argv[1] == "once":
        once(*sys.argv[2:])
        return
    kind, path, ops = sys.argv[1], sys.argv[2], int(sys.argv[3])
    PAUSE[0] = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    _emit(started=kind)
    {"read": read, "write": write, "parked": write, "meta": meta}[kind](path, ops)
    _emit(done=kind)


if __name__ == "__main__":
    main()
