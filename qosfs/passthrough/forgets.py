"""The kernel's FORGETs, applied without stalling the event loop for thousands at once.

The kernel forgets inodes in batches: under memory pressure or after a ``drop_caches``,
one BATCH_FORGET request may name tens of thousands. Each costs the daemon ~10 us (an
idle backing id closed, its file's read counting stopped, the inode folded or freed and
its journal record changed): 16,000 in one request held the loop 0.1-0.3 s, and every
other request waited that long (an idle mount's round trip, 65 s after a loader's pass
over 16,000 files on ext4, then a drop_caches: 105-298 ms).

So a FORGET applies its first :data:`BATCH` entries at once and, while the service runs
(:meth:`Forgets.run`), leaves the rest to it, which applies them a batch at a time with a
turn of the event loop in between. The handler itself never waits: pyfuse3 starts
another worker for each request read while every worker is busy, and a worker keeps its
request buffer, so handlers that waited between batches left the daemon ~6-18 MiB
larger after forgetting 200,000 inodes.

Lookup counts are additive, so a LOOKUP of an inode whose FORGET is still queued counts
the same either way: the inode is kept until its count is spent. What is queued is
applied before a successor takes the tables (:meth:`flush`); a crash loses it, as it
loses a FORGET read and not yet applied: the successor keeps those inodes known (their
rows, never their descriptors, which it opens on demand).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable, Sequence

import trio

#: Inodes forgotten between two turns of the event loop (~1-2 ms of work).
BATCH = 128


class Forgets:
    """The FORGETs not yet applied, and the service that applies them."""

    __slots__ = ("_apply", "_pending", "_queued", "_running", "_wake")

    def __init__(self, apply: Callable[[int, int], None]) -> None:
        self._apply = apply  # (nodeid, count): forget one inode, never raises
        # Per FORGET left to the service: its node ids, its counts, how far applied. As
        # arrays, 16 bytes an entry in one allocation each, not the request's tuples:
        # keeping those (~90 bytes each, tens of thousands a request) alive across
        # requests grew the allocator's arenas for good (the daemon's RSS after forgetting
        # 200,000 inodes went from 50 to 53-58 MiB).
        self._pending: deque[tuple[array[int], array[int], list[int]]] = deque()
        self._queued = 0
        self._wake = trio.Event()
        self._running = False

    def __len__(self) -> int:
        return self._queued

    def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        """A FORGET's entries: the first :data:`BATCH` applied now (after any still
        queued, in order), the rest left to the service; all now without one."""
        if not self._running or (not self._pending and len(inode_list) <= BATCH):
            self.flush()
            for nodeid, count in inode_list:
                self._apply(nodeid, count)
            return
        self._pending.append((array("Q", [nodeid for nodeid, _ in inode_list]),
                              array("Q", [count for _, count in inode_list]), [0]))
        self._queued += len(inode_list)
        self._step()
        if self._pending:
            self._wake.set()

    def flush(self) -> None:
        """Apply everything queued now (before a successor takes the tables)."""
        while self._pending:
            self._step()

    def _step(self) -> None:
        """Apply up to :data:`BATCH` queued entries, oldest first."""
        pending, apply, budget = self._pending, self._apply, BATCH
        while budget and pending:
            nodeids, counts, done = pending[0]
            start = done[0]
            end = min(start + budget, len(nodeids))
            for i in range(start, end):
                apply(nodeids[i], counts[i])
            budget -= end - start
            self._queued -= end - start
            if end == len(nodeids):
                pending.popleft()
            else:
                done[0] = end

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The daemon's service: apply what FORGETs left, a batch a turn of the loop."""
        self._running = True
        try:
            task_status.started()
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                while self._pending:
                    await trio.sleep(0)  # the requests that came meanwhile first
                    self._step()
        finally:
            self._running = False
            self.flush()
