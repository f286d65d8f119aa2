"""Vocabulary every layer shares: errors with exit codes, units, Linux syscalls, what
libfuse says about the caller of the request being served, and the count of unexpected
failures the daemon survived. Imports nothing above it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qosfs.core.faces import lazy_face

if TYPE_CHECKING:
    from qosfs.core.errors import (
        EXIT_CONTROL,
        EXIT_DAEMON,
        EXIT_FUSE,
        EXIT_MOUNTPOINT,
        EXIT_PLAN,
        EXIT_POLICY,
        EXIT_SOURCE,
        EXIT_USAGE,
        QosfsError,
    )
    from qosfs.core.failures import Failures
    from qosfs.core.limit_kinds import (
        BY_KEY,
        CAP_KEYS,
        LIMIT_KINDS,
        KeyedValues,
        Kind,
        LimitKind,
        default_burst,
    )
    from qosfs.core.mountinfo import MountEntry, containing, mounts
    from qosfs.core.units import (
        UnitError,
        format_bandwidth,
        format_duration,
        format_interval,
        format_iops,
        format_size,
        parse_bandwidth,
        parse_duration,
        parse_interval,
        parse_iops,
        parse_size,
        show_value,
    )

_EXPORTS = {
    "errors": (
        "QosfsError", "EXIT_CONTROL", "EXIT_DAEMON", "EXIT_FUSE", "EXIT_MOUNTPOINT", "EXIT_PLAN",
        "EXIT_POLICY", "EXIT_SOURCE", "EXIT_USAGE"
    ),
    "units": (
        "UnitError", "format_bandwidth", "format_duration", "format_interval", "format_iops",
        "format_size", "parse_bandwidth", "parse_duration", "parse_interval", "parse_iops",
        "parse_size", "show_value"
    ),
    "limit_kinds": (
        "BY_KEY", "CAP_KEYS", "LIMIT_KINDS", "KeyedValues", "Kind", "LimitKind", "default_burst"
    ),
    "mountinfo": ("MountEntry", "containing", "mounts"),
    "failures": ("Failures",),
}
__all__ = [
    "BY_KEY",
    "CAP_KEYS",
    "EXIT_CONTROL",
    "EXIT_DAEMON",
    "EXIT_FUSE",
    "EXIT_MOUNTPOINT",
    "EXIT_PLAN",
    "EXIT_POLICY",
    "EXIT_SOURCE",
    "EXIT_USAGE",
    "LIMIT_KINDS",
    "Failures",
    "KeyedValues",
    "Kind",
    "LimitKind",
    "MountEntry",
    "QosfsError",
    "UnitError",
    "containing",
    "default_burst",
    "format_bandwidth",
    "format_duration",
    "format_interval",
    "format_iops",
    "format_size",
    "mounts",
    "parse_bandwidth",
    "parse_duration",
    "parse_interval",
    "parse_iops",
    "parse_size",
    "show_value",
]

if not TYPE_CHECKING:  # type checkers read the imports above
    __getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
