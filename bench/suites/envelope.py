"""Envelope: what one mount carries, for docs/performance.md's table (and the floor under it).

Through the embedded default policy, ``--no-qos`` and, as the floor, a pyfuse3
filesystem that answers without doing anything (one 1 GiB file of zeros, the same
pyfuse3 main loop as qosfs): 4 KiB random reads at queue depth 1 and with 4 jobs,
1 MiB direct reads with 2 jobs, and cold create / stat / unlink (meta.fio). What the
floor cannot beat, qosfs cannot either: the difference is what qosfs's handlers cost.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.core.context import Run
from bench.core.fio import JOBS_DIR, run_job
from bench.core.system import unmount
from bench.core.tables import Plots, Rows, table
from bench.core.typed import Record

MiB = 1 << 20
SIDES = ("policy", "no-qos", "null")

# The floor: pyfuse3 with handlers that do nothing but answer.
NULL_FS = r'''
import errno, stat, sys
import pyfuse3, trio
SIZE, ZERO = 1 << 30, bytes(1 << 20)
class Null(pyfuse3.Operations):
    def _attr(self, ino):
        e = pyfuse3.EntryAttributes()
        e.st_ino, e.entry_timeout, e.attr_timeout, e.st_blksize = ino, 1.0, 1.0, 4096
        if ino == pyfuse3.ROOT_INODE:
            e.st_mode, e.st_nlink = stat.S_IFDIR | 0o755, 2
        else:
            e.st_mode, e.st_nlink, e.st_size = stat.S_IFREG | 0o644, 1, SIZE
        return e
    async def getattr(self, ino, ctx=None):
        return self._attr(ino)
    async def lookup(self, parent, name, ctx=None):
        if name != b"f":
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(2)
    async def open(self, ino, flags, ctx):
        return pyfuse3.FileInfo(fh=ino)
    async def read(self, fh, off, size):
        return ZERO[:size]
    async def release(self, fh):
        pass
pyfuse3.init(Null(), sys.argv[1], set(pyfuse3.default_options) | {"fsname=nullfs"})
try:
    trio.run(pyfuse3.main, 4, 4096)
finally:
    pyfuse3.close()
'''


@dataclass(frozen=True, kw_only=True)
class EnvelopeResult(Record):
    seconds: int
    files: int
    reps: int
    summary: dict[str, dict[str, list[float]]]  # side -> figure -> one per repetition


def _fio(fio: str, args: list[str]) -> dict[str, Any]:
    out = subprocess.run([fio, "--output-format=json", *args], capture_output=True,
                         text=True, check=True, timeout=120)
    job: dict[str, Any] = json.loads(out.stdout)["jobs"][0]
    return job


def _reads(fio: str, path: Path, seconds: int) -> dict[str, float]:
    common = [f"--filename={path}", "--direct=1", "--ioengine=psync", "--time_based",
              f"--runtime={seconds}", "--group_reporting"]
    out = {}
    for jobs in (1, 4):
        job = _fio(fio, ["--name=r", "--rw=randread", "--bs=4k", f"--numjobs={jobs}", *common])
        out[f"randread_4k_{jobs}job_iops"] = job["read"]["iops"]
    job = _fio(fio, ["--name=s", "--rw=read", "--bs=1m", "--numjobs=2", *common])
    out["read_1m_2job_gb_per_s"] = job["read"]["bw_bytes"] / 1e9
    return out


def _meta(fio: str, top: Path, files: int) -> dict[str, float]:
    out = {}
    (top / "meta").mkdir()
    for section in ("create", "stat", "delete"):
        metrics, _, _ = run_job(fio, JOBS_DIR / "meta.fio", str(top / "meta"),
                                {"NRFILES": str(files), "SETTLE": "1.5"},
                                (f"--section={section}",))
        assert metrics is not None
        out[f"{section}_per_s"] = metrics.iops
    (top / "meta").rmdir()
    return out


def _null(run: Run, seconds: int) -> dict[str, float]:
    mnt = run.work / "null-mnt"
    mnt.mkdir(exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", NULL_FS, str(mnt)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not (mnt / "f").exists():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the do-nothing pyfuse3 filesystem did not mount")
            time.sleep(0.1)
        return _reads(run.fio, mnt / "f", seconds)
    finally:
        unmount(mnt)
        proc.wait(timeout=10)


def run(run: Run) -> EnvelopeResult:
    seconds = int(run.pick(5, 3))
    files = int(run.pick(5000, 2000))
    src = run.scratch("envelope")
    (src / "data").mkdir()
    with open(src / "data" / "file.bin", "wb") as f:
        block = bytes(MiB)
        for _ in range(1024):
            f.write(block)
    reps = run.repetitions(2, 1)
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    for rep in range(reps):
        for side in SIDES:
            if side == "null":
                runs[side].append(_null(run, seconds))
                continue
            with run.mount(src, no_qos=side == "no-qos") as mounted:
                figures = _reads(run.fio, mounted.path / "data" / "file.bin", seconds)
                figures.update(_meta(run.fio, mounted.path, files))
            runs[side].append(figures)
            run.log(f"  envelope {side} rep {rep}: " + ", ".join(
                f"{k} {v:,.1f}" for k, v in figures.items()))
    summary = {side: {key: [r[key] for r in rs] for key in rs[0]} for side, rs in runs.items()}
    return EnvelopeResult.from_json({"seconds": seconds, "files": files, "reps": reps,
                                     "summary": summary})


# -- its part of REPORT.md --


def headline(r: EnvelopeResult) -> Rows:
    """None: what one mount carries is a capacity figure, not a guarantee."""
    return []


def section(plots: Plots, r: EnvelopeResult) -> list[str]:
    sm = r.summary
    labels = {"randread_4k_1job_iops": "4 KiB random reads, QD1 (IOPS)",
              "randread_4k_4job_iops": "4 KiB random reads, 4 jobs (IOPS)",
              "read_1m_2job_gb_per_s": "1 MiB direct reads, 2 jobs (GB/s)",
              "create_per_s": "create (per s)", "stat_per_s": "stat (per s)",
              "delete_per_s": "unlink (per s)"}

    def cell(side: str, key: str) -> str:
        values = sm.get(side, {}).get(key)
        if not values:
            return "—"
        fmt = "{:.2f}" if key.endswith("gb_per_s") else "{:,.0f}"
        return " / ".join(fmt.format(v) for v in values)

    rows = [[label, cell("policy", k), cell("no-qos", k), cell("null", k)]
            for k, label in labels.items()]
    return [
        "## Envelope: what one mount carries", "",
        *table(["what", "default policy", "--no-qos", "do-nothing pyfuse3"], rows), "",
        f"tmpfs source; fio, {r.seconds} s per figure, {r.reps} repetitions shown "
        f"apart; meta.fio with {r.files} files. The do-nothing pyfuse3 filesystem is "
        "the floor: what pyfuse3's request loop and the kernel cost without any work.", "",
    ]
