"""What the handover tests' loads share: callers in threads on descriptors opened before
the first handover, each call timed (the longest, overall and by call) and every error
kept, so a test can say afterwards that nothing failed and how long a caller stalled.
The workloads themselves (what is read, written and checked) stay in each test."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True)
class TimedLoad:
    """Threads calling into a mount; a subclass opens ``self.rfd``/``self.wfd`` and
    starts its workers with :meth:`_spawn`."""

    errors: list[str] = field(default_factory=list)
    worst: float = 0.0  # the longest call, seconds
    worst_by: dict[str, float] = field(default_factory=dict)  # by call: pread, fsync, ...
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    rfd: int = -1  # the reader's and the writer's descriptors, opened by the subclass
    wfd: int = -1

    def _spawn(self, *targets: Callable[[], None]) -> None:
        for target in targets:
            t = threading.Thread(target=target, daemon=True)
            t.start()
            self._threads.append(t)

    def _timed(self, call: Callable[[], Any]) -> Any:
        """*call*'s result, or None after an OSError (kept in ``errors``)."""
        t0 = time.monotonic()
        try:
            return call()
        except OSError as exc:
            self.errors.append(f"{call}: {exc}")
            return None
        finally:
            took = time.monotonic() - t0
            self.worst = max(self.worst, took)
            name = getattr(call, "func", call).__name__
            self.worst_by[name] = max(self.worst_by.get(name, 0.0), took)

    def _join(self, timeout: float) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=timeout)
            assert not t.is_alive(), "a call on the mount hung"

    def stop(self) -> None:
        """Stop the callers (a hung call fails the test) and close their descriptors; a
        failing close fails the test too."""
        self._join(30)
        rfd, wfd, self.rfd, self.wfd = self.rfd, self.wfd, -1, -1
        os.close(rfd)
        os.close(wfd)

    def halt(self) -> None:
        """Stop without asking how it went (a failed test's cleanup): the descriptors
        are closed, so that the mount can be unmounted."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        for fd in (self.rfd, self.wfd):
            if fd >= 0:  # not closed yet (a cleanup may come after stop)
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.rfd = self.wfd = -1
