"""The QoS engine of a policy: classes, tenants, users and the backend as rate levels.

At open, a file is classified (path, uid, gid, op, job) into a class and a tenant, and
bound to a :class:`PolicyFlow`: the chain of :class:`~qosfs.limiter.RateLevel` it is
charged to, most specific first (user, class, tenant, backend). Every read/write waits in
:func:`qosfs.limiter.admit` until every level of its chain admits it.

A policy is swapped whole (:meth:`PolicyQos.swap`): levels of classes and tenants that
survive by name keep their bucket state and get the new limits through ``set_limits``,
which wakes every request parked there so it re-checks at once. Open files of a class
that disappeared are re-bound to ``default``.

The token-bucket state lives in :mod:`qosfs.limiter` behind ``RateLevel``; a shared
(cluster-wide) backend would replace how a level's buckets are charged, not this module
or ``fs.py``.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from qosfs.bucket import UNLIMITED, LevelLimits, Limit
from qosfs.classify import Classifier, JobCache, JobInfo
from qosfs.limiter import FairShareGroup, Kind, LevelStatistics, RateLevel, admit
from qosfs.policy import ClassRule, Limits, Policy
from qosfs.qos import THREADS_PER_FLOW

if TYPE_CHECKING:
    import pyfuse3

    from qosfs.inodes import Inode

log = logging.getLogger(__name__)


def level_limits(limits: Limits) -> LevelLimits:
    """The bucket limits of a policy :class:`~qosfs.policy.Limits` (bursts resolved)."""

    def bandwidth(cap: float | None) -> Limit:
        return UNLIMITED if cap is None else Limit(cap, limits.bandwidth_burst(cap))

    def iops(cap: float | None) -> Limit:
        return UNLIMITED if cap is None else Limit(cap, limits.iops_burst(cap))

    return LevelLimits(
        read_bytes=bandwidth(limits.read_bandwidth),
        write_bytes=bandwidth(limits.write_bandwidth),
        read_ops=iops(limits.read_iops),
        write_ops=iops(limits.write_iops),
        meta_ops=iops(limits.meta_iops),
    )


class ClassState:
    """The live state of one class: its level (or per-user group) and its thread pool."""

    def __init__(self, rule: ClassRule) -> None:
        self.rule = rule
        limits = level_limits(rule.limits)
        self.group: FairShareGroup | None = None
        if rule.per_user:
            self.group = FairShareGroup(rule.name, limits)
            self.level = self.group.parent
        else:
            self.level = RateLevel(rule.name, limits)
        # Threads for blocking calls are per class: a class whose backend calls hang
        # cannot take the threads another class needs.
        self.limiter = trio.CapacityLimiter(THREADS_PER_FLOW)

    def update(self, rule: ClassRule) -> None:
        self.rule = rule
        limits = level_limits(rule.limits)
        if self.group is not None:
            self.group.set_limits(limits)
        else:
            self.level.set_limits(limits)

    @property
    def read_capped(self) -> bool:
        lim = self.rule.limits
        return lim.read_bandwidth is not None or lim.read_iops is not None


class PolicyFlow:
    """What one (class, tenant, uid) is charged to; shared by all its open files."""

    __slots__ = ("cls", "tenant", "backend", "uid", "limited", "direct_io", "limiter",
                 "bytes_read", "bytes_written", "ops_read", "ops_write", "open_files",
                 "_chain", "__weakref__")

    def __init__(self, cls: ClassState, tenant: RateLevel | None, backend: RateLevel | None,
                 uid: int) -> None:
        self.uid = uid
        self.limited = True  # admission also counts per level, so it is always called
        self.bytes_read = self.bytes_written = self.ops_read = self.ops_write = 0
        self.open_files = 0
        self.tenant = tenant
        self.backend = backend
        self.bind(cls)

    def bind(self, cls: ClassState) -> None:
        """(Re)attach to a class, e.g. after a swap removed the old one."""
        self.cls = cls
        cache = cls.rule.cache
        self.direct_io = cache == "direct" or (cache == "auto" and cls.read_capped)
        self.limiter = cls.limiter
        chain = [cls.level]
        if self.tenant is not None:
            chain.append(self.tenant)
        if self.backend is not None:
            chain.append(self.backend)
        self._chain = chain

    def _levels(self) -> list[RateLevel]:
        group = self.cls.group
        if group is None:
            return self._chain
        return [group.level_for(self.uid), *self._chain]

    async def admit_read(self, nbytes: int) -> None:
        await admit(self._levels(), Kind.READ, nbytes)

    async def admit_write(self, nbytes: int) -> None:
        await admit(self._levels(), Kind.WRITE, nbytes)

    async def admit_meta(self) -> None:
        await admit(self._levels(), Kind.META, 0)

    def release(self) -> None:
        self.open_files -= 1

    def __repr__(self) -> str:
        return f"<PolicyFlow class={self.cls.rule.name} uid={self.uid} open={self.open_files}>"


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """A snapshot of every level's counters, for status, stats and metrics."""

    generation: int
    classes: dict[str, LevelStatistics]
    users: dict[str, dict[int, LevelStatistics]]
    tenants: dict[str, LevelStatistics]
    backend: LevelStatistics | None


class PolicyQos:
    """The QoS engine for a policy (implements :class:`qosfs.qos.QosEngine`)."""

    def __init__(self, policy: Policy) -> None:
        self.meta_limiter = trio.CapacityLimiter(THREADS_PER_FLOW)
        self.classes: dict[str, ClassState] = {}
        self.tenants: dict[str, RateLevel] = {}
        self.backend: RateLevel | None = None
        self._flows: dict[tuple[str, str | None, int], PolicyFlow] = {}
        self._all_flows: weakref.WeakSet[PolicyFlow] = weakref.WeakSet()
        self._jobs = JobCache()
        self.generation = 0
        self.swap(policy)

    # ------------------------------------------------------------------ policy swap

    def swap(self, policy: Policy) -> None:
        """Put *policy* in force at once; parked requests re-check against it."""
        classifier = Classifier(policy)
        classes: dict[str, ClassState] = {}
        for rule in policy.classes:
            old = self.classes.get(rule.name)
            if old is not None and old.rule.per_user == rule.per_user:
                old.update(rule)
                classes[rule.name] = old
            else:
                classes[rule.name] = ClassState(rule)
        tenants: dict[str, RateLevel] = {}
        for tenant in policy.tenants:
            level = self.tenants.get(tenant.name)
            if level is None:
                level = RateLevel(f"tenant:{tenant.name}", level_limits(tenant.limits))
            else:
                level.set_limits(level_limits(tenant.limits))
            tenants[tenant.name] = level
        if policy.backend is None:
            if self.backend is not None:
                self.backend.set_limits(LevelLimits())  # wake anything parked there
            backend = None
        elif self.backend is None:
            # Built with its limits, like a new tenant: set_limits() needs a running trio
            # loop, and the first swap happens in __init__, before the loop starts.
            backend = RateLevel("backend", level_limits(policy.backend.limits))
        else:
            backend = self.backend
            backend.set_limits(level_limits(policy.backend.limits))
        old_classes, old_tenants = self.classes, self.tenants
        self.policy, self.classifier = policy, classifier
        self.classes, self.tenants, self.backend = classes, tenants, backend
        self.meta_limited = any(c.limits.meta_iops is not None for c in policy.classes) or any(
            t.limits.meta_iops is not None for t in policy.tenants) or (
            backend is not None and policy.backend is not None
            and policy.backend.limits.meta_iops is not None)
        self._rebind(old_classes, old_tenants)
        self.generation += 1
        log.info("policy generation %d in force (%d classes, %d tenants, from %s)",
                 self.generation, len(classes), len(tenants), policy.source)

    def _rebind(self, old_classes: dict[str, ClassState],
                old_tenants: dict[str, RateLevel]) -> None:
        default = self.classes["default"]
        for flow in list(self._all_flows):
            cls = self.classes.get(flow.cls.rule.name)
            if flow.tenant is not None and flow.tenant not in self.tenants.values():
                flow.tenant = None
            flow.backend = self.backend
            flow.bind(cls if cls is not None else default)
        # Anything still parked at a level that left the policy must not wait for ever.
        for name, state in old_classes.items():
            if self.classes.get(name) is not state:
                (state.group.set_limits if state.group else state.level.set_limits)(LevelLimits())
        for name, level in old_tenants.items():
            if self.tenants.get(name) is not level:
                level.set_limits(LevelLimits())
        self._flows = {k: f for k, f in self._flows.items()
                       if self.classes.get(k[0]) is f.cls}

    # ------------------------------------------------------------------ QosEngine

    def _job(self, pid: int) -> JobInfo | None:
        if not self.policy.needs_job_lookup:
            return None
        return self._jobs.get(pid, self.policy.job_env)

    def _flow_for(self, path: str, ctx: pyfuse3.RequestContext, op: str) -> PolicyFlow:
        uid, gid = ctx.uid, ctx.gid
        rule = self.classifier.classify(path, uid, gid, op, self._job(ctx.pid))
        tenant = self.classifier.tenant_of(uid, gid, path)
        tname = tenant.name if tenant is not None else None
        key = (rule.name, tname, uid)
        flow = self._flows.get(key)
        if flow is None:
            flow = PolicyFlow(self.classes[rule.name],
                              self.tenants.get(tname) if tname else None, self.backend, uid)
            self._flows[key] = flow
            self._all_flows.add(flow)
        return flow

    def open_flow(self, fs: Any, inode: Inode, ctx: pyfuse3.RequestContext,
                  writing: bool) -> PolicyFlow:
        flow = self._flow_for(fs.relpath(inode), ctx, "write" if writing else "read")
        flow.open_files += 1
        return flow

    async def admit_meta(self, fs: Any, inode: Inode, ctx: pyfuse3.RequestContext) -> None:
        await self._flow_for(fs.relpath(inode), ctx, "meta").admit_meta()

    # ------------------------------------------------------------------ observation

    def statistics(self) -> EngineStatistics:
        users = {
            name: {uid: lvl.statistics() for uid, lvl in st.group.children.items()}
            for name, st in self.classes.items() if st.group is not None
        }
        return EngineStatistics(
            generation=self.generation,
            classes={name: st.level.statistics() for name, st in self.classes.items()},
            users=users,
            tenants={name: lvl.statistics() for name, lvl in self.tenants.items()},
            backend=self.backend.statistics() if self.backend is not None else None,
        )
