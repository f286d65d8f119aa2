"""How many requests may wait for tokens at once, per uid, per class and in all.

A request parked by QoS holds a pyfuse3 worker task, and a parked write holds its data
twice (pyfuse3's copy and the worker's receive buffer, ~2 MiB for a 1 MiB write). Without
bounds one user's thousands of writer threads filled every worker (pyfuse3 stops reading
``/dev/fuse`` when all are busy): every class froze (a 6-byte ``cat`` in an unthrottled
class took 19 s) and memory grew with the flood.

So a request that must wait is first counted against these bounds, and one that would
exceed a bound is answered ``EAGAIN`` at once ("try again"; nothing was written, nothing
acknowledged). The bounds (:class:`ParkingLimits`) cap:

* per uid: requests and bytes of write data -- one user cannot take the lot;
* per class: requests -- one class cannot take every worker from the others;
* in all: requests (below the worker limit, so that requests that need no tokens always
  find a worker) and bytes of write data -- the daemon's memory.

Only requests that must wait pass through here: the fast path never does.
"""

from __future__ import annotations

from dataclasses import dataclass

_MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class ParkingLimits:
    """Bounds on parked requests (defaults: docs/policy.md, "Floods of throttled requests")."""

    per_uid_requests: int = 256
    per_uid_bytes: int = 64 * _MiB
    per_class_requests: int = 1024
    total_requests: int = 3072
    total_bytes: int = 256 * _MiB


@dataclass(frozen=True, slots=True)
class ParkingStatistics:
    requests: int
    bytes: int
    refused: int
    by_class: dict[str, int]


class ParkedCount:
    """Counts parked requests against :class:`ParkingLimits` (all on the event loop).

    Only a count: requests wait in a level's :class:`~qosfs.qos.waiting.Turn`; this says
    whether one more may.
    """

    __slots__ = ("_by_class", "_by_uid", "_bytes_by_uid", "bytes", "limits", "refused",
                 "refused_by_class", "requests")

    def __init__(self, limits: ParkingLimits | None = None) -> None:
        self.limits = limits or ParkingLimits()
        self.requests = 0
        self.bytes = 0
        self.refused = 0
        self.refused_by_class: dict[str, int] = {}
        self._by_uid: dict[int, int] = {}
        self._bytes_by_uid: dict[int, int] = {}
        self._by_class: dict[str, int] = {}

    def enter(self, uid: int, cls: str, nbytes: int) -> bool:
        """Admit a request that must wait; False (counted as refused) past a bound.

        *nbytes* is the write data it holds (0 for a read: its buffer is not allocated
        until it runs).
        """
        lim = self.limits
        by_uid = self._by_uid.get(uid, 0)
        bytes_uid = self._bytes_by_uid.get(uid, 0)
        by_class = self._by_class.get(cls, 0)
        if (by_uid >= lim.per_uid_requests or by_class >= lim.per_class_requests
                or self.requests >= lim.total_requests
                or (nbytes and (bytes_uid + nbytes > lim.per_uid_bytes
                                or self.bytes + nbytes > lim.total_bytes))):
            self.refused += 1
            self.refused_by_class[cls] = self.refused_by_class.get(cls, 0) + 1
            return False
        self._by_uid[uid] = by_uid + 1
        self._by_class[cls] = by_class + 1
        self.requests += 1
        if nbytes:
            self._bytes_by_uid[uid] = bytes_uid + nbytes
            self.bytes += nbytes
        return True

    def leave(self, uid: int, cls: str, nbytes: int) -> None:
        """A request admitted by :meth:`enter` stopped waiting (admitted or cancelled)."""
        left = self._by_uid[uid] - 1
        if left:
            self._by_uid[uid] = left
        else:
            del self._by_uid[uid]
        left = self._by_class[cls] - 1
        if left:
            self._by_class[cls] = left
        else:
            del self._by_class[cls]
        self.requests -= 1
        if nbytes:
            left = self._bytes_by_uid[uid] - nbytes
            if left:
                self._bytes_by_uid[uid] = left
            else:
                del self._bytes_by_uid[uid]
            self.bytes -= nbytes

    def statistics(self) -> ParkingStatistics:
        return ParkingStatistics(self.requests, self.bytes, self.refused, dict(self._by_class))

    def __repr__(self) -> str:
        return (f"<ParkedCount requests={self.requests} bytes={self.bytes} "
                f"refused={self.refused}>")
