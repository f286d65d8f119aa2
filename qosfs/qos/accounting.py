"""Per-flow traffic counters and latency histograms: bumped on the hot path, read at scrape.

Every open file is bound to a :class:`FlowStats` (through its flow), shared by all files of
the same (class, tenant, uid). The filesystem (:mod:`qosfs.passthrough`) calls
:meth:`FlowStats.record_read` / :meth:`~FlowStats.record_write` once per request with the
bytes moved, the seconds the request waited for tokens and the nanoseconds the backing
syscall took (one ``time.perf_counter_ns()`` pair around it). What that costs, and why it
is built this way:

* Plain ``int`` attributes and list slots, no lock, no label lookup, no allocation beyond
  the ints themselves: trio runs one task at a time, so the counters need no lock, and a
  reader (``qosfs ctl stats``, the Prometheus exporter) copies them on the event loop's
  thread (:meth:`FlowStats.snapshot`), so it never sees a dict change size under it.
* Histogram buckets are powers of two microseconds (1 us, 2 us, 4 us ... ~16.8 s, then
  +Inf), so the bucket index is ``(ns // 1000).bit_length()``: no search, no float.
  Factor-2 buckets bound a quantile estimate to within 2x; that is what OpenTelemetry's
  exponential histogram at scale 0 gives too, and it keeps an observation at a few
  integer operations. Measured on the development VM (2 vCPU, CPython 3.11): the
  ``perf_counter_ns()`` pair plus ``record_read`` cost about 0.3 us per request
  (``test_hot_path_cost_is_small`` in ``tests/unit/qos/test_accounting.py`` prints it),
  against 20-60 us for a FUSE round trip.
* Two histograms per direction: the whole request (throttle wait + backing syscall) and
  the backing syscall alone. The second is the backend latency a latency-target
  controller needs per protected class and short window: take
  :meth:`Accounts.histogram` twice and subtract (:meth:`HistogramSnapshot.__sub__`).
* Factor-2 buckets are too coarse to hold a target: a 5 ms target would be judged on the
  4.1 ms / 8.2 ms bounds. The classes with a latency target (:mod:`qosfs.qos.latency`)
  therefore also record their read backend times in a :class:`FineHistogram` (8 buckets
  per power of two, quantiles within 12.5 %), switched on per class
  (:meth:`Accounts.set_fine_classes`) so other classes pay one ``is None`` test.

Keys live as long as the policy has their class and tenant (:meth:`Accounts.retain`), and
a ``qosfs upgrade`` hands their totals to the new process (:meth:`Accounts.export_totals`),
so a Prometheus counter only ever restarts when its class was removed and came back, or
when the daemon restarts -- except
per-uid keys, whose number is bounded (``[metrics]`` in the policy, see
:meth:`Accounts.set_user_series`): a class labels at most ``user_series`` uids (later
ones are counted in the class's uid-less key from their first byte), and a uid idle for
``user_series_idle`` is folded into that key (:meth:`Accounts.fold`). Each uid costs about
120 series, so this is what keeps 10,000 users from being 1.2M series per node. Folding
keeps every class sum monotonic; the uid-less series jumps by what the uid had.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BUCKET_BOUNDS_SECONDS",
    "AccountKey",
    "Accounts",
    "FineHistogram",
    "FlowSnapshot",
    "FlowStats",
    "HistogramSnapshot",
    "LatencyHistogram",
]

#: Finite buckets: le = 1 us * 2**k for k = 0..NBUCKETS-1; one more slot counts +Inf.
NBUCKETS = 25
_TOP = NBUCKETS  # index of the +Inf slot
BUCKET_BOUNDS_SECONDS: tuple[float, ...] = tuple((1 << k) * 1e-6 for k in range(NBUCKETS))

#: (class, tenant or None, uid or None): uid only for ``per_user`` classes.
AccountKey = tuple[str, "str | None", "int | None"]


class LatencyHistogram:
    """Counts of durations in power-of-two microsecond buckets, and their sum."""

    __slots__ = ("counts", "sum_ns")

    def __init__(self) -> None:
        self.counts = [0] * (NBUCKETS + 1)
        self.sum_ns = 0

    def observe(self, ns: int) -> None:
        """Count one duration of ``ns`` nanoseconds (negative clock steps count as 0)."""
        i = (ns // 1000).bit_length() if ns > 0 else 0
        self.counts[i if i < _TOP else _TOP] += 1  # noqa: FURB136 (hot: min() costs 60 ns)
        self.sum_ns += ns if ns > 0 else 0  # noqa: FURB136

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(tuple(self.counts), self.sum_ns)

    def __repr__(self) -> str:
        return f"<LatencyHistogram count={sum(self.counts)} sum={self.sum_ns / 1e9:.6f}s>"


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """A frozen copy of a :class:`LatencyHistogram`; subtract two to get a window.

    Example:
        >>> h = LatencyHistogram()
        >>> for ns in (3_000, 5_000, 900_000):
        ...     h.observe(ns)
        >>> h.snapshot().quantile(0.5)   # upper bound of the bucket holding the median
        8e-06
    """

    counts: tuple[int, ...] = (0,) * (NBUCKETS + 1)
    sum_ns: int = 0

    @property
    def count(self) -> int:
        return sum(self.counts)

    @property
    def sum_seconds(self) -> float:
        return self.sum_ns / 1e9

    def __add__(self, other: HistogramSnapshot) -> HistogramSnapshot:
        return HistogramSnapshot(tuple(a + b for a, b in zip(self.counts, other.counts,
                                                                strict=True)),
                                 self.sum_ns + other.sum_ns)

    def __sub__(self, earlier: HistogramSnapshot) -> HistogramSnapshot:
        """What was observed between ``earlier`` and this snapshot."""
        return HistogramSnapshot(tuple(a - b for a, b in zip(self.counts, earlier.counts,
                                                                strict=True)),
                                 self.sum_ns - earlier.sum_ns)

    def cumulative(self) -> list[tuple[float, int]]:
        """``[(upper bound in seconds, observations <= it), ...]``, ending with +Inf."""
        out = []
        total = 0
        for bound, n in zip((*BUCKET_BOUNDS_SECONDS, float("inf")), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding quantile ``q`` (None when empty).

        An upper bound, not an interpolation: a controller holding a latency target
        should rather over- than under-estimate. +Inf when it falls in the overflow.
        """
        total = self.count
        if total == 0:
            return None
        rank = q * total
        for bound, seen in self.cumulative():
            if seen >= rank:
                return bound
        return float("inf")  # pragma: no cover - the last bucket always reaches total


#: FineHistogram: 8 sub-buckets per power of two of microseconds, up to 2**FINE_OCTAVES us.
FINE_SUB = 8
FINE_OCTAVES = 25
_FINE_TOP = (FINE_OCTAVES - 2) * FINE_SUB  # index of the overflow slot


def fine_index(ns: int) -> int:
    """The :class:`FineHistogram` slot of a duration: exact below 8 us, then 8 per octave."""
    us = ns // 1000 if ns > 0 else 0
    b = us.bit_length()
    if b <= 3:
        return us
    i = (b - 3) * FINE_SUB + (us >> (b - 4)) - FINE_SUB
    return i if i < _FINE_TOP else _FINE_TOP  # noqa: FURB136 (hot)


def fine_upper_bound(i: int) -> float:
    """Seconds: the exclusive upper bound of slot ``i`` (inf for the overflow slot)."""
    if i >= _FINE_TOP:
        return float("inf")
    if i < FINE_SUB:
        return (i + 1) * 1e-6
    b, m = i // FINE_SUB + 3, FINE_SUB + i % FINE_SUB
    return ((m + 1) << (b - 4)) * 1e-6


class FineHistogram:
    """Log-linear latency counts (8 per octave): what a latency target is judged on.

    Slot ``i`` of a duration is :func:`fine_index`; quantiles are the upper bound of the
    slot holding the rank, so an estimate is never low and at most 12.5 % high (factor-2
    buckets: up to 100 %). Counts only; take :meth:`snapshot` twice and subtract for a
    window. One writer at a time (the event loop, or one probe thread): ``counts`` is a
    list of ints, and a reader on another thread copies it with ``tuple()``, which holds
    the GIL, so it sees each slot either before or after an increment.

    Example:
        >>> h = FineHistogram()
        >>> for ns in (1_000_000,) * 98 + (4_500_000, 9_000_000):
        ...     h.observe(ns)
        >>> round(FineHistogram.quantile(h.snapshot(), 0.99) * 1e3, 3)   # ms
        4.608
    """

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts = [0] * (_FINE_TOP + 1)

    def observe(self, ns: int) -> None:
        self.counts[fine_index(ns)] += 1

    def snapshot(self) -> tuple[int, ...]:
        return tuple(self.counts)

    @staticmethod
    def window(now: tuple[int, ...], before: tuple[int, ...] | None) -> tuple[int, ...]:
        """The counts observed between two snapshots (``before`` None: since the start)."""
        if before is None:
            return now
        return tuple(a - b for a, b in zip(now, before, strict=True))

    @staticmethod
    def quantile(counts: tuple[int, ...], q: float) -> float | None:
        """Upper bound of the slot holding quantile ``q`` of ``counts``; None when empty."""
        total = sum(counts)
        if total == 0:
            return None
        rank = q * total
        seen = 0
        for i, n in enumerate(counts):
            seen += n
            if n and seen >= rank:
                return fine_upper_bound(i)
        return float("inf")  # pragma: no cover - rounding only

    def __repr__(self) -> str:
        return f"<FineHistogram count={sum(self.counts)}>"


@dataclass(frozen=True, slots=True)
class FlowSnapshot:
    """A frozen copy of one :class:`FlowStats`."""

    read_bytes: int = 0
    write_bytes: int = 0
    read_ops: int = 0
    write_ops: int = 0
    meta_ops: int = 0
    throttled_seconds: float = 0.0
    read_latency: HistogramSnapshot = HistogramSnapshot()
    write_latency: HistogramSnapshot = HistogramSnapshot()
    read_backend: HistogramSnapshot = HistogramSnapshot()
    write_backend: HistogramSnapshot = HistogramSnapshot()
    opens: int = 0


def record_latency(backend: LatencyHistogram, whole: LatencyHistogram, ns: int,
                   waited: float) -> None:
    """Observe ``ns`` in ``backend`` and ``ns`` + the wait in ``whole`` (one index if no wait).
    Called once per request (FlowStats.record_*, and the flows' read_done and
    OpenCharge.write_done, which inline record_read/record_write: no call more per request)."""
    if ns < 0:  # a clock step; never seen with a monotonic clock, but never index -1
        ns = 0
    i = (ns // 1000).bit_length()
    if i > _TOP:
        i = _TOP
    backend.counts[i] += 1
    backend.sum_ns += ns
    if waited:
        ns += int(waited * 1e9)
        i = (ns // 1000).bit_length()
        if i > _TOP:
            i = _TOP
    whole.counts[i] += 1
    whole.sum_ns += ns


class FlowStats:
    """The traffic of one (class, tenant, uid): what moved, how long it waited and took."""

    __slots__ = ("kernel_reads", "meta_ops", "opens", "read_backend", "read_bytes",
                 "read_fine", "read_latency", "read_ops", "throttled_seconds",
                 "write_backend", "write_bytes", "write_latency", "write_ops")

    def __init__(self) -> None:
        self.read_bytes = self.write_bytes = 0
        self.read_ops = self.write_ops = self.meta_ops = 0
        # Files opened (counted by qosfs.qos.charge.OpenCharge at open, always): the one
        # sign of activity a class whose reads bypass the daemon (kernel passthrough)
        # still gives, with its metadata requests; the latency controller watches it.
        self.opens = 0
        # Of read_ops, the reads the kernel served for passed-through opens (counted by
        # qosfs.passthrough.read_counting): they never reached the daemon.
        self.kernel_reads = 0
        self.throttled_seconds = 0.0
        self.read_latency = LatencyHistogram()  # the whole request, throttle wait included
        self.write_latency = LatencyHistogram()
        self.read_backend = LatencyHistogram()  # the backing syscall alone
        self.write_backend = LatencyHistogram()
        # Read backend times at fine resolution, only for classes with a latency target.
        self.read_fine: FineHistogram | None = None

    def record_read(self, nbytes: int, waited: float, backend_ns: int) -> None:
        """Count one read of ``nbytes`` that waited ``waited`` s and took ``backend_ns``.

        The bucket arithmetic of :meth:`LatencyHistogram.observe` is inlined here: this
        runs once per request, and two method calls would double its cost.
        """
        self.read_bytes += nbytes
        self.read_ops += 1
        record_latency(self.read_backend, self.read_latency, backend_ns, waited)
        if waited:
            self.throttled_seconds += waited
        if self.read_fine is not None:
            self.read_fine.observe(backend_ns)

    def record_write(self, nbytes: int, waited: float, backend_ns: int) -> None:
        """Count one write; see :meth:`record_read`."""
        self.write_bytes += nbytes
        self.write_ops += 1
        record_latency(self.write_backend, self.write_latency, backend_ns, waited)
        if waited:
            self.throttled_seconds += waited

    def snapshot(self) -> FlowSnapshot:
        return FlowSnapshot(self.read_bytes, self.write_bytes, self.read_ops, self.write_ops,
                            self.meta_ops, self.throttled_seconds,
                            self.read_latency.snapshot(), self.write_latency.snapshot(),
                            self.read_backend.snapshot(), self.write_backend.snapshot(),
                            self.opens)

    def __repr__(self) -> str:
        return (f"<FlowStats read={self.read_bytes}B/{self.read_ops} "
                f"written={self.write_bytes}B/{self.write_ops} meta={self.meta_ops} "
                f"opens={self.opens}>")


#: The histograms of a key, in the order `Accounts.export_totals` lists them.
HISTOGRAMS = ("read_latency", "write_latency", "read_backend", "write_backend")


def _fold_histogram(into: LatencyHistogram, other: LatencyHistogram) -> None:
    for i, n in enumerate(other.counts):
        into.counts[i] += n
    into.sum_ns += other.sum_ns


def _add_totals(into: FlowStats, other: FlowStats) -> None:
    """Add *other*'s counters to *into*'s (the fine read histogram excepted: a latency
    controller diffs it per window, and old observations would read as a burst)."""
    into.read_bytes += other.read_bytes
    into.write_bytes += other.write_bytes
    into.read_ops += other.read_ops
    into.write_ops += other.write_ops
    into.meta_ops += other.meta_ops
    into.opens += other.opens
    into.kernel_reads += other.kernel_reads
    into.throttled_seconds += other.throttled_seconds
    for name in HISTOGRAMS:
        _fold_histogram(getattr(into, name), getattr(other, name))


def _activity(stats: FlowStats) -> int:
    """A number that changes whenever the key sees a request (an open too: a class whose
    reads bypass the daemon shows no other)."""
    return stats.read_ops + stats.write_ops + stats.meta_ops + stats.opens


class Accounts:
    """The :class:`FlowStats` of every (class, tenant, uid) that had an open or a request."""

    __slots__ = ("_activity", "_fine", "_labelled", "_stats", "user_series")

    def __init__(self, user_series: int | None = None) -> None:
        self._stats: dict[AccountKey, FlowStats] = {}
        self._fine: frozenset[str] = frozenset()
        # At most this many uid keys per class (None: no bound); see set_user_series().
        self.user_series = user_series
        self._labelled: dict[str, int] = {}  # uid keys per class now
        # Per uid key: (activity at the last look, when it last changed); see idle_uids().
        self._activity: dict[AccountKey, tuple[int, float]] = {}

    def get(self, cls: str, tenant: str | None, uid: int | None) -> FlowStats:
        """The stats of a key, created on first use (at open, never per request).

        A uid past the class's ``user_series`` bound gets the class's uid-less stats: its
        traffic is counted from its first byte there, so no series ever goes backwards.
        """
        key = (cls, tenant, uid)
        stats = self._stats.get(key)
        if stats is None:
            if uid is not None:
                labelled = self._labelled.get(cls, 0)
                if self.user_series is not None and labelled >= self.user_series:
                    return self.get(cls, tenant, None)
                self._labelled[cls] = labelled + 1
            stats = self._stats[key] = FlowStats()
            if cls in self._fine:
                stats.read_fine = FineHistogram()
        return stats

    def set_user_series(self, limit: int | None) -> list[AccountKey]:
        """Bound the uid keys per class from now on; returns the keys over the new bound
        (the least traffic first) for the caller to :meth:`fold` (it re-points the flows
        that count into them)."""
        self.user_series = limit
        if limit is None:
            return []
        over: list[AccountKey] = []
        for cls, n in self._labelled.items():
            if n > limit:
                keys = sorted((k for k in self._stats if k[0] == cls and k[2] is not None),
                              key=lambda k: self._stats[k].read_bytes + self._stats[k].write_bytes)
                over += keys[:n - limit]
        return over

    def idle_uids(self, now: float, idle_after: float) -> list[AccountKey]:
        """The uid keys without a request for *idle_after* seconds, as seen by successive
        calls (call it periodically: activity is compared between calls, so the hot path
        keeps no timestamps)."""
        idle = []
        seen = self._activity
        for key, stats in self._stats.items():
            if key[2] is None:
                continue
            count = _activity(stats)
            last = seen.get(key)
            if last is None or last[0] != count:
                seen[key] = (count, now)
            elif now - last[1] >= idle_after:
                idle.append(key)
        return idle

    def fold(self, key: AccountKey) -> tuple[FlowStats, FlowStats] | None:
        """Add a uid key's totals to its class's uid-less key and forget the uid key.

        Returns (the folded stats, the class's) so the caller can re-point flows still
        counting into the first, or None if *key* is not a uid key held here. Fine read
        histograms are not folded: a latency controller diffs them per key, and old
        observations arriving in one window would read as a burst.
        """
        cls, tenant, uid = key
        old = self._stats.get(key)
        if uid is None or old is None:
            return None
        del self._stats[key]
        self._activity.pop(key, None)
        self._labelled[cls] -= 1
        into = self.get(cls, tenant, None)
        _add_totals(into, old)
        return old, into

    def export_totals(self) -> list[list[Any]]:
        """Every key's totals as plain data, for a process that takes the mount over
        (``qosfs upgrade``): [class, tenant, uid, read_bytes, write_bytes, read_ops,
        write_ops, meta_ops, opens, throttled_seconds, histograms (each its bucket counts
        then its sum in ns, in `HISTOGRAMS` order)]."""
        return [[cls, tenant, uid, s.read_bytes, s.write_bytes, s.read_ops, s.write_ops,
                 s.meta_ops, s.opens, s.throttled_seconds,
                 [[*h.counts, h.sum_ns] for h in (getattr(s, n) for n in HISTOGRAMS)]]
                for (cls, tenant, uid), s in self._stats.items()]

    def import_totals(self, totals: list[list[Any]]) -> int:
        """Add a predecessor's `export_totals` to the keys here, so that every counter
        of ``/metrics`` goes on from where it stood instead of restarting at 0 (created
        as at an open: a uid past the ``user_series`` bound adds to its class's uid-less
        key, as its traffic would). Histograms of another bucket layout are left out.
        Returns how many keys were taken."""
        for cls, tenant, uid, rb, wb, ro, wo, mo, opens, throttled, histograms in totals:
            old = FlowStats()
            old.read_bytes, old.write_bytes = int(rb), int(wb)
            old.read_ops, old.write_ops, old.meta_ops = int(ro), int(wo), int(mo)
            old.opens, old.throttled_seconds = int(opens), float(throttled)
            if len(histograms) == len(HISTOGRAMS) and all(
                    len(h) == NBUCKETS + 2 for h in histograms):
                for name, values in zip(HISTOGRAMS, histograms, strict=True):
                    h = getattr(old, name)
                    h.counts = [int(n) for n in values[:-1]]
                    h.sum_ns = int(values[-1])
            _add_totals(self.get(str(cls), tenant, uid), old)
        return len(totals)

    def set_fine_classes(self, classes: frozenset[str]) -> None:
        """Record fine read backend histograms for exactly these classes from now on."""
        if classes == self._fine:
            return
        self._fine = classes
        for (cls, _, _), stats in self._stats.items():
            if cls not in classes:
                stats.read_fine = None
            elif stats.read_fine is None:
                stats.read_fine = FineHistogram()

    def fine_by_key(self, cls: str) -> dict[AccountKey, tuple[int, ...]]:
        """Per key of class ``cls``: its fine read backend counts (keys recording them).

        Keys come and go between two samples (a swap retires some, a new uid adds one):
        difference per key, treating a new key as starting from zero.
        """
        return {key: s.read_fine.snapshot() for key, s in self._stats.items()
                if key[0] == cls and s.read_fine is not None}

    def activity(self, cls: str) -> int:
        """A number that changes whenever class ``cls`` sees an open, a read or a metadata
        request (sum over its keys; the latency controller compares it between looks to
        see a protected class become active, also when its reads bypass the daemon)."""
        return sum(s.opens + s.read_ops + s.meta_ops for key, s in self._stats.items()
                   if key[0] == cls)

    def sent(self, cls: str) -> int:
        """Like :meth:`activity`, without the reads the kernel served: a number that
        changes whenever class ``cls`` sends the daemon a request (those wait in its
        queues, which a passed-through read never enters)."""
        return sum(s.opens + s.read_ops - s.kernel_reads + s.meta_ops
                   for key, s in self._stats.items() if key[0] == cls)

    def retain(self, keep: Callable[[AccountKey], bool]) -> None:
        """Forget every key ``keep`` rejects (after a policy swap re-bound the flows)."""
        for key in [k for k in self._stats if not keep(k)]:
            del self._stats[key]
            self._activity.pop(key, None)
            if key[2] is not None:
                self._labelled[key[0]] -= 1

    @property
    def uid_keys(self) -> int:
        """How many per-uid keys exist now (each is ~120 series in /metrics)."""
        return sum(self._labelled.values())

    def keys(self) -> list[AccountKey]:
        return list(self._stats)

    def snapshot(self) -> dict[AccountKey, FlowSnapshot]:
        """A consistent copy of every key's counters (call it on the event loop's thread)."""
        return {key: stats.snapshot() for key, stats in self._stats.items()}

    def histogram(self, cls: str, name: str) -> HistogramSnapshot:
        """One histogram (``"read_backend"``, ``"write_latency"``, ...) summed over a class.

        For a latency-target controller: sample it every window and subtract the previous
        sample to get the window's distribution.
        """
        total = HistogramSnapshot()
        for (key_cls, _, _), stats in self._stats.items():
            if key_cls == cls:
                total = total + getattr(stats, name).snapshot()
        return total

    def __len__(self) -> int:
        return len(self._stats)

    def __repr__(self) -> str:
        return f"<Accounts keys={len(self._stats)}>"
