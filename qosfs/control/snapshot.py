"""A consistent, frozen picture of a running engine, its current rates, and its JSON form.

One snapshot feeds ``qosfs ctl status`` / ``stats``, ``qosfs top`` and the Prometheus
exporter, so all three always agree. It is taken on the event loop's thread (the engine's
dicts are never iterated from another thread) and is plain data afterwards, safe to hand
to a worker thread for formatting.

*Levels* are where limits are enforced (class, tenant, per-user share, backend): their
limits in force, queue depth and throttled time, and their admitted traffic. *Accounts*
are who the traffic belongs to (class, tenant, and uid for ``per_user`` classes): bytes
and ops really moved, time spent waiting, latency histograms (:mod:`qosfs.qos.accounting`).

The engine is read through its control face (:class:`qosfs.qos.interface.QosControl`):
its policy, accounts, level statistics and own counters, all typed. An engine without a
policy (``--no-qos``) answers with no policy and no levels; its status then shows the
counted traffic only, as it always has (no engine counters either).

"Current rates" come from :class:`RateSampler`, which the daemon feeds one snapshot per
second: a rate is the difference of two consecutive samples over their interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qosfs.core.limit_kinds import LIMIT_KINDS
from qosfs.qos.accounting import BUCKET_BOUNDS_SECONDS, AccountKey, FlowSnapshot, HistogramSnapshot

if TYPE_CHECKING:
    from qosfs.qos.interface import QosControl
    from qosfs.qos.levels import LevelStatistics
    from qosfs.qos.stats import EngineCounters

__all__ = ["LevelRow", "RateSampler", "Snapshot", "take_snapshot", "to_json"]

#: Policy limit key -> LevelLimits field, in the order status shows them (the table).
LIMIT_FIELDS = tuple((kind.key, kind.bucket) for kind in LIMIT_KINDS)
#: Counters that have a rate.
RATE_FIELDS = ("read_bytes", "write_bytes", "read_ops", "write_ops", "meta_ops",
               "throttled_seconds")
HISTOGRAMS = ("read_latency", "write_latency", "read_backend", "write_backend")

LevelKey = tuple[str, str, "int | None"]


@dataclass(frozen=True, slots=True)
class LevelRow:
    """One rate level: what it enforces and what it has seen."""

    level: str  # "class", "user", "tenant" or "backend"
    name: str  # class or tenant name; "backend"
    uid: int | None  # for "user" rows
    limits: dict[str, float]  # caps in force (bytes/s, ops/s); absent = unlimited
    read_bytes: int
    write_bytes: int
    read_ops: int
    write_ops: int
    meta_ops: int
    throttled_seconds: float
    queue_depth: int
    waits: int
    settings: dict[str, Any] = field(default_factory=dict)  # classes: priority, per_user...

    @property
    def key(self) -> LevelKey:
        return (self.level, self.name, self.uid)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything ``status``, ``stats``, ``top`` and ``/metrics`` show, at one instant."""

    time: float  # trio.current_time() (monotonic) when taken
    qos: bool  # False: mounted with --no-qos, no policy
    generation: int
    policy_source: str | None
    levels: tuple[LevelRow, ...]
    accounts: tuple[tuple[AccountKey, FlowSnapshot], ...]
    changes: dict[tuple[str, str], int] = field(default_factory=dict)  # (cmd, result) -> n
    last_reload_ok: bool = True
    info: dict[str, Any] = field(default_factory=dict)  # source, mountpoint, uptime...
    latency: dict[str, Any] | None = None  # LatencyLoop.status(); None: no controller
    cluster: dict[str, Any] | None = None  # ClusterCoordinator.status(); None: no [cluster]
    counters: EngineCounters | None = None  # the engine's own; None: no policy

    def figures(self) -> dict[str, Any]:
        """What the daemon holds and did, as ``ctl status`` shows it beside the levels:
        the filesystem's resources (in ``info``) and the engine's own counters."""
        if self.counters is None:
            return dict(self.info)
        return {**self.info, **self.counters.as_status()}


def _row(level: str, name: str, uid: int | None, st: LevelStatistics,
         settings: dict[str, Any] | None = None) -> LevelRow:
    return LevelRow(level, name, uid, st.limits.caps(), st.bytes_read,
                    st.bytes_written, st.ops_read, st.ops_write, st.ops_meta,
                    st.throttled_seconds, st.queue_depth, st.waits, settings or {})


def take_snapshot(engine: QosControl, now: float, *,
                  changes: dict[tuple[str, str], int] | None = None,
                  last_reload_ok: bool = True, info: dict[str, Any] | None = None,
                  latency: dict[str, Any] | None = None,
                  cluster: dict[str, Any] | None = None) -> Snapshot:
    """Copy the counters of ``engine``.

    Must run on the event loop's thread: it iterates the engine's live dicts.
    """
    accounts = tuple(sorted(engine.accounts.snapshot().items(), key=_account_order))
    policy = engine.policy
    if policy is None:
        return Snapshot(now, False, engine.generation, None, (), accounts, dict(changes or {}),
                        last_reload_ok, dict(info or {}))
    stats = engine.statistics()
    rows: list[LevelRow] = []
    for rule in policy.classes:
        st = stats.classes.get(rule.name)
        if st is None:
            continue
        settings: dict[str, Any] = {"priority": rule.priority_name,
                                    "per_user": rule.per_user, "cache": rule.cache}
        if rule.scope != "node":
            settings["scope"] = rule.scope
        auto = stats.auto_caps.get(rule.name)
        if auto is not None:  # the latency controller's caps (limits shows what is in force)
            settings["auto_limits"] = {k: v for k, v in (
                ("read_bandwidth", auto.read_bandwidth),
                ("write_bandwidth", auto.write_bandwidth)) if v is not None}
        rows.append(_row("class", rule.name, None, st, settings))
        for uid, ust in sorted(stats.users.get(rule.name, {}).items()):
            rows.append(_row("user", rule.name, uid, ust))
    for name, st in stats.tenants.items():
        rows.append(_row("tenant", name, None, st))
    if stats.backend is not None:
        rows.append(_row("backend", "backend", None, stats.backend))
    return Snapshot(now, True, stats.generation, policy.source, tuple(rows), accounts,
                    dict(changes or {}), last_reload_ok, dict(info or {}), latency, cluster,
                    engine.counters())


def _account_order(item: tuple[AccountKey, FlowSnapshot]) -> tuple[str, str, int]:
    (cls, tenant, uid), _ = item
    return (cls, tenant or "", -1 if uid is None else uid)


class RateSampler:
    """Turns consecutive snapshots into per-second rates (the "current rates" shown)."""

    def __init__(self) -> None:
        self._last: Snapshot | None = None
        self.window = 0.0
        self.levels: dict[LevelKey, dict[str, float]] = {}
        self.accounts: dict[AccountKey, dict[str, float]] = {}

    def sample(self, snap: Snapshot) -> None:
        """Record a snapshot; rates cover the interval since the previous one."""
        last = self._last
        self._last = snap
        if last is None or snap.time <= last.time:
            return
        dt = snap.time - last.time
        self.window = dt
        before = {row.key: row for row in last.levels}
        self.levels = {row.key: _rates(row, before.get(row.key), dt) for row in snap.levels}
        prev = dict(last.accounts)
        self.accounts = {key: _rates(acc, prev.get(key), dt) for key, acc in snap.accounts}


def _rates(now: Any, before: Any, dt: float) -> dict[str, float]:
    if before is None:  # new since the last sample (a user became active): no rate yet
        return dict.fromkeys(RATE_FIELDS, 0.0)
    # A level that was replaced restarts its counters: never report a negative rate.
    return {f: max(0.0, (getattr(now, f) - getattr(before, f)) / dt) for f in RATE_FIELDS}


def _histogram_json(h: HistogramSnapshot) -> dict[str, Any]:
    return {"count": h.count, "sum_seconds": h.sum_seconds, "p50": h.quantile(0.5),
            "p99": h.quantile(0.99), "counts": list(h.counts)}


def _clean(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value


def to_json(snap: Snapshot, sampler: RateSampler | None, *, accounts: bool) -> dict[str, Any]:
    """The ``status`` (``accounts=False``) or ``stats`` (``accounts=True``) reply body."""
    rates = sampler.levels if sampler is not None else {}
    zero = dict.fromkeys(RATE_FIELDS, 0.0)
    levels = []
    for row in snap.levels:
        item: dict[str, Any] = {
            "level": row.level, "name": row.name, "uid": row.uid, "limits": row.limits,
            **row.settings,
            "read_bytes": row.read_bytes, "write_bytes": row.write_bytes,
            "read_ops": row.read_ops, "write_ops": row.write_ops, "meta_ops": row.meta_ops,
            "throttled_seconds": row.throttled_seconds, "queue_depth": row.queue_depth,
            "waits": row.waits, "rates": rates.get(row.key, zero),
        }
        levels.append(item)
    body: dict[str, Any] = {
        "ok": True, "qos": snap.qos, "generation": snap.generation,
        "policy_source": snap.policy_source, **snap.figures(),
        "changes": [{"command": c, "result": r, "count": n}
                    for (c, r), n in sorted(snap.changes.items())],
        "last_reload_ok": snap.last_reload_ok,
        "window_seconds": sampler.window if sampler is not None else 0.0,
        "levels": levels,
    }
    if snap.latency is not None:
        body["latency_control"] = snap.latency
    if snap.cluster is not None:
        body["cluster"] = snap.cluster
    if not snap.qos:
        body["message"] = "no policy: mounted with --no-qos (traffic is counted only)"
    account_rates = sampler.accounts if sampler is not None else {}
    rows = []
    for key, acc in snap.accounts:
        cls, tenant, uid = key
        account: dict[str, Any] = {
            "class": cls, "tenant": tenant, "uid": uid,
            "read_bytes": acc.read_bytes, "write_bytes": acc.write_bytes,
            "read_ops": acc.read_ops, "write_ops": acc.write_ops, "meta_ops": acc.meta_ops,
            # opens: all a passthrough class's reads leave here (the kernel reads for it)
            "opens": acc.opens, "throttled_seconds": acc.throttled_seconds,
            "rates": account_rates.get(key, zero),
        }
        if accounts:
            account["latency"] = {name: _histogram_json(getattr(acc, name))
                                  for name in HISTOGRAMS}
        rows.append(account)
    body["accounts"] = rows
    if accounts:
        body["bucket_bounds_seconds"] = list(BUCKET_BOUNDS_SECONDS)
    finite: dict[str, Any] = _finite(body)
    return finite


def _finite(value: Any) -> Any:
    """JSON has no Infinity: an unbounded quantile (+Inf bucket) becomes null."""
    if isinstance(value, float):
        return _clean(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
