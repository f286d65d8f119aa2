"""The one way a request waits for tokens: a turn, and sleeping until the buckets cover it.

Every level that can park a request (a class, user, tenant or the backend) uses the same
two pieces, the way trio builds its Lock, Semaphore and CapacityLimiter on one
``ParkingLot``:

* :class:`Turn` -- the requests parked at one (level, request kind), in arrival order.
  One of them holds the *turn*: only it has a timer and looks at the buckets; the others
  sleep on their own event until the turn is handed to them. A rate level hands the turn
  on in arrival order (FIFO); the backend's dispatcher hands it to the request its tags
  choose (:mod:`qosfs.qos.backend`). Either way there is one timer per queue, not one per
  parked request, and a request that leaves (admitted or cancelled) passes the turn on so
  nothing is stranded. Turns are for sharing tokens: when a level stops limiting a kind
  (a cap lifted, as at SIGTERM's drain), :meth:`Turn.release_all` lets every request
  parked for it go at once.
* :func:`until_covered` -- the turn holder's sleep: until the level's buckets cover the
  request, or its limits change (a ``ctl set`` wakes it at once).

Truthiness of a :class:`Turn` is what the fast path checks ("is anyone parked here?"), so
a new request never overtakes parked ones while the level limits its kind.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import trio

from qosfs.core.limit_kinds import Kind

__all__ = ["EPSILON", "Covering", "Limiting", "Ticket", "Turn", "until_covered"]

#: A shortfall smaller than this many seconds is admitted (the remainder stays as debt, so
#: nothing drifts). Without it, float rounding could leave a delay so small that
#: ``now + delay == now`` and the turn holder would spin without the clock advancing.
EPSILON = 1e-9


class Ticket:
    """One parked request's place in a :class:`Turn`.

    ``payload`` is whatever the level needs to decide who goes next (the backend keeps its
    class port and size there); a FIFO level leaves it None.
    """

    __slots__ = ("event", "payload")

    def __init__(self, payload: object = None) -> None:
        self.event = trio.Event()  # set when the turn is handed to this ticket
        self.payload = payload


class Turn(dict[Ticket, None]):
    """The requests parked at one (level, kind), in arrival order; one holds the turn.

    A dict of tickets (an ordered set with O(1) removal, for cancellation): its C-level
    truthiness is what every request's fast path checks per level, so it costs no Python
    call (a ``__bool__`` method added ~70 ns per level per request: bench/machinery.py).
    """

    __slots__ = ("holder",)

    def __init__(self) -> None:
        super().__init__()
        self.holder: Ticket | None = None

    def park(self, ticket: Ticket) -> None:
        """Join the line; the first to arrive at an empty line holds the turn at once."""
        self[ticket] = None
        if self.holder is None:
            self.holder = ticket

    async def wait_for_turn(self, ticket: Ticket, level: Limiting, kind: Kind) -> None:
        """Return once *ticket* holds the turn (at once if it already does), or once
        *level* no longer limits *kind* (:meth:`release_all` woke it): then there are no
        tokens to take turns for, and it goes without the turn."""
        while self.holder is not ticket and level.limited[kind]:
            await ticket.event.wait()
            ticket.event = trio.Event()

    def release_all(self) -> None:
        """Wake every ticket: the level just stopped limiting the kind (a cap lifted, as
        at SIGTERM's drain), so each of them goes at once (:meth:`wait_for_turn`) instead
        of one per scheduling round as the turn is handed along the line.

        Race-free: a woken ticket re-reads ``limited`` when it runs, in the step that then
        charges it (the level's ``delay`` is 0, so nothing awaits in between). If a cap
        came back before it ran, it waits for the turn again: the turn never left the
        line (a holder that leaves hands it on as ever), so FIFO and the one timer hold.
        """
        for ticket in self:
            ticket.event.set()

    @staticmethod
    def release_unlimited(lines: Sequence[Turn], limited: Sequence[bool]) -> None:
        """After a change of limits: `release_all` of each kind's line (*lines*, by kind)
        that no bucket limits any more (*limited*, by kind): nothing is left to take turns
        for, so every request parked there goes now."""
        for line, limits in zip(lines, limited, strict=True):
            if line and not limits:
                line.release_all()

    def hand_to(self, ticket: Ticket) -> None:
        """Give the turn to *ticket* (a parked one) and wake it."""
        self.holder = ticket
        ticket.event.set()

    def leave(self, ticket: Ticket, choose: Callable[[], Ticket] | None = None) -> None:
        """*ticket* stops waiting (admitted or cancelled). If it held the turn, the turn
        goes to ``choose()`` -- the level's pick -- or, without one, to the oldest."""
        del self[ticket]
        if self.holder is ticket:
            self.holder = None
            if self:
                self.hand_to(choose() if choose is not None else next(iter(self)))

    def __repr__(self) -> str:
        return f"<Turn parked={len(self)} held={self.holder is not None}>"


class Limiting(Protocol):
    """What :meth:`Turn.wait_for_turn` reads of a level."""

    @property
    def limited(self) -> Sequence[bool]:
        """Per kind: whether some bucket bounds it now."""


class Covering(Protocol):
    """What :func:`until_covered` needs of a level's buckets."""

    @property
    def changed(self) -> trio.Event:
        """Set (and replaced) whenever the level's limits change."""

    def delay(self, kind: Kind, nbytes: int, now: float) -> float:
        """Seconds until the buckets cover a request of *nbytes* of *kind* (0: now)."""


async def until_covered(level: Covering, kind: Kind, nbytes: int) -> float:
    """Sleep until *level*'s buckets cover the request, waking early when its limits
    change; return the time at which they do (charge the request at that time).

    Only the turn holder calls this, so a queue has one timer however long it is (and
    requests :meth:`Turn.release_all` let go, whose delay is 0: they never sleep here).
    """
    while True:
        now = trio.current_time()
        delay = level.delay(kind, nbytes, now)
        if delay <= EPSILON:
            return now
        changed = level.changed
        with trio.move_on_at(now + delay):
            await changed.wait()
