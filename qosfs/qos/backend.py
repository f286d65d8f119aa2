"""The ``[backend]`` level: what the storage delivers, shared out by minimums and priority.

When a policy declares what the storage can deliver (``[backend] read_bandwidth = ...``),
the backend is a level like any other -- its buckets pace the total -- but the requests
parked there are not served first come, first served. They are dispatched the way
mClock/dmClock does it (Gulati et al., OSDI 2010; Ceph's OSD scheduler), with two tags
per class and request kind:

* a **reservation tag** ``R`` that advances by ``nbytes / min_bandwidth`` for every
  request of the class, and is never behind the request's arrival time (an idle class
  banks nothing, while a backlogged one keeps its exact spacing even when a dispatch
  comes late);
* a **weight tag** ``P`` that advances by ``cost / weight``, where ``cost`` is the
  request's share of the backend's capacity (``max(nbytes / bandwidth, 1 / iops)``), and
  starts no earlier than the virtual time ``V`` of the request last dispatched -- start-time
  fair queueing, so a class returning from idle does not get a burst of saved-up credit.

When the backend's buckets have room for one more request, the next one is:

1. the head of the class furthest behind its reservation (``R <= now``, smallest ``R``):
   minimums come first;
2. otherwise the head of the class with the smallest weight tag (ties: larger weight):
   the rest is shared in proportion to ``priority`` weights (low 1, normal 10, high 100).

Every dispatch advances both tags, so a minimum is a floor, not an addition: a class gets
``max(min, weighted share)``. Only classes with a request parked here compete, so the
scheme is work-conserving -- what a high class does not use, lower classes get. Caps are
not enforced here: the class and tenant levels come earlier in a request's chain, so a
request that reaches the backend is already within its class's caps.

Minimums and priorities only mean something when the declared backend capacity is the
real bottleneck; when qosfs's demand stays under it, nothing parks here at all.

:class:`ClassPort` is a class's entrance to the backend: it is a
:class:`qosfs.qos.levels.Stage`, so admission (:func:`qosfs.qos.levels.try_admit`, then
:func:`~qosfs.qos.levels.admit_rest` for a request that waits) charges it like any
level. Waiting uses the same primitive as every level (:mod:`qosfs.qos.waiting`): one
:class:`~qosfs.qos.waiting.Turn` per kind, handed on by :meth:`BackendLevel._select`
rather than in arrival order.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from qosfs.core.limit_kinds import LIMIT_KINDS
from qosfs.qos.bucket import NO_LIMITS, LevelLimits
from qosfs.qos.levels import Kind, LevelStatistics
from qosfs.qos.store import LevelFactory, local_level
from qosfs.qos.waiting import Ticket, Turn, until_covered

__all__ = ["BackendLevel", "ClassPort", "Share"]

_INF = math.inf


@dataclass(frozen=True, slots=True)
class Share:
    """How one class shares the backend: its weight and guaranteed minimums (bytes/s)."""

    weight: float = 10.0
    min_read_bandwidth: float = 0.0
    min_write_bandwidth: float = 0.0

    def __post_init__(self) -> None:
        if not self.weight > 0.0:
            raise ValueError(f"weight must be > 0, got {self.weight!r}")
        if self.min_read_bandwidth < 0.0 or self.min_write_bandwidth < 0.0:
            raise ValueError("minimum bandwidths must be >= 0")


class ClassPort:
    """A class's entrance to the backend level, charged by admission like any level."""

    __slots__ = ("backend", "min_rate", "name", "queues", "reserve_tag", "weight", "weight_tag")

    def __init__(self, backend: BackendLevel, name: str, share: Share) -> None:
        self.backend = backend
        self.name = name
        # This class's parked requests per kind, in arrival order (the backend's Turn
        # holds every class's): a dispatch picks the head of one of these.
        self.queues: tuple[deque[Ticket], ...] = (deque(), deque(), deque())
        self.reserve_tag = [-_INF, -_INF, -_INF]
        self.weight_tag = [0.0, 0.0, 0.0]
        self.set_share(share)

    def set_share(self, share: Share) -> None:
        """Change weight and minimums live; the next dispatch decision uses them."""
        self.weight = share.weight
        self.min_rate = (share.min_read_bandwidth, share.min_write_bandwidth, 0.0)

    def __repr__(self) -> str:
        return (f"<ClassPort {self.name!r} weight={self.weight:g} "
                f"parked={sum(map(len, self.queues))}>")

    # -- the Stage interface admission uses (qosfs.qos.levels) -------------------------

    @property
    def limited(self) -> Sequence[bool]:
        return self.backend.level.limited

    @property
    def parked(self) -> tuple[Turn, Turn, Turn]:
        return self.backend.parked

    def try_pass(self, kind: Kind, nbytes: int, now: float) -> bool:
        # Behind those parked only while the backend limits the kind, as at any level
        # (qosfs.qos.levels.RateLevel.try_pass says why, and why it is race-free).
        backend = self.backend
        if (backend.parked[kind] and backend.level.limited[kind]) or not \
                backend.level.try_pass(kind, nbytes, now):
            return False
        backend._served(self, kind, nbytes, now)
        return True

    def count(self, kind: Kind, nbytes: int, ops: int) -> None:
        self.backend.level.count(kind, nbytes, ops)

    def refund(self, kind: Kind, nbytes: int, ops: int) -> None:
        # The tags are not rolled back: a cancelled request costs its class a little
        # priority, never capacity, and cancellation is rare (an interrupted caller).
        self.backend.level.refund(kind, nbytes, ops)

    async def wait(self, kind: Kind, nbytes: int) -> float:
        return await self.backend._wait(self, kind, nbytes)

    def charge_bytes(self, kind: Kind, nbytes: int) -> None:
        """Count bytes another class's port already passed as this class's use of the
        backend (a rename moved them here): its tags advance, so it yields to the other
        classes as if it had sent them; the backend's buckets, which saw them, stay."""
        self.backend._served(self, kind, nbytes, trio.current_time())


class BackendLevel:
    """The backend's buckets plus the dispatcher of the requests parked on them.

    Args:
        limits: What the storage delivers (``[backend]``); unlimited kinds never park.
        factory: Builds the level holding the backend's buckets (the engine's factory).
    """

    def __init__(self, limits: LevelLimits = NO_LIMITS,
                 factory: LevelFactory = local_level) -> None:
        self.level = factory("backend", limits)
        self.ports: dict[str, ClassPort] = {}
        # All parked requests per kind, in arrival order; truthy when anything waits,
        # which is what admission checks. One of them holds the turn.
        self.parked: tuple[Turn, Turn, Turn] = (Turn(), Turn(), Turn())
        # Classes with a request parked, per kind: what a dispatch decision scans.
        self._backlogged: tuple[dict[ClassPort, None], ...] = ({}, {}, {})
        self._vtime = [0.0, 0.0, 0.0]
        self._index_costs()

    def set_limits(self, limits: LevelLimits) -> None:
        """New capacity, in force at once (the request holding the turn re-checks)."""
        self.level.set_limits(limits)
        self._index_costs()
        Turn.release_unlimited(self.parked, self.level.limited)

    def port(self, name: str, share: Share) -> ClassPort:
        """The port of class *name*, created or updated with *share*."""
        port = self.ports.get(name)
        if port is None:
            port = self.ports[name] = ClassPort(self, name, share)
        else:
            port.set_share(share)
        return port

    def retire_ports(self, keep: set[str]) -> None:
        """Forget the ports of classes not in *keep*; their parked requests still go."""
        for name in [n for n in self.ports if n not in keep]:
            del self.ports[name]

    def statistics(self) -> LevelStatistics:
        """The backend level's counters (what was admitted in total)."""
        return self.level.statistics()

    def __repr__(self) -> str:
        return f"<BackendLevel {self.level!r} ports={sorted(self.ports)}>"

    # -- dispatch -----------------------------------------------------------------------

    def _index_costs(self) -> None:
        """Seconds of backend capacity per byte and per op, by kind (0 when unlimited)."""
        byte_cost = [0.0] * len(Kind)
        op_cost = [0.0] * len(Kind)
        for kind in LIMIT_KINDS:
            cost = 1.0 / self.level.limits.get(kind.bucket).rate
            costs = byte_cost if kind.per_byte else op_cost
            costs[kind.charges] = max(costs[kind.charges], cost)
        self._byte_cost = tuple(byte_cost)
        self._op_cost = tuple(op_cost)

    def _served(self, port: ClassPort, kind: Kind, nbytes: int, arrived: float) -> None:
        """Advance *port*'s tags for a request that arrived at *arrived*, admitted now."""
        # Plain comparisons instead of max(): this runs on every admitted request when a
        # backend is declared, and a max() call costs about 60 ns (see qosfs.qos.bucket).
        cost = nbytes * self._byte_cost[kind]
        op_cost = self._op_cost[kind]
        if op_cost > cost:
            cost = op_cost
        if cost > 0.0:
            start = port.weight_tag[kind]
            vtime = self._vtime[kind]
            if start < vtime:
                start = vtime
            port.weight_tag[kind] = start + cost / port.weight
            self._vtime[kind] = start
        min_rate = port.min_rate[kind]
        if min_rate:
            tag = port.reserve_tag[kind]
            port.reserve_tag[kind] = (tag if tag > arrived else arrived) + nbytes / min_rate  # noqa: FURB136

    def _select(self, kind: Kind, now: float) -> Ticket:
        """The parked request that should go next (see the module docstring)."""
        backlogged = self._backlogged[kind]
        best: ClassPort | None = None
        best_tag = _INF
        for port in backlogged:
            tag = port.reserve_tag[kind]
            if port.min_rate[kind] and tag <= now and tag < best_tag:
                best, best_tag = port, tag
        if best is None:
            vtime = self._vtime[kind]
            for port in backlogged:
                tag = port.weight_tag[kind]
                if tag < vtime:
                    tag = vtime
                if tag < best_tag or (best is not None and tag == best_tag
                                      and port.weight > best.weight):
                    best, best_tag = port, tag
        assert best is not None, "select() called with nothing parked"
        return best.queues[kind][0]

    async def _wait(self, port: ClassPort, kind: Kind, nbytes: int) -> float:
        """Park until this request is both chosen and covered by the buckets; charge it.

        One request per kind holds the turn (:class:`qosfs.qos.waiting.Turn`): it sleeps
        until the buckets cover it (or the limits change), then asks :meth:`_select` who
        should go. If that is someone else, it hands the turn over and parks again;
        otherwise it is charged and leaves, handing the turn to the next choice. So there
        is one timer per kind, and every decision is taken at the instant capacity is
        there, with the tags as they are.
        """
        ticket = Ticket(port)
        queue = port.queues[kind]
        if not queue:
            self._backlogged[kind][port] = None
        queue.append(ticket)
        turn = self.parked[kind]
        turn.park(ticket)
        level = self.level
        level.queue_depth += 1
        level.waits += 1
        start = trio.current_time()
        try:
            while True:
                await turn.wait_for_turn(ticket, level, kind)
                now = await until_covered(level, kind, nbytes)
                if turn.holder is not ticket:  # released: the backend no longer limits it
                    break
                chosen = self._select(kind, now)
                if chosen is ticket:
                    break
                turn.hand_to(chosen)
            level.charge(kind, nbytes, now)
            self._served(port, kind, nbytes, start)
        finally:
            waited = trio.current_time() - start
            level.throttled_seconds += waited
            level.queue_depth -= 1
            queue.remove(ticket)  # the head when admitted, anywhere when cancelled
            if not queue:
                del self._backlogged[kind][port]
            turn.leave(ticket, lambda: self._select(kind, trio.current_time()))
        return waited
