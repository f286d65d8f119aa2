"""The daemon's CPU time in each FUSE handler, for ``python -m bench.opcost --handlers``.

A profiler that samples (py-spy) spreads a cold file's ~300 us over dozens of frames, and
its line numbers were misleading in the daemon (a one-store call shown as 4% of the
time). This times every call of the handlers with the calling thread's CPU clock, which
waits on nothing, so a handler that blocks on the disk or on tokens is charged only the
CPU it used; the difference to the daemon's whole CPU is what pyfuse3, trio and the
services did between requests. Each timed call costs ~1.5 us of its own (two clock
reads, each a system call, and a wrapper), inside the figures.

How it gets into the daemon: :func:`sitecustomize_dir` writes a ``sitecustomize`` module
that Python imports at start when its directory is on ``PYTHONPATH``; it calls
:func:`install` if ``QOSFS_HANDLER_TIMES`` names a file. The totals live in that file,
mapped by both sides: the daemon adds to it in place, the bench reads it between passes
(:func:`read`), so nothing has to be asked of the daemon. Nothing here runs unless the
bench sets it up: the product never imports this module.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ENV = "QOSFS_HANDLER_TIMES"
#: The handlers timed, in the file's order: (CPU ns, calls) each, as two int64.
HANDLERS = ("lookup", "forget", "getattr", "setattr", "open", "create", "read", "write",
            "flush", "fsync", "release", "opendir", "readdir", "releasedir", "getxattr",
            "listxattr", "statfs", "unlink", "rename", "mkdir")
_SIZE = len(HANDLERS) * 16

# Loads this very file by its path: the daemon's PYTHONPATH may hold another tree's qosfs
# (opcost's before/after sides), whose bench/ need not have this module.
_SITECUSTOMIZE = f'''\
"""Written by bench.core.handler_times: times the daemon's handlers when {ENV} is set."""
import importlib.util
import os

if os.environ.get("{ENV}"):
    spec = importlib.util.spec_from_file_location("_handler_times", {str(Path(__file__))!r})
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install(os.environ["{ENV}"])
'''


def sitecustomize_dir(parent: Path) -> Path:
    """A directory holding the ``sitecustomize`` module, to put first on PYTHONPATH."""
    where = Path(tempfile.mkdtemp(prefix="handler-times-", dir=parent))
    (where / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    return where


def new_file(path: Path) -> None:
    """An empty totals file at *path*, for a daemon about to start."""
    path.write_bytes(bytes(_SIZE))


def read(path: Path) -> dict[str, tuple[int, int]]:
    """{handler: (CPU ns, calls)} so far."""
    data = path.read_bytes()
    return {name: struct.unpack_from("<qq", data, i * 16) for i, name in enumerate(HANDLERS)}


def install(path: str) -> None:
    """In the daemon: wrap each handler of the pass-through operations with a timer that
    adds to the totals file at *path*."""
    from qosfs.passthrough.operations import PassthroughOperations

    fd = os.open(path, os.O_RDWR)
    try:
        totals = memoryview(mmap.mmap(fd, _SIZE)).cast("q")
    finally:
        os.close(fd)
    for i, name in enumerate(HANDLERS):
        method = getattr(PassthroughOperations, name, None)
        if method is not None:
            setattr(PassthroughOperations, name, _timed(method, totals, 2 * i))


def _timed(method: Callable[..., Awaitable[Any]], totals: memoryview,
           at: int) -> Callable[..., Awaitable[Any]]:
    clock = time.thread_time_ns

    @functools.wraps(method)
    async def timed(*args: Any) -> Any:
        # The thread's CPU clock: a handler that waits (tokens, a thread) is charged the
        # CPU of the steps it ran, plus whatever other tasks ran on the loop meanwhile.
        start = clock()
        try:
            return await method(*args)
        finally:
            totals[at] += clock() - start
            totals[at + 1] += 1

    return timed
