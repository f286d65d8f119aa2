"""Pollers of a mount's control socket and metrics listener, for the handover tests:
one thread asks ``status`` over the control socket (raw JSON lines, no subprocess, so a
poll costs a millisecond and a gap is seen at its true length), another GETs
``/metrics``, each in a loop. Every failure is kept with its errno, and each listener's
longest refusal (from a failed poll to the next good one) and its longest good poll are
measured, so a test can say the listeners never went away and for how long they would
have been.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class ListenerStats:
    """What one poller saw."""

    polls: int = 0
    failures: list[str] = field(default_factory=list)
    longest_gap: float = 0.0  # seconds from a failed poll's start to the next good one
    longest_poll: float = 0.0  # the slowest good poll, seconds
    _failing_since: float | None = None

    def good(self, t0: float, t1: float) -> None:
        self.polls += 1
        self.longest_poll = max(self.longest_poll, t1 - t0)
        if self._failing_since is not None:
            self.longest_gap = max(self.longest_gap, t1 - self._failing_since)
            self._failing_since = None

    def bad(self, t0: float, exc: OSError | ValueError) -> None:
        self.polls += 1
        self.failures.append(f"{type(exc).__name__}: {exc}")
        if self._failing_since is None:
            self._failing_since = t0

    def summary(self) -> str:
        return (f"{self.polls} polls, {len(self.failures)} failed, longest refusal "
                f"{self.longest_gap * 1000:.1f} ms, slowest answer "
                f"{self.longest_poll * 1000:.1f} ms")


def ask_status(path: str, timeout: float = 10.0) -> dict[str, object]:
    """One ``status`` request on the control socket at *path*."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(b'{"cmd": "status"}\n')
        reply = b""
        while not reply.endswith(b"\n"):
            data = sock.recv(65536)
            if not data:
                raise ValueError("the control socket closed before its reply")
            reply += data
    result: dict[str, object] = json.loads(reply)
    return result


def get_metrics(host: str, port: int, timeout: float = 10.0) -> bytes:
    """One ``GET /metrics``; the body (ValueError unless the answer is 200)."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while data := sock.recv(65536):
            answer += data
    if not answer.startswith(b"HTTP/1.1 200"):
        raise ValueError(f"/metrics answered {answer[:40]!r}")
    return answer.partition(b"\r\n\r\n")[2]


class ListenerPolls:
    """Polls the control socket at *control* and ``/metrics`` at *metrics* (host, port;
    None: not polled) in two threads until stopped."""

    def __init__(self, control: str, metrics: tuple[str, int] | None) -> None:
        self.control = ListenerStats()
        self.metrics = ListenerStats()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(
            self.control, lambda: ask_status(control)), daemon=True)]
        if metrics is not None:
            self._threads.append(threading.Thread(target=self._loop, args=(
                self.metrics, lambda: get_metrics(*metrics)), daemon=True))

    def start(self) -> ListenerPolls:
        for t in self._threads:
            t.start()
        return self

    def _loop(self, stats: ListenerStats, poll: Callable[[], object]) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                poll()
            except (OSError, ValueError) as exc:
                stats.bad(t0, exc)
                time.sleep(0.001)
                continue
            stats.good(t0, time.monotonic())

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)
            assert not t.is_alive(), "a poll of a listener hung"
