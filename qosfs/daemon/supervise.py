"""The daemon's services on the event loop, restarted when they fail.

The control socket, the metrics exporter, the latency controller and the cluster lease
renewal share one trio nursery with ``pyfuse3.main``: an exception leaving any of them
would cancel the nursery and take the mount down, for a failure that only concerns
``ctl status`` or a controller. So each service runs under :func:`supervised`: an
unexpected exception is counted (:class:`qosfs.core.failures.Failures`, logged once per
kind) and the service is started again after a pause, which doubles while it keeps
failing (a service failing at once would otherwise spin the loop every request shares).

A service that fails before it reports itself started is not restarted: the daemon is
still starting, and failing then is a clear error instead of a half-served mount.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from qosfs.core.failures import Failures

__all__ = ["FIRST_PAUSE", "LONGEST_PAUSE", "Service", "supervised"]

Service = Callable[..., Awaitable[Any]]  # called with task_status=, as nursery.start does

FIRST_PAUSE = 1.0  # seconds before the first restart
LONGEST_PAUSE = 60.0  # the pause doubles up to this; a service that ran as long resets it


class _Reporting:
    """The task status handed to a service: remembers whether it reported started."""

    __slots__ = ("done", "outer")

    def __init__(self, outer: trio.TaskStatus[None]) -> None:
        self.outer = outer
        self.done = False

    def started(self, value: None = None) -> None:
        self.done = True
        self.outer.started(value)


async def supervised(name: str, service: Service, failures: Failures,
                     task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Run *service* until cancelled, starting it again after each unexpected failure
    (counted under *name*). Started once *service* first reports itself started."""
    status = _Reporting(task_status)
    pause = FIRST_PAUSE
    while True:
        began = trio.current_time()
        try:
            if status.done:
                await service()
            else:
                await service(task_status=status)
            return  # a service that ends by itself is done
        except Exception as exc:
            if not status.done:
                raise  # still starting: the daemon fails to start, saying why
            if trio.current_time() - began >= LONGEST_PAUSE:
                pause = FIRST_PAUSE  # it ran well for a while: a new fault, not the same
            failures.record(name, exc, f"restarting it in {pause:g} s")
        await trio.sleep(pause)
        pause = min(pause * 2, LONGEST_PAUSE)
