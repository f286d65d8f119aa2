"""The one table of limit kinds: everything that names a limit is derived from it.

A limit kind is a cap a policy can set (``read_bandwidth``), the token bucket that
enforces it (``read_bytes``), the requests it is charged for (reads) and how (bytes or one
operation), the policy key of its bucket depth, and how status, metrics and ``ctl`` show
it. The policy parser and writer (:mod:`qosfs.policy.build`), the policy's
:class:`~qosfs.policy.model.Limits`, a level's :class:`~qosfs.qos.bucket.LevelLimits` and
buckets (:mod:`qosfs.qos.levels`), the backend's dispatch costs, ``ctl status``
(:mod:`qosfs.control.snapshot`, :mod:`qosfs.control.ctl`) and the ``qosfs_limit_*``
metrics all iterate :data:`LIMIT_KINDS`. Adding a kind is a row here plus the code that
charges it (docs/architecture.md walks through one).

Example:
    >>> BY_KEY["write_iops"].bucket, BY_KEY["write_iops"].per_byte
    ('write_ops', False)
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

from qosfs.core.units import (
    format_bandwidth,
    format_iops,
    format_size,
    parse_bandwidth,
    parse_iops,
    parse_size,
)

__all__ = [
    "BUCKETS",
    "BURST_KEYS",
    "BY_BUCKET",
    "BY_KEY",
    "CAP_KEYS",
    "DEFAULT_BURST_SECONDS",
    "LIMIT_KINDS",
    "MIN_BURST_BYTES",
    "MIN_BURST_OPS",
    "KeyedValues",
    "Kind",
    "LimitKind",
    "default_burst",
]


class Kind(enum.IntEnum):
    """What a request consumes: READ/WRITE charge bytes and ops, META charges meta ops.

    Integer-valued because levels index per-kind tuples with it on the hot path.
    """

    READ = 0
    WRITE = 1
    META = 2


class LimitKind(NamedTuple):
    """One row of the table (see the module docstring).

    A NamedTuple rather than a frozen dataclass: ``qosfs ctl`` reads this table to show
    limits, and importing :mod:`dataclasses` (through :mod:`inspect`) would cost it
    ~6 ms of its start.
    """

    key: str  # the policy key, and the field status and snapshots show it under
    bucket: str  # the LevelLimits field and bucket name
    charges: Kind  # the requests it is charged for
    per_byte: bool  # True: a request costs its bytes; False: one operation
    burst_key: str  # the policy key of its bucket depth
    label: str  # "direction" / "op" label of qosfs_limit_*_per_second, and ctl's prefix
    parse: Callable[[Any], float]  # policy text -> rate (core.units)
    show: Callable[[float], str]  # rate -> policy text

    @property
    def unit(self) -> str:
        """``"bytes"`` or ``"ops"``: what its rate counts per second."""
        return "bytes" if self.per_byte else "ops"


LIMIT_KINDS: tuple[LimitKind, ...] = (
    LimitKind("read_bandwidth", "read_bytes", Kind.READ, True, "burst", "read",
              parse_bandwidth, format_bandwidth),
    LimitKind("write_bandwidth", "write_bytes", Kind.WRITE, True, "burst", "write",
              parse_bandwidth, format_bandwidth),
    LimitKind("read_iops", "read_ops", Kind.READ, False, "burst_iops", "read",
              parse_iops, format_iops),
    LimitKind("write_iops", "write_ops", Kind.WRITE, False, "burst_iops", "write",
              parse_iops, format_iops),
    LimitKind("meta_iops", "meta_ops", Kind.META, False, "burst_iops", "meta",
              parse_iops, format_iops),
)

CAP_KEYS = tuple(kind.key for kind in LIMIT_KINDS)
BUCKETS = tuple(kind.bucket for kind in LIMIT_KINDS)
BY_KEY = {kind.key: kind for kind in LIMIT_KINDS}
BY_BUCKET = {kind.bucket: kind for kind in LIMIT_KINDS}

#: Bucket depths a policy may set, with their parser and writer: bytes for the
#: per-byte kinds, operations for the others.
BURST_KEYS: dict[str, tuple[Callable[[Any], float], Callable[[float], str]]] = {
    "burst": (parse_size, lambda v: format_size(int(v))),
    "burst_iops": (parse_iops, format_iops),
}

#: A cap without an explicit burst may accumulate this many seconds of its rate: within
#: the 10 % tolerance of the 1 s cap-accuracy guarantee.
DEFAULT_BURST_SECONDS = 0.1
#: ... but at least this much, so one large request or a few small ones pass without debt.
MIN_BURST_BYTES = float(2**20)
MIN_BURST_OPS = 8.0


def default_burst(kind: LimitKind, rate: float) -> float:
    """The bucket depth of a cap of *kind* at *rate* when the policy sets none."""
    floor = MIN_BURST_BYTES if kind.per_byte else MIN_BURST_OPS
    return max(rate * DEFAULT_BURST_SECONDS, floor)


V = TypeVar("V")


class KeyedValues(Generic[V]):
    """Immutable values keyed by a fixed tuple of names (a subclass sets ``KEYS`` from the
    table), read as attributes: ``limits.read_bandwidth``.

    Built by keyword like a dataclass; a key left out has the class's ``DEFAULT``. It
    compares, hashes and prints like a frozen dataclass of those fields, so the classes
    built on it (policy :class:`~qosfs.policy.model.Limits`, a level's
    :class:`~qosfs.qos.bucket.LevelLimits`) need no edit when a kind is added.
    Attribute reads go through ``__getattr__`` (~0.2 µs): never on a request's path, only
    when a policy is built or swapped and when a file is opened.
    """

    __slots__ = ("_values",)
    _values: dict[str, V]
    KEYS: ClassVar[tuple[str, ...]] = ()
    DEFAULT: ClassVar[Any] = None

    def __init__(self, **values: V) -> None:
        unknown = [key for key in values if key not in self.KEYS]
        if unknown:
            raise TypeError(f"{type(self).__name__}() got unexpected keyword argument(s) "
                            f"{', '.join(unknown)}")
        kept = {k: v for k, v in values.items() if v != self.DEFAULT}
        object.__setattr__(self, "_values", kept)

    def __getattr__(self, name: str) -> V:
        if name in type(self).KEYS:
            value: V = self._values.get(name, self.DEFAULT)
            return value
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def get(self, key: str) -> V:
        """The value of *key* (``DEFAULT`` if it was left out)."""
        value: V = self._values.get(key, self.DEFAULT)
        return value

    def items(self) -> Iterator[tuple[str, V]]:
        """Every key in table order with its value, defaults included."""
        for key in self.KEYS:
            yield key, self._values.get(key, self.DEFAULT)

    def set_items(self) -> Iterator[tuple[str, V]]:
        """The keys that differ from the default, in table order."""
        for key in self.KEYS:
            if key in self._values:
                yield key, self._values[key]

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, KeyedValues)
        same: bool = self._values == other._values
        return same

    def __hash__(self) -> int:
        return hash((type(self), frozenset(self._values.items())))

    def __repr__(self) -> str:
        inner = ", ".join(f"{key}={value!r}" for key, value in self.set_items())
        return f"{type(self).__name__}({inner})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), dict(self._values)))


def _rebuild(cls: type[KeyedValues[Any]], values: dict[str, Any]) -> KeyedValues[Any]:
    return cls(**values)
