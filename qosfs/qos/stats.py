"""What an engine reports of itself: frozen, typed figures for status, stats and metrics.

Both engines answer with these (:class:`qosfs.qos.engine.PolicyQos`, and the policy-less
:class:`qosfs.qos.interface.PassThroughQos` with empty ones), and the control layer reads
them from the engine it holds (:mod:`qosfs.control.snapshot`): the filesystem carries no
figure of the engine's. Taken on the event loop's thread, plain data afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qosfs.qos.levels import LevelStatistics

__all__ = ["NO_AUTO_CAPS", "NO_COUNTERS", "AutoCaps", "EngineCounters", "EngineStatistics"]


@dataclass(frozen=True, slots=True)
class AutoCaps:
    """Bandwidth caps set by the latency controller (bytes/s; None: not capped by it).

    Set through :meth:`qosfs.qos.engine.PolicyQos.set_auto_caps`, reported in
    :attr:`EngineStatistics.auto_caps`.
    """

    read_bandwidth: float | None = None
    write_bandwidth: float | None = None


NO_AUTO_CAPS = AutoCaps()


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """Every level's counters and the limits in force (:meth:`PolicyQos.statistics
    <qosfs.qos.engine.PolicyQos.statistics>`)."""

    generation: int  # of the policy in force; 0: no policy
    classes: dict[str, LevelStatistics]
    users: dict[str, dict[int, LevelStatistics]]  # per_user classes: each active uid's share
    tenants: dict[str, LevelStatistics]
    backend: LevelStatistics | None  # None: the policy declares no [backend]
    # The latency controller's caps by class (qosfs.qos.latency); a class's
    # ``limits`` above show what is in force, these what the controller asked for.
    auto_caps: dict[str, AutoCaps] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """The engine's own counters, beside its levels'. Field names are the ``ctl status``
    keys (:meth:`as_status`); ``/metrics`` exports each (qosfs.control.metrics)."""

    streaming_moves: dict[str, int]  # writable opens moved as streaming writers, by class left
    rename_charged_bytes: dict[str, int]  # bytes re-charged at a rename, by class charged
    user_accounts: int  # uids with series of their own ([metrics] user_series)
    users_expired: int  # uid accounts folded into their class after going idle
    parked_requests: int  # requests waiting for tokens now (qosfs.qos.bounds)
    parked_bytes: int  # write data they hold
    parking_refused: int  # requests answered EAGAIN past a parking bound

    def as_status(self) -> dict[str, Any]:
        """The ``ctl status`` keys and values (fresh dicts: safe to hand on)."""
        return {"streaming_moves": dict(self.streaming_moves),
                "rename_charged_bytes": dict(self.rename_charged_bytes),
                "user_accounts": self.user_accounts, "users_expired": self.users_expired,
                "parked_requests": self.parked_requests, "parked_bytes": self.parked_bytes,
                "parking_refused": self.parking_refused}


#: What an engine that moves, charges and parks nothing reports.
NO_COUNTERS = EngineCounters({}, {}, 0, 0, 0, 0, 0)
