"""What the QoS machinery adds to each metadata operation, measured in-process.

Through a mount, one metadata operation costs 50-250 us of round trips, wake-ups and
syscalls, and on a 2-vCPU VM the rates of two *identical* mounts differ by up to 40% from
one interleaved run to the next (bench.metadata shows such a pair): a policy / no-qos
ratio of mount rates cannot resolve a 5% cost. The machinery itself is deterministic
Python, so this module calls the filesystem's handlers directly, on the scratch tmpfs,
with the engine of a mount without policy and with the generous policy of the overhead
suite, alternately, and reports the handler time per operation on each side. What the
policy adds, times the operation rate of a ``--no-qos`` mount, is the share of each
operation's time the machinery takes.

Each operation is the sequence of FUSE requests the kernel sends for it on a cold cache
(bench.metadata's ``meta.fio``): create = lookup (negative) + create + release; stat =
lookup; open = lookup + open + read + release (of an empty file); unlink = lookup +
unlink.

``read``/``write`` below are the data path's own handlers: a 4 KiB read and a 4 KiB write
at offset 0 of one open file, so a change to the handlers themselves (not the engine)
can be compared to the one before.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyfuse3
import trio

from bench.figures import HandlerCost, HandlerCosts
from qosfs.daemon.filesystem import build_filesystem
from qosfs.passthrough.backing_io import IoMode
from qosfs.passthrough.operations import FsOptions, PassthroughOperations
from qosfs.policy.loading import parse_policy
from qosfs.qos.engine import PolicyQos
from qosfs.qos.interface import PassThroughQos

OPERATIONS = ("create", "stat", "open", "unlink")
FILES = 1000  # per operation and round: a quarter of the daemon's usual fd headroom
ROUNDS = 7


async def _round(fs: PassthroughOperations, top: Path, name: str) -> dict[str, float]:
    """One pass of every operation over FILES files; microseconds per operation."""
    ctx = SimpleNamespace(uid=0, gid=0, pid=os.getpid(), umask=0o022)
    os.mkdir(top / name)
    parent = (await fs.lookup(pyfuse3.ROOT_INODE, name.encode(), ctx)).st_ino
    names = [f"f{i}".encode() for i in range(FILES)]
    took: dict[str, float] = {}

    t = time.perf_counter()
    for n in names:
        await fs.lookup(parent, n, ctx)  # negative: the kernel asks before it creates
        info, entry = await fs.create(parent, n, 0o644, os.O_WRONLY | os.O_CREAT, ctx)
        await fs.release(info.fh)
        await fs.forget([(entry.st_ino, 1)])
    took["create"] = time.perf_counter() - t

    t = time.perf_counter()
    for n in names:
        entry = await fs.lookup(parent, n, ctx)
        await fs.forget([(entry.st_ino, 1)])
    took["stat"] = time.perf_counter() - t

    t = time.perf_counter()
    for n in names:
        entry = await fs.lookup(parent, n, ctx)
        info = await fs.open(entry.st_ino, os.O_RDONLY, ctx)
        await fs.read(info.fh, 0, 4096)
        await fs.release(info.fh)
        await fs.forget([(entry.st_ino, 1)])
    took["open"] = time.perf_counter() - t

    t = time.perf_counter()
    for n in names:
        entry = await fs.lookup(parent, n, ctx)
        await fs.unlink(parent, n, ctx)
        await fs.forget([(entry.st_ino, 1)])
    took["unlink"] = time.perf_counter() - t

    await fs.forget([(parent, 1)])
    os.rmdir(top / name)
    return {op: 1e6 * s / FILES for op, s in took.items()}


def measure(scratch: Path, policy_text: str) -> HandlerCosts:
    """Median handler microseconds per operation without and with *policy_text*."""
    sides: dict[str, PassthroughOperations] = {}
    fds = []
    for side, engine in (("no-qos", PassThroughQos()),
                         ("policy", PolicyQos(parse_policy(policy_text)))):
        top = scratch / side
        top.mkdir()
        fd = os.open(top, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        fds.append(fd)
        sides[side] = build_filesystem(fd, IoMode.INLINE, engine, FsOptions())
    samples: dict[str, dict[str, list[float]]] = {s: {op: [] for op in OPERATIONS}
                                                  for s in sides}

    async def main() -> None:
        for r in range(ROUNDS + 1):  # the first round of each side warms up, discarded
            order = list(sides.items())
            for side, fs in order if r % 2 else reversed(order):
                us = await _round(fs, scratch / side, f"r{r}")
                if r:
                    for op in OPERATIONS:
                        samples[side][op].append(us[op])

    try:
        trio.run(main)
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(scratch / "no-qos", ignore_errors=True)
        shutil.rmtree(scratch / "policy", ignore_errors=True)
    costs = {}
    for op in OPERATIONS:
        base = statistics.median(samples["no-qos"][op])
        pol = statistics.median(samples["policy"][op])
        costs[op] = HandlerCost(no_qos_us=round(base, 2), policy_us=round(pol, 2),
                                added_us=round(pol - base, 2))
    return HandlerCosts(files=FILES, rounds=ROUNDS, ops=costs)


# -- admission: what every read, write and metadata request pays on the fast path ------

ADMISSION_POLICY = """
[backend]
read_bandwidth = "1000GiB/s"
write_bandwidth = "1000GiB/s"
read_iops = 1000000000
write_iops = 1000000000
meta_iops = 1000000000

[tenants.all]
uids = [0]
read_bandwidth = "1000GiB/s"
write_bandwidth = "1000GiB/s"

[classes.data]
paths = ["data/**"]
read_bandwidth = "1000GiB/s"
write_bandwidth = "1000GiB/s"
read_iops = 1000000000
write_iops = 1000000000
meta_iops = 1000000000
"""
ADMISSIONS = 200_000  # per figure and round
ADMISSION_ROUNDS = 5


class _PathBook:
    """The PathSource an engine reads (the filesystem's PathBook, without a filesystem)."""

    epoch = 0

    def relpath_until(self, node: Any) -> tuple[str, float]:
        return str(node.path), time.monotonic() + 3600.0


def admission(cluster: bool = False) -> dict[str, float]:
    """Nanoseconds per admission (median of rounds) of a 4 KiB read, a 1 MiB write and a
    metadata operation, charged at a class, a tenant and a declared backend that all
    limit them far above demand: every bucket is looked at, nothing waits. This is the
    cost the engine adds to each request on the fast path, in-process and without the
    filesystem around it, so a change to the engine can be compared to the one before."""
    text = ADMISSION_POLICY
    factory: Any = None
    if cluster:  # the same class, scope = "cluster" (grants never renewed: no Redis here)
        from qosfs.qos.cluster import ClusterCoordinator

        text = ('[cluster]\nredis = "unix:///nonexistent"\n' + text).replace(
            '[classes.data]\n', '[classes.data]\nscope = "cluster"\n')
        policy = parse_policy(text)
        assert policy.cluster is not None
        factory = ClusterCoordinator(policy.cluster, "bench")
    policy = parse_policy(text)
    qos = PolicyQos(policy) if factory is None else PolicyQos(policy, level_factory=factory)
    paths, node = _PathBook(), SimpleNamespace(path="data/x", qos_memo=None)
    ctx = SimpleNamespace(uid=0, gid=0, pid=os.getpid())
    out: dict[str, float] = {}

    async def main() -> None:
        flow = qos.open_flow(paths, node, ctx, False)
        cases = (("read 4 KiB", lambda: flow.admit_read(4096)),
                 ("write 1 MiB", lambda: flow.admit_write(1 << 20)),
                 ("metadata", lambda: qos.admit_meta(paths, node, ctx)))
        for name, admit in cases:
            runs = []
            for _ in range(ADMISSION_ROUNDS):
                start = time.perf_counter_ns()
                for _ in range(ADMISSIONS):
                    await admit()
                runs.append((time.perf_counter_ns() - start) / ADMISSIONS)
            out[name] = round(statistics.median(runs))

    trio.run(main)
    return out


# -- the data path's handlers: what read() and write() cost around the syscall --------

IO_CALLS = 50_000  # per figure and round
IO_ROUNDS = 5


def io_handlers(scratch: Path, policy_text: str) -> dict[str, dict[str, float]]:
    """Nanoseconds per call (median of rounds) of ``read`` and ``write`` of 4 KiB at
    offset 0 of one open file on *scratch*, without a policy and with *policy_text*:
    the handler, admission (fast path) and the backing ``pread``/``pwrite`` inline."""
    out: dict[str, dict[str, float]] = {"read 4 KiB": {}, "write 4 KiB": {}}
    ctx = SimpleNamespace(uid=0, gid=0, pid=os.getpid(), umask=0o022)
    block = b"x" * 4096
    for side, engine in (("no-qos", PassThroughQos()),
                         ("policy", PolicyQos(parse_policy(policy_text)))):
        top = scratch / f"io-{side}"
        top.mkdir()
        fd = os.open(top, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        fs = build_filesystem(fd, IoMode.INLINE, engine, FsOptions())

        async def main(fs: PassthroughOperations = fs, side: str = side) -> None:
            info, entry = await fs.create(pyfuse3.ROOT_INODE, b"f", 0o644,
                                          os.O_RDWR | os.O_CREAT, ctx)
            await fs.write(info.fh, 0, block)
            for name, call in (("read 4 KiB", lambda: fs.read(info.fh, 0, 4096)),
                               ("write 4 KiB", lambda: fs.write(info.fh, 0, block))):
                runs = []
                for _ in range(IO_ROUNDS):
                    start = time.perf_counter_ns()
                    for _ in range(IO_CALLS):
                        await call()
                    runs.append((time.perf_counter_ns() - start) / IO_CALLS)
                out[name][side] = round(statistics.median(runs))
            await fs.release(info.fh)
            await fs.forget([(entry.st_ino, 1)])

        try:
            trio.run(main)
        finally:
            fs.close_all()
            os.close(fd)
            shutil.rmtree(top, ignore_errors=True)
    return out


def run() -> int:
    """``python -m bench machinery``: the per-request costs above, printed."""
    import tempfile

    print("admission, fast path (class + tenant + backend, all limited, none waiting), ns:")
    local, shared = admission(), admission(cluster=True)
    print(f"  {'':12s} {'node':>6s} {'cluster':>8s}   (the class's scope)")
    for name, ns in local.items():
        print(f"  {name:12s} {ns:6.0f} {shared[name]:8.0f}")
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=base) as scratch:
        from bench.overhead import GENEROUS_POLICY

        handlers = measure(Path(scratch), GENEROUS_POLICY)
        io = io_handlers(Path(scratch), GENEROUS_POLICY)
    print(f"metadata handlers ({FILES} files x {ROUNDS} rounds, us per operation):")
    print(f"  {'':8s} {'no-qos':>8s} {'policy':>8s} {'added':>8s}")
    for op, row in handlers.ops.items():
        print(f"  {op:8s} {row.no_qos_us:8.2f} {row.policy_us:8.2f} {row.added_us:8.2f}")
    print(f"data handlers ({IO_CALLS} calls x {IO_ROUNDS} rounds, ns per call, syscall "
          "included):")
    print(f"  {'':12s} {'no-qos':>8s} {'policy':>8s}")
    for name, row in io.items():
        print(f"  {name:12s} {row['no-qos']:8.0f} {row['policy']:8.0f}")
    return 0
