"""Non-idempotent requests done exactly once across a crash: intents and outcomes kept by
request id in the session journal.

A daemon that died had read requests it never answered; its successor has the kernel send
them again (FUSE_NOTIFY_RESEND), marked by bit 63 of their otherwise unchanged ``unique``.
A rename, unlink, rmdir, link, mkdir, symlink, mknod or O_EXCL create the dead process had
already performed would fail the second time (ENOENT, EEXIST) although the caller's
operation succeeded. So before the system call the daemon writes an *intent* (the
request's id) into a ring in the journal, and after it the *outcome* (0 or the errno). A
resent request with an outcome is answered with it without executing again; one with an
intent and no outcome (killed between the system call and the store) is executed, and the
errno a second execution gives when the first had done it counts as done; one with no
intent was never begun.

The ring: `RING_ENTRIES` entries of two aligned 8-byte words, (key, tag | code), written
with native stores (one ``mov`` each on a little-endian machine: a kill never leaves half a
word). Entries are taken from a FIFO of free ones at the intent and given back once the
handler's answer is ready (the outcome stored, the new name looked up), right before the
reply (pyfuse3 replies when the handler returns, with no checkpoint in between): since
at most ``MAX_TASKS`` (4096, qosfs.daemon.serve) requests are in flight and the ring has
twice as many entries, an entry is never reused while its request is in flight, and an
outcome outlives its reply by at least 4096 other intents. The tag (31 bits of the key
and a set top bit, never 0) makes an entry valid only when both words agree: a reused
entry is cleared (word 1 = 0) before its key changes, so a kill in between leaves an
empty entry, never another request's outcome; an outcome store torn byte by byte (it is
not) would read as the intent, never as another outcome.

A successor that recovers copies the dead process's entries into its own ring (oldest
reused first), so a second kill before the resent requests are answered still finds them.

The cost: two native stores and a deque pop per intent, one store and an append per
outcome (about 1 us per operation, bench in tests/unit/passthrough/test_intents.py).
"""

from __future__ import annotations

import errno
import logging
import os
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pyfuse3

log = logging.getLogger(__name__)

RESEND = 1 << 63  # FUSE_UNIQUE_RESEND: the kernel sent this request again
RING_ENTRIES = 8192  # 2 x MAX_TASKS (qosfs.daemon.serve): see the module docstring
_WORD = struct.Struct("=Q")  # native and aligned: one store
ENTRY_SIZE = 16
RING_SIZE = RING_ENTRIES * ENTRY_SIZE
PENDING = 0xFFFFFFFF  # the intent is written, the outcome not
_MAX_ERRNO = 4095
_T = TypeVar("_T")
_R = TypeVar("_R")

# What a second execution answers when the first one had done the operation.
GONE = errno.ENOENT  # unlink, rmdir, rename
EXISTS = errno.EEXIST  # mkdir, symlink, link, mknod, O_EXCL create


def request_ids_known() -> bool:
    """Whether pyfuse3 tells a request's unique id (deploy/libfuse/pyfuse3-req-unique.patch
    on a libfuse with fuse_req_unique): without it resent requests execute again."""
    return bool(getattr(pyfuse3, "REQUEST_UNIQUE_SUPPORTED", False))


def _tag(key: int) -> int:
    return (((key >> 1) & 0x7FFFFFFF) | 0x80000000) << 32


class IntentRing:
    """The writer's side of the ring, at *at* in *buf* (the journal's mapping)."""

    def __init__(self, buf: Any, at: int, entries: int = RING_ENTRIES) -> None:
        self._buf = buf
        self._at = at
        self._free: deque[int] = deque(range(entries))
        self.entries = entries

    def intend(self, key: int) -> int:
        """Write the intent of request *key*; returns its entry, held until `release`
        (-1: none free, which MAX_TASKS rules out; the request then goes unrecorded)."""
        free = self._free
        if not free:
            return -1
        entry = free.popleft()
        at = self._at + entry * ENTRY_SIZE
        buf = self._buf
        _WORD.pack_into(buf, at + 8, 0)  # empty while the key changes
        _WORD.pack_into(buf, at, key)
        _WORD.pack_into(buf, at + 8, _tag(key) | PENDING)
        return entry

    def outcome(self, entry: int, key: int, code: int) -> None:
        """The outcome of request *key* (0 or an errno), in its *entry*."""
        if entry >= 0:
            _WORD.pack_into(self._buf, self._at + entry * ENTRY_SIZE + 8, _tag(key) | code)

    def release(self, entry: int) -> None:
        """*entry*'s request is being answered: the entry may be reused (last of all)."""
        if entry >= 0:
            self._free.append(entry)

    def carry(self, raw: bytes) -> None:
        """Take over a dead predecessor's ring (*raw*, as the journal read it): its entries
        in the same places, reused oldest first (request ids grow), empty ones before."""
        n = min(len(raw) // ENTRY_SIZE, self.entries)
        self._buf[self._at:self._at + n * ENTRY_SIZE] = raw[:n * ENTRY_SIZE]
        used = {entry: key for entry, key, _ in _entries(raw[:n * ENTRY_SIZE])}
        empty = [e for e in range(self.entries) if e not in used]
        self._free = deque(empty + sorted(used, key=used.__getitem__))


def _entries(raw: bytes) -> list[tuple[int, int, int]]:
    """(entry, key, code) of every valid entry of a ring."""
    out = []
    for entry in range(len(raw) // ENTRY_SIZE):
        key, word = struct.unpack_from("=QQ", raw, entry * ENTRY_SIZE)
        if word and word & 0xFFFFFFFF00000000 == _tag(key):
            out.append((entry, key, word & 0xFFFFFFFF))
    return out


def read_ring(raw: bytes) -> dict[int, int]:
    """Request key -> outcome (0 or errno) or PENDING, from a ring's bytes. A key found
    twice (a successor executed again what its predecessor had only intended) keeps the
    outcome over the intent."""
    past: dict[int, int] = {}
    for _, key, stored in _entries(raw):
        # Above the errno range: an outcome store torn by the kill, not known to be done.
        code = PENDING if stored > _MAX_ERRNO else stored
        if past.get(key, PENDING) == PENDING:
            past[key] = code
    return past


# ----------------------------------------------------------------------- the handlers' side


@dataclass(frozen=True, slots=True)
class CrashPoint:
    """Test only: where the daemon kills itself (see `crash_point_from_env`)."""

    op: str
    stage: str  # "intent": before the system call; "syscall": after it, before the
    # outcome is stored; "outcome": after that, before the reply
    name: bytes


CRASH_ENV = "QOSFS_TEST_CRASH_AT"
_STAGES = ("intent", "syscall", "outcome")


def crash_point_from_env() -> CrashPoint | None:
    """Test only (tests/mount/test_crash_recovery.py): ``QOSFS_TEST_CRASH_AT=op:stage:name``
    makes the daemon ``os._exit(9)`` at *stage* of the first *op* (``rename``, ``unlink``,
    ...) on an entry called *name*, to drive a kill at an exact point through a real
    mount. Read once, when the operations are made; unset in production."""
    value = os.environ.get(CRASH_ENV)
    if not value:
        return None
    op, stage, name = value.split(":", 2)
    if stage not in _STAGES:
        raise ValueError(f"{CRASH_ENV}: stage {stage!r} is not one of {_STAGES}")
    return CrashPoint(op, stage, os.fsencode(name))


class ExactlyOnce:
    """Runs the non-idempotent operations of a daemon: records them in the journal's
    ring, and answers a resent one with what the dead predecessor recorded.

    ``ring`` is set when a journal is attached (no journal: nothing recorded); ``past``
    holds the dead predecessor's outcomes when this daemon recovered a mount."""

    def __init__(self) -> None:
        self.ring: IntentRing | None = None
        self.past: dict[int, int] = {}
        self.carried = b""  # the predecessor's ring, for the journal attached next
        self.replayed = 0  # resent requests not executed again (answered from the record)
        self._crash = crash_point_from_env()

    def attach(self, ring: IntentRing) -> None:
        self.ring = ring
        if self.carried:
            ring.carry(self.carried)
            self.carried = b""

    async def run(self, ctx: Any, op: str, name: bytes, already: int,
                  call: Callable[[], Awaitable[_T]],
                  answer: Callable[[_T | None], Awaitable[_R]]) -> _R:
        """``await answer(await call())``, *call* recorded under the id of the request
        whose context is *ctx* (unrecorded where pyfuse3 cannot tell it). *answer* gets
        None instead of *call*'s result when *call* is not executed because the dead
        predecessor did it, or when a second execution failed with *already* after a
        first one may have done it; it completes the reply (e.g. looks the new name up).
        An errno the predecessor answered is raised again as OSError. The entry is held
        until *answer* returns: the handler replies right after, with no checkpoint in
        between."""
        ring = self.ring
        unique: int = getattr(ctx, "unique", 0)  # an unpatched pyfuse3 has no such field
        if ring is None or not unique:
            return await answer(await call())
        key = unique & ~RESEND
        maybe_done = False
        if unique & RESEND:
            code = self.past.get(key)
            if code is not None:
                if code != PENDING:
                    self.replayed += 1
                    # Only after a crash, once per request the dead daemon had done.
                    log.info("resent %s of %r: answered with the dead daemon's outcome "
                             "(%s), not done again", op, name, os.strerror(code) if code
                             else "success")
                    if code:
                        raise OSError(code, os.strerror(code))
                    return await answer(None)
                maybe_done = True
        entry = ring.intend(key)
        crash = self._crash
        if crash is not None and (crash.op != op or crash.name != name):
            crash = None
        try:
            if crash is not None:
                _crash_at("intent", crash)
            try:
                result: _T | None = await call()
            except OSError as exc:
                code = exc.errno or errno.EIO
                if not (maybe_done and code == already):
                    if crash is not None:
                        _crash_at("syscall", crash)
                    ring.outcome(entry, key, code)
                    if crash is not None:
                        _crash_at("outcome", crash)
                    raise
                self.replayed += 1  # the first execution had done it
                log.info("resent %s of %r: done by the dead daemon (%s now)", op, name,
                         os.strerror(code))
                result = None
            if crash is not None:
                _crash_at("syscall", crash)
            ring.outcome(entry, key, 0)
            if crash is not None:
                _crash_at("outcome", crash)
            return await answer(result)
        finally:
            ring.release(entry)


def _crash_at(stage: str, crash: CrashPoint) -> None:
    """Test only: die here if this is the stage the test asked for."""
    if crash.stage == stage:
        os._exit(9)
