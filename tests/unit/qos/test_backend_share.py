"""The backend level's dispatcher on trio's mock clock: weights, minimums, work conservation.

Each class is a class of a policy with a ``[backend]`` table, and its requests are
charged through the flow of a file opened in it (tests.admission), as the product
charges them: the class's level, then its port to the backend.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from qosfs.policy.loading import parse_policy
from qosfs.qos.backend import BackendLevel, ClassPort
from qosfs.qos.engine import PolicyQos
from qosfs.qos.flow import PolicyFlow
from qosfs.qos.levels import Kind, LevelLimits, Limit
from tests.admission import MiB, admit, engine, klass, open_flow, table
from tests.mock_clock import mock_clock


def backend_policy(*classes: str, write: str = "100MiB/s", read: str | None = None,
                   ) -> tuple[PolicyQos, BackendLevel]:
    """An engine whose backend delivers *write* (and *read*), shared by *classes*."""
    capacity = {"write_bandwidth": write} | ({"read_bandwidth": read} if read else {})
    qos = engine(table("backend", **capacity), *classes)
    assert qos.backend is not None
    return qos, qos.backend


def share(name: str, priority: int = 10, min_write: str | None = None, **caps: str) -> str:
    """A class competing for the backend with weight *priority* and a minimum."""
    extra: dict[str, object] = {"min_write_bandwidth": min_write} if min_write else {}
    return klass(name, priority=priority, **extra, **caps)


def flows(qos: PolicyQos, *names: str) -> dict[str, PolicyFlow]:
    return {name: open_flow(qos, f"{name}/f") for name in names}


async def saturate(flow: PolicyFlow, until: float, kind: Kind = Kind.WRITE,
                   workers: int = 4, size: int = MiB) -> list[int]:
    """Keep *workers* requests of *size* in flight through *flow* until *until*."""
    moved = [0]

    async def worker() -> None:
        while trio.current_time() < until:
            await admit(flow, kind, size)
            if trio.current_time() <= until:  # not the requests still parked at the end
                moved[0] += size

    async with trio.open_nursery() as nursery:
        for _ in range(workers):
            nursery.start_soon(worker)
    return moved


async def race(backend: BackendLevel, chains: dict[str, PolicyFlow],
               seconds: float = 10.0) -> dict[str, float]:
    """Run every flow at full demand for *seconds*; MiB/s each achieved.

    The backend's bucket is emptied first: its initial burst would be served first come,
    first served (nobody is parked yet), which is right but blurs the shares measured.
    """
    bucket = backend.level.buckets["write_bytes"]  # type: ignore[attr-defined]
    bucket.take(bucket.burst, trio.current_time())
    until = trio.current_time() + seconds
    results: dict[str, list[int]] = {}

    async def run(name: str, flow: PolicyFlow) -> None:
        results[name] = await saturate(flow, until)

    async with trio.open_nursery() as nursery:
        for name, flow in chains.items():
            nursery.start_soon(run, name, flow)
    return {name: moved[0] / MiB / seconds for name, moved in results.items()}


def port(backend: BackendLevel, name: str) -> ClassPort:
    return backend.ports[name]


@mock_clock
async def test_priority_weights_split_a_contended_backend() -> None:
    qos, b = backend_policy(share("high", 100), share("low", 1))
    rates = await race(b, flows(qos, "high", "low"))
    assert 98 <= rates["high"] + rates["low"] <= 102  # the backend's 100 MiB/s, no more
    assert rates["high"] / rates["low"] == pytest.approx(100, rel=0.15)
    assert rates["low"] > 0.5  # lower priority is slowed, never starved


@mock_clock
async def test_equal_weights_share_equally() -> None:
    qos, b = backend_policy(share("a"), share("b"), share("c"))
    rates = await race(b, flows(qos, "a", "b", "c"))
    for rate in rates.values():
        assert rate == pytest.approx(100 / 3, rel=0.05)


@mock_clock
async def test_work_conserving_a_lone_low_class_gets_everything() -> None:
    qos, b = backend_policy(share("high", 100), share("low", 1))  # high: declared, idle
    rates = await race(b, flows(qos, "low"))
    assert rates["low"] == pytest.approx(100, rel=0.02)


@mock_clock
async def test_minimum_is_guaranteed_against_a_high_priority_class() -> None:
    qos, b = backend_policy(share("high", 100), share("ckpt", 1, min_write="30MiB/s"))
    rates = await race(b, flows(qos, "high", "ckpt"))
    assert rates["ckpt"] == pytest.approx(30, rel=0.05)
    assert rates["high"] == pytest.approx(70, rel=0.05)


@mock_clock
async def test_minimum_is_a_floor_not_an_addition() -> None:
    qos, b = backend_policy(share("a", 10, min_write="30MiB/s"), share("b", 10))
    rates = await race(b, flows(qos, "a", "b"))
    # Equal weights already give each 50 MiB/s, above a's 30 MiB/s minimum.
    assert rates["a"] == pytest.approx(50, rel=0.05)
    assert rates["b"] == pytest.approx(50, rel=0.05)


@mock_clock
async def test_class_cap_holds_and_the_rest_goes_to_others() -> None:
    qos, b = backend_policy(share("high", 100, write_bandwidth="20MiB/s", burst="2MiB"),
                            share("low", 1))
    rates = await race(b, flows(qos, "high", "low"))
    assert rates["high"] == pytest.approx(20, rel=0.03)
    assert rates["low"] == pytest.approx(80, rel=0.03)


@mock_clock
async def test_reads_and_writes_are_dispatched_separately() -> None:
    qos, _ = backend_policy(share("hi", 100), share("lo", 1), read="200MiB/s")
    hi, lo = open_flow(qos, "hi/f"), open_flow(qos, "lo/f", writing=False)
    until = trio.current_time() + 10
    async with trio.open_nursery() as nursery:
        nursery.start_soon(saturate, hi, until, Kind.WRITE)
        reads = await saturate(lo, until, Kind.READ)
    assert reads[0] / MiB / 10 == pytest.approx(200, rel=0.03)  # writes do not slow reads


@mock_clock
async def test_cancelled_waiters_pass_the_turn_on() -> None:
    qos, b = backend_policy(share("a"), write="10MiB/s")
    flow = open_flow(qos, "a/f")
    await flow.admit_write(10 * MiB)  # empty the bucket: the next ones park
    done: list[str] = []
    scopes = {name: trio.CancelScope() for name in ("turn", "second", "third", "fourth")}

    async def request(name: str) -> None:
        with scopes[name]:
            await flow.admit_write(MiB)
            done.append(name)

    async with trio.open_nursery() as nursery:
        for name in scopes:
            nursery.start_soon(request, name)
            await trio.testing.wait_all_tasks_blocked()
        assert b.parked[Kind.WRITE].holder is not None
        scopes["turn"].cancel()  # the one holding the turn (it parked first)
        scopes["third"].cancel()  # one parked behind it
    assert done == ["second", "fourth"]
    assert b.level.queue_depth == 0 and not b.parked[Kind.WRITE]
    assert b.level.bytes_written == 12 * MiB  # nothing charged for the cancelled ones
    assert qos.parking.requests == 0


@mock_clock
async def test_raising_the_backend_capacity_wakes_parked_requests_at_once() -> None:
    qos, b = backend_policy(share("a"), write="1MiB/s")
    flow = open_flow(qos, "a/f")
    await flow.admit_write(10 * MiB)  # ~10 s of debt at 1 MiB/s
    finished: list[float] = []

    async def request() -> None:
        await flow.admit_write(MiB)
        finished.append(trio.current_time())

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(request)
        await trio.sleep(0.5)
        b.set_limits(LevelLimits(write_bytes=Limit(1024 * MiB, 64 * MiB)))
    assert len(finished) == 3
    assert max(finished) - start < 0.52  # at once (the old debt, 10 ms at the new rate)


@mock_clock
async def test_requests_of_a_class_a_swap_removed_still_complete() -> None:
    qos, b = backend_policy(share("old"), write="1MiB/s")
    flow = open_flow(qos, "old/f")
    await flow.admit_write(2 * MiB)
    done: list[int] = []

    async def request() -> None:
        await flow.admit_write(MiB)
        done.append(1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(request)
        nursery.start_soon(request)
        await trio.testing.wait_all_tasks_blocked()
        qos.swap(parse_policy(table("backend", write_bandwidth="1MiB/s")))  # "old" gone
    assert done == [1, 1] and "old" not in b.ports


@mock_clock
async def test_uncontended_requests_pass_without_parking() -> None:
    qos, b = backend_policy(share("a"))
    flow = open_flow(qos, "a/f")
    with trio.testing.assert_no_checkpoints():
        for _ in range(5):
            await flow.admit_write(MiB)
    assert b.level.waits == 0 and b.level.bytes_written == 5 * MiB


@mock_clock
async def test_bytes_moved_to_a_class_by_a_rename_count_as_its_share() -> None:
    """A rename charges a class bytes another class already sent to the backend: the
    class yields that much to the others, and the backend's bucket is not charged again."""
    qos, b = backend_policy(share("a"), share("b"))
    before = b.level.statistics().bytes_written
    port(b, "a").charge_bytes(Kind.WRITE, 200 * MiB)
    assert b.level.statistics().bytes_written == before
    rates = await race(b, flows(qos, "a", "b"))
    assert 98 <= rates["a"] + rates["b"] <= 102
    assert rates["b"] - rates["a"] == pytest.approx(20, abs=3)  # 200 MiB over 10 s
