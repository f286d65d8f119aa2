"""The QoS engine of a policy: classes, tenants, users and the backend as rate levels.

At open, a file is classified (path, uid, gid, op, job) into a class and a tenant, and
bound to a :class:`PolicyFlow`: the chain of :class:`~qosfs.qos.levels.Level` it is
charged to, most specific first (user, class, tenant, backend). Every read/write is first
offered to :func:`~qosfs.qos.levels.try_admit`, which charges the whole chain at once when
it can (most requests); otherwise it parks (:meth:`PolicyFlow._park`, within the parking
lot's bounds and for as long as its caller lives) until every level has admitted it.

A policy is swapped whole (:meth:`PolicyQos.swap`): levels of classes and tenants that
survive by name keep their bucket state and get the new limits through ``set_limits``,
which wakes every request parked there so it re-checks at once. Open files of a class
that disappeared are re-bound to ``default``.

Automatic caps (:mod:`qosfs.qos.latency_control`) are kept apart from the policy: the engine
holds them per class name (:meth:`PolicyQos.set_auto_caps`) and a class level enforces the
lower of its configured cap and its automatic one, so a swap or ``ctl set`` re-applies the
automatic cap at once, bounded by the new configured cap, and the policy stays what the
administrator wrote.

Every level is built through one token store, a :class:`~qosfs.qos.levels.LevelFactory`
(the ``level_factory`` argument; in-process token buckets by default): class, per-user
group, tenant and backend levels alike, each with its policy ``scope``. What a store does
with a scope, and which policy changes it refuses, is its own business: a new store
needs no change here. The filesystem and the control layer reach this engine through
:class:`qosfs.qos.interface.QosEngine` only.
"""

from __future__ import annotations

import errno
import functools
import logging
import math
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import trio

from qosfs.core.limit_kinds import BY_KEY, LIMIT_KINDS, default_burst
from qosfs.policy.classify import CallerKey, Classifier, JobCache, compile_path_globs
from qosfs.policy.model import ClassRule, Limits, Policy, stream_threshold
from qosfs.qos.accounting import AccountKey, Accounts, record_latency
from qosfs.qos.backend import BackendLevel, ClassPort, Share
from qosfs.qos.bounds import ParkingLot
from qosfs.qos.bucket import LevelLimits, Limit
from qosfs.qos.charge import InodeCharge
from qosfs.qos.explain import Asked, explain
from qosfs.qos.interface import (
    NO_CALLER_WATCH,
    THREADS_PER_FLOW,
    XATTR_CANARY,
    XATTR_CHARGED,
    XATTR_FREE,
    Caller,
    CallerWatch,
    Classified,
    Flow,
    PathSource,
)
from qosfs.qos.latency_probe import PROBE_XATTR
from qosfs.qos.levels import (
    FairShareGroup,
    Kind,
    Level,
    LevelFactory,
    RateLevel,
    admit_rest,
    local_level,
    refund_bytes,
    try_admit,
)
from qosfs.qos.stats import NO_AUTO_CAPS, AutoCaps, EngineCounters, EngineStatistics

if TYPE_CHECKING:
    import pyfuse3

log = logging.getLogger(__name__)


def level_limits(limits: Limits) -> LevelLimits:
    """The bucket limits of a policy :class:`~qosfs.policy.model.Limits` (bursts resolved),
    one bucket per row of the table of limit kinds."""
    buckets = {}
    for kind in LIMIT_KINDS:
        cap = limits.get(kind.key)
        if cap is not None:
            buckets[kind.bucket] = Limit(cap, limits.burst_of(kind, cap))
    return LevelLimits(**buckets)


_READ, _WRITE, _META = Kind.READ, Kind.WRITE, Kind.META
_monotonic = time.monotonic
_CALLER_FIELDS = len(CallerKey._fields)
_CAPABILITY_XATTR = b"security.capability"


def class_limits(limits: Limits, auto: AutoCaps = NO_AUTO_CAPS) -> LevelLimits:
    """The bucket limits of a class: its configured caps, lowered by automatic ones.

    Where the automatic cap is the lower one, its bucket holds 100 ms of it (at least
    1 MiB), or the configured ``burst`` if that is smaller: a configured burst sized for
    the static cap (say 128 MiB) would let a storm through a cap meant to protect latency.
    """
    base = level_limits(limits)
    if auto == NO_AUTO_CAPS:
        return base
    buckets = dict(base.set_items())
    for key in ("read_bandwidth", "write_bandwidth"):
        kind = BY_KEY[key]
        cap: float | None = getattr(auto, key)
        configured = limits.get(key)
        if cap is not None and (configured is None or cap < configured):
            burst = default_burst(kind, cap)
            configured_burst = limits.get(kind.burst_key)
            if configured_burst is not None:
                burst = min(burst, float(configured_burst))
            buckets[kind.bucket] = Limit(cap, burst)
    return LevelLimits(**buckets)


def backend_share(rule: ClassRule) -> Share:
    """How a class competes for the declared backend capacity."""
    return Share(weight=float(rule.priority_weight),
                 min_read_bandwidth=rule.min_read_bandwidth or 0.0,
                 min_write_bandwidth=rule.min_write_bandwidth or 0.0)


def _cache_timeouts(policy: Policy) -> Callable[[str], tuple[float | None, float | None]] | None:
    """What ``entry_timeout``/``attr_timeout`` an object's path gets under *policy*: for
    each, the first class in policy order that sets it and whose paths match (the default
    class matches everything); None for a key no class decides (the mount's option).
    None when no class sets either, so the filesystem skips the path lookup altogether.

    By path alone, not by caller: the kernel caches a name and an inode's attributes for
    every process, so a timeout that depended on who asked would apply to everyone anyway.
    """
    rules = [(None if rule.name == "default" else compile_path_globs(rule.paths),
              rule.entry_timeout, rule.attr_timeout)
             for rule in policy.classes
             if rule.entry_timeout is not None or rule.attr_timeout is not None]
    if not rules:
        return None

    @functools.lru_cache(maxsize=16384)
    def timeouts(path: str) -> tuple[float | None, float | None]:
        entry: float | None = None
        attr: float | None = None
        for pattern, entry_timeout, attr_timeout in rules:
            if pattern is not None and pattern.fullmatch(path) is None:
                continue
            if entry is None:
                entry = entry_timeout
            if attr is None:
                attr = attr_timeout
            if entry is not None and attr is not None:
                break
        return entry, attr

    return timeouts


class ClassState:
    """The live state of one class: its level (or per-user group) and its thread pool."""

    def __init__(self, rule: ClassRule, auto: AutoCaps = NO_AUTO_CAPS,
                 factory: LevelFactory = local_level) -> None:
        self.rule = rule
        self.auto = auto
        limits = class_limits(rule.limits, auto)
        self.group: FairShareGroup | None = None
        self.level: Level
        if rule.per_user:  # the store builds the split too: it may count users elsewhere
            self.group = factory.fair_share(rule.name, limits, rule.scope)
            self.level = self.group.parent
        else:
            self.level = factory(rule.name, limits, rule.scope)
        # Threads for blocking calls are per class: a class whose backend calls hang
        # cannot take the threads another class needs.
        self.threads = trio.CapacityLimiter(THREADS_PER_FLOW)

    def update(self, rule: ClassRule, auto: AutoCaps = NO_AUTO_CAPS) -> None:
        self.rule = rule
        self.auto = auto
        self.set_limits(class_limits(rule.limits, auto))

    def set_limits(self, limits: LevelLimits) -> None:
        """Limits in force now, through the per-user group when there is one (it re-splits
        them among the active users); wakes every request parked at the class."""
        if self.group is not None:
            self.group.set_limits(limits)
        else:
            self.level.set_limits(limits)


class PolicyFlow:
    """What one (class, tenant, uid) is charged to; shared by all its open files."""

    __slots__ = (
        "__weakref__",
        "_accounts",
        "_chain",
        "backend",
        "callers",
        "cls",
        "direct_io",
        "limited",
        "open_files",
        "parking",
        "stats",
        "tenant",
        "tenant_name",
        "threads",
        "uid",
    )

    def __init__(self, cls: ClassState, tenant: Level | None, backend: BackendLevel | None,
                 uid: int, tenant_name: str | None = None,
                 accounts: Accounts | None = None, parking: ParkingLot | None = None,
                 callers: CallerWatch = NO_CALLER_WATCH) -> None:
        self.uid = uid
        self.parking = parking if parking is not None else ParkingLot()
        self.callers = callers  # who a parked request's caller is (qosfs.qos.interface)
        self.limited = True  # admission also counts per level, so it is always called
        self.open_files = 0
        self.tenant = tenant
        self.tenant_name = tenant_name
        self._accounts = accounts if accounts is not None else Accounts()
        self.backend = backend
        self.bind(cls)

    def bind(self, cls: ClassState) -> None:
        """(Re)attach to a class, e.g. after a swap removed the old one."""
        self.cls = cls
        self.direct_io = cls.rule.reads_bypass_cache
        self.threads = cls.threads
        # Traffic counters (qosfs.qos.accounting): per uid only where the class is per-user.
        self.stats = self._accounts.get(cls.rule.name, self.tenant_name,
                                        self.uid if cls.rule.per_user else None)
        chain: list[Level | ClassPort] = [cls.level]
        if self.tenant is not None:
            chain.append(self.tenant)
        if self.backend is not None:
            chain.append(self.backend.port(cls.rule.name, backend_share(cls.rule)))
        self._chain = chain

    def _levels(self) -> list[Level | ClassPort]:
        group = self.cls.group
        if group is None:
            return self._chain
        return [group.level_for(self.uid), *self._chain]

    # Each tries the coroutine-free fast path first (levels.try_admit): most requests
    # never wait, and an awaited admit() per request was a measurable part of what a
    # policy adds to a lookup (bench/machinery.py).

    async def admit_read(self, nbytes: int) -> float:
        """Wait until every level admits the read; returns the seconds spent waiting.

        Raises:
            OSError: EAGAIN if it would have to wait and the parking lot is full
                (:mod:`qosfs.qos.bounds`); EINTR if its caller was killed while it waited.
        """
        levels = self._levels()
        start = try_admit(levels, _READ, nbytes)
        if start < 0:
            return 0.0
        return await self._park(levels, start, _READ, nbytes,
                                self.callers.current_caller(nbytes))

    async def admit_write(self, nbytes: int) -> float:
        """As :meth:`admit_read`, for a write."""
        levels = self._levels()
        start = try_admit(levels, _WRITE, nbytes)
        if start < 0:
            return 0.0
        return await self._park(levels, start, _WRITE, nbytes,
                                self.callers.current_caller(nbytes))

    async def admit_meta(self) -> None:
        levels = self._levels()
        start = try_admit(levels, _META, 0)
        if start >= 0:
            await self._park(levels, start, _META, 0, None)
        self.stats.meta_ops += 1

    async def _park(self, levels: list[Level | ClassPort], start: int, kind: Kind,
                    nbytes: int, caller: Caller | None) -> float:
        """Wait at ``levels[start:]`` (try_admit charged the levels before), within the
        parking lot's bounds and for as long as the caller lives."""
        uid = self.uid if caller is None else caller.uid  # the writer, not the opener
        cls = self.cls.rule.name
        held = nbytes if kind is _WRITE else 0  # the data a parked write holds
        lot = self.parking
        if not lot.enter(uid, cls, held):
            for level in levels[:start]:
                level.refund(kind, nbytes, 1)
            raise OSError(errno.EAGAIN, "too many requests waiting for tokens")
        try:
            with self.callers.cancelled_if_killed(caller):
                return await admit_rest(levels, start, kind, nbytes)
            raise OSError(errno.EINTR, "caller killed while waiting for tokens")
        finally:
            lot.leave(uid, cls, held)

    def refund_read(self, nbytes: int) -> None:
        """Give back what a short read (EOF) was charged but did not transfer."""
        refund_bytes(self._levels(), Kind.READ, nbytes)

    def refund_write_op(self) -> None:
        """Give back the write op, charged and counted, of a request that only finishes a
        caller's write the kernel split at a page boundary (:mod:`qosfs.qos.charge`); its
        bytes stay charged."""
        for level in self._levels():
            level.refund(Kind.WRITE, 0, 1)
        self.stats.write_ops -= 1

    def read_done(self, asked: int, nbytes: int, waited: float, backend_ns: int) -> None:
        """Count a read; a short one (EOF) is charged only what it transferred: the
        readahead of a small file is not charged."""
        if nbytes < asked:
            refund_bytes(self._levels(), Kind.READ, asked - nbytes)
        # FlowStats.record_read, inlined: a call more per read would cost more than this.
        stats = self.stats
        stats.read_bytes += nbytes
        stats.read_ops += 1
        record_latency(stats.read_backend, stats.read_latency, backend_ns, waited)
        if waited:
            stats.throttled_seconds += waited
        if stats.read_fine is not None:
            stats.read_fine.observe(backend_ns)

    @property
    def throttled_writes(self) -> bool:
        """Whether a cap (configured or automatic) bounds this flow's writes right now.

        Read per write (two attribute lookups): caps change live, by ``ctl set`` and by
        the latency controller.
        """
        tenant = self.tenant
        return self.cls.level.limited[Kind.WRITE] or (
            tenant is not None and tenant.limited[Kind.WRITE])

    @property
    def class_name(self) -> str:
        return self.cls.rule.name

    def passes_reads_through(self) -> bool:
        """Whether a read-only open of this flow made now may be read by the kernel alone
        (kernel FUSE passthrough): its class asks for it (``passthrough = "reads"``) and
        no level its reads pass caps them now -- the class (configured caps and the
        latency controller's automatic ones alike), a per-uid split, the tenant, the
        backend's share. Asked once per open, never per request; an open passed through
        stays so when a cap appears later (the kernel offers no way back), which
        :func:`qosfs.policy.model.passthrough_blocker` and docs/policy.md say."""
        rule = self.cls.rule
        if rule.passthrough != "reads" or rule.per_user:
            return False
        return not self.reads_capped()

    def reads_capped(self) -> bool:
        """Whether a level its reads pass caps them now (configured or automatic caps,
        a per-uid split, the tenant, the backend's share). Asked once per open: a flow
        whose reads nothing caps lets the filesystem read an open file ahead of its
        reads (:meth:`qosfs.passthrough.backing_io.BackingIO.prefetch`)."""
        return any(level.limited[_READ] for level in self._levels())

    def direct_io_for(self, accmode: int) -> bool:
        """Whether a file of this flow opened now with *accmode* bypasses the page cache.

        ``cache = "direct"``, or ``auto`` with a read cap: every open, so that a re-read
        cannot escape the cap through cached pages. ``direct-writes``: every writable
        open. ``auto`` with writes throttled now: write-only opens -- a checkpoint stream
        never reads its pages back, and cached they evict what protected readers cached
        and cost the writer a copy into fresh pages (bench isolation, checkpoints capped
        at 50 MiB/s, 3 alternating runs: reader p99 1.65x -> 1.00x its solo figure,
        throughput 81% -> 99%). Not read-write opens in ``auto``: the kernel refuses a
        shared mapping of a direct_io file (ENODEV), and mmap needs a readable descriptor.
        """
        if self.direct_io:
            return True
        if accmode == os.O_RDONLY:
            return False
        cache = self.cls.rule.cache
        if cache == "direct-writes":
            return True
        return cache == "auto" and accmode == os.O_WRONLY and self.throttled_writes

    def __repr__(self) -> str:
        return f"<PolicyFlow class={self.cls.rule.name} uid={self.uid} open={self.open_files}>"


class PolicyQos:
    """The QoS engine for a policy (implements :class:`qosfs.qos.interface.QosEngine`)."""

    needs_paths = True  # classes and tenants match path globs

    def __init__(self, policy: Policy, level_factory: LevelFactory = local_level,
                 callers: CallerWatch = NO_CALLER_WATCH) -> None:
        self.level_factory = level_factory  # builds every class, user, tenant, backend level
        # Who sends a parked request, and whether it is being killed: the mount's FUSE
        # introspection (qosfs.passthrough.interrupts); nobody, off a mount.
        self.callers = callers
        self.meta_limiter = trio.CapacityLimiter(THREADS_PER_FLOW)
        self.classes: dict[str, ClassState] = {}
        self.tenants: dict[str, Level] = {}
        self.backend: BackendLevel | None = None
        self._flows: dict[tuple[str, str | None, int], PolicyFlow] = {}
        self._all_flows: weakref.WeakSet[PolicyFlow] = weakref.WeakSet()
        self._jobs = JobCache()
        self.accounts = Accounts()  # traffic counters per (class, tenant, uid), for metrics
        self.users_expired = 0  # uid accounts folded into their class after going idle
        self._next_sweep = 0.0
        self.auto_caps: dict[str, AutoCaps] = {}  # by class name; see set_auto_caps()
        self.draining = False
        self.generation = 0
        self.parking = ParkingLot()  # bounds on requests waiting for tokens (qosfs.qos.bounds)
        self.policy = policy  # swap() replaces it; set first so swap() can compare
        self.stream_moves: dict[str, int] = {}  # opens moved as streaming writers, by class
        self.rename_charges: dict[str, int] = {}  # bytes charged at a rename, by class
        # Pids of the latency canary (qosfs.qos.latency_probe fills it while it runs).
        self.probe_tids: set[int] = set()
        self.swap(policy)

    # ------------------------------------------------------------------ policy swap

    def check_swap(self, policy: Policy) -> None:
        """PolicyError if `swap` would refuse *policy* (settings the token store was built
        from); callable outside the event loop, which `swap` is not (a successor checks
        the policy ``qosfs mount --policy`` names before its predecessor stops reading)."""
        self.level_factory.check_swap(self.policy, policy)

    def swap(self, policy: Policy) -> None:
        """Put *policy* in force at once; parked requests re-check against it.

        Raises:
            PolicyError: the token store refuses the change (settings it was built from,
                which take effect only when a mount starts); the running policy stays.
        """
        if self.generation:
            self.check_swap(policy)
        classifier = Classifier(policy)
        classes: dict[str, ClassState] = {}
        for rule in policy.classes:
            old = self.classes.get(rule.name)
            auto = self.auto_caps.get(rule.name, NO_AUTO_CAPS)
            if old is not None and old.rule.per_user == rule.per_user \
                    and old.rule.scope == rule.scope:
                old.update(rule, auto)
                classes[rule.name] = old
            else:
                classes[rule.name] = ClassState(rule, auto, self.level_factory)
        tenants: dict[str, Level] = {}
        scopes = {tenant.name: tenant.scope for tenant in self.policy.tenants}  # in force
        for tenant in policy.tenants:
            level = self.tenants.get(tenant.name)
            # Another scope is another level (the store may keep it elsewhere), as for a
            # class (ClassState is rebuilt above when its scope changes).
            if level is None or scopes.get(tenant.name) != tenant.scope:
                level = self.level_factory(f"tenant:{tenant.name}",
                                           level_limits(tenant.limits), tenant.scope)
            else:
                level.set_limits(level_limits(tenant.limits))
            tenants[tenant.name] = level
        if policy.backend is None:
            if self.backend is not None:
                self.backend.set_limits(LevelLimits())  # wake anything parked there
            backend = None
        else:
            limits = level_limits(policy.backend.limits)
            if self.backend is None:  # built with its limits: the first swap runs before trio
                backend = BackendLevel(limits, self.level_factory)
            else:
                backend = self.backend
                backend.set_limits(limits)
            for rule in policy.classes:
                backend.port(rule.name, backend_share(rule))
            backend.retire_ports({rule.name for rule in policy.classes})
        old_classes, old_tenants = self.classes, self.tenants
        self.policy, self.classifier = policy, classifier
        self._needs_job = policy.needs_job_lookup  # read per request: computed once here
        self._job_envs = policy.job_envs
        self._streaming = policy.streaming_target  # the class streaming writers move to
        self.classes, self.tenants, self.backend = classes, tenants, backend
        self.meta_limited = policy.meta_limited
        self.cache_timeouts = _cache_timeouts(policy)
        self._rebind(old_classes, old_tenants)
        for key in self.accounts.set_user_series(policy.exported.user_series):
            self._fold(key)
        self.auto_caps = {k: v for k, v in self.auto_caps.items() if k in classes}
        self.generation += 1
        log.info("policy generation %d in force (%d classes, %d tenants, from %s)",
                 self.generation, len(classes), len(tenants), policy.source)

    def _rebind(self, old_classes: dict[str, ClassState],
                old_tenants: dict[str, Level]) -> None:
        default = self.classes["default"]
        for flow in list(self._all_flows):
            cls = self.classes.get(flow.cls.rule.name)
            if flow.tenant is not None and flow.tenant not in self.tenants.values():
                flow.tenant = None
                flow.tenant_name = None
            flow.backend = self.backend
            flow.bind(cls if cls is not None else default)
        # Anything still parked at a level that left the policy must not wait for ever.
        for name, state in old_classes.items():
            if self.classes.get(name) is not state:
                state.set_limits(LevelLimits())
        for name, level in old_tenants.items():
            if self.tenants.get(name) is not level:
                level.set_limits(LevelLimits())
        self._flows = {k: f for k, f in self._flows.items()
                       if self.classes.get(k[0]) is f.cls}
        self.accounts.retain(self._account_in_policy)

    def _account_in_policy(self, key: AccountKey) -> bool:
        """Keep the accounts of every class and tenant still in the policy. Those of the
        other per_user setting stay too (no longer fed): dropping them made a class's
        recorded bytes vanish from stats and /metrics at every per_user toggle."""
        cls, tenant, _ = key
        return cls in self.classes and (tenant is None or tenant in self.tenants)

    def _fold(self, key: AccountKey) -> bool:
        """Fold a uid's account into its class's uid-less one; flows that counted into it
        count there from now on (qosfs.qos.accounting: no series goes backwards)."""
        folded = self.accounts.fold(key)
        if folded is None:
            return False
        old, into = folded
        for flow in list(self._all_flows):
            if flow.stats is old:
                flow.stats = into
        return True

    def expire_idle_users(self, now: float) -> int:
        """Fold the accounts of uids idle for the policy's ``user_series_idle`` with no
        file open, and forget cached flows with no open file (a later open makes a new
        one, with a fresh per-uid account if the class has room). Call it often (every
        second); it does its work at most every quarter of the idle time (1 s..60 s).
        Returns how many uids were folded."""
        if now < self._next_sweep:
            return 0
        idle_after = self.policy.exported.user_series_idle
        self._next_sweep = now + min(max(idle_after / 4, 1.0), 60.0)
        for state in self.classes.values():  # fair-share levels of users gone quiet
            if state.group is not None:
                state.group.expire()
        busy = {id(flow.stats) for flow in self._all_flows if flow.open_files > 0}
        folded = 0
        for key in self.accounts.idle_uids(now, idle_after):
            stats = self.accounts.get(*key)
            if id(stats) not in busy and self._fold(key):
                folded += 1
        self._flows = {k: f for k, f in self._flows.items() if f.open_files > 0}
        self.users_expired += folded
        return folded

    def drain(self) -> None:
        """Lift every limit at once: the daemon is shutting down.

        Throttling delays, it never drops: a request parked for tokens when SIGTERM
        arrives is still served, and it is served now rather than at the cap's pace, so a
        deep queue of checkpoint writes does not hold the unmount for minutes.
        """
        self.draining = True  # no automatic cap may come back (qosfs.qos.latency_control)
        for state in self.classes.values():
            state.set_limits(LevelLimits())
        for level in self.tenants.values():
            level.set_limits(LevelLimits())
        if self.backend is not None:
            self.backend.set_limits(LevelLimits())

    def getxattr_admission(self, name: bytes, pid: int) -> int:
        """The canary's getxattr of the probe attribute is answered at once (only its round
        trip matters). The kernel itself asks for security.capability before every write
        (to know whether the write must drop file capabilities): not the caller's
        metadata operation, so not charged (a meta_iops cap would throttle its writes)."""
        if name == PROBE_XATTR and pid in self.probe_tids:
            return XATTR_CANARY
        return XATTR_FREE if name == _CAPABILITY_XATTR else XATTR_CHARGED

    def set_auto_caps(self, name: str, caps: AutoCaps) -> bool:
        """Put the latency controller's caps for class *name* in force (parked requests
        re-check at once); the configured caps still bound them. Returns whether anything
        changed (unknown class, same caps, or shutting down: nothing)."""
        state = self.classes.get(name)
        if state is None or self.draining or state.auto == caps or state.rule.scope != "node":
            return False  # a level shared beyond this mount is its store's to steer
        if caps == NO_AUTO_CAPS:
            self.auto_caps.pop(name, None)
        else:
            self.auto_caps[name] = caps
        state.update(state.rule, caps)
        return True

    # ------------------------------------------------------------------ QosEngine

    def caller_key(self, ctx: pyfuse3.RequestContext, op: str) -> CallerKey:
        """What classification reads of this request besides the path (the memo's key)."""
        return CallerKey(op, ctx.uid, ctx.gid, ctx.pid if self._needs_job else 0)

    def _flow_for(self, path: str, ctx: pyfuse3.RequestContext, op: str) -> PolicyFlow:
        return self._classified(path, self.caller_key(ctx, op))

    def _classified(self, path: str, caller: CallerKey) -> PolicyFlow:
        job = self._jobs.get(caller.pid, self._job_envs) if self._needs_job else None
        rule, tenant = self.classifier.resolve(path, caller, job)
        return self._flow(rule.name, tenant.name if tenant is not None else None, caller.uid)

    def _flow(self, cls: str, tname: str | None, uid: int) -> PolicyFlow:
        key = (cls, tname, uid)
        flow = self._flows.get(key)
        if flow is None:
            flow = PolicyFlow(self.classes[cls], self.tenants.get(tname) if tname else None,
                              self.backend, uid, tname, self.accounts, self.parking,
                              self.callers)
            self._flows[key] = flow
            self._all_flows.add(flow)
        return flow

    def flow_key(self, flow: Flow) -> list[Any]:
        """[class, tenant or None, uid]: a flow is one per those three (`_flow`)."""
        assert isinstance(flow, PolicyFlow)  # this engine's open_flow made it
        return [flow.cls.rule.name, flow.tenant_name, flow.uid]

    def flow_from_key(self, key: Sequence[Any]) -> PolicyFlow:
        """The flow of [class, tenant, uid], made if need be (counting nothing: the open
        that comes with it counts itself). A class or tenant this policy lacks gives way
        to the default class or no tenant, as a policy swap rebinds flows (`_rebind`)."""
        name, tenant, uid = str(key[0]), key[1], int(key[2])
        if name not in self.classes:
            name = "default"
        if tenant is not None and tenant not in self.tenants:
            tenant = None
        return self._flow(name, None if tenant is None else str(tenant), uid)

    # ------------------------------------------------------------------ handover

    def _node_levels(self) -> list[tuple[tuple[str, str, int], Level]]:
        """Every class, user and tenant level, by (kind, name, uid or -1)."""
        levels: list[tuple[tuple[str, str, int], Level]] = []
        for name, st in self.classes.items():
            levels.append((("class", name, -1), st.level))
            if st.group is not None:
                levels += [(("user", name, uid), child)
                           for uid, child in st.group.children.items()]
        levels += [(("tenant", name, -1), level) for name, level in self.tenants.items()]
        return levels

    def export_balances(self, to_monotonic: float) -> list[list[Any]]:
        """What each limited bucket of this mount's levels holds, for a process that takes
        the mount over or a new event loop (trio's clock differs per run): [kind, name,
        uid, bucket, tokens, updated as ``time.monotonic()``], *to_monotonic* being
        ``time.monotonic() - trio.current_time()``. A cluster level's share is its
        coordinator's business, and the backend's tags start afresh."""
        balances: list[list[Any]] = []
        for key, level in self._node_levels():
            if not isinstance(level, RateLevel) or level.steering is not None:
                continue
            for name, bucket in level.buckets.items():
                if not bucket.unlimited and math.isfinite(bucket.updated):
                    balances.append([*key, name, bucket.tokens, bucket.updated + to_monotonic])
        return balances

    def import_balances(self, balances: list[list[Any]], to_trio: float) -> int:
        """Put `export_balances`' figures in force (inside a trio run; *to_trio* is
        ``trio.current_time() - time.monotonic()``): a cap goes on from where it stood,
        debt included, instead of from a full burst. Returns how many buckets took one."""
        levels = dict(self._node_levels())
        taken = 0
        for kind, name, uid, key, tokens, updated in balances:
            level = levels.get((kind, name, uid))
            if level is None and kind == "user" and name in self.classes:
                group = self.classes[name].group
                level = group.level_for(int(uid)) if group is not None else None
            if not isinstance(level, RateLevel) or level.steering is not None:
                continue
            bucket = level.buckets.get(key)
            if bucket is None or bucket.unlimited:
                continue
            bucket.tokens = min(float(tokens), bucket.burst)
            bucket.updated = float(updated) + to_trio
            taken += 1
        return taken

    # ------------------------------------------------------------------ streaming writers

    def stream_threshold(self, flow: Flow) -> int:
        """Bytes of mostly sequential writes after which a writable open of *flow* moves
        to the streaming class (:mod:`qosfs.qos.charge`); 0: never (no such class, or *flow*'s
        class caps writes itself or is that class)."""
        assert isinstance(flow, PolicyFlow)  # this engine's open_flow made it
        return stream_threshold(flow.cls.rule, self._streaming)

    def moved_to_streaming(self, flow: Flow) -> PolicyFlow:
        """The flow an open of *flow* continues in once it is seen streaming (same tenant
        and uid, the streaming class); counts the move by the class it leaves."""
        assert isinstance(flow, PolicyFlow)
        target = self._streaming
        if target is None or target.name not in self.classes:
            return flow
        name = flow.cls.rule.name
        self.stream_moves[name] = self.stream_moves.get(name, 0) + 1
        return self._flow(target.name, flow.tenant_name, flow.uid)

    def charge_renamed(self, paths: PathSource, node: Classified, ctx: pyfuse3.RequestContext,
                       charged: Flow, nbytes: int) -> PolicyFlow | None:
        """*node* was renamed; *nbytes* were written to it through *charged* (an uncapped
        class). If writes under its new name belong to a capped class, move the charge
        there now: that class goes into debt, which its next writes pay, and *charged*
        gets the bytes back. Returns that flow (for the file's open handles), or None."""
        assert isinstance(charged, PolicyFlow)
        flow = self._memo_flow(paths, node, ctx, "write")
        if flow.cls is charged.cls or not flow.throttled_writes:
            return None
        # Class, user and tenant levels move the bytes; the backend saw them already, so
        # only its share of them moves (the new class's dispatch tags advance).
        for level in flow._levels():
            level.charge_bytes(Kind.WRITE, nbytes)  # a backend port moves its share only
        for level in charged._levels():
            if not isinstance(level, ClassPort):
                level.refund(Kind.WRITE, nbytes, 0)
        name = flow.cls.rule.name
        self.rename_charges[name] = self.rename_charges.get(name, 0) + nbytes
        return flow

    def _memo_flow(self, paths: PathSource, node: Classified, ctx: pyfuse3.RequestContext,
                   op: str) -> PolicyFlow:
        """The flow for *op* on *node* by this caller, from the inode's memo when valid.

        Classifying (the path, then the rules) is paid on every lookup/getattr/create
        under a ``meta_iops`` cap and at every open. Requests come in runs on the same
        object (every lookup in a directory is charged at that directory), so one memo per
        inode, of its last classification, answers most of them. It is valid for the same
        :class:`~qosfs.policy.classify.CallerKey` (op, uid, gid, and pid when the policy
        reads jobs), under the same policy
        generation and path epoch (see :mod:`qosfs.passthrough.paths`), and for as long as the path
        it was made from is trusted.
        """
        # The key is the CallerKey's fields, then the policy generation and path epoch.
        # A flat tuple, and the CallerKey built from it only on a miss: building one per
        # request cost 150 ns (bench/machinery.py); _make() refuses a key that lacks a
        # field CallerKey gained, so the two cannot drift apart.
        key = (op, ctx.uid, ctx.gid, ctx.pid if self._needs_job else 0, self.generation,
               paths.epoch)
        memo: InodeCharge | None = node.qos_memo  # the inode's slot (qosfs.qos.charge)
        if memo is None:  # inlined inode_charge(): this runs on every metadata request
            memo = node.qos_memo = InodeCharge()
        if memo.memo_key == key and _monotonic() < memo.memo_until:
            memoized: PolicyFlow = memo.memo_flow
            return memoized
        path, deadline = paths.relpath_until(node)
        flow = self._classified(path, CallerKey._make(key[:_CALLER_FIELDS]))
        memo.memo_key, memo.memo_until, memo.memo_flow = key, deadline, flow
        return flow

    def open_flow(self, paths: PathSource, node: Classified, ctx: pyfuse3.RequestContext,
                  writing: bool) -> PolicyFlow:
        return self._memo_flow(paths, node, ctx, "write" if writing else "read")

    async def admit_meta(self, paths: PathSource, node: Classified,
                         ctx: pyfuse3.RequestContext) -> None:
        await self._memo_flow(paths, node, ctx, "meta").admit_meta()

    # ------------------------------------------------------------------ observation

    def statistics(self) -> EngineStatistics:
        """Every level's counters and limits in force, and the latency controller's caps."""
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
            auto_caps=dict(self.auto_caps),
        )

    def counters(self) -> EngineCounters:
        """This engine's own counters (what ``ctl status`` shows beside the levels)."""
        parking = self.parking
        return EngineCounters(
            streaming_moves=dict(self.stream_moves),
            rename_charged_bytes=dict(self.rename_charges),
            user_accounts=self.accounts.uid_keys, users_expired=self.users_expired,
            parked_requests=parking.requests, parked_bytes=parking.bytes,
            parking_refused=parking.refused)

    def open_classes(self) -> set[str]:
        """The classes with a file open through them now (the latency controller runs its
        canary only while a class it protects has one)."""
        return {flow.cls.rule.name for flow in list(self._all_flows) if flow.open_files > 0}

    def explain(self, asked: Asked, *, pid: int, uid: int, gid: int, mountpoint: str | None,
                mount_cache: str) -> dict[str, Any]:
        """What *asked* gets under the policy in force, with the limits in force here
        (:func:`qosfs.qos.explain.explain`)."""
        return explain(self.classifier, asked, pid=pid, uid=uid, gid=gid,
                       mountpoint=mountpoint, live=self.statistics(), mount_cache=mount_cache)
