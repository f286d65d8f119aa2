"""The backend level's dispatcher on trio's mock clock: weights, minimums, work conservation."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from qosfs.qos.backend import BackendLevel, ClassPort, Share
from qosfs.qos.levels import Kind, LevelLimits, Limit, RateLevel, Stage, admit
from tests.mock_clock import mock_clock

MiB = 1024 * 1024


def backend(write: float = 100 * MiB, read: float | None = None) -> BackendLevel:
    return BackendLevel(LevelLimits(
        write_bytes=Limit(write, write * 0.1),
        read_bytes=Limit(read, read * 0.1) if read else Limit()))


async def saturate(chain: list[Stage], until: float, kind: Kind = Kind.WRITE,
                   workers: int = 4, size: int = MiB) -> list[int]:
    """Keep *workers* requests of *size* in flight through *chain* until *until*."""
    moved = [0]

    async def worker() -> None:
        while trio.current_time() < until:
            await admit(chain, kind, size)
            if trio.current_time() <= until:  # not the requests still parked at the end
                moved[0] += size

    async with trio.open_nursery() as nursery:
        for _ in range(workers):
            nursery.start_soon(worker)
    return moved


async def race(chains: dict[str, list[Stage]], seconds: float = 10.0) -> dict[str, float]:
    """Run every chain at full demand for *seconds*; MiB/s each achieved.

    The backend's bucket is emptied first: its initial burst would be served first come,
    first served (nobody is parked yet), which is right but blurs the shares measured.
    """
    for chain in chains.values():
        bucket = chain[-1].backend.level.buckets["write_bytes"]  # type: ignore[attr-defined]
        bucket.take(bucket.burst, trio.current_time())
        break
    until = trio.current_time() + seconds
    results: dict[str, list[int]] = {}

    async def run(name: str, chain: list[Stage]) -> None:
        results[name] = await saturate(chain, until)

    async with trio.open_nursery() as nursery:
        for name, chain in chains.items():
            nursery.start_soon(run, name, chain)
    return {name: moved[0] / MiB / seconds for name, moved in results.items()}


def port(b: BackendLevel, name: str, weight: float = 10.0, min_write: float = 0.0) -> ClassPort:
    return b.port(name, Share(weight=weight, min_write_bandwidth=min_write))


@mock_clock
async def test_priority_weights_split_a_contended_backend() -> None:
    b = backend()
    rates = await race({"high": [port(b, "high", 100)], "low": [port(b, "low", 1)]})
    assert 98 <= rates["high"] + rates["low"] <= 102  # the backend's 100 MiB/s, no more
    assert rates["high"] / rates["low"] == pytest.approx(100, rel=0.15)
    assert rates["low"] > 0.5  # lower priority is slowed, never starved


@mock_clock
async def test_equal_weights_share_equally() -> None:
    b = backend()
    rates = await race({"a": [port(b, "a")], "b": [port(b, "b")], "c": [port(b, "c")]})
    for rate in rates.values():
        assert rate == pytest.approx(100 / 3, rel=0.05)


@mock_clock
async def test_work_conserving_a_lone_low_class_gets_everything() -> None:
    b = backend()
    port(b, "high", 100)  # declared, but idle
    rates = await race({"low": [port(b, "low", 1)]})
    assert rates["low"] == pytest.approx(100, rel=0.02)


@mock_clock
async def test_minimum_is_guaranteed_against_a_high_priority_class() -> None:
    b = backend()
    rates = await race({"high": [port(b, "high", 100)],
                        "ckpt": [port(b, "ckpt", 1, min_write=30 * MiB)]})
    assert rates["ckpt"] == pytest.approx(30, rel=0.05)
    assert rates["high"] == pytest.approx(70, rel=0.05)


@mock_clock
async def test_minimum_is_a_floor_not_an_addition() -> None:
    b = backend()
    rates = await race({"a": [port(b, "a", 10, min_write=30 * MiB)], "b": [port(b, "b", 10)]})
    # Equal weights already give each 50 MiB/s, above a's 30 MiB/s minimum.
    assert rates["a"] == pytest.approx(50, rel=0.05)
    assert rates["b"] == pytest.approx(50, rel=0.05)


@mock_clock
async def test_class_cap_holds_and_the_rest_goes_to_others() -> None:
    b = backend()
    capped = RateLevel("high", LevelLimits(write_bytes=Limit(20 * MiB, 2 * MiB)))
    rates = await race({"high": [capped, port(b, "high", 100)], "low": [port(b, "low", 1)]})
    assert rates["high"] == pytest.approx(20, rel=0.03)
    assert rates["low"] == pytest.approx(80, rel=0.03)


@mock_clock
async def test_reads_and_writes_are_dispatched_separately() -> None:
    b = backend(write=100 * MiB, read=200 * MiB)
    hi, lo = port(b, "hi", 100), port(b, "lo", 1)
    until = trio.current_time() + 10
    async with trio.open_nursery() as nursery:
        nursery.start_soon(saturate, [hi], until, Kind.WRITE)
        reads = await saturate([lo], until, Kind.READ)
    assert reads[0] / MiB / 10 == pytest.approx(200, rel=0.03)  # writes do not slow reads


@mock_clock
async def test_cancelled_waiters_pass_the_turn_on() -> None:
    b = backend(write=10 * MiB)
    p = port(b, "a")
    await admit([p], Kind.WRITE, 10 * MiB)  # empty the bucket: the next ones park
    done: list[str] = []
    scopes = {name: trio.CancelScope() for name in ("turn", "second", "third", "fourth")}

    async def request(name: str) -> None:
        with scopes[name]:
            await admit([p], Kind.WRITE, MiB)
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


@mock_clock
async def test_raising_the_backend_capacity_wakes_parked_requests_at_once() -> None:
    b = backend(write=1 * MiB)
    p = port(b, "a")
    await admit([p], Kind.WRITE, 10 * MiB)  # ~10 s of debt at 1 MiB/s
    finished: list[float] = []

    async def request() -> None:
        await admit([p], Kind.WRITE, MiB)
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
async def test_requests_of_a_retired_class_still_complete() -> None:
    b = backend(write=1 * MiB)
    old = port(b, "old")
    await admit([old], Kind.WRITE, 2 * MiB)
    done: list[int] = []

    async def request() -> None:
        await admit([old], Kind.WRITE, MiB)
        done.append(1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(request)
        nursery.start_soon(request)
        await trio.testing.wait_all_tasks_blocked()
        b.retire_ports(set())
    assert done == [1, 1] and "old" not in b.ports


@mock_clock
async def test_uncontended_requests_pass_without_parking() -> None:
    b = backend()
    p = port(b, "a")
    with trio.testing.assert_no_checkpoints():
        for _ in range(5):
            await admit([p], Kind.WRITE, MiB)
    assert b.level.waits == 0 and b.level.bytes_written == 5 * MiB


@mock_clock
async def test_bytes_moved_to_a_class_by_a_rename_count_as_its_share() -> None:
    """A rename charges a class bytes another class already sent to the backend: the
    class yields that much to the others, and the backend's bucket is not charged again."""
    b = backend()
    a, other = port(b, "a"), port(b, "b")
    before = b.level.statistics().bytes_written
    a.charge_bytes(Kind.WRITE, 200 * MiB)
    assert b.level.statistics().bytes_written == before
    rates = await race({"a": [a], "b": [other]})
    assert 98 <= rates["a"] + rates["b"] <= 102
    assert rates["b"] - rates["a"] == pytest.approx(20, abs=3)  # 200 MiB over 10 s
