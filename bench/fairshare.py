"""Fair share: three users writing into one ``per_user = "fair"`` class share its cap
equally, and the split follows as users come and go.

Three uids each run checkpoint-storm.fio (one 1 MiB sequential writer) as themselves
(``setpriv``), into their own directory of a class capped at :data:`CAP`, staggered so
every re-split shows: A writes through phases 1-4, B joins at phase 2, C at phase 3 and
leaves after it. Per-uid rates are the daemon's per-user level counters every 0.5 s; each
phase's figure is the mean over its windows after the first second (a newcomer's fio
start-up lands there), compared with ``CAP / active users``. A user who stops keeps its
share until it has been idle for the class's ``idle_after`` (2 s, qosfs.qos.levels), by
design, so after a departure the first ``idle_after`` + 1 s are left out instead.
"""

from __future__ import annotations

import inspect
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from bench.context import Run
from bench.figures import FairshareResult
from bench.fio import JOBS_DIR, FioError, run_job
from bench.sampler import Sample, StatusSampler, error_pct, mean_rate, windows
from bench.system import BenchError
from qosfs.core.units import parse_bandwidth
from qosfs.qos.store import FairShareGroup

UIDS = (60001, 60002, 60003)
CAP = "150MiB/s"
POLICY = f"""
[classes.shared]
paths = ["shared/**"]
write_bandwidth = "{CAP}"
per_user = "fair"

[classes.default]
"""
# (uid index, first phase, last phase) -- phases are numbered from 0
SCHEDULE = ((0, 0, 3), (1, 1, 3), (2, 2, 2))
PHASES = 4
SKIP = 1.0  # seconds discarded at the start of each phase
IDLE_AFTER = inspect.signature(FairShareGroup).parameters["idle_after"].default


def phase_table(samples: list[Sample], t0: float, phase_s: int,
                cap: float) -> list[dict[str, Any]]:
    """Per phase: who was active, their mean rates, the equal share and the worst error."""
    rates = {uid: windows(samples, ("user", "shared", uid), "write_bytes") for uid in UIDS}
    out = []
    for p in range(PHASES):
        active = [UIDS[i] for i, first, last in SCHEDULE if first <= p <= last]
        start, end = t0 + p * phase_s, t0 + (p + 1) * phase_s
        left = any(last == p - 1 for _, _, last in SCHEDULE)
        skip = SKIP + (IDLE_AFTER if left else 0.0)
        achieved = {uid: mean_rate(rates[uid], start + skip, end) for uid in active}
        share = cap / len(active)
        errors = [error_pct(v, share) for v in achieved.values() if v is not None]
        out.append({"phase": p + 1, "active": active, "share": share, "skipped_s": skip,
                    "achieved": {str(u): v for u, v in achieved.items()},
                    "worst_pct": max(errors, key=abs) if errors else None,
                    "total": sum(v for v in achieved.values() if v is not None)})
    return out


def run(run: Run) -> FairshareResult:
    if shutil.which("setpriv") is None:
        raise BenchError("setpriv not found (util-linux): needed to write as other uids")
    phase_s = int(run.pick(5, 4))  # whole seconds: fio's runtime
    src = run.scratch("fairshare")
    for uid in UIDS:
        d = src / "shared" / f"u{uid}"
        d.mkdir(parents=True)
        os.chown(d, uid, uid)
    errors: list[str] = []

    def writer(directory: Path, uid: int, start: float, seconds: int) -> None:
        time.sleep(max(0.0, start - time.monotonic()))
        prefix = ("setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups")
        try:
            run_job(run.fio, JOBS_DIR / "checkpoint-storm.fio", str(directory),
                    {"NUMJOBS": "1", "SIZE": "256m", "RUNTIME": str(seconds)}, parse=False,
                    prefix=prefix, cwd="/")
        except FioError as exc:
            errors.append(str(exc))

    with run.mount(src, POLICY) as m, StatusSampler(m.socket, 0.5) as sampler:
        t0 = time.monotonic() + 0.5
        threads = [threading.Thread(target=writer, args=(
            m.path / "shared" / f"u{UIDS[i]}", UIDS[i], t0 + first * phase_s,
            (last - first + 1) * phase_s)) for i, first, last in SCHEDULE]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise BenchError(errors[0])
    cap = parse_bandwidth(CAP)
    table = phase_table(sampler.samples, t0, phase_s, cap)
    for row in table:
        run.log(f"  phase {row['phase']}: " + ", ".join(
            f"uid {u} {v / (1 << 20):.1f}" for u, v in row["achieved"].items() if v)
            + f" MiB/s (equal share {row['share'] / (1 << 20):.1f})")
    series = {str(uid): [(round(w.mid - t0, 3), w.rate) for w in
                         windows(sampler.samples, ("user", "shared", uid), "write_bytes")]
              for uid in UIDS}
    return FairshareResult.from_json({
        "cap": CAP, "uids": list(UIDS), "phase_s": phase_s, "schedule": SCHEDULE,
        "idle_after_s": IDLE_AFTER, "phases": table, "series": series,
        "policy": POLICY.strip()})
