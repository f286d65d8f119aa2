"""Priorities and minimums: with ``[backend] write_bandwidth`` declared, two classes that
both want more than the backend share it by priority weight, and a class's
``min_write_bandwidth`` is a floor under its share (DESIGN §3; qosfs.qos.backend).

Scenarios, each on a fresh mount: a ``high`` and a ``low`` class (weights 100 and 1),
each with four 1 MiB sequential writers (checkpoint-storm.fio), without and with a
minimum for ``low``; and ``low`` alone (what a high class does not use, lower classes
get). Achieved rates are the class levels' admitted bytes per second (steady windows,
:mod:`bench.core.sampler`); expected shares follow :func:`expected_shares`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.core.context import Run
from bench.core.fio import JOBS_DIR, FioError, run_job
from bench.core.plotting import bars, save
from bench.core.sampler import StatusSampler, error_pct, mean_rate, steady, windows
from bench.core.system import BenchError, drop_caches, wait_quiet
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
from bench.core.typed import Record, key
from qosfs.core.units import parse_bandwidth
from qosfs.policy.keys import PRIORITY_WEIGHTS

BACKEND = "100MiB/s"
LOW_MIN = "30MiB/s"
CLASSES = ("high", "low")
# Writers per class, at queue depth 1 each. Shares follow weights only while both classes
# always have a request waiting at the backend: between one write's completion and the
# next one's arrival, a class has nothing queued and the other is served.
WRITERS = "4"
POLICY = """
[backend]
write_bandwidth = "{backend}"

[classes.high]
paths = ["high/**"]
priority = "high"

[classes.low]
paths = ["low/**"]
priority = "low"
{low_min}

[classes.default]
"""


@dataclass(frozen=True, kw_only=True)
class ClassShare(Record):
    class_: str = field(metadata=key("class"))
    expected: float
    achieved: float | None
    error_pct: float | None
    error_backend_pct: float | None


@dataclass(frozen=True, kw_only=True)
class PriorityScenario(Record):
    name: str
    low_min: str | None
    classes: list[ClassShare]
    windows: int = 0


@dataclass(frozen=True, kw_only=True)
class PrioritiesResult(Record):
    backend: str
    weights: dict[str, int]
    runtime_s: int
    writers: int
    policy: str
    scenarios: list[PriorityScenario]


@dataclass(frozen=True)
class Scenario:
    name: str
    writers: tuple[str, ...]  # classes with demand
    low_min: str | None = None


SCENARIOS = (
    Scenario("weights only", CLASSES),
    Scenario(f"low has min_write_bandwidth {LOW_MIN}", CLASSES, LOW_MIN),
    Scenario("low alone", ("low",)),
)


def expected_shares(capacity: float, demand: dict[str, tuple[float, float]]
                    ) -> dict[str, float]:
    """Each backlogged class's share of *capacity*: ``max(minimum, weighted share)``.

    *demand* maps a class to (weight, minimum). Water-filling: a class whose weighted
    share of what is left falls below its minimum gets the minimum, and the rest is
    shared again among the others by weight.
    """
    fixed: dict[str, float] = {}
    while True:
        left = capacity - sum(fixed.values())
        free = {c: wm for c, wm in demand.items() if c not in fixed}
        total = sum(w for w, _ in free.values())
        shares = {c: left * w / total for c, (w, _) in free.items()} if total else {}
        below = {c for c, (_, minimum) in free.items() if shares[c] < minimum}
        if not below:
            return {**fixed, **shares}
        for c in below:
            fixed[c] = demand[c][1]


def _scenario(run: Run, sc: Scenario, runtime: int) -> dict[str, Any]:
    low_min = f'min_write_bandwidth = "{sc.low_min}"' if sc.low_min else ""
    src = run.scratch("priorities")
    for cls in CLASSES:
        (src / cls).mkdir()
    errors: list[FioError] = []

    def writer(directory: str) -> None:
        try:
            run_job(run.fio, JOBS_DIR / "checkpoint-storm.fio", directory,
                    {"NUMJOBS": WRITERS, "SIZE": "256m", "RUNTIME": str(runtime)}, parse=False,
                    cwd=str(run.work))
        except FioError as exc:
            errors.append(exc)

    with run.mount(src, POLICY.format(backend=BACKEND, low_min=low_min)) as m:
        drop_caches()
        wait_quiet(run.quiet_wait)
        with StatusSampler(m.socket, 1.0) as sampler:
            threads = [threading.Thread(target=writer, args=(str(m.path / c),))
                       for c in sc.writers]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    if errors:
        raise BenchError(str(errors[0]))
    backend = parse_bandwidth(BACKEND)
    expected = expected_shares(backend, {
        c: (PRIORITY_WEIGHTS[c], parse_bandwidth(sc.low_min) if c == "low" and sc.low_min
            else 0.0) for c in sc.writers})
    # the span where every writer was busy: steady windows of the backend level
    span = steady(windows(sampler.samples, ("backend", "backend", None), "write_bytes"))
    rows = []
    for c in sc.writers:
        ws = windows(sampler.samples, ("class", c, None), "write_bytes")
        got = mean_rate(ws, span[0].t0, span[-1].t1) if span else None
        rows.append({"class": c, "expected": expected[c], "achieved": got,
                     "error_pct": None if got is None else error_pct(got, expected[c]),
                     # in points of the backend: a 2 MiB/s share missed by 1 MiB/s is -50%
                     # of itself but 0.5% of what the backend moves
                     "error_backend_pct": None if got is None
                     else 100 * (got - expected[c]) / backend})
        run.log(f"  {sc.name}: {c} {0 if got is None else got / (1 << 20):.1f} MiB/s "
                f"(expected {expected[c] / (1 << 20):.1f})")
    return {"name": sc.name, "low_min": sc.low_min, "classes": rows,
            "windows": len(span)}


def run(run: Run) -> PrioritiesResult:
    runtime = int(run.pick(10, 5))
    return PrioritiesResult.from_json({
        "backend": BACKEND, "weights": {c: PRIORITY_WEIGHTS[c] for c in CLASSES},
        "runtime_s": runtime, "writers": int(WRITERS),
        "policy": POLICY.format(backend=BACKEND, low_min=f'# min_write_bandwidth = '
                                f'"{LOW_MIN}"  (second scenario)').strip(),
        "scenarios": [_scenario(run, sc, runtime) for sc in SCENARIOS]})


# -- its part of REPORT.md --


def headline(prio: PrioritiesResult) -> Rows:
    errs = [c.error_backend_pct for sc in prio.scenarios for c in sc.classes
            if c.error_backend_pct is not None]
    if not errs:
        return []
    w = max(errs, key=abs)
    return [[f"priorities/minimums, backend {prio.backend}: worst error vs expected "
             "share, in % of the backend", pct(w), f"±{SHARE_PCT:.0f}%",
             verdict(abs(w) <= SHARE_PCT)]]


def section(plots: Plots, r: PrioritiesResult) -> list[str]:
    rows = []
    for sc in r.scenarios:
        for c in sc.classes:
            ok = None if c.error_backend_pct is None else \
                abs(c.error_backend_pct) <= SHARE_PCT
            rows.append([sc.name, f"{c.class_} (weight {r.weights[c.class_]})",
                         mib(c.expected), mib(c.achieved), pct(c.error_pct),
                         pct(c.error_backend_pct), verdict(ok)])
    return [
        "## 7. Priorities and minimums on a declared backend", "",
        *plot(plots, "priorities", "achieved vs expected shares"),
        *table(["scenario", "class", "expected", "achieved", "error", "error, % of backend",
                 "result"], rows), "",
        f"`[backend] write_bandwidth = \"{r.backend}\"`; each class runs {r.writers} 1 MiB "
        f"sequential writers for {r.runtime_s} s (each class alone could exceed the "
        "backend). Expected = max(minimum, weighted share), shared again among the others "
        "when a minimum binds. Achieved: the classes' admitted bytes over the steady windows "
        "of the backend level (first and last second discarded).", "",
        *policy_block(r.policy),
    ]


def chart(plt: Any, r: PrioritiesResult, out: Path, name: str) -> str:
    rows = [(sc.name, c) for sc in r.scenarios for c in sc.classes]
    fig, ax = plt.subplots(figsize=(8, 4))
    bars(ax, [f"{n}: {c.class_}" for n, c in rows], {
        "expected": [c.expected / MiB for _, c in rows],
        "achieved": [(c.achieved or 0) / MiB for _, c in rows]}, "MiB/s")
    ax.set_title(f"Backend {r.backend} shared by priority and minimum")
    return save(plt, fig, out, name)
