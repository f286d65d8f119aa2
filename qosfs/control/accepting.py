"""The accept loop of the control socket and of the metrics listener: one that a planned
handover can stop, and then wait out.

At a handover (:mod:`qosfs.daemon.takeover.listeners`) the old daemon stops accepting, answers
what it accepted, and ends; connections made meanwhile wait in the kernel's backlog for
the successor, which serves the same listening socket. "What it accepted" is not a count
taken when it stops: an accept task that the I/O poll had already woken when the cancel
came still returns its connection, a moment later (trio delivers a cancel at the next
checkpoint, and a successful accept has none). Counting at once saw no connection, the
process ended, and that one was cut unanswered (a ``/metrics`` poll got an empty answer in
CI). So the loop runs its connections in its own nursery and :meth:`AcceptLoop.stopped`
waits until that nursery is done.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable

import trio

log = logging.getLogger(__name__)

#: Takes an accepted connection: starts its task in the nursery, or closes it (refused).
Admit = Callable[[trio.SocketStream, trio.Nursery], Awaitable[None]]


class AcceptLoop:
    """Accepts on a listening socket until cancelled or :meth:`stop`-ped."""

    def __init__(self, name: str) -> None:
        self.name = name  # for the log: "control socket", "metrics"
        self._accepting: trio.CancelScope | None = None
        self._served: trio.Event | None = None  # set when run() returns

    def stop(self) -> None:
        """Accept nothing more; the connections accepted are finished. On the loop."""
        if self._accepting is not None:
            self._accepting.cancel()

    async def stopped(self) -> None:
        """Wait until :meth:`run` is over: after :meth:`stop`, until its accepting has
        ended and every connection it accepted is done (at once if it never ran)."""
        if self._served is not None:
            await self._served.wait()

    async def run(self, sock: socket.socket, admit: Admit,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Accept on *sock* (a duplicate of it: *sock* stays open) and hand each
        connection to *admit*, until cancelled, or until stopped and its connections are
        done. Started once listening."""
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock.dup()))
        self._accepting = trio.CancelScope()
        served = self._served = trio.Event()
        try:
            async with listener, trio.open_nursery() as nursery:
                task_status.started()
                with self._accepting:
                    while True:
                        try:
                            stream = await listener.accept()
                        except OSError as exc:  # EMFILE and friends: back off, serve on
                            log.warning("%s: accept failed: %s", self.name, exc)
                            await trio.sleep(0.1)
                            continue
                        await admit(stream, nursery)
        finally:
            served.set()
