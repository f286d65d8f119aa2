"""Overhead of the qosfs pass-through (no policy) against the native directory beneath it.

One scratch tmpfs holds two sibling directories: ``native/`` is benchmarked directly,
``backing/`` through a qosfs mount. Every workload runs on both sides in the same run, in
alternating order (native first on one repetition, qosfs first on the next), and the
figure reported is the median over repetitions. Before every measured run the page cache,
dentries and inodes are dropped: tmpfs keeps its data (its pages are the files), the FUSE
mount loses its cached pages and dentries, so the qosfs side starts cold and the native
side is the memory-speed baseline.

Workloads come in groups that share a mount and a laid-out file; each group gets a fresh
qosfs daemon, so one group's failure (or daemon crash) does not spoil the next.
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import fio as fiolib
from bench.fio import JOBS_DIR, FioError, FioMetrics
from bench.system import (
    REPO,
    BenchError,
    CpuMeter,
    QosfsMount,
    drop_caches,
    machine_info,
    require_root,
    tmpfs_area,
    wait_quiet,
)

GB = 1e9
META_ENGINES = ("filecreate", "filestat", "filedelete")


@dataclass(frozen=True)
class Row:
    """One line of the report: a figure, its unit and the target for the qosfs side."""

    key: str
    label: str
    metric: str  # "bw" (bytes/s) or "iops" (ops/s)
    target: float | None = None

    def value(self, m: FioMetrics) -> float:
        return m.bw_bytes if self.metric == "bw" else m.iops

    def fmt(self, v: float | None) -> str:
        if v is None:
            return "—"
        if self.metric == "bw":
            return f"{v / GB:.2f} GB/s"
        return f"{v / 1e3:.1f}k ops/s" if v >= 1e3 else f"{v:.0f} ops/s"


@dataclass
class Group:
    """Workloads that share a qosfs mount (its extra arguments) and set-up files."""

    name: str
    rows: list[Row]
    mount_args: tuple[str, ...] = ()
    note: str = ""
    # filled by the runner: row key -> side -> list of per-repetition records
    runs: dict[str, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)
    error: str | None = None
    elapsed: float = 0.0


@dataclass
class Config:
    quick: bool
    out: Path
    reps: int
    size: str
    runtime: int
    nrfiles: int
    tmpfs_size: str
    qosfs_args: tuple[str, ...]
    only: tuple[str, ...]
    quiet_wait: float = 2.0


def build_groups() -> list[Group]:
    return [
        Group("seqread", [
            Row("seqread-buffered", "1 MiB seq read, buffered (cold)", "bw", 1.5 * GB),
            Row("seqread-direct", "1 MiB seq read, direct=1", "bw", 3.0 * GB),
        ]),
        Group("seqwrite", [Row("seqwrite", "1 MiB seq write + end_fsync", "bw")]),
        Group("randread", [
            Row("randread-1", "4 KiB rand read, direct=1, numjobs=1", "iops", 25e3),
            Row("randread-4", "4 KiB rand read, direct=1, numjobs=4", "iops", 25e3),
        ]),
        Group("meta", [
            Row("create", "create 10k files (cold)", "iops", 4e3),
            Row("stat", "stat 10k files (cold)", "iops", 20e3),
            Row("unlink", "unlink 10k files (cold)", "iops"),
        ], note="each timed operation is cold: meta.fio sleeps SETTLE s after fio's set-up "
                "(which stats every file) so the kernel's 1 s entry/attr cache has expired "
                "and every stat is a FUSE LOOKUP, every create a negative LOOKUP + CREATE"),
    ]


class Runner:
    def __init__(self, cfg: Config, fio: str) -> None:
        self.cfg = cfg
        self.fio = fio
        self.flip = False  # alternates which side runs first
        self.log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)
        self.caches_dropped = True
        self.cwd: str | None = None  # fio's working directory (exec_prerun writes there)
        self.backing = ""  # the directory the current qosfs mount serves
        self.native_top = ""

    # --------------------------------------------------------------- measuring

    def _measure(self, job: str, directory: str, env: dict[str, str],
                 mount: QosfsMount | None, extra: tuple[str, ...] = ()) -> dict[str, Any]:
        """Drop caches, run one fio job, return its figures plus CPU accounting."""
        self.caches_dropped &= drop_caches()
        waited, busy_before = wait_quiet(self.cfg.quiet_wait)
        cpu0 = mount.cpu_seconds() if mount else None
        io0 = mount.io_bytes() if mount else None
        kids0 = _child_cpu()
        meter = CpuMeter()
        t0 = time.monotonic()
        metrics, doc, cmd = fiolib.run_job(self.fio, JOBS_DIR / job, directory, env, extra,
                                           cwd=self.cwd)
        wall = time.monotonic() - t0
        busy = meter.busy_pct()
        assert metrics is not None and doc is not None
        rec: dict[str, Any] = metrics.to_dict()
        rec["command"] = shlex.join(cmd)
        rec["wall_s"] = round(wall, 3)
        ncpu = len(os.sched_getaffinity(0))
        rec["machine_busy_pct"] = round(busy, 1)
        rec["busy_before_pct"] = round(busy_before, 1)
        rec["quiet_wait_s"] = round(waited, 2)
        fio_cpu = _child_cpu() - kids0  # fio and its job processes, set-up included
        daemon_cpu = None
        if mount is not None and cpu0 is not None:
            cpu1 = mount.cpu_seconds()
            if cpu1 is not None:
                daemon_cpu = cpu1 - cpu0
                rec["daemon_cpu_pct"] = round(100 * daemon_cpu / wall, 1)
            io1 = mount.io_bytes()
            if io0 is not None and io1 is not None:
                rec["daemon_rchar"] = io1[0] - io0[0]
                rec["daemon_wchar"] = io1[1] - io0[1]
        # CPU the machine spent on anything but fio and our daemon (other tenants, kernel
        # threads, this runner), in percent of one CPU: a noisy neighbour shows up here.
        other = busy / 100 * ncpu * wall - fio_cpu - (daemon_cpu or 0.0)
        rec["other_cpu_pct"] = round(max(0.0, 100 * other / wall), 1)
        rec["fio_disk_util"] = doc.get("disk_util", [])
        return rec

    def _sides(self, native: str, mnt: str) -> list[tuple[str, str]]:
        order = [("native", native), ("qosfs", mnt)]
        if self.flip:
            order.reverse()
        self.flip = not self.flip
        return order

    # --------------------------------------------------------------- groups

    def run_group(self, group: Group, area: Path, mnt_dir: Path, log_file: str) -> None:
        native = str(area / "native")
        backing = str(area / "backing")
        self.native_top = native
        mnt = str(mnt_dir)
        args = (*group.mount_args, *self.cfg.qosfs_args)
        with QosfsMount(backing, mnt, args, log_file) as mount:
            try:
                self.backing = backing
                getattr(self, f"_group_{group.name.replace('-', '_')}")(group, native, mnt,
                                                                       mount)
            finally:
                for d in (native, mnt):  # leave both sides empty for the next group
                    for entry in os.scandir(d):
                        if entry.is_dir(follow_symlinks=False):
                            shutil.rmtree(entry.path, ignore_errors=True)
                        else:
                            try:
                                os.unlink(entry.path)
                            except OSError:
                                pass

    def _record(self, group: Group, row: Row, side: str, rec: dict[str, Any]) -> None:
        group.runs.setdefault(row.key, {}).setdefault(side, []).append(rec)
        self.log(f"  {row.key:18s} {side:6s} {row.fmt(row.value(_metrics(rec)))}"
                 f"  p99 {rec['clat_p99_us']:.0f} us"
                 + (f"  daemon {rec['daemon_cpu_pct']:.0f}% CPU" if "daemon_cpu_pct" in rec
                    else "")
                 + (f"  other load {rec['other_cpu_pct']:.0f}%"
                    if rec["other_cpu_pct"] >= 20 else ""))

    def _layout(self, job: str, env: dict[str, str], native: str,
                extra: tuple[str, ...] = ()) -> None:
        """Lay out a job's files (untimed) on the native side and copy them to the backing
        directory: writing them through qosfs would only make the set-up slower."""
        fiolib.run_job(self.fio, JOBS_DIR / job, native, env, ("--create_only=1", *extra),
                       parse=False, cwd=self.cwd)
        rel = os.path.relpath(native, self.native_top)
        dst_dir = os.path.normpath(os.path.join(self.backing, rel))
        for entry in os.scandir(native):
            if entry.is_file(follow_symlinks=False):
                shutil.copyfile(entry.path, os.path.join(dst_dir, entry.name))

    def _group_seqread(self, group: Group, native: str, mnt: str, mount: QosfsMount) -> None:
        base = {"SIZE": self.cfg.size, "RUNTIME": str(self.cfg.runtime)}
        self._layout("seqread.fio", {**base, "DIRECT": "0"}, native)
        for row, direct in zip(group.rows, ("0", "1")):
            for _ in range(self.cfg.reps):
                for side, d in self._sides(native, mnt):
                    rec = self._measure("seqread.fio", d, {**base, "DIRECT": direct},
                                        mount if side == "qosfs" else None)
                    self._record(group, row, side, rec)

    def _group_seqwrite(self, group: Group, native: str, mnt: str, mount: QosfsMount) -> None:
        env = {"SIZE": self.cfg.size, "NUMJOBS": "1"}
        for _ in range(self.cfg.reps):
            for side, d in self._sides(native, mnt):
                rec = self._measure("seqwrite.fio", d, env, mount if side == "qosfs" else None)
                self._record(group, group.rows[0], side, rec)

    def _group_randread(self, group: Group, native: str, mnt: str, mount: QosfsMount) -> None:
        base = {"SIZE": self.cfg.size, "RUNTIME": str(self.cfg.runtime), "DIRECT": "1"}
        self._layout("randread.fio", {**base, "NUMJOBS": "1"}, native)
        for row, jobs in zip(group.rows, ("1", "4")):
            for _ in range(self.cfg.reps):
                for side, d in self._sides(native, mnt):
                    rec = self._measure("randread.fio", d, {**base, "NUMJOBS": jobs},
                                        mount if side == "qosfs" else None)
                    self._record(group, row, side, rec)

    def _group_meta(self, group: Group, native: str, mnt: str, mount: QosfsMount) -> None:
        env = {"NRFILES": str(self.cfg.nrfiles)}
        create, stat, unlink = group.rows
        for rep in range(self.cfg.reps):
            sub = f"meta-{rep}"
            for d in (native, mnt):
                os.mkdir(os.path.join(d, sub))
            sides = self._sides(native, mnt)
            for side, top in sides:
                self._record(group, create, side, self._measure(
                    "meta.fio", os.path.join(top, sub), env,
                    mount if side == "qosfs" else None, ("--section=create",)))
            # filestat and filedelete need files of `filesize`: lay them out (untimed) on
            # the native side and copy them to the backing directory, replacing the empty
            # ones filecreate made (the mount forgets the old ones when caches drop).
            self._layout("meta.fio", env, os.path.join(native, sub), ("--section=stat",))
            for row, section in ((stat, "stat"), (unlink, "delete")):
                for side, top in sides:
                    self._record(group, row, side, self._measure(
                        "meta.fio", os.path.join(top, sub), env,
                        mount if side == "qosfs" else None, (f"--section={section}",)))
            for d in (native, mnt):
                shutil.rmtree(os.path.join(d, sub), ignore_errors=True)


def _child_cpu() -> float:
    """CPU seconds of our waited-for children (fio and the job processes it reaped)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _metrics(rec: dict[str, Any]) -> FioMetrics:
    keys = FioMetrics.__dataclass_fields__
    return FioMetrics(**{k: v for k, v in rec.items() if k in keys})


def _median(row: Row, recs: list[dict[str, Any]]) -> float | None:
    vals = [row.value(_metrics(r)) for r in recs]
    return statistics.median(vals) if vals else None


def summarize(groups: list[Group]) -> list[dict[str, Any]]:
    out = []
    for g in groups:
        for row in g.rows:
            runs = g.runs.get(row.key, {})
            nat = _median(row, runs.get("native", []))
            q = _median(row, runs.get("qosfs", []))
            ratio = q / nat if q is not None and nat else None
            if row.target is None or q is None:
                verdict = "—" if q is not None else "error"
            else:
                verdict = "pass" if q >= row.target else "MISS"
            qruns = runs.get("qosfs", [])
            out.append({
                "key": row.key, "label": row.label, "group": g.name, "metric": row.metric,
                "native": nat, "qosfs": q, "ratio": ratio, "target": row.target,
                "verdict": verdict, "error": g.error if q is None else None,
                "reps": len(qruns),
                "native_p99_us": _median_of(runs.get("native", []), "clat_p99_us"),
                "qosfs_p50_us": _median_of(qruns, "clat_p50_us"),
                "qosfs_p99_us": _median_of(qruns, "clat_p99_us"),
                "qosfs_daemon_cpu_pct": _median_of(qruns, "daemon_cpu_pct"),
                "max_other_cpu_pct": max((r["other_cpu_pct"] for side in runs.values()
                                          for r in side), default=None),
                "display": (row.fmt(nat), row.fmt(q),
                            row.fmt(row.target) if row.target else "—"),
            })
    return out


def _median_of(recs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in recs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def write_report(cfg: Config, info: dict[str, Any], groups: list[Group],
                 complete: bool, elapsed: float) -> tuple[Path, Path]:
    cfg.out.mkdir(parents=True, exist_ok=True)
    summary = summarize(groups)
    doc = {
        "benchmark": "overhead",
        "complete": complete,
        "elapsed_s": round(elapsed, 1),
        "machine": info,
        "config": {"quick": cfg.quick, "reps": cfg.reps, "size": cfg.size,
                   "runtime_s": cfg.runtime, "nrfiles": cfg.nrfiles,
                   "tmpfs_size": cfg.tmpfs_size, "qosfs_args": list(cfg.qosfs_args)},
        "summary": [{k: v for k, v in s.items() if k != "display"} for s in summary],
        "groups": [{"name": g.name, "mount_args": list(g.mount_args), "note": g.note,
                    "error": g.error, "elapsed_s": round(g.elapsed, 1), "runs": g.runs}
                   for g in groups],
    }
    jpath = cfg.out / "overhead.json"
    jpath.write_text(json.dumps(doc, indent=2) + "\n")

    def us(v: float | None) -> str:
        return "—" if v is None else (f"{v / 1e3:.1f} ms" if v >= 1e4 else f"{v:.0f} µs")

    lines = [
        "# qosfs overhead: pass-through (no policy) vs native tmpfs",
        "",
        f"{info['date']} · kernel {info['kernel']} · {info['cpu_model']} · "
        f"{info['nproc']} CPUs · {info['fio_version']} · qosfs {info['qosfs']} "
        f"(commit {info['git_commit'] or 'n/a'}) · pyfuse3 {info['pyfuse3']}",
        "",
        f"Mode: {'quick' if cfg.quick else 'full'} — file size {cfg.size}, {cfg.runtime} s "
        f"per timed job, {cfg.nrfiles} files, median of {cfg.reps} repetition(s), sides "
        f"alternated; qosfs args: {' '.join(cfg.qosfs_args) or '(defaults)'}; "
        f"{'complete' if complete else '**INCOMPLETE (interrupted)**'}, {elapsed:.0f} s.",
        "",
        "| workload | native | qosfs | ratio | target (qosfs) | result |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for s in summary:
        nat, q, tgt = s["display"]
        ratio = "—" if s["ratio"] is None else f"{s['ratio']:.2f}"
        verdict = s["verdict"] if not s["error"] else f"error: {s['error']}"
        lines.append(f"| {s['label']} | {nat} | {q} | {ratio} | {tgt} | {verdict} |")
    lines += [
        "",
        "Latency and CPU (medians; qosfs side unless said):",
        "",
        "| workload | native p99 | qosfs p50 | qosfs p99 | daemon CPU | max other load |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for s in summary:
        cpu = s["qosfs_daemon_cpu_pct"]
        other = s["max_other_cpu_pct"]
        lines.append(f"| {s['label']} | {us(s['native_p99_us'])} | {us(s['qosfs_p50_us'])} | "
                     f"{us(s['qosfs_p99_us'])} | {'—' if cpu is None else f'{cpu:.0f}%'} | "
                     f"{'—' if other is None else f'{other:.0f}%'} |")
    cold = [r["daemon_rchar"] / r["io_bytes"] for g in groups
            for r in g.runs.get("seqread-buffered", {}).get("qosfs", [])
            if r.get("daemon_rchar") and r.get("io_bytes")]
    cold_note = (f" Checked: the daemon read {statistics.median(cold):.2f}× the bytes fio "
                 "read (its /proc/PID/io rchar), so no pass was served from cache."
                 if cold else "")
    busy = [r["other_cpu_pct"] for g in groups for side in g.runs.values()
            for recs in side.values() for r in recs]
    noisy = sum(1 for b in busy if b >= 20)
    lines += [
        "",
        "Notes:",
        "",
        "- Units: GB/s = 10^9 bytes/s (fio's bw_bytes); ops/s = fio's iops. ratio = "
        "qosfs / native. Targets apply to the qosfs side.",
        "- Both sides live on one tmpfs, so the native side is a memory-speed baseline and "
        "qosfs figures are the pass-through's own cost (FUSE round trips, copies, Python).",
        "- **Buffered** means cold, through the page cache: caches are dropped before every "
        "run, and each pass reopens the file (fio invalidate=1; qosfs revalidates per open), "
        "so on qosfs every byte goes readahead → FUSE READ → daemon → tmpfs. tmpfs data "
        "cannot be dropped (its pages are the files): a native buffered read is a memory "
        "copy." + cold_note,
        "- **direct=1**: O_DIRECT on both sides; on qosfs each read is one FUSE request "
        "answered by the daemon (no page cache).",
        f"- Metadata: fio filecreate/filestat/filedelete, {cfg.nrfiles} files, one job; "
        "caches dropped before each section. " + " ".join(f"`{g.name}`: {g.note}."
                                                          for g in groups if g.note),
        "- Queue-depth-1 figures (rand read numjobs=1, metadata) are round-trip latencies: "
        "caller → kernel → daemon → kernel → caller, two wake-ups each. On a VM an idle "
        "vCPU halts and waking it costs tens of µs (here: cpuidle "
        f"{info.get('cpuidle_driver') or '?'}, guest_halt_poll_ns="
        f"{info.get('guest_halt_poll_ns') or '?'}), so these figures are better on a busy "
        "machine than on an idle one; the runner waits for an idle machine (--quiet-wait) "
        "to keep runs comparable.",
        "- daemon CPU = the qosfs process's CPU time / wall time (100% = one core). "
        "other load = machine CPU not used by fio or the daemon, in % of one core (other "
        f"tenants, kernel threads); {noisy} of {len(busy)} runs saw ≥ 20% "
        "(figures from those runs are less trustworthy on this 2-CPU machine).",
        "- Raw per-run figures, fio command lines and machine details: overhead.json.",
    ]
    mpath = cfg.out / "overhead.md"
    mpath.write_text("\n".join(lines) + "\n")
    return mpath, jpath


def run(cfg: Config) -> int:
    try:
        fio = fiolib.find_fio()
        require_root("bench overhead")
    except (FioError, BenchError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    info = machine_info(fiolib.fio_version(fio))
    groups = [g for g in build_groups()
              if not cfg.only or g.name in cfg.only or any(r.key in cfg.only for r in g.rows)]
    if not groups:
        print(f"bench: --only {','.join(cfg.only)} matches no workload", file=sys.stderr)
        return 2
    missing = fiolib.missing_engines(fio, META_ENGINES)
    if missing:
        for g in groups:
            if g.name.startswith("meta"):
                g.error = f"fio lacks the {', '.join(missing)} engine(s)"
    runner = Runner(cfg, fio)
    t0 = time.monotonic()
    complete = False
    work = Path(tempfile.mkdtemp(prefix="qosfs-bench-work-"))
    log_file = str(work / "qosfs.log")
    mnt_dir = work / "mnt"
    mnt_dir.mkdir()
    runner.cwd = str(work)
    try:
        with tmpfs_area(cfg.tmpfs_size, ("native", "backing")) as area:
            runner.log(f"bench: tmpfs {area} ({cfg.tmpfs_size}), qosfs on {mnt_dir}")
            for g in groups:
                if g.error:
                    runner.log(f"{g.name}: skipped: {g.error}")
                    continue
                runner.log(f"{g.name}:")
                tg = time.monotonic()
                try:
                    runner.run_group(g, area, mnt_dir, log_file)
                except (FioError, BenchError, OSError) as exc:
                    g.error = str(exc).splitlines()[0][:300]
                    runner.log(f"  {g.name} failed: {g.error}")
                    _log_tail(log_file, runner.log)
                g.elapsed = time.monotonic() - tg
                runner.log(f"  ({g.elapsed:.0f} s)")
        complete = True
    except KeyboardInterrupt:
        runner.log("bench: interrupted; writing what was measured")
    finally:
        info["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
        info["caches_dropped"] = runner.caches_dropped
        mpath, jpath = write_report(cfg, info, groups, complete, time.monotonic() - t0)
        shutil.rmtree(work, ignore_errors=True)
    print(mpath.read_text())
    print(f"wrote {mpath} and {jpath}")
    return 0 if complete and not any(g.error for g in groups) else 1


def _log_tail(log_file: str, log: Callable[[str], None]) -> None:
    try:
        tail = Path(log_file).read_text().splitlines()[-5:]
    except OSError:
        return
    for line in tail:
        log(f"    qosfs.log: {line}")


def default_out() -> Path:
    return REPO / "bench" / "results"
