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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.core.context import Run
from bench.core.fio import JOBS_DIR, FioError, run_job
from bench.core.plotting import save
from bench.core.sampler import Sample, Series, StatusSampler, error_pct, mean_rate, windows
from bench.core.system import BenchError
from bench.core.tables import (
    SHARE_PCT,
    MiB,
    Plots,
    Rows,
    mib,
    pct,
    plot,
    policy_block,
    table,
    verdict,
)
from bench.core.typed import Json, Record
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


@dataclass(frozen=True, kw_only=True)
class FairPhase(Record):
    phase: int
    active: list[int]
    share: float
    achieved: dict[str, float | None]  # per uid
    worst_pct: float | None
    total: float
    skipped_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class FairshareResult(Record):
    cap: str
    phase_s: int
    idle_after_s: float
    phases: list[FairPhase]
    series: dict[str, Series]  # per uid
    policy: str
    uids: list[int] = field(default_factory=list)
    schedule: Json = None


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


# -- its part of REPORT.md --


def headline(fair: FairshareResult) -> Rows:
    errs = [p.worst_pct for p in fair.phases if p.worst_pct is not None]
    if not errs:
        return []
    w = max(errs, key=abs)
    return [["fair share, 3 uids: worst per-user error vs equal split", pct(w),
             f"±{SHARE_PCT:.0f}%", verdict(abs(w) <= SHARE_PCT)]]


def section(plots: Plots, r: FairshareResult) -> list[str]:
    rows = []
    for p in r.phases:
        rows.append([str(p.phase), ", ".join(str(u) for u in p.active), mib(p.share),
                     ", ".join(mib(v) for v in p.achieved.values()), pct(p.worst_pct),
                     mib(p.total)])
    return [
        "## 5. Fair share: three users in a `per_user = \"fair\"` class", "",
        *plot(plots, "fairshare", "per-user rates"),
        *table(["phase", "active uids", "equal share", "achieved per uid", "worst error",
                 "class total"], rows), "",
        f"Class capped at {r.cap}; each uid runs one 1 MiB sequential writer as itself "
        f"(setpriv), phases of {r.phase_s} s. Per-uid rates from the daemon's per-user "
        "levels every 0.5 s; the first second of each phase is discarded (a newcomer's fio "
        "start-up), and after a departure the first "
        f"{r.idle_after_s + 1:.0f} s: a user who stops keeps its share until idle for "
        f"`idle_after` = {r.idle_after_s:.0f} s, by design.", "",
        *policy_block(r.policy),
    ]


def chart(plt: Any, r: FairshareResult, out: Path, name: str) -> str:
    fig, ax = plt.subplots(figsize=(9, 3.5))
    for uid, pts in r.series.items():
        ax.plot([t for t, _ in pts], [v / MiB for _, v in pts], label=f"uid {uid}")
    for p in r.phases:
        t0 = (p.phase - 1) * r.phase_s
        ax.hlines(p.share / MiB, t0, t0 + r.phase_s, colors="grey", linestyles=":")
    ax.set_xlabel("s (phases: dotted line = equal share)")
    ax.set_ylabel("MiB/s (0.5 s windows)")
    ax.set_title(f"Fair share of {r.cap} between active uids")
    ax.legend(fontsize=8)
    return save(plt, fig, out, name)
