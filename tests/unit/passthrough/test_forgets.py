"""qosfs.passthrough.forgets: a FORGET of thousands of inodes applied a batch at a time by
the daemon's service, other tasks running in between, nothing lost, in order, and all of
it at once where no service runs or before a successor takes the tables."""

from __future__ import annotations

import trio

from qosfs.passthrough import forgets
from qosfs.passthrough.forgets import Forgets


def test_without_the_service_a_forget_is_applied_whole_and_at_once() -> None:
    applied: list[tuple[int, int]] = []
    f = Forgets(lambda nodeid, count: applied.append((nodeid, count)))
    entries = [(n, 1) for n in range(3 * forgets.BATCH + 5)]
    f.forget(entries)
    assert applied == entries and len(f) == 0


def test_with_the_service_a_big_forget_is_applied_in_batches_with_turns_between() -> None:
    applied: list[tuple[int, int]] = []
    f = Forgets(lambda nodeid, count: applied.append((nodeid, count)))
    entries = [(n, 2) for n in range(3 * forgets.BATCH + 5)]
    seen: list[int] = []

    async def main() -> None:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(f.run)
                f.forget(entries)
                assert len(applied) == forgets.BATCH  # the first batch at once
                while len(applied) < len(entries):
                    seen.append(len(applied))
                    await trio.sleep(0)
                f.forget([(9999, 1)])  # a small one afterwards: at once
                assert applied[-1] == (9999, 1) and len(f) == 0
                nursery.cancel_scope.cancel()

    trio.run(main)
    assert applied[:len(entries)] == entries  # every entry, in order
    # Another task saw a batch's outcome (trio runs runnable tasks in a random order,
    # so not necessarily after every batch).
    assert set(seen) & {forgets.BATCH * k for k in (1, 2, 3)}, seen


def test_flush_applies_what_is_queued_before_a_successor_takes_the_tables() -> None:
    applied: list[tuple[int, int]] = []
    f = Forgets(lambda nodeid, count: applied.append((nodeid, count)))
    entries = [(n, 1) for n in range(2 * forgets.BATCH)]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(f.run)
            f.forget(entries)
            assert 0 < len(f) < len(entries)
            f.flush()
            assert applied == entries and len(f) == 0
            nursery.cancel_scope.cancel()

    trio.run(main)
