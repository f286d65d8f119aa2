"""What a request that must wait meets on the product's path: the parking bounds
(EAGAIN past them, :mod:`qosfs.qos.bounds`) and its caller's death (EINTR), through a
file's flow on trio's mock clock (tests.admission)."""

from __future__ import annotations

import errno

import pytest
import trio
import trio.testing

from qosfs.qos.bounds import ParkingLimits
from qosfs.qos.engine import PolicyQos
from qosfs.qos.flow import PolicyFlow
from tests.admission import (
    Callers,
    MiB,
    class_level,
    engine,
    klass,
    open_flow,
    table,
    tenant_level,
)
from tests.mock_clock import mock_clock

# The class lets everything through; the tenant after it is where requests park. So a
# request refused or abandoned has passed a level already, which must get it back.
OPEN_CLASS = klass(write_bandwidth="1GiB/s", burst="64MiB")
TIGHT_TENANT = table("tenants.t", paths=["c/**"], write_bandwidth="1MiB/s", burst="1MiB",
                     meta_iops=1, burst_iops=1)


def tight(parking: ParkingLimits) -> tuple[PolicyQos, PolicyFlow]:
    """A file whose writes park at the tenant once its 1 MiB burst is spent."""
    qos = engine(OPEN_CLASS, TIGHT_TENANT, parking=parking)
    return qos, open_flow(qos)


async def refused(request: object) -> int:
    """The errno a request was refused with (it must be refused, at once)."""
    with trio.testing.assert_no_checkpoints(), pytest.raises(OSError) as raised:
        await request  # type: ignore[misc]
    return raised.value.errno or 0


@mock_clock
async def test_a_request_past_a_full_lot_is_refused_at_once_and_refunded() -> None:
    qos, flow = tight(ParkingLimits(per_uid_requests=2))
    cls, tenant = class_level(qos), tenant_level(qos)
    await flow.admit_write(MiB)  # the tenant's burst: the next writes park
    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(flow.admit_write, MiB)
        await trio.testing.wait_all_tasks_blocked()
        assert (qos.parking.requests, qos.parking.bytes) == (2, 2 * MiB)
        assert await refused(flow.admit_write(MiB)) == errno.EAGAIN
        # The class it had passed got it back; the tenant never charged it.
        assert cls.bytes_written == 3 * MiB and cls.ops_write == 3
        assert cls.buckets["write_bytes"].tokens == 64 * MiB - 3 * MiB
        assert tenant.queue_depth == 2
    assert trio.current_time() == pytest.approx(2.0)  # the two parked ones went through
    stats = qos.parking.statistics()
    assert (stats.requests, stats.bytes, stats.refused) == (0, 0, 1)
    assert qos.parking.refused_by_class == {"c": 1}
    assert tenant.bytes_written == cls.bytes_written == 3 * MiB


@mock_clock
async def test_requests_that_need_no_wait_never_enter_the_lot() -> None:
    qos, flow = tight(ParkingLimits(total_requests=0))  # nothing may park at all
    with trio.testing.assert_no_checkpoints():
        await flow.admit_write(MiB)
        await flow.admit_read(MiB)  # the tenant caps writes and metadata only
        await flow.admit_meta()
    assert await refused(flow.admit_write(MiB)) == errno.EAGAIN
    assert await refused(flow.admit_meta()) == errno.EAGAIN
    assert qos.parking.refused == 2 and qos.parking.requests == 0


def test_the_per_uid_bound_counts_the_writer_not_the_opener(
        monkeypatch: pytest.MonkeyPatch) -> None:
    callers = Callers(monkeypatch, uid=1000)

    @mock_clock
    async def body() -> None:
        qos, flow = tight(ParkingLimits(per_uid_requests=1))  # opened by uid 0
        await flow.admit_write(MiB)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(flow.admit_write, MiB)
            await trio.testing.wait_all_tasks_blocked()
            assert await refused(flow.admit_write(MiB)) == errno.EAGAIN  # 1000's second
            callers.uid = 1001
            nursery.start_soon(flow.admit_write, MiB)  # another writer of the same open
            await trio.testing.wait_all_tasks_blocked()
            assert qos.parking.requests == 2
        assert qos.parking.refused == 1

    body()


def test_the_per_uid_bytes_bound_counts_write_data_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    Callers(monkeypatch, uid=1000)

    @mock_clock
    async def body() -> None:
        qos = engine(klass(write_bandwidth="1MiB/s", burst="1MiB", read_bandwidth="1MiB/s"),
                     parking=ParkingLimits(per_uid_bytes=2 * MiB))
        flow = open_flow(qos)
        await flow.admit_write(MiB)
        await flow.admit_read(MiB)
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(flow.admit_write, MiB)
            await trio.testing.wait_all_tasks_blocked()
            assert await refused(flow.admit_write(MiB)) == errno.EAGAIN  # 3 MiB held
            nursery.start_soon(flow.admit_read, 8 * MiB)  # a read holds no data yet
            await trio.testing.wait_all_tasks_blocked()
            assert (qos.parking.requests, qos.parking.bytes) == (3, 2 * MiB)

    body()


def test_the_per_class_bound_holds_across_users_and_spares_other_classes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    callers = Callers(monkeypatch)

    @mock_clock
    async def body() -> None:
        qos = engine(klass("c", write_bandwidth="1MiB/s", burst="1MiB"),
                     klass("d", write_bandwidth="1MiB/s", burst="1MiB"),
                     parking=ParkingLimits(per_class_requests=2))
        c, d = open_flow(qos, "c/f"), open_flow(qos, "d/f")
        await c.admit_write(MiB)
        await d.admit_write(MiB)
        async with trio.open_nursery() as nursery:
            for uid in (1, 2):
                callers.uid = uid
                nursery.start_soon(c.admit_write, MiB)
                await trio.testing.wait_all_tasks_blocked()
            callers.uid = 3
            assert await refused(c.admit_write(MiB)) == errno.EAGAIN
            nursery.start_soon(d.admit_write, MiB)
            await trio.testing.wait_all_tasks_blocked()
            assert qos.parking.statistics().by_class == {"c": 2, "d": 1}
        assert qos.parking.refused_by_class == {"c": 1}

    body()


def test_a_killed_caller_leaves_at_once_with_eintr_and_everything_given_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    callers = Callers(monkeypatch, uid=1000)

    @mock_clock
    async def body() -> None:
        qos, flow = tight(ParkingLimits())
        cls, tenant = class_level(qos), tenant_level(qos)
        await flow.admit_write(MiB)
        outcome: dict[str, object] = {}
        finished: list[float] = []

        async def doomed() -> None:
            try:
                await flow.admit_write(MiB)
            except OSError as exc:
                outcome["errno"], outcome["at"] = exc.errno, trio.current_time()

        async def behind() -> None:
            await flow.admit_write(MiB)
            finished.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(doomed)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(behind)
            await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(0.25)
            callers.kill(0)  # the first parked request's caller: FUSE INTERRUPT, SIGKILL
        assert outcome == {"errno": errno.EINTR, "at": 0.25}
        # The one behind it did not wait for the dead one's tokens: 1 MiB at 1 MiB/s.
        assert finished == [pytest.approx(1.0)]
        assert cls.bytes_written == tenant.bytes_written == 2 * MiB
        assert cls.ops_write == 2 and tenant.queue_depth == 0
        assert (qos.parking.requests, qos.parking.bytes, qos.parking.refused) == (0, 0, 0)
        assert not callers.parked

    body()


def test_a_metadata_request_parks_without_a_caller_and_by_the_openers_uid(
        monkeypatch: pytest.MonkeyPatch) -> None:
    Callers(monkeypatch, uid=1000)

    @mock_clock
    async def body() -> None:
        qos = engine(OPEN_CLASS, TIGHT_TENANT, parking=ParkingLimits(per_uid_requests=1))
        flow = open_flow(qos, uid=7)
        await flow.admit_meta()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(flow.admit_meta)
            await trio.testing.wait_all_tasks_blocked()
            assert await refused(flow.admit_meta()) == errno.EAGAIN
        assert trio.current_time() == pytest.approx(1.0)
        assert flow.stats.meta_ops == 2  # the refused one is not counted as done

    body()
