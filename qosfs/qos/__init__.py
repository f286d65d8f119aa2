"""The QoS engine: token buckets, rate levels and the one way to wait at them, the
engine that binds a classified open file to its chain of levels, sharing of a declared
backend, traffic accounting and the latency controller. Knows nothing of FUSE: the
filesystem reaches it through :mod:`qosfs.qos.interface`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qosfs.core.faces import lazy_face

if TYPE_CHECKING:
    from qosfs.qos.accounting import AccountKey, Accounts, FlowStats
    from qosfs.qos.backend import BackendLevel, ClassPort, Share
    from qosfs.qos.bounds import ParkingLimits, ParkingLot
    from qosfs.qos.bucket import NO_LIMITS, UNLIMITED, LevelLimits, Limit, TokenBucket
    from qosfs.qos.engine import PolicyFlow, PolicyQos, class_limits, level_limits
    from qosfs.qos.interface import (
        THREADS_PER_FLOW,
        Classified,
        CountingFlow,
        Flow,
        PassThroughQos,
        PathSource,
        QosEngine,
    )
    from qosfs.qos.latency_control import LatencyDecider, LatencyLoop
    from qosfs.qos.latency_probe import PROBE_XATTR, LatencyProbe
    from qosfs.qos.levels import (
        FairShareGroup,
        Level,
        LevelFactory,
        LevelStatistics,
        LocalLevels,
        RateLevel,
        Stage,
        admit,
        admit_rest,
        local_level,
        refund_bytes,
        try_admit,
    )
    from qosfs.qos.stats import AutoCaps, EngineCounters, EngineStatistics
    from qosfs.qos.waiting import Ticket, Turn, until_covered

_EXPORTS = {
    "interface": (
        "THREADS_PER_FLOW", "Classified", "CountingFlow", "Flow", "PassThroughQos", "PathSource",
        "QosEngine"
    ),
    "engine": (
        "PolicyFlow", "PolicyQos", "class_limits", "level_limits"
    ),
    "levels": (
        "FairShareGroup", "Level", "LevelFactory", "LevelStatistics", "LocalLevels", "RateLevel",
        "Stage", "admit", "admit_rest", "local_level", "refund_bytes", "try_admit"
    ),
    "bucket": ("NO_LIMITS", "UNLIMITED", "LevelLimits", "Limit", "TokenBucket"),
    "backend": ("BackendLevel", "ClassPort", "Share"),
    "stats": ("AutoCaps", "EngineCounters", "EngineStatistics"),
    "waiting": ("Ticket", "Turn", "until_covered"),
    "accounting": ("AccountKey", "Accounts", "FlowStats"),
    "bounds": ("ParkingLimits", "ParkingLot"),
    "latency_control": ("LatencyDecider", "LatencyLoop"),
    "latency_probe": ("PROBE_XATTR", "LatencyProbe"),
}
__all__ = [
    "NO_LIMITS",
    "PROBE_XATTR",
    "THREADS_PER_FLOW",
    "UNLIMITED",
    "AccountKey",
    "Accounts",
    "AutoCaps",
    "BackendLevel",
    "ClassPort",
    "Classified",
    "CountingFlow",
    "EngineCounters",
    "EngineStatistics",
    "FairShareGroup",
    "Flow",
    "FlowStats",
    "LatencyDecider",
    "LatencyLoop",
    "LatencyProbe",
    "Level",
    "LevelFactory",
    "LevelLimits",
    "LevelStatistics",
    "Limit",
    "LocalLevels",
    "ParkingLimits",
    "ParkingLot",
    "PassThroughQos",
    "PathSource",
    "PolicyFlow",
    "PolicyQos",
    "QosEngine",
    "RateLevel",
    "Share",
    "Stage",
    "Ticket",
    "TokenBucket",
    "Turn",
    "admit",
    "admit_rest",
    "class_limits",
    "level_limits",
    "local_level",
    "refund_bytes",
    "try_admit",
    "until_covered",
]

if not TYPE_CHECKING:  # type checkers read the imports above
    __getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
