"""A peer in the bench: libfuse's own ``passthrough_hp`` beside native and qosfs.

qosfs is a FUSE daemon in Python; the question a reader asks is how far it is from what a
FUSE daemon can do on this machine, not only from the directory itself. libfuse ships
one: ``passthrough_hp``, its C++ "high-performance" example, built here from the same
source package as the libfuse the project links pyfuse3 to (``deploy/libfuse/build.sh``,
``make passthrough-hp``). It is measured in the same run, over the same files, as:

* ``hp-single``: one thread (``--single``), kernel passthrough off (``--nopassthrough``):
  a compiled daemon that serves every request, like qosfs's one Python thread;
* ``hp-multi``: libfuse's worker threads (its default), passthrough off;
* ``hp-passthrough``: one thread with kernel passthrough (its default): reads of an
  open file go from the kernel to the backing file, opens and lookups still reach it.

qosfs runs ``--no-qos`` and with the embedded default policy, the files under ``data/``
so the policy classifies them as ``datasets``. When ``ctl status`` has a ``passthrough``
entry (qosfs passing a class's reads to the kernel), it is recorded as it is.

Two tables (issue 30's):

* tmpfs: fio psync, O_DIRECT so that the page cache answers no read and each one takes
  the column's path: 4 KiB random reads at QD1 and with 4 jobs (IOPS), 128 KiB random
  reads at QD1 and 1 MiB sequential reads (MB/s), on one file; then the small-file loader
  (:func:`bench.core.epochs.epoch`: 4 processes open, read whole and close 4,000 files of
  128 KiB), ``cold`` = the first pass after the daemon started and caches were dropped,
  ``warm`` = the pass after it (files/s).
* disk (the run's disk area, ext4 on the VM's disk here): the loader with 2 processes
  over 6,000 files of 112 KiB, page cache dropped before the cold pass.

Each column is mounted fresh, measured once, unmounted; a column that fails is recorded
with its one-line reason and the others go on. Without passthrough_hp (no libfuse source
build), its columns say why in one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.core.context import Run
from bench.core.epochs import epoch, make_samples
from bench.core.fio import FioError, FioMetrics, parse_fio_json
from bench.core.libfuse_peer import PEER_OPTIONS, build_peer, peer_mount, refused_passthrough
from bench.core.system import (
    REPO,
    BenchError,
    cpu_seconds,
    describe_disk,
    drop_caches,
    wait_quiet,
)
from bench.core.tables import Plots, Rows, pct, ratio, table, verdict
from bench.core.typed import Json, Record
from qosfs.control.ctl import Client, checked

MiB = 1 << 20
TMPFS_FILES, TMPFS_KIB, TMPFS_WORKERS = 4000, 128, 4
DISK_FILES, DISK_KIB, DISK_WORKERS = 6000, 112, 2
# The daemon used less CPU than this share of the QD1 job's time: its reads did not reach it.
PASSED_THROUGH_CPU = 0.05
FIO_JOB = "randread_4k_qd1_iops"


# Columns of the two tables, in order; the workloads (rows) in order, with their units.
PEER_TMPFS_COLUMNS = ("native", "hp-single", "hp-multi", "hp-passthrough", "no-qos",
                      "policy")


PEER_DISK_COLUMNS = ("native", "hp-single", "hp-passthrough", "policy")


PEER_FIO = ("randread_4k_qd1_iops", "randread_4k_4jobs_iops", "randread_128k_qd1_mb_s",
            "read_1m_direct_mb_s")


PEER_LOADER = ("loader_cold_files_s", "loader_warm_files_s")


@dataclass(frozen=True, kw_only=True)
class PeerResult(Record):
    """bench.peer: each column's figure per workload (``tmpfs``: PEER_FIO and PEER_LOADER;
    ``disk``: PEER_LOADER); a column or workload that could not run is absent, with its
    one-line reason in ``errors``."""

    seconds: int  # fio runtime per job
    tmpfs_files: int
    tmpfs_file_kib: int
    tmpfs_workers: int
    disk_files: int
    disk_file_kib: int
    disk_workers: int
    disk: str | None  # what the disk table ran on ("ext4 on /dev/vda, /var/tmp"), or None
    peer: str | None  # the passthrough_hp binary measured, or None
    peer_missing: str | None  # why passthrough_hp was not measured (one line)
    peer_passthrough: bool | None  # its kernel passthrough column really passed through
    tmpfs: dict[str, dict[str, float]]  # column -> workload -> figure
    disk_figures: dict[str, dict[str, float]]
    errors: dict[str, str]  # "<table> <column>" -> one line
    # how busy the machine was just before each column ran, nothing of the suite's running
    # (other tenants; 100 = every CPU), per table
    busy_pct: dict[str, dict[str, float]] = field(default_factory=dict)
    qosfs_passthrough: Json = None  # `ctl status`'s "passthrough" entry, when it has one


def fio_read(fio: str, path: Path, rw: str, bs: str, jobs: int, seconds: int) -> FioMetrics:
    """One fio psync O_DIRECT read job on *path*, time based."""
    cmd = [fio, "--name=peer", f"--filename={path}", f"--rw={rw}", f"--bs={bs}",
           f"--numjobs={jobs}", "--direct=1", "--ioengine=psync", "--time_based",
           f"--runtime={seconds}", "--norandommap", "--randrepeat=0", "--group_reporting",
           "--output-format=json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise FioError(f"fio {rw} {bs} on {path}: {lines[-1] if lines else proc.returncode}")
    return parse_fio_json(json.loads(proc.stdout[proc.stdout.find("{"):]))


def fio_figures(run: Run, path: Path, pid: int | None) -> tuple[dict[str, float], float | None]:
    """The four fio figures of one column, and the share of the QD1 job's time the
    daemon *pid* spent on CPU (None for native)."""
    seconds = int(run.pick(8, 3))
    out: dict[str, float] = {}
    cpu0 = cpu_seconds(pid) if pid else None
    start = time.monotonic()
    out[FIO_JOB] = fio_read(run.fio, path, "randread", "4k", 1, seconds).iops
    cpu1 = cpu_seconds(pid) if pid else None
    busy = None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) / (time.monotonic() - start)
    out["randread_4k_4jobs_iops"] = fio_read(run.fio, path, "randread", "4k", 4, seconds).iops
    out["randread_128k_qd1_mb_s"] = fio_read(
        run.fio, path, "randread", "128k", 1, seconds).bw_bytes / 1e6
    out["read_1m_direct_mb_s"] = fio_read(run.fio, path, "read", "1m", 1, seconds).bw_bytes / 1e6
    return out, busy


def loader_figures(root: Path, names: list[str], workers: int) -> dict[str, float]:
    """Cold (the caller dropped caches after mounting) and warm passes, files/s."""
    cold = epoch(root, names, seed=1, workers=workers)["samples_per_s"]
    warm = epoch(root, names, seed=2, workers=workers)["samples_per_s"]
    return {"loader_cold_files_s": cold, "loader_warm_files_s": warm}


def _passthrough_entry(sock: str) -> Any:
    """``ctl status``'s ``passthrough`` entry, None when the daemon has none."""
    with Client(sock) as client:
        return checked(client.request({"cmd": "status"})).get("passthrough")


class _Columns:
    """Mounts one column at a time over a source and measures it (see the module
    docstring); records what each column gave or why it did not."""

    def __init__(self, run: Run, peer: str | None, peer_missing: str | None) -> None:
        self.run, self.peer, self.peer_missing = run, peer, peer_missing
        self.errors: dict[str, str] = {}
        self.passthrough: dict[str, Any] = {}
        self.peer_busy: float | None = None
        self.peer_refused = False
        self.busy: dict[str, dict[str, float]] = {}

    @contextmanager
    def root(self, column: str, source: Path) -> Iterator[tuple[Path, int | None, str | None]]:
        """(where to read, the daemon's pid, qosfs's control socket) for *column*."""
        if column == "native":
            yield source, None, None
            return
        if column.startswith("hp-"):
            if self.peer is None:
                raise BenchError(f"passthrough_hp not measured: {self.peer_missing}")
            log = self.run.work / f"peer-{column}-{time.monotonic_ns()}.log"
            mnt = self.run.work / f"peer-mnt-{column}"
            try:
                with peer_mount(str(REPO / self.peer), source, mnt, PEER_OPTIONS[column],
                                log) as pid:
                    yield mnt, pid, None
            finally:
                if refused_passthrough(log):
                    self.peer_refused = True
            return
        with self.run.mount(source, no_qos=column == "no-qos") as mounted:
            yield mounted.path, mounted.mount.pid, mounted.socket

    def measure(self, table: str, column: str, source: Path, names: list[str],
                workers: int, fio_file: Path | None) -> dict[str, float]:
        figures: dict[str, float] = {}
        try:
            with self.root(column, source) as (root, pid, sock):
                # the machine's busy share with nothing of ours running (other tenants):
                # on a shared machine, read a column's ratio with it
                _, busy = wait_quiet(self.run.quiet_wait)
                self.busy.setdefault(table, {})[column] = busy
                drop_caches()
                figures.update(loader_figures(root, names, workers))
                if fio_file is not None:
                    fio, busy = fio_figures(self.run, root / fio_file, pid)
                    figures.update(fio)
                    if column == "hp-passthrough":
                        self.peer_busy = busy
                if sock is not None:
                    entry = _passthrough_entry(sock)
                    if entry is not None:
                        self.passthrough[f"{table} {column}"] = entry
        except (BenchError, FioError, OSError, subprocess.SubprocessError) as exc:
            self.errors[f"{table} {column}"] = str(exc).strip().splitlines()[0]
        self.run.log(f"  peer {table} {column}: " + ", ".join(
            f"{k} {v:,.0f}" for k, v in figures.items()))
        return figures


def run(run: Run) -> PeerResult:
    peer, missing = build_peer()
    run.log(f"  peer: passthrough_hp {peer or 'not built: ' + str(missing)}")
    columns = _Columns(run, peer, missing)

    src = run.scratch("peer")
    names = make_samples(src, TMPFS_FILES, kib=TMPFS_KIB)
    fio_file = Path("data") / "fio.bin"
    size = int(run.pick(1024, 256))
    with open(src / fio_file, "wb") as f:
        block = os.urandom(MiB)
        for _ in range(size):
            f.write(block)
    tmpfs = {c: columns.measure("tmpfs", c, src, names, TMPFS_WORKERS, fio_file)
             for c in PEER_TMPFS_COLUMNS}

    disk_figures: dict[str, dict[str, float]] = {}
    disk = None
    if run.disk is None:
        columns.errors["disk"] = "no disk area in this run (--disk-dir '')"
    else:
        dsrc = run.scratch("peer", "disk")
        disk = describe_disk(dsrc)
        dnames = make_samples(dsrc, DISK_FILES, kib=DISK_KIB)
        os.sync()
        disk_figures = {c: columns.measure("disk", c, dsrc, dnames, DISK_WORKERS, None)
                        for c in PEER_DISK_COLUMNS}

    passed = None
    if peer is not None and columns.peer_busy is not None:
        passed = not columns.peer_refused and columns.peer_busy < PASSED_THROUGH_CPU
    return PeerResult(
        seconds=int(run.pick(8, 3)), tmpfs_files=TMPFS_FILES, tmpfs_file_kib=TMPFS_KIB,
        tmpfs_workers=TMPFS_WORKERS, disk_files=DISK_FILES, disk_file_kib=DISK_KIB,
        disk_workers=DISK_WORKERS, disk=disk, peer=peer, peer_missing=missing,
        peer_passthrough=passed,
        tmpfs={c: f for c, f in tmpfs.items() if f},
        disk_figures={c: f for c, f in disk_figures.items() if f},
        errors=columns.errors, busy_pct=columns.busy, qosfs_passthrough=columns.passthrough or None)


# -- its part of REPORT.md --


PEER_NATIVE_MIN = 0.8  # issue 30: the passthrough class reaches 0.8x native on tmpfs


def headline(r: PeerResult) -> Rows:
    """qosfs against native and against libfuse's single-threaded passthrough_hp."""
    qd1 = peer_ratio(r.tmpfs, "randread_4k_qd1_iops", "policy")
    rows = [["peer (tmpfs): qosfs default policy / native, 4 KiB random read QD1",
             ratio(qd1), f"≥ {PEER_NATIVE_MIN}",
             verdict(None if qd1 is None else qd1 >= PEER_NATIVE_MIN)]]
    for where, figures in (("tmpfs", r.tmpfs), ("disk", r.disk_figures)):
        cold = peer_ratio(figures, "loader_cold_files_s", "policy", "hp-single")
        rows.append([f"peer ({where}): qosfs default policy / passthrough_hp 1 thread, "
                     "small-file loader cold", ratio(cold), "≥ 1",
                     verdict(None if cold is None else cold >= 1.0)])
    return rows


PEER_COLUMNS = {"native": "native", "hp-single": "passthrough_hp 1 thread",
                "hp-multi": "passthrough_hp, libfuse's threads",
                "hp-passthrough": "passthrough_hp 1 thread, kernel passthrough",
                "no-qos": "qosfs --no-qos", "policy": "qosfs default policy (datasets)"}


PEER_ROWS = {"randread_4k_qd1_iops": "4 KiB random read, QD1 (IOPS)",
             "randread_4k_4jobs_iops": "4 KiB random read, 4 jobs (IOPS)",
             "randread_128k_qd1_mb_s": "128 KiB random read, QD1 (MB/s)",
             "read_1m_direct_mb_s": "1 MiB sequential O_DIRECT (MB/s)",
             "loader_cold_files_s": "small-file loader, cold (files/s)",
             "loader_warm_files_s": "small-file loader, warm (files/s)"}


def peer_ratio(table: dict[str, dict[str, float]], key: str, column: str,
               base: str = "native") -> float | None:
    """*column*'s figure for *key* over *base*'s, when both were measured."""
    got, of = table.get(column, {}).get(key), table.get(base, {}).get(key)
    return got / of if got is not None and of else None


def _peer_figure(key: str, v: float) -> str:
    if key.endswith("_mb_s"):
        return f"{v:,.0f}"
    return f"{v / 1e3:,.0f}k" if v >= 1e5 else f"{v / 1e3:.1f}k" if v >= 1e4 else f"{v:,.0f}"


def _peer_table(figures: dict[str, dict[str, float]], columns: tuple[str, ...],
                keys: tuple[str, ...], base_label: str, busy: dict[str, float]) -> list[str]:
    rows = []
    for key in keys:
        cells = [PEER_ROWS[key]]
        for column in columns:
            v = figures.get(column, {}).get(key)
            r = peer_ratio(figures, key, column)
            cells.append("—" if v is None else _peer_figure(key, v) if column == "native"
                         or r is None else f"{_peer_figure(key, v)} ({r:.2f}×)")
        rows.append(cells)
    if busy:
        rows.append(["machine busy before the column (other tenants)"] +
                    [pct(busy.get(c), signed=False) for c in columns])
    header = ["workload", *(base_label if c == "native" else PEER_COLUMNS[c] for c in columns)]
    return table(header, rows)


def section(plots: Plots, r: PeerResult) -> list[str]:
    notes = []
    if r.peer is None:
        notes.append(f"passthrough_hp was not measured: {r.peer_missing}.")
    elif r.peer_passthrough is not None:
        notes.append("passthrough_hp's kernel passthrough column: "
                     + ("its daemon served no reads (passed through)." if r.peer_passthrough
                        else "its reads still reached the daemon (passthrough refused or "
                        "not negotiated)."))
    notes += [f"Not measured, {where}: {why}." for where, why in r.errors.items()]
    if r.qosfs_passthrough is None:
        notes.append("qosfs's `ctl status` has no `passthrough` entry: every qosfs read "
                     "went through the daemon.")
    else:
        notes += [f"qosfs `ctl status` passthrough, {where}: `{json.dumps(entry)}`"
                  for where, entry in sorted(r.qosfs_passthrough.items())]
    return [
        "## A peer: libfuse's passthrough_hp beside native and qosfs", "",
        f"tmpfs source; fio psync, O_DIRECT, {r.seconds} s per job, on one file under "
        f"`data/`; small-file loader: {r.tmpfs_workers} processes reading "
        f"{r.tmpfs_files:,} × {r.tmpfs_file_kib} KiB files. In brackets: the ratio to "
        "native.", "",
        *_peer_table(r.tmpfs, PEER_TMPFS_COLUMNS, PEER_FIO + PEER_LOADER, "native",
                     r.busy_pct.get("tmpfs", {})), "",
        f"Disk ({r.disk or 'no disk area'}; the run's --disk-dir): {r.disk_files:,} × "
        f"{r.disk_file_kib} KiB files, {r.disk_workers} reader processes, page cache "
        "dropped before the cold pass. In brackets: the ratio to bare.", "",
        *_peer_table(r.disk_figures, PEER_DISK_COLUMNS, PEER_LOADER, "bare",
                     r.busy_pct.get("disk", {})), "",
        "Each column is mounted fresh over the same files and measured once, after waiting "
        "(up to --quiet-wait s) for the machine to be idle; \"machine busy\" is every "
        "CPU's busy share over the last 0.25 s of that wait (100% = all CPUs), nothing of "
        "the suite's running: a column that ran while other tenants were busy shows it. "
        "`cold`: the "
        "first pass after the daemon started and caches were dropped; `warm`: the next. "
        f"passthrough_hp ({r.peer or 'not built'}) is libfuse's C++ example, built from "
        "the same source as the library pyfuse3 is linked to (`make passthrough-hp`); "
        "without kernel passthrough it runs `--nopassthrough`.", "",
        *(f"- {n}" for n in notes), "",
    ]
