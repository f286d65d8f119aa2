"""Unexpected failures the daemon survived: counted by kind, logged once per kind.

A bug anywhere on a request's path (the engine, a level, the backend dispatch, the
cluster store, the filesystem's own bookkeeping) must cost the requests it touches, not
the mount: pyfuse3 ends its main loop on any exception but ``FUSEError``, and then
every caller of the mount gets ENOTCONN until it is remounted. So every handler answers
EIO for what it did not expect, and every service on the event loop (control socket,
metrics, latency control, cluster renewal) is restarted when it fails
(:mod:`qosfs.daemon.supervise`).

A broken class fails every one of its requests, thousands a second: logging each would
flood the journal and cost more than the request. The first failure of each kind
(where, exception type) is logged at ERROR with its traceback; the rest are counted.
Operators see the counts in ``qosfs ctl status`` (``internal_errors``) and as
``qosfs_internal_errors_total{where, type}``.
"""

from __future__ import annotations

import logging

__all__ = ["Failures"]

log = logging.getLogger(__name__)


def _innermost(exc: BaseException) -> BaseException:
    """A nursery's group of one failure is that failure (its type is the kind)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class Failures:
    """Counts of unexpected failures by (where, exception type); one log line per kind.

    Example:
        >>> failures = Failures()
        >>> failures.record("read", ValueError("bug"), "answered EIO")  # logged
        >>> failures.record("read", ValueError("bug"), "answered EIO")  # counted only
        >>> failures.counts()
        {'read': {'ValueError': 2}}
    """

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], int] = {}

    def __repr__(self) -> str:
        return f"<Failures {self.total} in {len(self._counts)} kinds>"

    @property
    def total(self) -> int:
        return sum(self._counts.values())

    def record(self, where: str, exc: BaseException, outcome: str) -> None:
        """Count *exc*, raised in *where* (a handler, a service); log it if it is the
        first of its kind, saying what was done about it (*outcome*)."""
        exc = _innermost(exc)
        key = (where, type(exc).__qualname__)
        seen = self._counts.get(key, 0)
        self._counts[key] = seen + 1
        if not seen:
            log.error("unexpected failure in %s: %s: %s; %s. Further %s in %s are counted, "
                      "not logged (internal_errors in 'qosfs ctl status --json')",
                      where, key[1], exc, outcome, key[1], where, exc_info=exc)

    def counts(self) -> dict[str, dict[str, int]]:
        """``{where: {exception type: count}}``, for status and metrics."""
        out: dict[str, dict[str, int]] = {}
        for (where, kind), n in sorted(self._counts.items()):
            out.setdefault(where, {})[kind] = n
        return out
