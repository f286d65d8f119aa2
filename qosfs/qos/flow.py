"""What a file's traffic is charged to: a class's live state and a flow's chain of levels.

A :class:`PolicyFlow` is one (class, tenant, uid): the :class:`~qosfs.qos.levels.Level`
chain its reads, writes and metadata requests pass, most specific first (user, class,
tenant, backend port). Every request is first offered to
:func:`~qosfs.qos.levels.try_admit`, which charges the whole chain at once when it can
(most requests); otherwise it parks (:meth:`PolicyFlow._park`), within the parking bounds
(:mod:`qosfs.qos.bounds`) and for as long as its caller lives, until every level has
admitted it. A :class:`ClassState` is what flows of a class share: its level (or per-user
split), the limits in force (configured caps lowered by automatic ones) and its threads.

This is the request path, kept apart from the engine (:mod:`qosfs.qos.engine`), which
decides which flow a request gets and keeps flows in step with the policy: a change there
cannot add a call here.
"""

from __future__ import annotations

import errno
import os

import trio

from qosfs.core.limit_kinds import BY_KEY, LIMIT_KINDS, default_burst
from qosfs.policy.model import ClassRule, Limits
from qosfs.qos.accounting import Accounts, record_latency
from qosfs.qos.backend import BackendLevel, ClassPort, Share
from qosfs.qos.bounds import ParkedCount
from qosfs.qos.bucket import LevelLimits, Limit
from qosfs.qos.interface import NO_CALLER_WATCH, THREADS_PER_FLOW, Caller, CallerWatch
from qosfs.qos.levels import Kind, Level, admit_rest, refund_bytes, try_admit
from qosfs.qos.stats import NO_AUTO_CAPS, AutoCaps
from qosfs.qos.store import FairShareGroup, LevelFactory, local_level

__all__ = ["ClassState", "PolicyFlow", "backend_share", "class_limits", "level_limits"]

_READ, _WRITE, _META = Kind.READ, Kind.WRITE, Kind.META


def level_limits(limits: Limits) -> LevelLimits:
    """The bucket limits of a policy :class:`~qosfs.policy.model.Limits` (bursts resolved),
    one bucket per row of the table of limit kinds."""
    buckets = {}
    for kind in LIMIT_KINDS:
        cap = limits.get(kind.key)
        if cap is not None:
            buckets[kind.bucket] = Limit(cap, limits.burst_of(kind, cap))
    return LevelLimits(**buckets)


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
                 accounts: Accounts | None = None, parking: ParkedCount | None = None,
                 callers: CallerWatch = NO_CALLER_WATCH) -> None:
        self.uid = uid
        self.parking = parking if parking is not None else ParkedCount()
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

    def chain(self) -> list[Level | ClassPort]:
        """The levels a request of this flow passes now, most specific first."""
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
            OSError: EAGAIN if it would have to wait and a parking bound is reached
                (:mod:`qosfs.qos.bounds`); EINTR if its caller was killed while it waited.
        """
        levels = self.chain()
        start = try_admit(levels, _READ, nbytes)
        if start < 0:
            return 0.0
        return await self._park(levels, start, _READ, nbytes,
                                self.callers.current_caller(nbytes))

    async def admit_write(self, nbytes: int) -> float:
        """As :meth:`admit_read`, for a write."""
        levels = self.chain()
        start = try_admit(levels, _WRITE, nbytes)
        if start < 0:
            return 0.0
        return await self._park(levels, start, _WRITE, nbytes,
                                self.callers.current_caller(nbytes))

    async def admit_meta(self) -> None:
        levels = self.chain()
        start = try_admit(levels, _META, 0)
        if start >= 0:
            await self._park(levels, start, _META, 0, None)
        self.stats.meta_ops += 1

    async def _park(self, levels: list[Level | ClassPort], start: int, kind: Kind,
                    nbytes: int, caller: Caller | None) -> float:
        """Wait at ``levels[start:]`` (try_admit charged the levels before), within the
        parking bounds and for as long as the caller lives."""
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
        refund_bytes(self.chain(), Kind.READ, nbytes)

    def read_done(self, asked: int, nbytes: int, waited: float, backend_ns: int) -> None:
        """Count a read; a short one (EOF) is charged only what it transferred: the
        readahead of a small file is not charged."""
        if nbytes < asked:
            refund_bytes(self.chain(), Kind.READ, asked - nbytes)
        # FlowStats.record_read, inlined: a call more per read would cost more than this.
        stats = self.stats
        stats.read_bytes += nbytes
        stats.read_ops += 1
        record_latency(stats.read_backend, stats.read_latency, backend_ns, waited)
        if waited:
            stats.throttled_seconds += waited
        if stats.read_fine is not None:
            stats.read_fine.observe(backend_ns)

    def refund_write_op(self) -> None:
        """Give back the write op, charged and counted, of a request that only finishes a
        caller's write the kernel split at a page boundary (:mod:`qosfs.qos.charge`); its
        bytes stay charged."""
        for level in self.chain():
            level.refund(Kind.WRITE, 0, 1)
        self.stats.write_ops -= 1

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
        (kernel FUSE passthrough): its class does not keep its reads in the daemon
        (``passthrough = "off"``, or a latency target measured on its own reads), and no
        level its reads pass caps them now -- the class (configured caps and the latency
        controller's automatic ones alike), a per-uid split, the tenant, the backend's
        share. Asked once per open, never per request; an open passed through stays so
        when a cap appears later (the kernel offers no way back), which
        :func:`qosfs.policy.model.passthrough_blocker` and docs/policy.md say."""
        rule = self.cls.rule
        if rule.passthrough == "off" or rule.per_user or rule.latency_needs_reads:
            return False
        return not self.reads_capped()

    def reads_capped(self) -> bool:
        """Whether a level its reads pass caps them now (configured or automatic caps,
        a per-uid split, the tenant, the backend's share). Asked once per open: a flow
        whose reads nothing caps lets the filesystem read an open file ahead of its
        reads (:meth:`qosfs.passthrough.backing_io.BackingIO.prefetch`)."""
        return any(level.limited[_READ] for level in self.chain())

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
