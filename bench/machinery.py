"""``python -m bench machinery``: what the QoS machinery costs per request, measured
in-process (no mount; about a minute).

* admission: the engine's fast path for a read, a write and a metadata request, with a
  class, a tenant and a backend all limited and none waiting, node and cluster scope;
* the metadata handlers, without and with a policy: :func:`bench.suites.metadata.measure`,
  the in-process figure the metadata suite reports;
* ``read``/``write``: the data path's own handlers, a 4 KiB read and a 4 KiB write at
  offset 0 of one open file, so a change to the handlers themselves (not the engine) can
  be compared to the one before.
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

from bench.core.sides import GENEROUS_POLICY
from bench.suites.metadata import FILES, ROUNDS, measure
from qosfs.daemon.fs_assembly import build_filesystem
from qosfs.passthrough.backing_io import IoMode
from qosfs.passthrough.operations import FsOptions, PassthroughOperations
from qosfs.policy.loading import parse_policy
from qosfs.qos.engine import PolicyQos
from qosfs.qos.interface import PassThroughQos

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
        whole = build_filesystem(fd, IoMode.INLINE, engine, FsOptions())

        async def main(fs: PassthroughOperations = whole.ops, side: str = side) -> None:
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
            whole.close_all()
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
