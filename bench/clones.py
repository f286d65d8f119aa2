"""Past one core, measured: one FUSE connection served by several Python processes.

docs/architecture.md ("Past one core") designs how qosfs would serve one mount from
several worker processes, each reading its own clone of the connection's descriptor
(``FUSE_DEV_IOC_CLONE``). Before that is built into qosfs (a shared node table, leases
of the buckets, the workers' lifecycle), this measures what the mechanism itself gives on
this machine, with the same pyfuse3 and the same kernel passthrough qosfs uses:

* ``clonefs``: a minimal read-only pass-through filesystem in pyfuse3. Its node ids are
  the backing files' inode numbers, and each process learns the tree's names when it
  starts, so that any process can answer any request (the stand-in for the shared node
  table: every request a worker gets names a node it can resolve alone). An open is
  answered with a backing id (kernel passthrough, kept per inode and per process), so
  its reads never reach a process; LOOKUP, GETATTR, OPEN and RELEASE do.
* ``--burn-us``: each LOOKUP and OPEN also spins that long, to give a request the cost
  of qosfs's own Python (its classification, charge, journal and counting), so that the
  figures say what a second process would give qosfs, not only a daemon that does
  nothing.
* The first process mounts and answers INIT; each further one gets a clone of the
  descriptor and adopts the session (``pyfuse3.init_adopted``: deploy/libfuse's adopt
  patches, which qosfs's live handover uses). The kernel hands each request to
  whichever process reads first.

The driver runs the small-file loader (:func:`bench.core.epochs.read_files`: open, read
whole, close, on N threads) bare and through 1 and 2 processes, cold on the disk (caches
dropped) and warm on tmpfs, and prints files/s, the ratio to bare, the processes' CPU per
file and the share of requests each process answered::

    python -m bench clones [--files 2400] [--threads 1,4,16] [--burn-us 0,40]
                           [--rounds 2] [--disk-dir /var/tmp]
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import mmap
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.core.epochs import make_tree, read_files
from bench.core.system import cpu_seconds, drop_caches, unmount_and_reap

#: ``_IOR(229, 0, uint32_t)``: bind a new /dev/fuse descriptor to a mount's connection.
FUSE_DEV_IOC_CLONE = 0x8004E500
#: Room for the request counts of this many processes in the shared counter file.
MAX_WORKERS = 16
_COUNT = struct.Struct("<Q")


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
    return subprocess.Popen([sys.executable, "-m", "bench.clones", "--serve",
                             json.dumps(spec)], pass_fds=pass_fds,
                            cwd=str(Path(__file__).parent.parent))


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
        e.entry_timeout = e.attr_timeout = 1.0
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
            poll_us: int) -> Iterator[tuple[list[int], mmap.mmap]]:
    """clonefs mounted on *mnt* and served by *workers* processes: their pids and the
    shared request counts (one u64 per process)."""
    counters = work / "clonefs-counts"
    counters.write_bytes(bytes(MAX_WORKERS * 8))
    spec = {"source": str(source), "mountpoint": str(mnt), "index": 0,
            "counters": str(counters), "burn_us": burn_us, "poll_us": poll_us,
            "workers": workers, "fd": None, "state": None,
            "ready": str(work / "clonefs-ready-0")}
    proc = _spawn(spec)
    try:
        pids = list(_wait_ready(spec, proc)["pids"])
        with open(counters, "r+b") as f:
            yield pids, mmap.mmap(f.fileno(), MAX_WORKERS * 8)
    finally:
        unmount_and_reap(mnt, proc, 20)


def _measure(root: Path, names: list[str], threads: int, seed: int, cold: bool,
             pids: list[int], shared: mmap.mmap | None) -> dict[str, Any]:
    if cold:
        drop_caches()
    else:
        read_files(root, names, 4, seed + 1000)  # the warm pass's files in every cache
    before = [cpu_seconds(p) or 0.0 for p in pids]
    counts = [_COUNT.unpack_from(shared, i * 8)[0] for i in range(len(pids))] if shared else []
    rate = read_files(root, names, threads, seed)
    cpu = sum((cpu_seconds(p) or 0.0) - b for p, b in zip(pids, before, strict=True))
    served = [_COUNT.unpack_from(shared, i * 8)[0] - c for i, c in enumerate(counts)] \
        if shared else []
    return {"rate": rate, "cpu_us": cpu / len(names) * 1e6, "served": served}


def run(files: int, threads: list[int], burns: list[int], rounds: int, disk_dir: Path,
        poll_us: int) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """{place: {side: [one measurement per round and thread count...]}}."""
    work = Path(tempfile.mkdtemp(prefix="clones-", dir=disk_dir))
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    shm = Path(tempfile.mkdtemp(prefix="clones-", dir="/dev/shm"))
    try:
        places = {"disk, cold": (work / "src", True), "tmpfs, warm": (shm / "src", False)}
        names = {}
        for place, (src, _) in places.items():
            names[place] = make_tree(src, files, 112 * 1024)
        mnt = work / "mnt"
        mnt.mkdir()
        sides = ["bare"] + [f"{w} proc, burn {b} us" for b in burns for w in (1, 2)]
        for rnd in range(rounds):
            for place, (src, cold) in places.items():
                out = results.setdefault(place, {})
                for side in sides:
                    for n in threads:
                        if side == "bare":
                            m = _measure(src, names[place], n, rnd, cold, [], None)
                            out.setdefault(f"{side} {n}", []).append(m)
                    if side == "bare":
                        continue
                    w, b = int(side.split()[0]), int(side.split()[-2])
                    with clonefs(src, mnt, work, w, b, poll_us) as (pids, shared):
                        for n in threads:
                            m = _measure(mnt, names[place], n, rnd, cold, pids, shared)
                            out.setdefault(f"{side} {n}", []).append(m)
            print(f"round {rnd + 1} of {rounds} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return results


def report(results: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    lines = []
    for place, sides in results.items():
        lines += [f"## {place}", "",
                  "| side | threads | files/s | x bare | CPU/file (us) | requests per process |",
                  "|---|---:|---:|---:|---:|---|"]
        for key, ms in sides.items():
            side, n = key.rsplit(" ", 1)
            rate = statistics.median(m["rate"] for m in ms)
            bare = statistics.median(m["rate"] for m in sides[f"bare {n}"])
            cpu = statistics.median(m["cpu_us"] for m in ms)
            served = ms[-1]["served"]
            total = sum(served) or 1
            share = " / ".join(f"{100 * s / total:.0f}%" for s in served) if served else ""
            lines.append(f"| {side} | {n} | {rate:,.0f} | {rate / bare:.2f} | "
                         f"{cpu:.0f} | {share} |")
        lines.append("")
    return "\n".join(lines)


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--files", type=int, default=2400, help="files of 112 KiB (2,400)")
    p.add_argument("--threads", default="1,4,16", help="reader threads (1,4,16)")
    p.add_argument("--burn-us", default="0,40", help="CPU spent per LOOKUP and OPEN (0,40)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--poll-us", type=int, default=50, help="busy polling, as qosfs's (50)")
    p.add_argument("--disk-dir", type=Path, default=Path("/var/tmp"),
                   help="where the disk tree goes (a disk, not tmpfs)")


def run_command(args: argparse.Namespace) -> int:
    results = run(args.files, [int(x) for x in args.threads.split(",")],
                  [int(x) for x in args.burn_us.split(",")], args.rounds, args.disk_dir,
                  args.poll_us)
    print(report(results))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.clones --serve SPEC``: one process of clonefs (the driver starts
    them); anything else: as ``python -m bench clones``."""
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--serve"]:
        _serve(json.loads(argv[1]))
        return 0
    p = argparse.ArgumentParser(prog="python -m bench clones")
    options(p)
    return run_command(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
