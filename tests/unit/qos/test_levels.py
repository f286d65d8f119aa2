"""Levels and FairShareGroup on trio's mock clock, charged the way the product charges
them: through the flow of a file opened under a policy (tests.admission), so each test
also runs the fast path, the parking bounds and the killed-caller scope of a real request."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from qosfs.qos.bounds import ParkingLimits
from qosfs.qos.engine import PolicyQos
from qosfs.qos.flow import PolicyFlow
from qosfs.qos.levels import (
    Kind,
    LevelLimits,
    LevelStatistics,
    Limit,
    RateLevel,
)
from qosfs.qos.store import FairShareGroup
from tests.admission import GiB, MiB, class_level, engine, klass, open_flow, table
from tests.mock_clock import mock_clock


def writes_capped(rate: str, burst: str, name: str = "c", parking: ParkingLimits | None = None,
                  ) -> tuple[PolicyFlow, RateLevel]:
    """A file in class *name*, whose writes are capped at *rate* with *burst*; the flow
    it is charged to, and the class's level."""
    qos = engine(klass(name, write_bandwidth=rate, burst=burst), parking=parking)
    return open_flow(qos, f"{name}/f"), class_level(qos, name)


def class_and_tenant(cls: Mapping[str, object], tenant: Mapping[str, object],
                     ) -> tuple[PolicyQos, PolicyFlow]:
    """A file charged at class ``c`` and then at tenant ``t``, with these settings."""
    qos = engine(klass("c", **cls), table("tenants.t", paths=["c/**"], **tenant))
    return qos, open_flow(qos)


async def at(t: float, fn: Callable[[], Awaitable[object]]) -> None:
    """Run ``fn`` at absolute mock time ``t`` (trio's start order is deliberately random)."""
    await trio.sleep_until(t)
    await fn()


@mock_clock
async def test_unlimited_fast_path_never_checkpoints() -> None:
    qos, flow = class_and_tenant({"per_user": "fair"}, {})
    with trio.testing.assert_no_checkpoints():
        for _ in range(1000):
            assert await flow.admit_read(MiB) == 0.0
    state = qos.classes["c"]
    assert state.group is not None
    levels = [state.group.children[0], state.level, qos.tenants["t"]]
    assert [lv.bytes_read for lv in levels] == [1000 * MiB] * 3
    assert all(lv.waits == 0 and lv.ops_read == 1000 for lv in levels)
    assert qos.parking.statistics().refused == 0 and qos.parking.requests == 0


@mock_clock
async def test_limited_fast_path_with_tokens_never_checkpoints() -> None:
    qos = engine(klass(read_bandwidth="1GiB/s", burst="8MiB", read_iops=1000, burst_iops=10))
    flow = open_flow(qos, writing=False)
    with trio.testing.assert_no_checkpoints():
        for _ in range(8):
            assert await flow.admit_read(MiB) == 0.0
    assert class_level(qos).waits == 0


@mock_clock
async def test_sequential_requests_get_the_exact_rate() -> None:
    flow, level = writes_capped("10MiB/s", "1MiB")
    start = trio.current_time()
    for _ in range(100):
        await flow.admit_write(MiB)
    # First from the burst, then one per 0.1 s: 9.9 s, i.e. 10 s minus the burst.
    assert trio.current_time() - start == pytest.approx(9.9)
    assert level.bytes_written == 100 * MiB and level.ops_write == 100
    assert level.throttled_seconds == pytest.approx(9.9)
    assert level.waits == 99 and level.queue_depth == 0


@mock_clock
async def test_concurrent_requests_get_the_exact_rate() -> None:
    # 99 MiB parked at once: past the 64 MiB a uid may park (qosfs.qos.bounds, tested in
    # test_parking.py), so this test's lot is larger.
    flow, _ = writes_capped("10MiB/s", "1MiB", parking=ParkingLimits(per_uid_bytes=GiB))
    done: list[float] = []

    async def one() -> None:
        await flow.admit_write(MiB)
        done.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        for _ in range(100):
            nursery.start_soon(one)
    assert max(done) == pytest.approx(9.9)
    assert sorted(done) == pytest.approx([i / 10 for i in range(100)])
    # Over any 1 s window, at most rate * 1 s + burst was admitted.
    for t in range(9):
        assert sum(t <= d < t + 1 for d in done) * MiB <= 10 * MiB + MiB


@mock_clock
async def test_oversized_request_goes_through_in_debt_and_next_waits() -> None:
    flow, level = writes_capped("1MiB/s", "1MiB")
    assert await flow.admit_write(10 * MiB) == 0.0  # full bucket: through now
    assert level.buckets["write_bytes"].tokens == -9 * MiB
    waited = await flow.admit_write(MiB)
    assert waited == pytest.approx(10.0)  # 9 s of debt + its own 1 MiB


@mock_clock
async def test_oversized_request_is_not_starved_by_small_ones() -> None:
    flow, _ = writes_capped("1MiB/s", "1MiB")
    await flow.admit_write(MiB)  # drain
    order: list[str] = []

    async def req(name: str, n: int) -> None:
        await flow.admit_write(n)
        order.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(at, 0.01, functools.partial(req, "big", 4 * MiB))
        for i in range(10):
            nursery.start_soon(at, 0.02 + i / 100, functools.partial(req, f"s{i}", 64 * 1024))
    assert order == ["big"] + [f"s{i}" for i in range(10)]


@mock_clock
async def test_waiters_are_served_fifo() -> None:
    flow, _ = writes_capped("1MiB/s", "1MiB")
    await flow.admit_write(MiB)
    order: list[int] = []

    async def req(i: int) -> None:
        await flow.admit_write((i % 3 + 1) * 100_000)
        order.append(i)

    async with trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(at, i / 1000, functools.partial(req, i))
    assert order == list(range(20))


@mock_clock
async def test_kinds_do_not_queue_behind_each_other() -> None:
    flow, level = writes_capped("1MiB/s", "1MiB")
    await flow.admit_write(MiB)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(flow.admit_write, MiB)
        await trio.sleep(0.1)
        with trio.testing.assert_no_checkpoints():
            assert await flow.admit_read(MiB) == 0.0
            await flow.admit_meta()
    assert (level.ops_read, level.ops_meta, level.ops_write) == (1, 1, 2)


@mock_clock
async def test_write_iops_cap() -> None:
    qos = engine(klass(write_iops=100, burst_iops=10))
    flow, level = open_flow(qos), class_level(qos)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(210):  # below the parking bound of 256 per uid: none refused
            nursery.start_soon(flow.admit_write, 4096)
    assert trio.current_time() - start == pytest.approx(2.0)
    assert level.ops_write == 210 and level.bytes_written == 210 * 4096


@mock_clock
async def test_meta_iops_cap_ignores_bytes() -> None:
    qos = engine(klass(meta_iops=50, burst_iops=1, write_bandwidth="1B/s", burst=1))
    flow, level = open_flow(qos), class_level(qos)
    start = trio.current_time()
    for _ in range(51):
        await flow.admit_meta()
    assert trio.current_time() - start == pytest.approx(1.0)
    assert level.ops_meta == 51 and level.bytes_written == 0
    assert flow.stats.meta_ops == 51


@mock_clock
async def test_bytes_and_ops_both_bind() -> None:
    qos = engine(klass(read_bandwidth="10MiB/s", burst="1MiB", read_iops=10, burst_iops=1))
    flow = open_flow(qos, writing=False)
    start = trio.current_time()
    for _ in range(21):  # 4 KiB reads: the ops cap governs, 2 s
        await flow.admit_read(4096)
    assert trio.current_time() - start == pytest.approx(2.0)
    start = trio.current_time()
    for _ in range(10):  # 4 MiB reads: one op token (0.1 s), then the bytes cap, 0.4 s each
        await flow.admit_read(4 * MiB)
    assert trio.current_time() - start == pytest.approx(0.1 + 9 * 0.4)


@pytest.mark.parametrize("slow_first", [False, True])
def test_slowest_level_governs(slow_first: bool) -> None:
    @mock_clock
    async def body() -> None:
        fast = {"write_bandwidth": "10MiB/s", "burst": "1MiB"}
        slow = {"write_bandwidth": "5MiB/s", "burst": "1MiB"}
        qos, flow = class_and_tenant(slow, fast) if slow_first else class_and_tenant(fast, slow)
        async with trio.open_nursery() as nursery:
            for _ in range(50):
                nursery.start_soon(flow.admit_write, MiB)
        assert trio.current_time() == pytest.approx(49 / 5)
        levels = (class_level(qos), qos.tenants["t"])
        assert [lv.bytes_written for lv in levels] == [50 * MiB] * 2

    body()


@mock_clock
async def test_waiting_request_holds_no_reservation_at_later_levels() -> None:
    qos, flow = class_and_tenant({"write_bandwidth": "1MiB/s", "burst": "1MiB"},
                                 {"write_bandwidth": "100MiB/s", "burst": "10MiB"})
    cls, later = class_level(qos), qos.tenants["t"]
    assert isinstance(later, RateLevel)
    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(flow.admit_write, MiB)
        await trio.sleep(0.5)
        assert cls.queue_depth == 4
        assert later.bytes_written == MiB  # only the one that passed its class
        assert later.buckets["write_bytes"].delay_for(10 * MiB, trio.current_time()) == 0.0


@mock_clock
async def test_cancelled_waiter_refunds_passed_levels() -> None:
    qos, flow = class_and_tenant({"write_bandwidth": "100MiB/s", "burst": "10MiB"},
                                 {"write_bandwidth": "1MiB/s", "burst": "1MiB"})
    a, b = class_level(qos), qos.tenants["t"]
    assert isinstance(b, RateLevel)
    await flow.admit_write(MiB)  # b is now empty
    tokens_a = a.buckets["write_bytes"].tokens
    with trio.move_on_after(0.5) as scope:
        await flow.admit_write(MiB)
    assert scope.cancelled_caught
    assert a.bytes_written == b.bytes_written == MiB and a.ops_write == b.ops_write == 1
    assert a.buckets["write_bytes"].tokens == tokens_a
    assert b.queue_depth == 0 and b.waits == 1
    assert b.throttled_seconds == pytest.approx(0.5)
    assert qos.parking.requests == 0  # it left the parked count too
    # b earned 0.5 MiB meanwhile and nobody queues: the next request waits only 0.5 s.
    assert await flow.admit_write(MiB) == pytest.approx(0.5)


@pytest.mark.parametrize("victim", [0, 1])
def test_cancelled_waiter_does_not_stick_the_queue(victim: int) -> None:
    @mock_clock
    async def body() -> None:
        flow, level = writes_capped("1MiB/s", "1MiB")
        await flow.admit_write(MiB)
        done: dict[int, float] = {}
        scopes = [trio.CancelScope() for _ in range(3)]

        async def req(i: int) -> None:
            with scopes[i]:
                await flow.admit_write(MiB)
                done[i] = trio.current_time()

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(at, i / 100, functools.partial(req, i))
            await trio.sleep(0.5)
            scopes[victim].cancel()
        assert sorted(done) == [i for i in range(3) if i != victim]
        assert sorted(done.values()) == pytest.approx([1.0, 2.0])
        assert level.queue_depth == 0 and level.bytes_written == 3 * MiB

    body()


@mock_clock
async def test_raising_a_cap_wakes_parked_requests_in_the_same_instant() -> None:
    flow, level = writes_capped("1MiB/s", "1MiB")
    await flow.admit_write(MiB)
    done: list[float] = []

    async def req() -> None:
        await flow.admit_write(MiB)
        done.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        for i in range(5):
            nursery.start_soon(at, i / 1000, req)
        await trio.sleep_until(0.5)
        assert level.queue_depth == 5
        level.set_limits(LevelLimits(write_bytes=Limit(GiB, 64 * MiB)))
    # Without the wake-up the head would sleep until t=1 and the last until t=5.
    assert done == [0.5] * 5


@mock_clock
async def test_raising_a_cap_shortens_a_debt_wait() -> None:
    flow, level = writes_capped("1MiB/s", "1MiB")
    await flow.admit_write(10 * MiB)  # 9 MiB of debt
    done: list[float] = []

    async def req() -> None:
        await flow.admit_write(MiB)
        done.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(req)
        await trio.sleep(1.0)
        level.set_limits(LevelLimits(write_bytes=Limit(GiB, 64 * MiB)))
    # 8 MiB of debt left at t=1 plus 1 MiB, at 1 GiB/s: 8.8 ms instead of 9 s.
    assert done == [pytest.approx(1.0 + 9 / 1024)]


@mock_clock
async def test_lowering_a_cap_applies_to_the_next_request() -> None:
    flow, level = writes_capped("1GiB/s", "64MiB")
    await flow.admit_write(64 * MiB)
    await trio.sleep(1.0)  # full again
    level.set_limits(LevelLimits(write_bytes=Limit(MiB, MiB)))
    start = trio.current_time()
    for _ in range(3):
        await flow.admit_write(MiB)
    assert trio.current_time() - start == pytest.approx(2.0)


@mock_clock
async def test_lifting_a_cap_releases_waiters_and_restores_the_fast_path() -> None:
    flow, level = writes_capped("1MiB/s", "1MiB")
    await flow.admit_write(10 * MiB)
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(flow.admit_write, MiB)
        await trio.sleep(1.0)
        level.set_limits(LevelLimits())
    assert trio.current_time() == 1.0
    with trio.testing.assert_no_checkpoints():
        await flow.admit_write(GiB)


@mock_clock
async def test_a_short_read_gives_back_unused_bytes_but_keeps_the_op() -> None:
    qos = engine(klass(read_bandwidth="1MiB/s", burst="1MiB", read_iops=10, burst_iops=10))
    flow, level = open_flow(qos, writing=False), class_level(qos)
    await flow.admit_read(128 * 1024)
    flow.refund_read(124 * 1024)  # short read at EOF: 4 KiB transferred
    assert level.bytes_read == 4096 and level.ops_read == 1
    assert level.buckets["read_bytes"].tokens == MiB - 4096
    assert level.buckets["read_ops"].tokens == 9


@mock_clock
async def test_statistics_snapshot_and_repr() -> None:
    flow, level = writes_capped("1MiB/s", "1MiB", name="checkpoints")
    await flow.admit_write(2 * MiB)
    await flow.admit_write(MiB)
    stats = level.statistics()
    assert stats == LevelStatistics(
        name="checkpoints",
        limits=level.limits,
        bytes_read=0,
        bytes_written=3 * MiB,
        ops_read=0,
        ops_write=2,
        ops_meta=0,
        throttled_seconds=2.0,
        queue_depth=0,
        waits=1,
    )
    with pytest.raises(AttributeError):
        stats.waits = 5  # type: ignore[misc]
    assert repr(level) == "<RateLevel 'checkpoints' write_bytes=1048576/s queue_depth=0 waits=1>"


def test_limit_validation_and_default_burst() -> None:
    with pytest.raises(ValueError, match=r"rate must be > 0 \(math.inf = unlimited\), got 0"):
        Limit(0)
    with pytest.raises(ValueError, match=r"burst must be finite and > 0, got -1"):
        Limit(10, -1)
    assert Limit(100 * MiB).effective_burst == 10 * MiB
    assert Limit(2).effective_burst == 1.0  # never below one token
    assert Limit(100, 20).scaled(0.25) == Limit(25, 5)
    assert Limit().scaled(0.5) == Limit()


async def _stream(flow: PolicyFlow, until: float) -> int:
    """One user's closed-loop writer: 256 KiB writes back to back until ``until``."""
    moved = 0
    while trio.current_time() < until:
        await flow.admit_write(256 * 1024)
        moved += 256 * 1024
    return moved


def _fair(write_bandwidth: str, burst: str) -> tuple[PolicyQos, FairShareGroup]:
    """A per-user class ``c`` with a write cap, and its group of per-user levels."""
    qos = engine(klass(per_user="fair", write_bandwidth=write_bandwidth, burst=burst))
    group = qos.classes["c"].group
    assert group is not None
    return qos, group


@mock_clock
async def test_fair_share_splits_between_active_users_and_reclaims_idle_shares() -> None:
    qos, group = _fair("30MiB/s", "3MiB")
    moved: dict[int, int] = {}

    async def user(uid: int, until: float, streams: int) -> None:
        flow = open_flow(qos, uid=uid)

        async def one() -> None:
            got = await _stream(flow, until)
            moved[uid] = moved.get(uid, 0) + got

        async with trio.open_nursery() as nursery:
            for _ in range(streams):
                nursery.start_soon(one)

    # Three users for 10 s; user 3 is greedy (4 streams) and gets no more than the others.
    async with trio.open_nursery() as nursery:
        nursery.start_soon(user, 1, 10.0, 1)
        nursery.start_soon(user, 2, 10.0, 2)
        nursery.start_soon(user, 3, 10.0, 4)
    rates = {uid: moved[uid] / 10.0 for uid in (1, 2, 3)}
    assert rates == pytest.approx({1: 10 * MiB, 2: 10 * MiB, 3: 10 * MiB}, rel=0.05)
    assert len(group.children) == 3

    # Users 1 and 2 go on for 20 s; user 3 is idle and expires after 2 s.
    moved.clear()
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(user, 1, start + 20.0, 1)
        nursery.start_soon(user, 2, start + 20.0, 1)
    assert set(group.children) == {1, 2}
    expected = (2 * 10 + 18 * 15) * MiB  # a third each for 2 s, then half each
    assert moved == pytest.approx({1: expected, 2: expected}, rel=0.02)
    assert group.parent.bytes_written <= 3 * MiB + 30 * MiB * trio.current_time()


@mock_clock
async def test_fair_share_resplit_wakes_waiters_and_parked_users_stay_active() -> None:
    qos, group = _fair("2MiB/s", "2MiB")
    group.idle_after = 1.0
    first, second = open_flow(qos, uid=1), open_flow(qos, uid=2)
    await first.admit_meta()  # a request of each makes both users active
    await second.admit_meta()
    b = group.children[2]
    assert b.limits.write_bytes == Limit(MiB, MiB)
    await second.admit_write(3 * MiB)  # user 2: 2 MiB of debt
    done: list[float] = []

    async def parked() -> None:
        await second.admit_write(MiB)  # 3 s at 1 MiB/s
        done.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(parked)
        await trio.sleep(1.5)
        assert group.expire() == 1  # user 1 idle; user 2 is parked, so still active
        assert set(group.children) == {2}
        assert b.limits.write_bytes == Limit(2 * MiB, 2 * MiB)
    # Re-split at 1.5 s: 0.5 MiB of debt left + 1 MiB, now at 2 MiB/s: 0.75 s more.
    assert done == [pytest.approx(2.25)]
    await trio.sleep_until(2.5)
    assert group.expire() == 1 and group.children == {}
    await open_flow(qos, uid=3).admit_meta()
    assert group.children[3].limits.write_bytes == Limit(2 * MiB, 2 * MiB)
    assert repr(group) == "<FairShareGroup 'c' active_users=1>"


@mock_clock
async def test_new_user_shrinks_shares_and_set_limits_resplits() -> None:
    group = FairShareGroup("c", LevelLimits(read_ops=Limit(100, 10)))
    a = group.level_for(1)
    assert a.limits.read_ops == Limit(100, 10)
    group.level_for(2)
    assert a.limits.read_ops == Limit(50, 5)
    group.set_limits(LevelLimits(read_ops=Limit(300, 30)))
    assert a.limits.read_ops == Limit(150, 15) and group.parent.limits.read_ops.rate == 300
    with pytest.raises(ValueError, match=r"idle_after must be > 0, got 0"):
        FairShareGroup("x", idle_after=0)


@settings(max_examples=40, deadline=None)
@given(
    arrivals=st.lists(
        st.tuples(st.floats(0.0, 3.0), st.integers(1, 3 * MiB)), min_size=1, max_size=40
    ),
)
def test_any_arrival_pattern_stays_in_the_envelope_and_fifo(
    arrivals: list[tuple[float, int]],
) -> None:
    rate, burst = 2 * MiB, MiB
    arrivals.sort(key=lambda a: a[0])
    arrivals = [(t + i * 1e-6, n) for i, (t, n) in enumerate(arrivals)]  # distinct instants
    done: list[tuple[float, int]] = []

    @mock_clock
    async def body() -> None:
        flow, _ = writes_capped("2MiB/s", "1MiB")

        async def req(i: int, n: int) -> None:
            await flow.admit_write(n)
            done.append((trio.current_time(), i))

        async with trio.open_nursery() as nursery:
            for i, (t, n) in enumerate(arrivals):
                nursery.start_soon(at, t, functools.partial(req, i, n))

    body()
    assert [i for _, i in done] == list(range(len(arrivals)))  # FIFO
    admitted = 0
    for t, i in done:  # never more than burst + rate * t (+ one oversized request's excess)
        admitted += arrivals[i][1]
        assert admitted <= burst + rate * t + 2 * MiB + 1
    # Live and not idling: after the last arrival, at most all the traffic's worth of time.
    total = sum(n for _, n in arrivals)
    assert done[-1][0] <= arrivals[-1][0] + total / rate + 1e-6


@mock_clock
async def test_bytes_charged_after_the_fact_are_paid_by_the_next_requests() -> None:
    """Bytes written under a name that said nothing are charged at the rename: the debt
    must survive the tokens the idle bucket earned meanwhile (refill first, then take)."""
    flow, level = writes_capped("1MiB/s", "1MiB")
    await trio.sleep(10)  # idle: the bucket is full, and would be far more without its cap
    level.charge_bytes(Kind.WRITE, 4 * MiB)
    assert level.bytes_written == 4 * MiB and level.ops_write == 0
    start = trio.current_time()
    await flow.admit_write(MiB)
    assert trio.current_time() - start == pytest.approx(4.0)  # -3 MiB, then 1 MiB to earn
