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
  behind it follow in FIFO order, each re-checking as it becomes head. A cap lifted
  altogether (SIGTERM's drain) leaves no tokens to queue for: every waiter of that kind
  is released at once, and newcomers no longer queue behind them.
* **Fast path first**: the request path calls :func:`try_admit`, a plain function: when
  no one is queued and the buckets cover the request it charges every level and returns,
  without a coroutine, a checkpoint, a log call or an allocation of its own. Only a
  request some level cannot admit at once goes on to :func:`admit_rest`, which waits
  (the engine wraps that in its parking bounds: :meth:`qosfs.qos.flow.PolicyFlow.
  admit_read`).
* **Levels come from a store** (:class:`qosfs.qos.store.LevelFactory`): in-process
  buckets (:data:`~qosfs.qos.store.local_level`) or levels shared between mounts
  (:mod:`qosfs.qos.cluster`).
* No background refill task, no polling: buckets refill lazily from elapsed time, read
  through :func:`trio.current_time`, so tests run exactly and instantly on
  :class:`trio.testing.MockClock`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import trio

from qosfs.core.limit_kinds import LIMIT_KINDS, Kind
from qosfs.qos.bucket import (
    DEFAULT_BURST_SECONDS,
    NO_LIMITS,
    UNLIMITED,
    LevelLimits,
    Limit,
    TokenBucket,
)
from qosfs.qos.waiting import Ticket, Turn, until_covered

__all__ = [  # the limit values are re-exported from qosfs.qos.bucket for convenience
    "DEFAULT_BURST_SECONDS",
    "NO_LIMITS",
    "UNLIMITED",
    "Kind",
    "Level",
    "LevelLimits",
    "LevelStatistics",
    "Limit",
    "RateLevel",
    "Stage",
    "admit_rest",
    "refund_bytes",
    "try_admit",
]

_INF = math.inf


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
    """What admission charges: every :class:`Level`, and a class's port to the
    backend (:class:`qosfs.qos.backend.ClassPort`), which dispatches by priority.

    ``limited`` and ``parked`` are indexed by :class:`Kind` and read on the fast path:
    a stage that neither limits a kind nor has a request of that kind parked is only
    counted.
    """

    @property
    def limited(self) -> Sequence[bool]:
        """Per kind: whether some bucket bounds it (False: admission only counts)."""

    @property
    def parked(self) -> Sequence[Turn]:
        """Per kind: the requests parked here (truthy when any is)."""

    def try_pass(self, kind: Kind, nbytes: int, now: float) -> bool:
        """The fast path, synchronous: charge and count the request if nothing is parked
        and the buckets cover it now; otherwise change nothing and return False."""

    def count(self, kind: Kind, nbytes: int, ops: int) -> None:
        """Count traffic that passed without being charged (the stage limits nothing)."""

    def refund(self, kind: Kind, nbytes: int, ops: int) -> None:
        """Give back what was charged for work that did not happen."""

    def charge_bytes(self, kind: Kind, nbytes: int) -> None:
        """Charge bytes already moved (no op, no waiting): the debt delays later requests."""

    async def wait(self, kind: Kind, nbytes: int) -> float:
        """Park until this stage admits the request, then charge it; returns the seconds
        waited. On cancellation nothing has been charged here."""


class Level(Stage, Protocol):
    """A named set of token buckets: a class, a user in a fair-share class, a tenant, the
    backend's capacity -- and, behind a :class:`~qosfs.qos.store.LevelFactory`, any other
    token store.

    Built only through a :class:`~qosfs.qos.store.LevelFactory`, so a store plugs in at
    one place. Every store so far hands out :class:`RateLevel` (a cluster level is one
    whose limits its share steers), which keeps the request path's call sites monomorphic.
    """

    name: str
    limits: LevelLimits
    # Admitted traffic (refunds subtract), read by status, metrics and the latency
    # controller; plain attributes so the hot path bumps them without a call.
    bytes_read: int
    bytes_written: int
    ops_read: int
    ops_write: int
    ops_meta: int
    queue_depth: int  # requests parked here now
    waits: int  # requests that ever parked here
    throttled_seconds: float  # time requests spent parked here

    @property
    def changed(self) -> trio.Event:
        """Set (and replaced) by every :meth:`set_limits`: the turn holders re-check."""

    def delay(self, kind: Kind, nbytes: int, now: float) -> float:
        """Seconds until the buckets cover the request (0.0: now); charges nothing."""

    def charge(self, kind: Kind, nbytes: int, now: float) -> None:
        """Charge and count an admitted request (the turn holder, once covered)."""

    def set_limits(self, limits: LevelLimits) -> None:
        """New limits in force now; wakes whatever is parked so it re-checks."""

    def statistics(self) -> LevelStatistics:
        """A frozen snapshot of the counters and limits."""


class Steering(Protocol):
    """Decides what a :class:`RateLevel` enforces when it is given limits."""

    def steer(self, limits: LevelLimits) -> None: ...


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
        "_ops_by_kind",
        "buckets",
        "bytes_read",
        "bytes_written",
        "changed",
        "limited",
        "limits",
        "name",
        "ops_meta",
        "ops_read",
        "ops_write",
        "parked",
        "queue_depth",
        "steering",
        "throttled_seconds",
        "waits",
    )

    def __init__(self, name: str, limits: LevelLimits = NO_LIMITS) -> None:
        self.name = name
        # Who decides what this level enforces, if not set_limits' caller: a cluster
        # level's share (qosfs.qos.cluster). A hook rather than a subclass so that every
        # level on a request's path is one type (a second type at the fast path's call
        # sites cost ~200 ns per request: bench/machinery.py, scope "cluster").
        self.steering: Steering | None = None
        self.limits = limits
        self.buckets: dict[str, TokenBucket] = {
            key: TokenBucket(limit.rate, limit.effective_burst) for key, limit in limits.items()
        }
        self.bytes_read = self.bytes_written = 0
        self.ops_read = self.ops_write = self.ops_meta = 0
        self.throttled_seconds = 0.0
        self.queue_depth = self.waits = 0
        self.parked: tuple[Turn, Turn, Turn] = (Turn(), Turn(), Turn())
        self.changed = trio.Event()  # set and replaced by every set_limits()
        self._index_buckets()

    def _index_buckets(self) -> None:
        """Precompute, per request kind, its limited per-byte and per-op buckets (None =
        unlimited), from the table of limit kinds: what try_pass reads per request."""
        by_bytes: list[TokenBucket | None] = [None] * len(Kind)
        by_ops: list[TokenBucket | None] = [None] * len(Kind)
        for kind in LIMIT_KINDS:
            bucket = self.buckets[kind.bucket]
            if not bucket.unlimited:
                (by_bytes if kind.per_byte else by_ops)[kind.charges] = bucket
        self._bytes_by_kind = tuple(by_bytes)
        self._ops_by_kind = tuple(by_ops)
        self.limited: tuple[bool, ...] = tuple(
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
        request not yet admitted. A kind left with no cap at all releases every request
        parked for it in the same instant (:meth:`qosfs.qos.waiting.Turn.release_all`).
        """
        if self.steering is not None:
            self.steering.steer(limits)
            return
        self.enforce(limits)

    def enforce(self, limits: LevelLimits) -> None:
        """Put *limits* in force now, whoever decided them (see :meth:`set_limits`)."""
        now = trio.current_time()
        for key, bucket in self.buckets.items():
            limit = limits.get(key)
            bucket.set_rate(limit.rate, limit.effective_burst, now)
        self.limits = limits
        self._index_buckets()
        Turn.release_unlimited(self.parked, self.limited)
        self.changed.set()
        self.changed = trio.Event()

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
            f"{key}={_number(limit.rate)}/s" for key, limit in self.limits.set_items()
        )
        return (
            f"<RateLevel {self.name!r} {limited or 'unlimited'} "
            f"queue_depth={self.queue_depth} waits={self.waits}>"
        )

    # -- the Level interface; all synchronous but wait(), so never interrupted halfway --

    def count(self, kind: Kind, nbytes: int, ops: int) -> None:
        if kind is _READ:
            self.bytes_read += nbytes
            self.ops_read += ops
        elif kind is _WRITE:
            self.bytes_written += nbytes
            self.ops_write += ops
        else:
            self.ops_meta += ops

    def try_pass(self, kind: Kind, nbytes: int, now: float) -> bool:
        """Charge and count the request if every bucket covers it and, while a bucket
        limits its kind, nobody is parked before it.

        FIFO is for sharing tokens. Once nothing limits the kind (a cap lifted: SIGTERM's
        drain, ``ctl set``, an automatic cap withdrawn), the requests still parked here
        wait for nothing but to run (:meth:`enforce` released them all, see
        :meth:`qosfs.qos.waiting.Turn.release_all`); a newcomer queued behind them kept the
        line full for as long as writers wrote again as soon as they were answered, so
        SIGTERM's drain, which waits until nothing is parked, waited its whole deadline.

        Race-free: trio runs one task at a time and this is synchronous, so ``limited``
        and ``parked`` are read in the step that charges, and :meth:`enforce` changes
        them in a step of its own. A request let by takes no tokens (the kind has no
        bucket), so those parked lose nothing; a cap put back before they left makes
        ``limited`` true again at once, and newcomers queue behind them again.

        The request path pays nothing for it: ``limited`` is read only when someone is
        parked here, i.e. by a request that was about to park.
        """
        if self.parked[kind] and self.limited[kind]:
            return False
        b = self._bytes_by_kind[kind]
        if b is not None and not b.try_take(nbytes, now):
            return False
        o = self._ops_by_kind[kind]
        if o is not None and not o.try_take(1, now):
            if b is not None:
                b.refund(nbytes)
            return False
        self.count(kind, nbytes, 1)
        return True

    def delay(self, kind: Kind, nbytes: int, now: float) -> float:
        b = self._bytes_by_kind[kind]
        o = self._ops_by_kind[kind]
        delay = 0.0 if b is None else b.delay_for(nbytes, now)
        return delay if o is None else max(delay, o.delay_for(1, now))

    def charge(self, kind: Kind, nbytes: int, now: float) -> None:
        b = self._bytes_by_kind[kind]
        if b is not None:
            b.take(nbytes, now)
        o = self._ops_by_kind[kind]
        if o is not None:
            o.take(1, now)
        self.count(kind, nbytes, 1)

    def charge_bytes(self, kind: Kind, nbytes: int) -> None:
        """Charge bytes already moved (no op, no waiting): the bucket goes into debt,
        which the next requests here pay. Refills first, or the debt would vanish into
        the tokens earned while idle."""
        b = self._bytes_by_kind[kind]
        if b is not None:
            b.take(nbytes, trio.current_time())
        self.count(kind, nbytes, 0)

    def refund(self, kind: Kind, nbytes: int, ops: int) -> None:
        b = self._bytes_by_kind[kind]
        if b is not None:
            b.refund(nbytes)
        o = self._ops_by_kind[kind]
        if o is not None and ops:
            o.refund(ops)
        self.count(kind, -nbytes, -ops)

    async def wait(self, kind: Kind, nbytes: int) -> float:
        """Park FIFO until this level admits the request, then charge it.

        Returns the seconds spent parked. On cancellation nothing has been charged here.
        """
        line = self.parked[kind]
        ticket = Ticket()
        line.park(ticket)
        self.queue_depth += 1
        self.waits += 1
        start = trio.current_time()
        try:
            await line.wait_for_turn(ticket, self, kind)
            self.charge(kind, nbytes, await until_covered(self, kind, nbytes))
        finally:
            waited = trio.current_time() - start
            self.throttled_seconds += waited
            self.queue_depth -= 1
            line.leave(ticket)  # the turn goes to the next in arrival order
        return waited




def try_admit(levels: Sequence[Stage], kind: Kind, nbytes: int) -> int:
    """The fast path of admission, without a coroutine: charge the levels, in order, that
    admit the request at once.

    *levels* are most specific first, e.g. ``[user, class, tenant, backend]``; a request
    is charged at a level when it passes it (see the module docstring for why). READ and
    WRITE charge *nbytes* plus one op; META charges one meta op.

    Returns -1 if every level did (the request may go), else the index of the first one
    that did not: the levels before it are charged, and the caller must finish with
    ``await admit_rest(levels, index, kind, nbytes)``. Hot paths call this first so that
    a request that does not wait costs no coroutine (bench/machinery.py).
    """
    now = -_INF
    for index, level in enumerate(levels):
        if level.limited[kind] or level.parked[kind]:
            if now == -_INF:
                now = trio.current_time()
            if not level.try_pass(kind, nbytes, now):
                return index
        else:
            level.count(kind, nbytes, 1)
    return -1


async def admit_rest(levels: Sequence[Stage], start: int, kind: Kind, nbytes: int) -> float:
    """Finish an admission :func:`try_admit` could not complete: wait at ``levels[start]``,
    which could not admit at once, then pass the rest; returns the seconds spent waiting.

    Raises:
        trio.Cancelled: if cancelled while waiting; every level already passed is
            refunded and the waiter leaves its queue, so nothing is lost or stuck.
    """
    passed = start  # levels[:passed] have charged this request
    waited = 0.0
    try:
        for index in range(start, len(levels)):
            level = levels[index]
            if index == start or not level.try_pass(kind, nbytes, trio.current_time()):
                waited += await level.wait(kind, nbytes)
            passed = index + 1
    except BaseException:
        for level in levels[:passed]:
            level.refund(kind, nbytes, 1)
        raise
    return waited


def refund_bytes(levels: Sequence[Stage], kind: Kind, nbytes: int) -> None:
    """Give back bytes that were admitted but not transferred (a short read at EOF).

    Without it, a 4 KiB file read with the kernel's 128 KiB readahead would be charged
    32 times its size. The op stays charged: the operation did happen.
    """
    if nbytes > 0:
        for level in levels:
            level.refund(kind, nbytes, 0)
