"""Per-window rates from the daemon's own counters, polled over the control socket.

:class:`StatusSampler` asks a mount for ``status`` every *interval* seconds from a thread
and keeps the cumulative counters of every level (class, user, tenant, backend) with the
instant it got them (the midpoint of the request, on this process's monotonic clock, the
same clock the suites use to mark a ``ctl set`` or a job's start). Rates are differences
of two consecutive samples over their own interval, computed afterwards by the pure
functions below, so a late poll widens a window instead of distorting its rate.

Why the daemon's counters and not fio's bandwidth logs: they are per class and per uid
(fio cannot tell which class or user a byte was charged to), they share one clock with
the suite, and they count what the limiter admitted, which is what a cap promises.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Any

from qosfs.control.ctl import Client, checked
from qosfs.core.errors import QosfsError

COUNTERS = ("read_bytes", "write_bytes", "read_ops", "write_ops", "meta_ops",
            "throttled_seconds")
Series = list[tuple[float, float]]  # (s, bytes/s), as the suites' records hold rates
LevelKey = tuple[str, str, "int | None"]  # (level, name, uid)


@dataclass(frozen=True)
class Sample:
    t: float  # time.monotonic() at the midpoint of the status request
    levels: dict[LevelKey, dict[str, float]]  # cumulative counters (and queue_depth)


@dataclass(frozen=True)
class Window:
    """The rate of one counter between two consecutive samples."""

    t0: float
    t1: float
    rate: float  # counter units per second
    throttled: float = 0.0  # seconds the level's requests waited in the window, per second

    @property
    def mid(self) -> float:
        return (self.t0 + self.t1) / 2


def parse_status(reply: dict[str, Any], t: float) -> Sample:
    """A :class:`Sample` from a ``status`` reply (levels only; ``--no-qos`` has none)."""
    levels = {}
    for lv in reply.get("levels", []):
        key = (lv["level"], lv["name"], lv["uid"])
        levels[key] = {c: float(lv[c]) for c in COUNTERS}
        levels[key]["queue_depth"] = float(lv.get("queue_depth", 0))
    return Sample(t, levels)


class StatusSampler:
    """Polls ``status`` every *interval* s while in its ``with`` block (one sample on
    entry and one on exit, so the block is covered end to end)."""

    def __init__(self, socket: str, interval: float = 1.0) -> None:
        self.socket = socket
        self.interval = interval
        self.samples: list[Sample] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="status-sampler", daemon=True)
        self._client: Client | None = None

    def _take(self) -> None:
        if self._client is None:
            return
        t0 = time.monotonic()
        try:
            reply = checked(self._client.request({"cmd": "status"}))
        except QosfsError as exc:
            self.error = str(exc)
            self._client.close()
            self._client = None
            return
        self.samples.append(parse_status(reply, (t0 + time.monotonic()) / 2))

    def _loop(self) -> None:
        start = time.monotonic()
        k = 1
        while not self._stop.wait(max(0.0, start + k * self.interval - time.monotonic())):
            self._take()
            k += 1

    def __enter__(self) -> StatusSampler:
        self._client = Client(self.socket)
        self._take()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._take()
        if self._client is not None:
            self._client.close()

    def windows(self, key: LevelKey, counter: str) -> list[Window]:
        return windows(self.samples, key, counter)


def windows(samples: list[Sample], key: LevelKey, counter: str) -> list[Window]:
    """Rates of *counter* at level *key* between consecutive samples; a sample where the
    level does not exist (yet) counts as zero."""
    out = []
    for a, b in itertools.pairwise(samples):
        dt = b.t - a.t
        if dt <= 0:
            continue
        va, vb = a.levels.get(key, {}), b.levels.get(key, {})
        rate = max(0.0, vb.get(counter, 0.0) - va.get(counter, 0.0)) / dt
        thr = max(0.0, vb.get("throttled_seconds", 0.0) - va.get("throttled_seconds", 0.0))
        out.append(Window(a.t, b.t, rate, thr / dt))
    return out


def steady(ws: list[Window]) -> list[Window]:
    """The windows of a run with steady demand: from the second window that moved anything
    to the one before the last that did. The first is dropped because it holds the
    bucket's burst (the depth a class may spend at once after idling), the last because
    the job ended inside it."""
    active = [i for i, w in enumerate(ws) if w.rate > 0]
    if len(active) < 3:
        return []
    return ws[active[0] + 1:active[-1]]


def span_rates(ws: list[Window], seconds: float) -> list[float]:
    """Average rate over every run of consecutive windows lasting about *seconds* (all of
    *ws* if they are shorter): the "over any 10 s window" figures."""
    if not ws:
        return []
    interval = (ws[-1].t1 - ws[0].t0) / len(ws)
    n = max(1, min(len(ws), round(seconds / interval)))
    out = []
    for i in range(len(ws) - n + 1):
        run = ws[i:i + n]
        total = sum(w.rate * (w.t1 - w.t0) for w in run)
        out.append(total / (run[-1].t1 - run[0].t0))
    return out


def mean_rate(ws: list[Window], t0: float, t1: float) -> float | None:
    """Average rate over the windows lying wholly within [t0, t1]."""
    inside = [w for w in ws if w.t0 >= t0 - 1e-9 and w.t1 <= t1 + 1e-9]
    if not inside:
        return None
    return sum(w.rate * (w.t1 - w.t0) for w in inside) / sum(w.t1 - w.t0 for w in inside)


def error_pct(achieved: float, target: float) -> float:
    """Signed deviation of *achieved* from *target*, in percent of the target."""
    return 100.0 * (achieved - target) / target
