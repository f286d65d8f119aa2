"""Token-bucket arithmetic and the limit values buckets are built from: pure, clock injected.

This module knows nothing about trio, files or requests. Every method that depends on time
takes the current time as a float ``now`` (seconds, any monotonic origin), so the same code
runs under the real clock, trio's mock clock, or a plain number in a property test.

Semantics in one paragraph: a bucket refills lazily at ``rate`` tokens per second up to
``burst``; :meth:`TokenBucket.take` charges unconditionally and may leave the bucket in debt
(negative ``tokens``); a request is *admissible* when the bucket holds ``min(n, burst)``
tokens, so a request larger than the burst waits for a full bucket, goes through, and the
debt it leaves delays whoever comes next. Nothing is ever rejected and nothing can wait
forever. ``rate == math.inf`` means unlimited, and every method returns at its first line.

Example:
    >>> b = TokenBucket(rate=10.0, burst=5.0)   # starts full
    >>> b.take(8.0, now=0.0)                     # 3 tokens of debt: 0.3 s to repay
    0.3
    >>> b.delay_for(1.0, now=0.0)                # 4 tokens short at 10/s
    0.4
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from qosfs.core.limit_kinds import BUCKETS, DEFAULT_BURST_SECONDS, LIMIT_KINDS, KeyedValues

__all__ = [
    "DEFAULT_BURST_SECONDS",
    "LIMIT_NAMES",
    "NO_LIMITS",
    "UNLIMITED",
    "LevelLimits",
    "Limit",
    "TokenBucket",
]

_INF = math.inf

#: The buckets of a level, in table order (qosfs.core.limit_kinds).
LIMIT_NAMES = BUCKETS


def _check(rate: float, burst: float) -> None:
    """Validate a (rate, burst) pair; the policy layer is expected to have done it already."""
    if not rate > 0.0:  # also rejects NaN
        raise ValueError(f"rate must be > 0 (math.inf = unlimited), got {rate!r}")
    if rate != _INF and not 0.0 < burst < _INF:
        raise ValueError(f"burst must be finite and > 0 for a finite rate, got {burst!r}")


@dataclass(slots=True, eq=False)
class TokenBucket:
    """A lazily refilled token bucket that allows debt.

    Attributes:
        rate: Tokens per second; ``math.inf`` means unlimited (burst and tokens are then
            ``math.inf`` too, and every operation is a no-op).
        burst: Bucket depth: the most tokens an idle bucket accumulates.
        tokens: Current balance as of ``updated``; negative means debt.
        updated: Time of the last refill. The default ``-inf`` makes a fresh bucket full
            at whatever time it is first used, so no clock is needed to build one.
    """

    rate: float = _INF
    burst: float = _INF
    tokens: float = math.nan  # NaN means "start full"
    updated: float = -_INF

    def __post_init__(self) -> None:
        _check(self.rate, self.burst)
        if self.rate == _INF:
            self.burst = self.tokens = _INF
        elif math.isnan(self.tokens):
            self.tokens = self.burst

    @property
    def unlimited(self) -> bool:
        """True when the bucket never delays anything."""
        return self.rate == _INF

    def refill(self, now: float) -> None:
        """Credit the tokens earned since the last refill, capped at ``burst``.

        Lazy refill is what lets the limiter run without a background task: the balance is
        only ever computed when someone looks at it. A ``now`` earlier than ``updated`` (a
        stale timestamp) is ignored rather than allowed to remove tokens.
        """
        elapsed = now - self.updated
        if elapsed > 0.0 and self.rate != _INF:
            tokens = self.tokens + elapsed * self.rate
            self.tokens = tokens if tokens < self.burst else self.burst  # noqa: FURB136 (hot)
            self.updated = now

    def take(self, n: float, now: float) -> float:
        """Charge ``n`` tokens unconditionally.

        Used when the work is already decided (or already done) and only has to be paid
        for: the bucket goes into debt rather than refusing, so an oversized request can
        never deadlock.

        Returns:
            Seconds until the balance is back at >= 0, i.e. how long a caller that wants to
            "charge then sleep" should sleep; 0.0 if the bucket covered ``n``.
        """
        if self.rate == _INF:
            return 0.0
        self.refill(now)
        self.tokens -= n
        return 0.0 if self.tokens >= 0.0 else -self.tokens / self.rate

    def try_take(self, n: float, now: float) -> bool:
        """Charge ``n`` tokens if the request is admissible now, else change nothing.

        Admissible means the bucket holds ``min(n, burst)`` tokens: a request no larger
        than the burst needs all of its tokens; a larger one needs a full bucket and
        leaves ``n - burst`` of debt behind. This is the fast-path primitive.
        """
        if self.rate == _INF:
            return True
        self.refill(now)
        need = n if n < self.burst else self.burst  # noqa: FURB136 (min() costs 60 ns)
        if self.tokens < need:
            return False
        self.tokens -= n
        return True

    def delay_for(self, n: float, now: float) -> float:
        """Seconds until a request of ``n`` tokens is admissible, without charging it.

        "Admissible" is as in :meth:`try_take`: ``min(n, burst)`` tokens on hand. A
        waiter that must clear several buckets sleeps for the largest of their delays,
        then re-checks, because another bucket's balance (or rate) may have changed.
        """
        if self.rate == _INF:
            return 0.0
        self.refill(now)
        deficit = min(n, self.burst) - self.tokens
        return deficit / self.rate if deficit > 0.0 else 0.0

    def refund(self, n: float) -> None:
        """Give back ``n`` tokens charged for work that did not happen (capped at burst).

        No refill is needed first: capping now or after the pending refill gives the
        same balance, because the refill is capped at the same burst.
        """
        if self.rate != _INF:
            self.tokens = min(self.tokens + n, self.burst)

    def set_rate(self, rate: float, burst: float, now: float) -> None:
        """Change rate and burst live.

        The bucket is first refilled at the old rate up to ``now`` (tokens already earned
        are kept), then the new parameters apply:

        * A positive balance keeps its *fill fraction*: ``tokens *= new_burst / old_burst``
          (Guava's ``SmoothBursty`` does the same). A request parked on a 40 % full 1 MiB
          bucket therefore goes through at once when the cap is raised to 1 GiB/s with a
          64 MiB burst, instead of waiting for tokens the old cap never let accrue; the
          gift is bounded by the new burst, like any idle bucket's.
        * Debt is kept in tokens, so raising the rate shortens the wait it implies, but a
          change never *lengthens* that wait: when the rate drops, debt is scaled by
          ``new_rate / old_rate`` so it still takes the same time to repay. We chose this
          over "forgive debt beyond 1 s of the new rate": the bytes behind the debt were
          admitted under the old limit, so lowering a cap from 1 GiB/s to 1 MiB/s must not
          turn 0.5 s of debt into 512 s of stall; yet fair-share re-splits (frequent rate
          changes) must not forgive debt either, which a flat time cap would do to the
          legitimate debt of a request larger than the burst.

        Switching between unlimited and limited resets the balance to a full bucket
        (an unlimited bucket has no meaningful balance and never has debt).
        """
        _check(rate, burst)
        if rate == _INF:
            self.rate = self.burst = self.tokens = _INF
            self.updated = now
            return
        if self.rate == _INF:
            self.rate, self.burst, self.tokens, self.updated = rate, burst, burst, now
            return
        self.refill(now)
        if self.tokens > 0.0:
            self.tokens = min(self.tokens * (burst / self.burst), burst)
        elif rate < self.rate:
            self.tokens *= rate / self.rate
        self.rate = rate
        self.burst = burst


# -- configuration values ---------------------------------------------------------------
# Pure data, kept here (not in qosfs.qos.levels, which imports trio) so that the policy
# parser can build validated limits without importing trio.


@dataclass(frozen=True, slots=True)
class Limit:
    """One bucket's configuration: ``rate`` per second (``math.inf`` = unlimited), ``burst``.

    ``burst=None`` means ``DEFAULT_BURST_SECONDS`` of the rate (at least one token).
    """

    rate: float = _INF
    burst: float | None = None

    def __post_init__(self) -> None:
        if not self.rate > 0.0:
            raise ValueError(f"rate must be > 0 (math.inf = unlimited), got {self.rate!r}")
        if self.burst is not None and not 0.0 < self.burst < _INF:
            raise ValueError(f"burst must be finite and > 0, got {self.burst!r}")

    @property
    def effective_burst(self) -> float:
        """The burst the bucket is built with."""
        if self.rate == _INF:
            return _INF
        if self.burst is not None:
            return self.burst
        return max(self.rate * DEFAULT_BURST_SECONDS, 1.0)

    def scaled(self, factor: float) -> Limit:
        """This limit times ``factor`` (rate and burst), e.g. one user's fair share."""
        if self.rate == _INF:
            return self
        return Limit(self.rate * factor, self.effective_burst * factor)


UNLIMITED = Limit()


class LevelLimits(KeyedValues[Limit]):
    """A level's limits, one per bucket of :data:`qosfs.core.limit_kinds.LIMIT_KINDS`
    (``read_bytes``, ``write_ops``, ...); buckets left out are unlimited.

    Example:
        >>> LevelLimits(write_bytes=Limit(1e6)).write_bytes.rate
        1000000.0
    """

    __slots__ = ()
    KEYS: ClassVar[tuple[str, ...]] = BUCKETS
    DEFAULT: ClassVar[Limit] = UNLIMITED

    def scaled(self, factor: float) -> LevelLimits:
        """Every limit times ``factor``; unlimited stays unlimited."""
        return LevelLimits(**{name: limit.scaled(factor) for name, limit in self.items()})

    def caps(self) -> dict[str, float]:
        """The finite caps, keyed like the policy file (``write_bandwidth``: bytes/s,
        ``*_iops``: ops/s), in the table's order: what status and explain show."""
        return {kind.key: rate for kind in LIMIT_KINDS
                if (rate := self.get(kind.bucket).rate) != _INF}


NO_LIMITS = LevelLimits()
