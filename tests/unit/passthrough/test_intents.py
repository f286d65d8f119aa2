"""The intent ring (qosfs.passthrough.intents): intents and outcomes read back by request
id, a kill at any store leaving an entry that is right or empty, an entry never reused
while its request is in flight, a successor carrying the ring over; and the decisions on
a resent request. The last test prints what recording costs per operation."""

from __future__ import annotations

import errno
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from qosfs.passthrough import intents as intents_module
from qosfs.passthrough.intents import (
    ENTRY_SIZE,
    EXISTS,
    GONE,
    PENDING,
    RESEND,
    RING_ENTRIES,
    RING_SIZE,
    ExactlyOnce,
    IntentRing,
    read_ring,
)
from qosfs.passthrough.journal import (
    FIRST_SLOT,
    HEADER_SIZE,
    SLOT_SIZE,
    SessionJournal,
    read_journal,
)

SESSION = {"source": "/src", "mountpoint": "/mnt"}


def ring(entries: int = 16) -> tuple[bytearray, IntentRing]:
    buf = bytearray(64 + entries * ENTRY_SIZE)
    return buf, IntentRing(buf, 64, entries)


def raw(buf: bytearray) -> bytes:
    return bytes(buf[64:])


# ---------------------------------------------------------------------- the ring


def test_intents_and_outcomes_read_back_by_request_id() -> None:
    buf, r = ring()
    a, b, c = r.intend(100), r.intend(102), r.intend(104)
    r.outcome(a, 100, 0)
    r.outcome(b, 102, errno.ENOENT)
    assert read_ring(raw(buf)) == {100: 0, 102: errno.ENOENT, 104: PENDING}
    assert len({a, b, c}) == 3


def test_a_kill_between_the_stores_of_a_reused_entry_leaves_it_empty_or_right() -> None:
    """An entry is cleared before its key changes: a kill at any store of a new intent
    leaves the old request's outcome whole, or nothing, never it under the new key."""
    buf, r = ring(1)
    e = r.intend(100)
    r.outcome(e, 100, 0)
    r.release(e)
    before = bytes(buf)
    writes: list[bytes] = []

    real_pack = intents_module._WORD.pack_into

    class Word:
        @staticmethod
        def pack_into(target: Any, at: int, value: int) -> None:
            real_pack(target, at, value)
            writes.append(bytes(target))

    intents_module._WORD, saved = Word, intents_module._WORD  # type: ignore[assignment]
    try:
        r.intend(202)
    finally:
        intents_module._WORD = saved
    assert len(writes) == 3
    for state in [before, *writes[:-1]]:  # killed after 0, 1 or 2 of the stores
        assert read_ring(state[64:]) in ({100: 0}, {})
        assert 202 not in read_ring(state[64:])
    assert read_ring(writes[-1][64:]) == {202: PENDING}


@pytest.mark.parametrize("code", [0, errno.ENOENT, errno.EEXIST])
def test_an_outcome_store_torn_byte_by_byte_reads_as_an_intent(code: int) -> None:
    """Were the 8-byte store ever split (it is one native store), every partial state
    reads as the intent, never as an outcome that was not written."""
    buf, r = ring(1)
    e = r.intend(100)
    pending = bytes(buf[64 + 8:64 + 16])
    r.outcome(e, 100, code)
    final = bytes(buf[64 + 8:64 + 16])
    for n in range(9):
        partial = final[:n] + pending[n:]
        buf[64 + 8:64 + 16] = partial
        assert read_ring(raw(buf)) == {100: code if partial == final else PENDING}, n


def test_an_entry_is_not_reused_while_its_request_is_in_flight() -> None:
    """Held entries (intent written, request not answered) stay as they are however many
    other requests come and go; a released one is reused last."""
    buf, r = ring(8)
    held = [r.intend(k) for k in (2, 4, 6, 8)]
    for k in range(1000, 3000, 2):
        e = r.intend(k)
        assert e not in held
        r.outcome(e, k, 0)
        r.release(e)
    assert {2, 4, 6, 8} <= set(read_ring(raw(buf)))
    for e in held:
        r.release(e)
    last = held[-1]
    order = [r.intend(k) for k in range(5000, 5016, 2)]
    assert order[-1] == last


def test_a_full_ring_records_nothing_rather_than_overwrite() -> None:
    _, r = ring(2)
    assert r.intend(2) >= 0 and r.intend(4) >= 0
    assert r.intend(6) == -1
    r.outcome(-1, 6, 0)  # ignored
    r.release(-1)


def test_an_outcome_wins_over_an_intent_of_the_same_request() -> None:
    """A successor executed again what its predecessor had only intended: the ring it
    carried holds both."""
    buf, r = ring()
    r.intend(100)
    e = r.intend(100)
    r.outcome(e, 100, 0)
    assert read_ring(raw(buf)) == {100: 0}


def test_a_successor_carries_the_ring_over_and_reuses_its_oldest_entries_first() -> None:
    old_buf, old = ring(8)
    for k in (40, 10, 30):
        old.outcome(old.intend(k), k, 0)
    new_buf, new = ring(8)
    new.carry(raw(old_buf))
    assert read_ring(raw(new_buf)) == {10: 0, 30: 0, 40: 0}
    # The five empty entries first, then the oldest request's (10), then 30's.
    for k in range(100, 114, 2):
        new.intend(k)
    assert read_ring(raw(new_buf)).keys() >= {40}
    assert 10 not in read_ring(raw(new_buf)) and 30 not in read_ring(raw(new_buf))


# ---------------------------------------------------------------------- in the journal


def test_the_journal_holds_the_ring_and_its_records_after_it(tmp_path: Path) -> None:
    j = SessionJournal(str(tmp_path / "j"))
    j.session(SESSION)
    e = j.intents.intend(77)
    j.intents.outcome(e, 77, errno.EEXIST)
    slot = j.put_inode(-1, 5, 1, 5, 1, False, None, -2, b"x", -1)
    assert slot == FIRST_SLOT and (FIRST_SLOT - 1) * SLOT_SIZE >= RING_SIZE
    back = read_journal(j.path)
    assert back.outcomes == {77: errno.EEXIST} and set(back.records) == {slot}
    assert len(back.ring) == RING_SIZE == RING_ENTRIES * ENTRY_SIZE
    j.close(remove=True)


def test_a_journal_of_the_version_before_the_ring_is_read(tmp_path: Path) -> None:
    """QOSFSJ02: records from slot 1, no ring; its successor recovers without outcomes."""
    j = SessionJournal(str(tmp_path / "j"))
    j.session(SESSION)
    slot = j.put_inode(-1, 5, 1, 5, 1, False, None, -2, b"x", -1)
    j.close(remove=False)
    old = 512  # that version's slot size
    with open(j.path, "rb") as f:
        data = f.read()
    record = data[HEADER_SIZE + slot * SLOT_SIZE:HEADER_SIZE + (slot + 1) * SLOT_SIZE]
    forged = bytearray(data[:HEADER_SIZE] + bytes(2 * old))
    forged[HEADER_SIZE + old:HEADER_SIZE + old + SLOT_SIZE] = record
    forged[:8] = b"QOSFSJ02"
    forged[8:12] = struct.pack("<I", old)
    Path(j.path).write_bytes(forged)
    back = read_journal(j.path)
    assert set(back.records) == {1} and back.records[1].name == b"x"
    assert back.outcomes == {} and back.ring == b""


# ---------------------------------------------------------------------- resent requests


@dataclass
class Ctx:
    unique: int


class Call:
    """A system call stand-in: counts its executions, fails with *fails* if set."""

    def __init__(self, fails: int = 0) -> None:
        self.fails = fails
        self.runs = 0

    async def __call__(self) -> str:
        self.runs += 1
        if self.fails:
            raise OSError(self.fails, "")
        return "done here"


async def answer(result: Any) -> Any:
    return ("answered", result)


def gate(past: dict[int, int] | None = None) -> tuple[bytearray, ExactlyOnce]:
    buf, r = ring(64)
    once = ExactlyOnce()
    once.past = past or {}
    once.attach(r)
    return buf, once


def run(once: ExactlyOnce, unique: Any, call: Call, already: int = GONE) -> Any:
    async def main() -> Any:
        return await once.run(unique, "unlink", b"n", already, call, answer)
    return trio.run(main)


def test_a_first_execution_is_recorded_with_its_outcome() -> None:
    buf, once = gate()
    assert run(once, Ctx(10), Call()) == ("answered", "done here")
    with pytest.raises(OSError):
        run(once, Ctx(12), Call(errno.EACCES))
    assert read_ring(raw(buf)) == {10: 0, 12: errno.EACCES}


def test_a_resent_request_done_by_the_dead_daemon_is_answered_not_executed() -> None:
    _, once = gate({10: 0, 12: errno.ENOTEMPTY})
    call = Call()
    assert run(once, Ctx(10 | RESEND), call) == ("answered", None)
    with pytest.raises(OSError) as err:
        run(once, Ctx(12 | RESEND), call)
    assert err.value.errno == errno.ENOTEMPTY and call.runs == 0 and once.replayed == 2


@pytest.mark.parametrize(("already", "fails"), [(GONE, errno.ENOENT), (EXISTS, errno.EEXIST)])
def test_an_intent_without_outcome_executes_and_its_already_errno_counts_as_done(
        already: int, fails: int) -> None:
    buf, once = gate({10: PENDING})
    call = Call(fails)
    assert run(once, Ctx(10 | RESEND), call, already) == ("answered", None)
    assert call.runs == 1 and read_ring(raw(buf)) == {10: 0}
    with pytest.raises(OSError):  # another errno is the answer
        run(once, Ctx(10 | RESEND), Call(errno.EACCES), already)


def test_a_resent_request_never_begun_executes_normally() -> None:
    _, once = gate({10: 0})
    call = Call(errno.ENOENT)
    with pytest.raises(OSError):
        run(once, Ctx(14 | RESEND), call)  # not in the record
    assert call.runs == 1


def test_a_new_request_of_the_same_id_as_a_recorded_one_is_executed() -> None:
    """Only the resend bit makes the record count (ids are per connection; a record is
    only looked at for a resent request)."""
    _, once = gate({10: 0})
    call = Call()
    run(once, Ctx(10), call)
    assert call.runs == 1


@pytest.mark.parametrize("ctx", [Ctx(0), object()])
def test_without_request_ids_nothing_is_recorded_and_everything_executes(ctx: Any) -> None:
    buf, once = gate({10: 0})
    call = Call()
    assert run(once, ctx, call) == ("answered", "done here")
    assert call.runs == 1 and read_ring(raw(buf)) == {}


def test_an_interrupted_call_leaves_its_intent_and_frees_the_entry() -> None:
    buf, once = gate()

    class Interrupted(Exception):
        pass

    async def boom() -> str:
        raise Interrupted

    async def main() -> None:
        await once.run(Ctx(10), "unlink", b"n", GONE, boom, answer)

    with pytest.raises(Interrupted):
        trio.run(main)
    assert read_ring(raw(buf)) == {10: PENDING}
    assert once.ring is not None and len(once.ring._free) == 64


def test_the_crash_hook_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(intents_module.CRASH_ENV, "rename:syscall:a:b")
    point = intents_module.crash_point_from_env()
    assert point is not None and (point.op, point.stage, point.name) == ("rename", "syscall",
                                                                         b"a:b")
    monkeypatch.setenv(intents_module.CRASH_ENV, "rename:later:a")
    with pytest.raises(ValueError):
        intents_module.crash_point_from_env()
    monkeypatch.delenv(intents_module.CRASH_ENV)
    assert intents_module.crash_point_from_env() is None


# ---------------------------------------------------------------------- the cost


def test_what_recording_costs_per_operation(capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path) -> None:
    """The added cost of a recorded operation over an unrecorded one, through
    ExactlyOnce.run on a journal's mapping (printed; the bound only catches a blunder)."""
    j = SessionJournal(str(tmp_path / "j"))
    try:
        once, bare = ExactlyOnce(), ExactlyOnce()
        once.attach(j.intents)
        n = 20000

        async def nothing() -> None:
            return None

        async def done(result: Any) -> None:
            return None

        async def loop(gate: ExactlyOnce) -> float:
            ctx = Ctx(0)
            t0 = time.perf_counter()
            for i in range(n):
                ctx.unique = 2 * i + 2
                await gate.run(ctx, "unlink", b"n", GONE, nothing, done)
            return (time.perf_counter() - t0) / n

        recorded = min(trio.run(loop, once) for _ in range(3))
        unrecorded = min(trio.run(loop, bare) for _ in range(3))
        ring_only = _ring_cost(j.intents)
    finally:
        j.close(remove=True)
    added = recorded - unrecorded
    with capsys.disabled():
        print(f"\nintent + outcome: {added * 1e6:.2f} us added per operation "
              f"({ring_only * 1e6:.2f} us of it the ring's stores)")
    assert added < 50e-6


def _ring_cost(r: IntentRing) -> float:
    n = 50000
    t0 = time.perf_counter()
    for i in range(n):
        e = r.intend(i)
        r.outcome(e, i, 0)
        r.release(e)
    return (time.perf_counter() - t0) / n


def test_the_ring_outnumbers_the_requests_that_can_be_in_flight_twice() -> None:
    """An entry is given back when its request is answered; with at most MAX_TASKS held,
    the FIFO reuses it only after MAX_TASKS other intents: the ring must stay larger."""
    from qosfs.daemon.serve import MAX_TASKS
    assert RING_ENTRIES >= 2 * MAX_TASKS
