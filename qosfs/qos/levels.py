"""Admission control for filesystem requests: rate levels, FIFO waiting, live limit changes.

A request (a read, a write or a metadata operation) is charged at every *level* it passes
-- the user inside a class, the class, the tenant, the backend -- and may proceed once each
level has admitted it. Each level holds up to five token buckets (``read_bytes``,
``write_bytes``, ``read_ops``, ``write_ops``, ``meta_ops``; see :mod:`qosfs.qos.bucket`).

Design, and why:

* **Levels are passed in order, most specific first** (``[user, class, tenant, backend]``).
  A request is charged at a level when it passes it, then moves on to the next one. A
  request throttled by its own class therefore never holds a reservation on the shared
  backend while it waits: reserving a shared level ahead of time would let a throttled
  checkpoint storm steal the protected classes' backend tokens.
* **Wait, then charge** at each level. Waiters queue FIFO per (level, kind) -- reads, writes
  and metadata use disjoint buckets, so they do not queue behind each other. Only the head
  of a queue has a timer; it sleeps until its buckets cover it, charges, leaves, and hands
  the turn to the next waiter. Nothing is charged while waiting, so cancelling a waiter
  only has to refund the levels it already passed, and a limit change needs no
  bookkeeping of reservations: the head simply re-computes its delay. Rates stay exact
  because the head is admitted at the very instant the balance covers it and the balance
  keeps accruing (the head needs at most ``burst`` tokens, so nothing is lost to the cap).
  Oversized requests still take the bucket into debt (see :mod:`qosfs.qos.bucket`).
* **Live change wakes waiters**: :meth:`RateLevel.set_limits` sets and replaces a
  per-level :class:`trio.Event` that every queue head sleeps on, so a request parked under
  1 MiB/s goes through in the same instant the cap is raised to 1 GiB/s; the waiters
  behind it follow in FIFO order, each re-checking as it becomes head.
* **Fast path**: when no one is queued and the buckets cover the request, :func:`admit`
  charges and returns without a checkpoint, a log call or an allocation of its own.
* No background refill task, no polling: buckets refill lazily from elapsed time, read
  through :func:`trio.current_time`, so tests run exactly and instantly on
  :class:`trio.testing.MockClock`.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import trio

from qosfs.qos.bucket import (
    DEFAULT_BURST_SECONDS,
    LIMIT_NAMES,
    NO_LIMITS,
    UNLIMITED,
    LevelLimits,
    Limit,
    TokenBucket,
)

__all__ = [  # the limit values are re-exported from qosfs.qos.bucket for convenience
    "DEFAULT_BURST_SECONDS",
    "NO_LIMITS",
    "UNLIMITED",
    "FairShareGroup",
    "Kind",
    "LevelLimits",
    "LevelStatistics",
    "Limit",
    "RateLevel",
    "Stage",
    "admit",
    "admit_rest",
    "refund_bytes",
    "try_admit",
]

# A head whose buckets are short by less than this much time is admitted (the shortfall is
# kept as debt, so nothing drifts). Without it, float rounding could leave a delay so small
# that ``now + delay == now`` and the head would spin without the clock advancing.
_EPSILON = 1e-9

_INF = math.inf


class Kind(enum.IntEnum):
    """What a request consumes: READ/WRITE charge bytes and ops, META charges meta ops."""

    READ = 0
    WRITE = 1
    META = 2


_READ = Kind.READ
_WRITE = Kind.WRITE


@dataclass(frozen=True, slots=True)
class LevelStatistics:
    """A snapshot of a level's counters (see :meth:`RateLevel.statistics`)."""

    name: str
    limits: LevelLimits
    bytes_read: int
    bytes_written: int
    ops_read: int
    ops_write: int
    ops_meta: int
    throttled_seconds: float
    queue_depth: int
    waits: int


class Stage(Protocol):
    """What :func:`admit` needs of a level: :class:`RateLevel`, or a class's port to the
    backend (:class:`qosfs.qos.backend.ClassPort`), which dispatches by priority."""

    @property
    def _limited(self) -> tuple[bool, ...]: ...

    @property
    def _queues(self) -> Sequence[object]: ...

    def _try_pass(self, kind: Kind, nbytes: int, now: float) -> bool: ...

    def _count(self, kind: Kind, nbytes: int, ops: int) -> None: ...

    def _refund(self, kind: Kind, nbytes: int, ops: int) -> None: ...

    async def _wait(self, kind: Kind, nbytes: int) -> float: ...


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


class RateLevel:
    """One named set of buckets that requests are charged at: a class, tenant, user, backend.

    Counters are plain attributes bumped without locks (trio runs one task at a time) and
    read by the metrics collector at scrape time: ``bytes_read``, ``bytes_written``,
    ``ops_read``, ``ops_write``, ``ops_meta`` (admitted traffic; refunds subtract),
    ``throttled_seconds`` (total time requests spent parked here), ``queue_depth``
    (requests parked now) and ``waits`` (requests that ever had to park here).

    Args:
        name: For ``repr``, statistics and metrics labels.
        limits: Initial limits; can be built outside a trio run.
    """

    __slots__ = (
        "_bytes_by_kind",
        "_changed",
        "_limited",
        "_ops_by_kind",
        "_queues",
        "buckets",
        "bytes_read",
        "bytes_written",
        "limits",
        "name",
        "ops_meta",
        "ops_read",
        "ops_write",
        "queue_depth",
        "throttled_seconds",
        "waits",
    )

    def __init__(self, name: str, limits: LevelLimits = NO_LIMITS) -> None:
        self.name = name
        self.limits = limits
        self.buckets: dict[str, TokenBucket] = {
            key: TokenBucket(limit.rate, limit.effective_burst)
            for key in LIMIT_NAMES
            for limit in (getattr(limits, key),)
        }
        self.bytes_read = self.bytes_written = 0
        self.ops_read = self.ops_write = self.ops_meta = 0
        self.throttled_seconds = 0.0
        self.queue_depth = self.waits = 0
        self._queues: tuple[deque[trio.Event], ...] = (deque(), deque(), deque())
        self._changed = trio.Event()  # set and replaced by every set_limits()
        self._index_buckets()

    def _index_buckets(self) -> None:
        """Precompute, per kind, the limited buckets involved (None = unlimited)."""
        b = {key: (None if bucket.unlimited else bucket) for key, bucket in self.buckets.items()}
        self._bytes_by_kind = (b["read_bytes"], b["write_bytes"], None)
        self._ops_by_kind = (b["read_ops"], b["write_ops"], b["meta_ops"])
        self._limited = tuple(
            x is not None or y is not None
            for x, y in zip(self._bytes_by_kind, self._ops_by_kind, strict=True)
        )

    def set_limits(self, limits: LevelLimits) -> None:
        """Apply new limits now and wake every queue head so it re-checks against them.

        Must be called inside a trio run (it reads :func:`trio.current_time`). Each bucket
        keeps what it earned under the old rate; how the balance and any debt carry over
        is described in :meth:`qosfs.qos.bucket.TokenBucket.set_rate`. Heads re-compute their
        delay in the same instant; the requests behind them follow in FIFO order, so a
        raised cap drains the whole queue at once, and a lowered cap applies to every
        request not yet admitted.
        """
        now = trio.current_time()
        for key, bucket in self.buckets.items():
            limit: Limit = getattr(limits, key)
            bucket.set_rate(limit.rate, limit.effective_burst, now)
        self.limits = limits
        self._index_buckets()
        self._changed.set()
        self._changed = trio.Event()

    def statistics(self) -> LevelStatistics:
        """A frozen snapshot of the counters and current limits."""
        return LevelStatistics(
            self.name,
            self.limits,
            self.bytes_read,
            self.bytes_written,
            self.ops_read,
            self.ops_write,
            self.ops_meta,
            self.throttled_seconds,
            self.queue_depth,
            self.waits,
        )

    def __repr__(self) -> str:
        limited = " ".join(
            f"{key}={_number(limit.rate)}/s"
            for key in LIMIT_NAMES
            for limit in (getattr(self.limits, key),)
            if limit.rate != _INF
        )
        return (
            f"<RateLevel {self.name!r} {limited or 'unlimited'} "
            f"queue_depth={self.queue_depth} waits={self.waits}>"
        )

    # -- internals used by admit(); all synchronous, so never interrupted halfway ---------

    def _count(self, kind: Kind, nbytes: int, ops: int) -> None:
        if kind is _READ:
            self.bytes_read += nbytes
            self.ops_read += ops
        elif kind is _WRITE:
            self.bytes_written += nbytes
            self.ops_write += ops
        else:
            self.ops_meta += ops

    def _try_pass(self, kind: Kind, nbytes: int, now: float) -> bool:
        """Charge and count the request if nobody is queued and every bucket covers it."""
        if self._queues[kind]:
            return False
        b = self._bytes_by_kind[kind]
        if b is not None and not b.try_take(nbytes, now):
            return False
        o = self._ops_by_kind[kind]
        if o is not None and not o.try_take(1, now):
            if b is not None:
                b.refund(nbytes)
            return False
        self._count(kind, nbytes, 1)
        return True

    def _delay(self, kind: Kind, nbytes: int, now: float) -> float:
        b = self._bytes_by_kind[kind]
        o = self._ops_by_kind[kind]
        delay = 0.0 if b is None else b.delay_for(nbytes, now)
        return delay if o is None else max(delay, o.delay_for(1, now))

    def _charge(self, kind: Kind, nbytes: int, now: float) -> None:
        b = self._bytes_by_kind[kind]
        if b is not None:
            b.take(nbytes, now)
        o = self._ops_by_kind[kind]
        if o is not None:
            o.take(1, now)
        self._count(kind, nbytes, 1)

    def charge_bytes(self, kind: Kind, nbytes: int) -> None:
        """Charge bytes already moved (no op, no waiting): the bucket goes into debt,
        which the next requests here pay. Refills first, or the debt would vanish into
        the tokens earned while idle."""
        b = self._bytes_by_kind[kind]
        if b is not None:
            b.take(nbytes, trio.current_time())
        self._count(kind, nbytes, 0)

    def _refund(self, kind: Kind, nbytes: int, ops: int) -> None:
        b = self._bytes_by_kind[kind]
        if b is not None:
            b.refund(nbytes)
        o = self._ops_by_kind[kind]
        if o is not None and ops:
            o.refund(ops)
        self._count(kind, -nbytes, -ops)

    async def _wait(self, kind: Kind, nbytes: int) -> float:
        """Park FIFO until this level admits the request, then charge it.

        Returns the seconds spent parked. On cancellation nothing has been charged here.
        """
        queue = self._queues[kind]
        turn = trio.Event()  # set by the predecessor when this waiter becomes head
        queue.append(turn)
        self.queue_depth += 1
        self.waits += 1
        start = trio.current_time()
        try:
            if queue[0] is not turn:
                await turn.wait()
            while True:
                now = trio.current_time()
                delay = self._delay(kind, nbytes, now)
                if delay <= _EPSILON:
                    break
                changed = self._changed  # only the head sleeps, so one timer per queue
                with trio.move_on_at(now + delay):
                    await changed.wait()
            self._charge(kind, nbytes, now)
        finally:
            waited = trio.current_time() - start
            self.throttled_seconds += waited
            self.queue_depth -= 1
            if queue[0] is turn:
                queue.popleft()
                if queue:
                    queue[0].set()
            else:  # cancelled while not yet head
                queue.remove(turn)
        return waited


async def admit(levels: Sequence[Stage], kind: Kind, nbytes: int) -> float:
    """Charge a request at every level, in order, waiting wherever a level is short.

    Args:
        levels: Most specific first, e.g. ``[user, class, tenant, backend]``; a request
            is charged at a level when it passes it (see the module docstring for why).
        kind: READ and WRITE charge ``nbytes`` plus one op; META charges one meta op.
        nbytes: Bytes requested (ignored for META).

    Returns:
        Seconds spent waiting (0.0 on the fast path, which never checkpoints).

    Raises:
        trio.Cancelled: if cancelled while waiting; every level already passed is
            refunded and the waiter leaves its queue, so nothing is lost or stuck.
    """
    start = try_admit(levels, kind, nbytes)
    return 0.0 if start < 0 else await admit_rest(levels, start, kind, nbytes)


def try_admit(levels: Sequence[Stage], kind: Kind, nbytes: int) -> int:
    """The fast path of :func:`admit`, without a coroutine: charge the levels, in order,
    that admit the request at once.

    Returns -1 if every level did (the request may go), else the index of the first one
    that did not: the levels before it are charged, and the caller must finish with
    ``await admit_rest(levels, index, kind, nbytes)``. Hot paths call this first so that
    a request that does not wait costs no coroutine (bench/machinery.py).
    """
    now = -_INF
    for index, level in enumerate(levels):
        if level._limited[kind] or level._queues[kind]:
            if now == -_INF:
                now = trio.current_time()
            if not level._try_pass(kind, nbytes, now):
                return index
        else:
            level._count(kind, nbytes, 1)
    return -1


async def admit_rest(levels: Sequence[Stage], start: int, kind: Kind, nbytes: int) -> float:
    """Finish an admission :func:`try_admit` could not complete: wait at ``levels[start]``,
    which could not admit at once, then pass the rest (see :func:`admit`)."""
    passed = start  # levels[:passed] have charged this request
    waited = 0.0
    try:
        for index in range(start, len(levels)):
            level = levels[index]
            if index == start or not level._try_pass(kind, nbytes, trio.current_time()):
                waited += await level._wait(kind, nbytes)
            passed = index + 1
    except BaseException:
        for level in levels[:passed]:
            level._refund(kind, nbytes, 1)
        raise
    return waited


def refund_bytes(levels: Sequence[Stage], kind: Kind, nbytes: int) -> None:
    """Give back bytes that were admitted but not transferred (a short read at EOF).

    Without it, a 4 KiB file read with the kernel's 128 KiB readahead would be charged
    32 times its size. The op stays charged: the operation did happen.
    """
    if nbytes > 0:
        for level in levels:
            level._refund(kind, nbytes, 0)


class FairShareGroup:
    """A class level whose limits are split equally among its currently active users.

    ``parent`` carries the class's full limits and caps the total; each active uid gets a
    child level with ``parent.limits / active_users``. The split is work-conserving at the
    granularity of activity: a user is active while it has a request parked at its level
    or made one within ``idle_after`` seconds; when it goes idle its share is re-split
    among the others (by ``set_limits``, which wakes their waiters), and when a new user
    arrives everybody's share shrinks. Idle children are dropped (memory stays bounded by
    the users active at once; per-user counters restart, the parent's are authoritative).

    Expiry is lazy -- checked when :meth:`level_for` is called and the earliest possible
    expiry has passed -- so no background task is needed; a scheduler may also call
    :meth:`expire` from a periodic tick.

    Charge a request at ``[group.level_for(uid), group.parent, <tenant>, <backend>]``.
    """

    __slots__ = ("_children", "_next_expiry", "_seen", "idle_after", "parent")

    def __init__(
        self, name: str, limits: LevelLimits = NO_LIMITS, *, idle_after: float = 2.0
    ) -> None:
        if not idle_after > 0.0:
            raise ValueError(f"idle_after must be > 0, got {idle_after!r}")
        self.parent = RateLevel(name, limits)
        self.idle_after = idle_after
        self._children: dict[int, RateLevel] = {}
        self._seen: dict[int, float] = {}
        self._next_expiry = _INF

    @property
    def children(self) -> dict[int, RateLevel]:
        """The active users' levels by uid (a copy)."""
        return dict(self._children)

    def set_limits(self, limits: LevelLimits) -> None:
        """Change the class limits live and re-split them among the active users."""
        self.parent.set_limits(limits)
        self._resplit()

    def level_for(self, uid: int) -> RateLevel:
        """The level of ``uid``, created (and shares re-split) if the user was idle.

        Call it once per request: it also records the user's activity.
        """
        now = trio.current_time()
        if now >= self._next_expiry:
            self._expire(now)
        child = self._children.get(uid)
        if child is None:
            share = self.parent.limits.scaled(1.0 / (len(self._children) + 1))
            child = RateLevel(f"{self.parent.name}/uid={uid}", share)
            self._children[uid] = child
            self._resplit()
            self._next_expiry = min(self._next_expiry, now + self.idle_after)
        self._seen[uid] = now
        return child

    def expire(self) -> int:
        """Drop the users idle for ``idle_after`` seconds now; return how many went."""
        return self._expire(trio.current_time())

    def _expire(self, now: float) -> int:
        cutoff = now - self.idle_after
        idle = []
        for uid, seen in self._seen.items():
            if seen <= cutoff:
                if self._children[uid].queue_depth:
                    self._seen[uid] = now  # parked requests keep a user active
                else:
                    idle.append(uid)
        for uid in idle:
            del self._children[uid], self._seen[uid]
        if idle:
            self._resplit()
        self._next_expiry = min(self._seen.values(), default=_INF) + self.idle_after
        return len(idle)

    def _resplit(self) -> None:
        if self._children:
            share = self.parent.limits.scaled(1.0 / len(self._children))
            for child in self._children.values():
                child.set_limits(share)

    def __repr__(self) -> str:
        return f"<FairShareGroup {self.parent.name!r} active_users={len(self._children)}>"
