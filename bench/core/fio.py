"""Running fio job files and reading their JSON output.

Job files live in ``bench/jobs/`` and take their parameters from the environment (fio's
``${VAR}`` substitution). Each job file documents its defaults on one machine-readable
comment line, ``# defaults: SIZE=1g RUNTIME=10``, which :func:`job_defaults` reads, so the
files stay usable by hand and the runner has no second copy of the defaults.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

JOBS_DIR = Path(__file__).resolve().parents[1] / "jobs"
PERCENTILES = ("50.000000", "99.000000", "99.900000")
_DDIRS = ("read", "write", "trim")


class FioError(Exception):
    """fio is missing, failed, or produced output we cannot read (one-line message)."""


def find_fio() -> str:
    path = shutil.which("fio")
    if path is None:
        raise FioError("fio not found on PATH: install it (apt-get install fio; 3.x with the "
                       "filecreate/filestat/filedelete engines) or add it to PATH")
    return path


def fio_version(fio: str) -> str:
    try:
        out = subprocess.run([fio, "--version"], capture_output=True, text=True, timeout=30)
    except OSError as exc:
        raise FioError(f"cannot run {fio}: {exc.strerror}") from None
    return out.stdout.strip() or out.stderr.strip()


def missing_engines(fio: str, engines: tuple[str, ...]) -> list[str]:
    """The engines of *engines* this fio build does not have."""
    out = subprocess.run([fio, "--enghelp"], capture_output=True, text=True, timeout=30)
    have = set(out.stdout.split())
    return [e for e in engines if e not in have]


def job_defaults(job_file: Path) -> dict[str, str]:
    """The ``# defaults: K=V ...`` line of a job file, as a dict."""
    for line in job_file.read_text().splitlines():
        m = re.match(r"^[#;]\s*defaults:\s*(.*)$", line)
        if m:
            return dict(item.split("=", 1) for item in m.group(1).split())
    return {}


@dataclass
class FioMetrics:
    """One fio invocation, summed over its jobs (they use group_reporting)."""

    bw_bytes: float = 0.0  # bytes/s, all directions
    iops: float = 0.0  # operations/s, all directions
    io_bytes: int = 0
    total_ios: int = 0
    runtime_ms: int = 0
    clat_mean_us: float = 0.0
    clat_p50_us: float = 0.0
    clat_p99_us: float = 0.0
    clat_p999_us: float = 0.0
    usr_cpu: float = 0.0  # fio's own CPU (percent of its runtime, summed over jobs)
    sys_cpu: float = 0.0
    jobs: int = 0
    ddirs: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def cpu_ns_per_io(self) -> float:
        """fio's own CPU time (user + system, over its jobs) per I/O, in ns. Time another
        VM takes from this one (steal) is not in it, so on a shared machine it drifts far
        less than the IOPS do, and a per-I/O cost of a few percent shows in it."""
        cpu_ns = (self.usr_cpu + self.sys_cpu) / 100 * self.runtime_ms * 1e6
        return cpu_ns / self.total_ios if self.total_ios else 0.0


def parse_fio_json(doc: dict[str, Any], groupid: int | None = None) -> FioMetrics:
    """Sum bandwidth and IOPS over jobs and directions; latency from the busiest direction.

    *groupid* keeps only the jobs of one reporting group (a job file whose sections start
    a ``new_group``, like mixed.fio's readers and writers).

    Works for every engine used here: the data engines report in ``read``/``write``, and
    filecreate/filestat/filedelete report each file operation as one I/O in the direction
    of ``rw`` (read by default), with its latency as ``clat``.
    """
    jobs = [j for j in doc.get("jobs") or []
            if groupid is None or j.get("groupid", 0) == groupid]
    if not jobs:
        raise FioError("fio JSON output has no jobs")
    m = FioMetrics(jobs=len(jobs))
    busiest: tuple[int, dict[str, Any]] | None = None
    for job in jobs:
        if job.get("error"):
            raise FioError(f"fio job {job.get('jobname')} failed with error {job['error']}")
        m.runtime_ms = max(m.runtime_ms, int(job.get("job_runtime", 0)))
        m.usr_cpu += float(job.get("usr_cpu", 0.0))
        m.sys_cpu += float(job.get("sys_cpu", 0.0))
        for ddir in _DDIRS:
            d = job.get(ddir) or {}
            ios = int(d.get("total_ios", 0))
            if not ios:
                continue
            if ddir not in m.ddirs:
                m.ddirs.append(ddir)
            m.bw_bytes += float(d.get("bw_bytes", 0.0))
            m.iops += float(d.get("iops", 0.0))
            m.io_bytes += int(d.get("io_bytes", 0))
            m.total_ios += ios
            if busiest is None or ios > busiest[0]:
                busiest = (ios, d)
    if busiest is not None:
        clat = busiest[1].get("clat_ns") or {}
        pct = clat.get("percentile") or {}
        m.clat_mean_us = float(clat.get("mean", 0.0)) / 1e3
        m.clat_p50_us = float(pct.get(PERCENTILES[0], 0.0)) / 1e3
        m.clat_p99_us = float(pct.get(PERCENTILES[1], 0.0)) / 1e3
        m.clat_p999_us = float(pct.get(PERCENTILES[2], 0.0)) / 1e3
    return m


def _stderr_line(stderr: str) -> str:
    """The line of fio's stderr that says what went wrong."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("fio:") or "error" in ln.lower() or "err=" in ln:
            return ln
    return lines[0] if lines else "(no message on stderr)"


def run_job(
    fio: str,
    job_file: Path,
    directory: str,
    env: dict[str, str],
    extra_args: tuple[str, ...] = (),
    timeout: float = 600.0,
    parse: bool = True,
    cwd: str | None = None,
    prefix: tuple[str, ...] = (),
) -> tuple[FioMetrics | None, dict[str, Any] | None, list[str]]:
    """Run *job_file* in *directory*; return (metrics, raw JSON, command line).

    Variables not in *env* take the job file's documented defaults. *prefix* goes before
    fio on the command line, e.g. ``setpriv --reuid=N ...`` to run it as another user (fio's
    own ``uid=`` option lays files out before switching, so their opens would be root's).
    Raises FioError with fio's own error line when it exits non-zero or its output cannot
    be parsed.
    """
    full_env = dict(os.environ)
    full_env.update(job_defaults(job_file))
    full_env.update(env)
    with tempfile.NamedTemporaryFile("r", prefix="fio-", suffix=".json") as out:
        cmd = [*prefix, fio, str(job_file), f"--directory={directory}", *extra_args]
        if parse:
            cmd += ["--output-format=json", f"--output={out.name}"]
        try:
            proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True,
                                  timeout=timeout, cwd=cwd)
        except subprocess.TimeoutExpired:
            raise FioError(f"{job_file.name}: fio did not finish within {timeout:.0f} s") \
                from None
        shown = [f"{k}={env[k]}" for k in sorted(env)] + cmd
        if proc.returncode != 0:
            raise FioError(f"{job_file.name} in {directory}: fio exited with "
                           f"{proc.returncode}: {_stderr_line(proc.stderr)}")
        if not parse:
            return None, None, shown
        text = out.read()
    start = text.find("{")  # fio may print notes before the JSON document
    if start < 0:
        raise FioError(f"{job_file.name}: fio wrote no JSON ({_stderr_line(proc.stderr)})")
    try:
        doc, _ = json.JSONDecoder().raw_decode(text[start:])
    except json.JSONDecodeError as exc:
        raise FioError(f"{job_file.name}: unreadable fio JSON: {exc}") from None
    try:
        return parse_fio_json(doc), doc, shown
    except FioError as exc:
        raise FioError(f"{job_file.name} in {directory}: {exc} "
                       f"({_stderr_line(proc.stderr)})") from None
