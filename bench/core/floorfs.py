"""The least a pyfuse3 daemon can do: a minimal read-only pass-through filesystem, served
by one process or by several over one connection.

``clonefs`` answers LOOKUP, GETATTR, OPEN and RELEASE and nothing else. Its node ids are
the backing files' inode numbers, and each process learns the tree's names when it
starts, so that any process can answer any request (the stand-in for a shared node
table). An open is answered with a backing id (kernel passthrough, registered once per
inode and per process, never closed), so its reads never reach a process; no journal, no
classification, no descriptor cache. With the same pyfuse3 build (deploy/libfuse's
patches, busy polling) and kernel as qosfs, it is the floor of what any pyfuse3 daemon
costs a small file here:

* ``bench smallfiles`` measures it beside qosfs as the ``pyfuse3`` side (one process);
* ``bench clones`` (docs/architecture.md, "Past one core") serves it from several
  processes: the first mounts and answers INIT, each further one gets a clone of the
  descriptor (``FUSE_DEV_IOC_CLONE``) and adopts the session (``pyfuse3.init_adopted``:
  the adopt patches qosfs's live handover uses), and the kernel hands each request to
  whichever process reads first. ``burn_us`` makes each LOOKUP and OPEN also spin that
  long, to give a request the cost of qosfs's own Python.

Each process is ``python -m bench.core.floorfs --serve SPEC``, started by :func:`clonefs`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.core.system import unmount_and_reap

#: ``_IOR(229, 0, uint32_t)``: bind a new /dev/fuse descriptor to a mount's connection.
FUSE_DEV_IOC_CLONE = 0x8004E500
#: Room for the request counts of this many processes in the shared counter file.
MAX_WORKERS = 16
_COUNT = struct.Struct("<Q")


def served_counts(shared: mmap.mmap, processes: int) -> list[int]:
    """The requests each of the first *processes* processes answered so far (the shared
    counts :func:`clonefs` yields)."""
    return [_COUNT.unpack_from(shared, i * 8)[0] for i in range(processes)]


def clone_fuse_fd(fd: int) -> int:
    """A new descriptor on the connection of /dev/fuse descriptor *fd*."""
    clone = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(clone, FUSE_DEV_IOC_CLONE, struct.pack("<I", fd))
    except OSError:
        os.close(clone)
        raise
    return clone


def _spin(ns: int) -> None:
    """Hold the CPU for *ns*: the Python cost qosfs adds to a request (``--burn-us``)."""
    end = time.perf_counter_ns() + ns
    while time.perf_counter_ns() < end:
        pass


def _spawn(spec: dict[str, Any], pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    """One process of clonefs, as *spec* says (:func:`_serve`); its ready file emptied."""
    Path(spec["ready"]).unlink(missing_ok=True)
    return subprocess.Popen([sys.executable, "-m", "bench.core.floorfs", "--serve",
                             json.dumps(spec)], pass_fds=pass_fds,
                            cwd=str(Path(__file__).parent.parent.parent))


def _wait_ready(spec: dict[str, Any], proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    """What process *spec* ``index`` wrote in its ready file once it serves."""
    ready = Path(spec["ready"])
    for _ in range(600):
        if ready.exists() and ready.stat().st_size:
            return dict(json.loads(ready.read_text()))
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"clonefs process {spec['index']} did not start")


def _start_worker(spec: dict[str, Any], index: int, fuse_fd: int,
                  state: dict[str, int]) -> subprocess.Popen[bytes]:
    """Start process *index*, serving a clone of *fuse_fd* (whose session has *state*);
    returns once it serves."""
    clone = clone_fuse_fd(fuse_fd)
    worker = dict(spec, index=index, fd=clone, state=state,
                  ready=str(Path(spec["ready"]).with_name(f"clonefs-ready-{index}")))
    try:
        proc = _spawn(worker, (clone,))
    finally:
        os.close(clone)
    _wait_ready(worker, proc)
    return proc


def _serve(spec: dict[str, Any]) -> None:
    """One process of clonefs: the first mounts it and starts the others (*spec*
    ``workers``), each of which adopts a clone of its descriptor (*spec* ``fd``)."""
    import logging

    import pyfuse3
    import trio

    logging.basicConfig(level=logging.WARNING)  # a handler's failure, on stderr
    source, mountpoint, index = spec["source"], spec["mountpoint"], spec["index"]
    counters, burn_us, poll_us = spec["counters"], spec["burn_us"], spec["poll_us"]
    cache_s = float(spec["cache_s"])
    workers, ready = spec["workers"], spec["ready"]
    adopt = None if spec["fd"] is None else (spec["fd"], spec["state"])

    burn = burn_us * 1000
    top = os.path.abspath(source)
    root_ino = os.lstat(top).st_ino
    paths: dict[int, bytes] = {pyfuse3.ROOT_INODE: os.fsencode(top)}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            ino = os.lstat(full).st_ino
            if ino in (pyfuse3.ROOT_INODE, root_ino):
                raise SystemExit(f"clonefs: {full} has inode {ino}, a root's number")
            paths[ino] = os.fsencode(full)
    with open(counters, "r+b") as f:
        shared = mmap.mmap(f.fileno(), MAX_WORKERS * 8)
    at = index * 8

    def count() -> None:
        _COUNT.pack_into(shared, at, _COUNT.unpack_from(shared, at)[0] + 1)

    def attributes(st: os.stat_result, ino: int) -> Any:
        e = pyfuse3.EntryAttributes()
        e.st_ino = ino
        e.generation = 0
        e.entry_timeout = e.attr_timeout = cache_s
        for name in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size",
                     "st_blksize", "st_blocks", "st_atime_ns", "st_mtime_ns", "st_ctime_ns"):
            setattr(e, name, getattr(st, name))
        return e

    class CloneFS(pyfuse3.Operations):
        enable_passthrough = True
        max_backing_stack_depth = 0  # ext4, tmpfs: nothing stacked below
        enable_writeback_cache = False  # the kernel does not combine it with passthrough

        def __init__(self) -> None:
            super().__init__()
            self.backing: dict[int, int] = {}  # inode -> this process's backing id

        async def lookup(self, parent: int, name: bytes, ctx: Any = None) -> Any:
            count()
            if burn:
                _spin(burn)
            try:
                st = os.lstat(paths[parent] + b"/" + name)
            except OSError as exc:
                raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
            if st.st_ino not in paths:
                raise pyfuse3.FUSEError(errno.ENOENT)  # made after the start: not served
            return attributes(st, st.st_ino)

        async def getattr(self, ino: int, ctx: Any = None) -> Any:
            count()
            return attributes(os.lstat(paths[ino]), ino)

        async def open(self, ino: int, flags: int, ctx: Any) -> Any:
            count()
            if burn:
                _spin(burn)
            if flags & os.O_ACCMODE != os.O_RDONLY:
                raise pyfuse3.FUSEError(errno.EROFS)
            backing = self.backing.get(ino)
            if backing is None:
                fd = os.open(paths[ino], os.O_RDONLY)
                try:
                    backing = self.backing[ino] = pyfuse3.passthrough_open(fd)
                finally:
                    os.close(fd)  # the kernel holds the file under its backing id
            # keep_cache would fail the open (EIO): the page cache is the backing file's.
            return pyfuse3.FileInfo(fh=ino, keep_cache=False, backing_id=backing)

        async def release(self, fh: int) -> None:
            count()

        async def forget(self, inode_list: Any) -> None:
            pass

        async def flush(self, fh: int) -> None:
            raise pyfuse3.FUSEError(errno.ENOSYS)  # as qosfs: no FLUSH per close

    ops = CloneFS()
    options = set(pyfuse3.default_options) | {"fsname=clonefs", "ro"}
    if adopt is None:
        pyfuse3.init(ops, mountpoint, options)
    else:
        pyfuse3.init_adopted(ops, adopt[0], adopt[1], None, options)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: pyfuse3.main(1, 64, busy_poll_us=poll_us))
            pids = [os.getpid()]
            if adopt is None:
                await trio.to_thread.run_sync(os.stat, mountpoint)  # INIT answered
                state = dict(pyfuse3.session_state())
                for more in range(1, workers):
                    children.append(await trio.to_thread.run_sync(
                        _start_worker, spec, more, pyfuse3.get_session_fd(), state))
                    pids.append(children[-1].pid)
            Path(ready).write_text(json.dumps({"pids": pids}))

    children: list[subprocess.Popen[bytes]] = []
    try:
        trio.run(main)
    finally:
        pyfuse3.close(unmount=False)
        for child in children:  # their clones end with the connection: so do they
            child.wait(timeout=20)


@contextmanager
def clonefs(source: Path, mnt: Path, work: Path, workers: int, burn_us: int,
            poll_us: int, cache_s: float = 1.0) -> Iterator[tuple[list[int], mmap.mmap]]:
    """clonefs mounted on *mnt* and served by *workers* processes: their pids and the
    shared request counts (one u64 per process). *cache_s*: how long the kernel may keep
    its entries and attributes (qosfs's default policy gives datasets 60 s)."""
    counters = work / "clonefs-counts"
    counters.write_bytes(bytes(MAX_WORKERS * 8))
    spec = {"source": str(source), "mountpoint": str(mnt), "index": 0,
            "counters": str(counters), "burn_us": burn_us, "poll_us": poll_us,
            "cache_s": cache_s, "workers": workers, "fd": None, "state": None,
            "ready": str(work / "clonefs-ready-0")}
    proc = _spawn(spec)
    try:
        pids = list(_wait_ready(spec, proc)["pids"])
        with open(counters, "r+b") as f:
            yield pids, mmap.mmap(f.fileno(), MAX_WORKERS * 8)
    finally:
        unmount_and_reap(mnt, proc, 20)


def main(argv: list[str]) -> int:
    """``python -m bench.core.floorfs --serve SPEC``: one process of clonefs (:func:`clonefs`
    starts them)."""
    if argv[:1] != ["--serve"] or len(argv) != 2:
        print("usage: python -m bench.core.floorfs --serve SPEC (started by clonefs)",
              file=sys.stderr)
        return 2
    _serve(json.loads(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
