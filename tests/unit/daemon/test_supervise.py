"""Services on the daemon's event loop are restarted when they fail (mock clock)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator

import pytest
import trio

from qosfs.core.failures import Failures
from qosfs.daemon.supervise import FIRST_PAUSE, LONGEST_PAUSE, supervised
from tests.mock_clock import mock_clock


@pytest.fixture(autouse=True)
def _failures_are_expected(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.ERROR)
    yield
    for r in caplog.get_records("call"):
        r.expected = True  # type: ignore[attr-defined]


def test_a_failing_service_is_restarted_with_growing_pauses() -> None:
    failures = Failures()
    starts: list[float] = []

    async def service(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        starts.append(trio.current_time())
        task_status.started()
        if len(starts) <= 8:
            raise ValueError("bug")
        await trio.sleep_forever()

    @mock_clock
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(supervised, "svc", service, failures)
            await trio.sleep(1000)
            nursery.cancel_scope.cancel()

    main()
    assert len(starts) == 9
    pauses = [b - a for a, b in itertools.pairwise(starts)]
    assert pauses == [FIRST_PAUSE * 2 ** i for i in range(6)] + [LONGEST_PAUSE] * 2
    assert failures.counts() == {"svc": {"ValueError": 8}}


def test_a_service_that_ran_long_is_restarted_after_the_first_pause_again() -> None:
    failures = Failures()
    starts: list[float] = []

    async def service(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        starts.append(trio.current_time())
        task_status.started()
        await trio.sleep(0 if len(starts) < 3 else LONGEST_PAUSE)
        raise ValueError("bug")

    @mock_clock
    async def main() -> None:
        with trio.move_on_after(4 * FIRST_PAUSE + LONGEST_PAUSE + 0.5):
            await supervised("svc", service, failures)

    main()
    assert [round(b - a, 3) for a, b in itertools.pairwise(starts)] == [
        FIRST_PAUSE, 2 * FIRST_PAUSE, LONGEST_PAUSE + FIRST_PAUSE]


def test_a_service_failing_before_it_started_fails_the_start() -> None:
    async def service(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        raise OSError("cannot listen")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            with pytest.raises(OSError, match="cannot listen"):
                await nursery.start(supervised, "svc", service, Failures())

    trio.run(main)


def test_a_service_that_returns_is_not_restarted() -> None:
    runs = []

    async def service(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        runs.append(1)
        task_status.started()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(supervised, "svc", service, Failures())

    trio.run(main)
    assert runs == [1]
