"""Caps lifted while requests are parked (SIGTERM's drain), with writers that go on writing.

The daemon's drain (:func:`qosfs.daemon.serve._drain`) lifts every cap, then waits until
nothing is parked. The requests parked at the lift go at once; the bug was in those that
came after it: they queued behind the ones still waiting for their turn, although the
level no longer limited anything, and writers that write again as soon as they are
answered refilled that queue as fast as the turn was handed along it. So the parked count
stayed full for as long as the writers wrote (up to the drain's 10 s deadline on a mount).

Each scenario parks writes at one kind of level -- a class, a user of a ``per_user`` class,
a tenant, the backend -- through a file's flow on trio's mock clock (tests.admission).
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from qosfs.core.limit_kinds import Kind
from qosfs.qos.bucket import LevelLimits, Limit
from qosfs.qos.engine import PolicyQos
from qosfs.qos.flow import PolicyFlow
from tests.admission import GiB, MiB, engine, klass, open_flow, table
from tests.mock_clock import mock_clock

CAP = {"write_bandwidth": "2MiB/s", "burst": "1MiB"}  # the mount test's checkpoint class

WHERE_THEY_PARK = {
    "class": (klass(**CAP),),
    "user": (klass(per_user="fair", **CAP),),
    "tenant": (klass(), table("tenants.t", paths=["c/**"], **CAP)),
    "backend": (table("backend", **CAP), klass()),
}

WRITERS = 8
WRITE_SECONDS = 0.0005  # one 1 MiB pwrite, done on the event loop (no thread once uncapped)
POLL = 0.01  # how often the daemon's drain looks at the parked count


async def writer(flow: PolicyFlow) -> None:
    """Writes 1 MiB after 1 MiB, as a checkpoint writer does through a mount: the write is
    admitted, the pwrite holds the event loop for WRITE_SECONDS (the mock clock moves
    while nothing else runs), the reply goes out, and the next write comes right after."""
    clock = trio.lowlevel.current_clock()
    assert isinstance(clock, trio.testing.MockClock)
    while True:
        await flow.admit_write(MiB)
        clock.jump(WRITE_SECONDS)
        await trio.lowlevel.checkpoint()


async def park_writers(nursery: trio.Nursery, qos: PolicyQos, flow: PolicyFlow) -> None:
    """Start the writers; return once at least half of them wait for tokens."""
    for _ in range(WRITERS):
        nursery.start_soon(writer, flow)
    while qos.parking.requests < WRITERS // 2:
        await trio.sleep(POLL)


@pytest.mark.parametrize("level", list(WHERE_THEY_PARK))
def test_a_request_after_the_drain_passes_at_once_beside_those_still_parked(
        level: str) -> None:
    @mock_clock
    async def body() -> None:
        qos = engine(*WHERE_THEY_PARK[level])
        flow = open_flow(qos)
        async with trio.open_nursery() as nursery:
            await park_writers(nursery, qos, flow)
            parked = qos.parking.requests
            qos.drain()
            # The lift woke them, but none has run yet: they are all still in line.
            assert qos.parking.requests == parked
            with trio.testing.assert_no_checkpoints():
                await flow.admit_write(MiB)  # nothing limits it: it waits for no one
            assert qos.parking.requests == parked
            nursery.cancel_scope.cancel()

    body()


@pytest.mark.parametrize("level", list(WHERE_THEY_PARK))
def test_the_drain_empties_the_parking_lot_while_the_writers_go_on(level: str) -> None:
    @mock_clock
    async def body() -> None:
        qos = engine(*WHERE_THEY_PARK[level])
        flow = open_flow(qos)
        written = flow.cls.level.bytes_written
        async with trio.open_nursery() as nursery:
            await park_writers(nursery, qos, flow)
            qos.drain()
            written = flow.cls.level.bytes_written
            looks = 0
            with trio.move_on_after(2.0):  # the old code never got there: 8 stayed parked
                while True:  # as the daemon's drain looks, every POLL seconds
                    await trio.sleep(POLL)
                    looks += 1
                    if not qos.parking.requests:
                        break
            nursery.cancel_scope.cancel()
        # Empty at the first look, with the writers still writing meanwhile. Released one
        # per scheduling round (the turn handed along the line), the parked writes took 2
        # looks: each round also ran the pwrites of the writers that were not parked.
        assert looks == 1, looks
        assert flow.cls.level.bytes_written - written >= WRITERS * MiB

    body()


def test_while_a_cap_holds_a_new_request_still_queues_behind_those_parked() -> None:
    @mock_clock
    async def body() -> None:
        qos = engine(*WHERE_THEY_PARK["class"])
        flow = open_flow(qos)
        level = flow.cls.level
        async with trio.open_nursery() as nursery:
            await park_writers(nursery, qos, flow)
            # Raised far above the demand, yet a cap: its tokens go first come, first
            # served, so a newcomer does not overtake the requests parked before it.
            qos.classes["c"].set_limits(LevelLimits(write_bytes=Limit(GiB, 64 * MiB)))
            assert level.limited[Kind.WRITE] and level.parked[Kind.WRITE]
            assert not level.try_pass(Kind.WRITE, MiB, trio.current_time())
            nursery.cancel_scope.cancel()

    body()


def test_a_cap_put_back_before_the_released_requests_ran_holds_them_again() -> None:
    @mock_clock
    async def body() -> None:
        qos = engine(*WHERE_THEY_PARK["class"])
        flow = open_flow(qos)
        await flow.admit_write(MiB)  # the burst: the next writes park
        done: list[float] = []

        async def write() -> None:
            await flow.admit_write(MiB)
            done.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(write)
            await trio.sleep(0.1)
            capped = qos.classes["c"].level.limits
            qos.classes["c"].set_limits(LevelLimits())  # every one of them released...
            qos.classes["c"].set_limits(capped)  # ...and capped again before any ran
        # A full bucket after the cap came back (tokens restart from the burst), then the
        # cap's pace, in arrival order: none went through on the release alone.
        assert done == pytest.approx([0.1, 0.6, 1.1, 1.6])

    body()
