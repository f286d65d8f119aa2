"""Metadata: create / stat / open / unlink rates of many small files (meta.fio), native vs
qosfs (``--no-qos`` and the generous policy of :mod:`bench.suites.overhead`), and under a
``meta_iops`` cap.

Every timed operation is cold: meta.fio sleeps SETTLE s after fio's set-up (which stats
every file) so the kernel's 1 s entry/attribute cache has expired and every stat is a FUSE
LOOKUP, every create a negative LOOKUP + CREATE. Each FUSE metadata request costs one
``meta_iops`` token, so one file operation costs one to three: the capped side shows what
a cap does to each operation's rate. Whether the cap itself holds (admitted metadata
requests per second against ``meta_iops``) is measured with the other caps
(:mod:`bench.suites.caps`), over runs long enough for 1 s windows.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyfuse3
import trio

from bench.core.context import Run
from bench.core.plotting import bars, save
from bench.core.sides import (
    NATIVE,
    NO_QOS,
    POLICY,
    Group,
    Row,
    Runner,
    Side,
    SummaryRow,
    run_groups,
)
from bench.core.tables import (
    MACHINERY_MIN,
    Plots,
    Rows,
    ops,
    plot,
    policy_block,
    ratio,
    table,
    verdict,
)
from bench.core.typed import Json, Record
from qosfs.daemon.fs_assembly import build_filesystem
from qosfs.passthrough.backing_io import IoMode
from qosfs.passthrough.operations import FsOptions, PassthroughOperations
from qosfs.policy.loading import parse_policy
from qosfs.qos.engine import PolicyQos
from qosfs.qos.interface import PassThroughQos

# A second --no-qos mount: the same pass-through twice, so the report shows how far two
# identical mounts differ in one run (on a 2-vCPU VM, metadata rates of two identical
# mounts differed by up to 40% in interleaved runs, so a policy/no-qos ratio alone
# cannot resolve a 5% cost; the in-process figure, measure() below, can).
NO_QOS_AGAIN = Side("no-qos-2", no_qos=True)
META_CAP = 2000  # FUSE metadata requests/s: below every uncapped rate measured here
META_CAP_POLICY = f"""
[classes.default]
meta_iops = {META_CAP}
"""
SECTIONS = ("create", "stat", "open", "delete")
FIO_ENGINES = ("filecreate", "filestat", "filedelete")  # what meta.fio needs of fio


@dataclass(frozen=True, kw_only=True)
class HandlerCost(Record):
    no_qos_us: float
    policy_us: float
    added_us: float


@dataclass(frozen=True, kw_only=True)
class HandlerCosts(Record):
    """measure() below: handler microseconds per metadata operation."""

    files: int
    rounds: int
    ops: dict[str, HandlerCost]


@dataclass(frozen=True, kw_only=True)
class MetadataResult(Record):
    summary: list[SummaryRow]
    nrfiles: int
    meta_cap: int
    policy: str
    in_process: HandlerCosts | None = None
    caches_dropped: bool = False
    groups: Json = None


class MetaRunner(Runner):
    def _kind_meta(self, group: Group, dirs: dict[str, str]) -> None:
        create, *rest = group.rows
        # discarded warm-up on every side (see Runner._run_rows): create and unlink a few
        warm = {**group.env, "NRFILES": "500", "SETTLE": "0"}
        for side, top in self.sides(group, dirs):
            os.mkdir(os.path.join(top, "warm-up"))
            for section in ("create", "delete"):
                self.measure("meta.fio", os.path.join(top, "warm-up"), warm,
                             self.mounts.get(side.name), (f"--section={section}",))
            shutil.rmtree(os.path.join(top, "warm-up"), ignore_errors=True)
        for rep in range(self.run.repetitions(group.reps)):
            sub = f"meta-{rep}"
            for d in dirs.values():
                os.mkdir(os.path.join(d, sub))
            sides = self.sides(group, dirs)
            for side, top in sides:
                self.record(group, create, side, self.measure(
                    "meta.fio", os.path.join(top, sub), group.env, self.mounts.get(side.name),
                    ("--section=create",)))
            # stat, open and delete need files of `filesize`: lay them out (untimed) on the
            # native side and copy them over the empty ones create made (the mounts forget
            # the old ones when caches drop and SETTLE passes).
            self.layout("meta.fio", group.env, dirs["native"], sub, ("--section=stat",))
            for row, section in zip(rest, SECTIONS[1:], strict=False):
                for side, top in sides:
                    self.record(group, row, side, self.measure(
                        "meta.fio", os.path.join(top, sub), group.env,
                        self.mounts.get(side.name), (f"--section={section}",)))
            for d in dirs.values():
                shutil.rmtree(os.path.join(d, sub), ignore_errors=True)


# -- in process: what the QoS machinery adds to each metadata operation -----------------
#
# Through a mount, one metadata operation costs 50-250 us of round trips, wake-ups and
# syscalls, and on a 2-vCPU VM the rates of two *identical* mounts differ by up to 40% from
# one interleaved run to the next (the no-qos-2 side shows such a pair): a policy / no-qos
# ratio of mount rates cannot resolve a 5% cost. The machinery itself is deterministic
# Python, so measure() calls the filesystem's handlers directly, on the scratch tmpfs,
# with the engine of a mount without policy and with the generous policy of the overhead
# suite, alternately, and reports the handler time per operation on each side. What the
# policy adds, times the operation rate of a ``--no-qos`` mount, is the share of each
# operation's time the machinery takes (machinery_share). ``python -m bench machinery``
# prints it too.
#
# Each operation is the sequence of FUSE requests the kernel sends for it on a cold cache
# (``meta.fio``): create = lookup (negative) + create + release; stat = lookup; open =
# lookup + open + read + release (of an empty file); unlink = lookup + unlink.

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
        sides[side] = build_filesystem(fd, IoMode.INLINE, engine, FsOptions()).ops
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


def run(run: Run) -> MetadataResult:
    nrfiles = int(run.pick(5000, 2000))
    capped = Side("meta-cap", META_CAP_POLICY)
    group = Group("meta", "meta", [
        Row("create", f"create {nrfiles} files", "iops"),
        Row("stat", f"stat {nrfiles} files", "iops"),
        Row("open", f"open + read 4 KiB + close {nrfiles} files", "iops"),
        Row("unlink", f"unlink {nrfiles} files", "iops"),
    ], sides=(NATIVE, NO_QOS, NO_QOS_AGAIN, POLICY, capped), reps=3,
        env={"NRFILES": str(nrfiles), "SETTLE": "1.5"})
    result = run_groups(run, [group], MetaRunner)
    result["in_process"] = measure(run.scratch("machinery"), POLICY.policy or "").to_json()
    result.update(nrfiles=nrfiles, meta_cap=META_CAP, policy=META_CAP_POLICY.strip())
    return MetadataResult.from_json(result)


# -- its part of REPORT.md --


def headline(meta: MetadataResult) -> Rows:
    nat = {s.key: s.ratio_to_native.get("no-qos") for s in meta.summary}
    rows = [["metadata, no-qos / native (create, stat, open, unlink)",
             ", ".join(ratio(nat.get(k)) for k in ("create", "stat", "open", "unlink")),
             "—", ""]]
    mach = [s.machinery for s in meta.summary if s.machinery is not None]
    twins = [s.over("no-qos-2", "no-qos") for s in meta.summary]
    spread = max((abs(t - 1.0) for t in twins if t is not None), default=None)
    if mach:
        worst = min(mach)
        ok: bool | None = worst >= MACHINERY_MIN
        if not ok and spread is not None and spread > 1.0 - MACHINERY_MIN:
            ok = None  # two identical mounts differ by more than the margin
        rows.append(["QoS machinery on metadata, mount rates: policy (every request "
                     "charged to meta_iops) / no-qos, worst operation"
                     + (f" (two identical no-qos mounts differ by up to "
                        f"{100 * spread:.0f}%)" if spread is not None else ""),
                     ratio(worst), f"≥ {MACHINERY_MIN}",
                     verdict(ok) if ok is not None else "inconclusive"])
    share = machinery_share(meta)
    if share:
        worst_op = min(share, key=lambda k: share[k])
        rows.append(["QoS machinery on metadata, in-process: 1 − added handler time × "
                     f"no-qos rate, worst operation ({worst_op})", ratio(share[worst_op]),
                     f"≥ {MACHINERY_MIN}", verdict(share[worst_op] >= MACHINERY_MIN)])
    return rows


def machinery_share(r: MetadataResult) -> dict[str, float]:
    """Per operation: 1 - (what the policy adds in-process, measure()) x (the rate
    of the --no-qos mount), i.e. the policy / no-qos throughput that cost alone leaves."""
    rates = {s.key: s.side("no-qos") for s in r.summary}
    out = {}
    for op, fig in (r.in_process.ops if r.in_process else {}).items():
        rate = rates.get(op)
        if rate:
            out[op] = 1.0 - fig.added_us * 1e-6 * rate
    return out


def section(plots: Plots, r: MetadataResult) -> list[str]:
    rows = []
    share = machinery_share(r)
    for s in r.summary:
        rt = s.ratio_to_native
        rows.append([s.label, *(ops(s.side(k)) for k in ("native", "no-qos", "policy",
                                                          "meta-cap")),
                     ratio(rt.get("no-qos")), ratio(s.over("no-qos-2", "no-qos")),
                     ratio(s.machinery), ratio(share.get(s.key)),
                     ratio(s.over("meta-cap", "no-qos"))])
    inproc = r.in_process
    mrows = [[op, f"{f.no_qos_us:.1f} µs", f"{f.policy_us:.1f} µs",
              f"{f.added_us:+.1f} µs"] for op, f in (inproc.ops if inproc else {}).items()]
    return [
        "## 6. Metadata: create / stat / open / unlink", "",
        *plot(plots, "metadata", "metadata ops/s"),
        *table(["operation", "native", "no-qos", "policy", f"meta_iops={r.meta_cap}",
                 "no-qos / native", "no-qos again / no-qos", "policy / no-qos",
                 "policy / no-qos from in-process cost", "capped / no-qos"], rows), "",
        "`no-qos again`: a second `--no-qos` mount, the same pass-through: how far two "
        "identical mounts differ in this run. Where that is more than 5%, `policy / no-qos` "
        "of mount rates cannot show a 5% cost; `from in-process cost` can: the handler "
        "time the policy adds per operation (below) times the `--no-qos` rate.", "",
        *table(["operation (FUSE requests)", "no-qos", "policy", "added by the policy"],
               mrows), "",
        f"In-process (`bench/machinery.py`): the filesystem's handlers called directly on "
        f"the scratch tmpfs, {inproc.files if inproc else '?'} files per operation, median of "
        f"{inproc.rounds if inproc else '?'} alternating rounds; create = lookup + create + "
        "release, stat = lookup, open = lookup + open + read + release, unlink = lookup + "
        "unlink.", "",
        f"meta.fio, {r.nrfiles} files of 4 KiB, one job, each operation cold (fio sleeps "
        "1.5 s after its set-up so the kernel's 1 s attribute cache has expired). fio counts "
        "files per second; one file operation is one to three FUSE metadata requests "
        "(lookup, create, open, unlink...), each of which costs a `meta_iops` token, so "
        "the capped column shows what a cap means per operation (short runs: the bucket's "
        "burst, 100 ms of the cap, adds to it). Whether the cap holds is in §2 "
        "(`meta_iops` rows).", "",
        *policy_block(r.policy),
    ]


def chart(plt: Any, r: MetadataResult, out: Path, name: str) -> str:
    rows = r.summary
    sides = ("native", "no-qos", "policy", "meta-cap")
    fig, ax = plt.subplots(figsize=(8, 4))
    bars(ax, [s.key for s in rows], {
        side: [s.side(side) for s in rows] for side in sides},
        "files/s")
    ax.set_yscale("log")
    ax.set_title("Metadata operations")
    return save(plt, fig, out, name)
