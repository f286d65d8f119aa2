"""The policy model: frozen dataclasses and :class:`PolicyError`.

Everything the QoS engine and the classifier read of a policy is defined here; parsing
and validation live in :mod:`qosfs.policy.build`, TOML text in :mod:`qosfs.policy.text`,
the names of its keys in :mod:`qosfs.policy.keys`, and :mod:`qosfs.policy.loading` parses,
loads and changes a policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from qosfs.core.errors import EXIT_POLICY, QosfsError
from qosfs.core.limit_kinds import (
    BURST_KEYS,
    BY_KEY,
    CAP_KEYS,
    LIMIT_KINDS,
    KeyedValues,
    LimitKind,
    default_burst,
)
from qosfs.core.units import format_bandwidth, format_duration, format_interval, format_size
from qosfs.policy.keys import LIMIT_KEYS, OPS, PRIORITY_WEIGHTS
from qosfs.policy.text import dump_toml


class PolicyError(QosfsError):
    """An invalid policy; ``str()`` is one line: ``source:line: key: reason``."""

    exit_code = EXIT_POLICY

    def __init__(self, reason: str, *, source: str = "<string>", line: int | None = None,
                 key: str | None = None) -> None:
        self.reason, self.source, self.line, self.key = reason, source, line, key
        where = source if line is None else f"{source}:{line}"
        super().__init__(f"{where}: {reason}" if key is None else f"{where}: {key}: {reason}")


class Limits(KeyedValues["float | None"]):
    """Caps in bytes/s and ops/s (``None``: no cap) and bucket depths (``None``: default),
    keyed like the policy file: one cap per row of
    :data:`qosfs.core.limit_kinds.LIMIT_KINDS`, plus ``burst`` (bytes) and ``burst_iops``.

    Example:
        >>> Limits(write_bandwidth=4e8).write_bandwidth
        400000000.0
    """

    __slots__ = ()
    KEYS: ClassVar[tuple[str, ...]] = LIMIT_KEYS
    DEFAULT: ClassVar[None] = None

    @property
    def is_unlimited(self) -> bool:
        """True when no cap is set (bursts alone limit nothing)."""
        return all(self.get(key) is None for key in CAP_KEYS)

    def caps(self) -> dict[str, float]:
        """The caps set, keyed like the file, in the table's order (bursts left out)."""
        return {key: value for key in CAP_KEYS if (value := self.get(key)) is not None}

    def burst_of(self, kind: LimitKind, cap: float) -> float:
        """Bucket depth for a cap of *kind*: its burst key if set, else the default
        (100 ms of the cap, at least 1 MiB or 8 ops). Derived rather than stored so a
        live change of the cap moves the default too."""
        burst = self.get(kind.burst_key)
        return float(burst) if burst is not None else default_burst(kind, cap)

    def bandwidth_burst(self, cap: float) -> float:
        """Bucket depth in bytes for a bandwidth cap (see :meth:`burst_of`)."""
        return self.burst_of(BY_KEY["read_bandwidth"], cap)

    def iops_burst(self, cap: float) -> float:
        """Bucket depth in ops for an IOPS cap (see :meth:`burst_of`)."""
        return self.burst_of(BY_KEY["read_iops"], cap)


#: The limits of a tenant, class or backend that sets none (immutable, so shared).
NO_CAPS = Limits()


@dataclass(frozen=True, slots=True)
class IdRange:
    """An inclusive range of uids or gids."""

    lo: int
    hi: int

    def __contains__(self, value: object) -> bool:
        return isinstance(value, int) and self.lo <= value <= self.hi


@dataclass(frozen=True, slots=True)
class Backend:
    """What the storage delivers in total; the denominators of guarantees and priorities."""

    limits: Limits


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who: a group of users (and optionally paths) with caps over all of its traffic."""

    name: str
    uids: tuple[IdRange, ...] = ()
    gids: tuple[IdRange, ...] = ()
    paths: tuple[str, ...] = ()
    limits: Limits = NO_CAPS
    # The callers' cgroup (a scheduler's job, a Kubernetes pod): who cannot forge it.
    cgroups: tuple[str, ...] = ()
    # An environment variable the caller's (exec-time) environment sets, e.g. a pod's
    # namespace or Run:ai project from the downward API, and globs its value must match
    # (none: set at all). Advisory: the caller controls its environment.
    job_env: str | None = None
    jobs: tuple[str, ...] = ()
    scope: str = "node"  # "cluster": the caps hold over every mount of the [cluster]


@dataclass(frozen=True, slots=True)
class ClassRule:
    """What: match criteria (empty: not a criterion) and the treatment of matching traffic."""

    name: str
    paths: tuple[str, ...] = ()
    uids: tuple[IdRange, ...] = ()
    gids: tuple[IdRange, ...] = ()
    tenants: tuple[str, ...] = ()
    ops: frozenset[str] = frozenset()  # empty: every op
    job_env: str | None = None
    jobs: tuple[str, ...] = ()
    cgroups: tuple[str, ...] = ()
    priority_weight: int = PRIORITY_WEIGHTS["normal"]
    priority_name: str = "normal"
    min_read_bandwidth: float | None = None
    min_write_bandwidth: float | None = None
    limits: Limits = NO_CAPS
    per_user: bool = False
    scope: str = "node"  # "cluster": the caps (and a per_user split) span every mount
    cache: str = "auto"
    passthrough: str = "auto"  # "reads" means the same; "off": see passthrough_blocker
    # How long the kernel may trust names (entry) and attributes (attr) of objects under
    # this class's paths; None: the mount's --attr-timeout. Decided by path alone: the
    # kernel caches an inode for every caller (qosfs.passthrough.operations,
    # qosfs.policy.classify.CacheTimeouts).
    entry_timeout: float | None = None
    attr_timeout: float | None = None
    target_read_latency: float | None = None
    # A target relative to the class itself: its read latency may be at most this many
    # times what it is while the classes below it are quiet (qosfs.qos.latency.decider).
    target_read_slowdown: float | None = None
    latency_percentile: float = 99.0
    latency_measure: str = "request"
    # Bytes of (mostly) sequential writes after which a writable open of an uncapped class
    # moves into this class (docs/policy.md, "Streaming writers, whatever their names");
    # None: this class takes no streams.
    detect_streaming_writes: int | None = None

    @property
    def reads_bypass_cache(self) -> bool:
        """Whether every open of this class bypasses the page cache (``direct_io``):
        ``cache = "direct"``, or ``"auto"`` with a read cap, so that a re-read cannot
        escape the cap through cached pages."""
        return self.cache == "direct" or (self.cache == "auto" and (
            self.limits.read_bandwidth is not None or self.limits.read_iops is not None))

    @property
    def latency_protected(self) -> bool:
        """Whether a latency target (absolute or relative) protects this class's reads."""
        return self.target_read_latency is not None or self.target_read_slowdown is not None

    @property
    def latency_needs_reads(self) -> bool:
        """Whether a latency target of this class is judged on the class's own reads as
        the daemon serves them (``latency_measure = "backend"``), so that its read-only
        opens must stay in the daemon (:func:`passthrough_blocker` says why)."""
        return self.latency_protected and self.latency_measure == "backend"


def stream_threshold(rule: ClassRule, target: ClassRule | None) -> int:
    """Bytes of mostly sequential writes after which a writable open of class *rule* moves
    to *target*, the policy's :attr:`~Policy.streaming_target` (docs/policy.md, "Streaming
    writers, whatever their names"); 0: never (no such class, or *rule* is that class or
    caps writes itself)."""
    if target is None or rule.name == target.name \
            or rule.limits.write_bandwidth is not None or rule.limits.write_iops is not None:
        return 0
    return target.detect_streaming_writes or 0


def _caps_reads(limits: Limits) -> bool:
    return limits.read_bandwidth is not None or limits.read_iops is not None


#: What :func:`passthrough_blocker` says of a class whose latency target is measured on
#: its own reads (no cap is involved: nothing to "hold" there).
MEASURED_IN_DAEMON = ("its read latency target is measured on its own reads' backing times "
                      '(latency_measure = "backend"), which only the daemon sees')


def passthrough_blocker(policy: Policy, rule: ClassRule,
                        tenants: tuple[Tenant, ...] | None = None) -> str | None:
    """Why the policy alone keeps a class's read-only opens in the daemon, or None if
    nothing in it does (then the kernel reads the backing file itself for them, where the
    mount negotiated kernel passthrough).

    Every class passes reads through by default (``passthrough = "auto"``, or its older
    spelling ``"reads"``); ``passthrough = "off"`` keeps a class in the daemon. Kernel
    passthrough takes the daemon off an open's read path: nothing could charge those
    reads. So an open is passed through only while no level its reads pass caps them: the
    class (a read cap, or ``per_user = "fair"``, which splits the class's share per uid),
    the caller's tenant, the ``[backend]``'s read caps, which every class's reads share by
    priority. The engine checks the same per open on the levels themselves, automatic caps
    of the latency controller included
    (:meth:`qosfs.qos.flow.PolicyFlow.passes_reads_through`); this is what ``qosfs
    check`` and ``qosfs explain`` can tell from the file.

    A read latency target (``target_read_latency``, ``target_read_slowdown``) keeps the
    reads in the daemon only where its measure needs them seen there:

    * ``latency_measure = "backend"`` is the percentile of the backing syscall times of
      the class's own reads, which the daemon takes around each ``pread`` it serves. A
      passed-through read has none: the figure the administrator chose would not exist.
    * ``latency_measure = "request"`` (the default) is what a caller waits for, and is
      measured by the canary in any case (:mod:`qosfs.qos.latency.probe`): its round trip
      through the mount stands for the queue a daemon-served read waits in. A
      passed-through read waits in no queue of the daemon's; what it waits for is the
      backing store, which the canary times itself by reading a file the class holds open
      (``O_DIRECT``, :meth:`qosfs.qos.latency.probe.LatencyProbe.watch_backing`), and the
      controller judges the class on that (:mod:`qosfs.qos.latency.loop`, "Reads not
      seen"). So such a class passes through and stays protected: the embedded default
      policy's ``datasets`` (``target_read_slowdown = 1.3``) is one.
    """
    if rule.passthrough == "off":
        return 'passthrough = "off" keeps the class\'s reads in the daemon'
    if _caps_reads(rule.limits):
        return "the class caps its reads"
    if rule.per_user:
        return 'per_user = "fair" shares the class\'s reads out per uid'
    if policy.backend is not None and _caps_reads(policy.backend.limits):
        return "[backend] caps reads, which every class shares by priority"
    if tenants is None:
        names = set(rule.tenants)
        tenants = tuple(t for t in policy.tenants if not names or t.name in names)
    capped = [t.name for t in tenants if _caps_reads(t.limits)]
    if capped:
        return (f"tenant{'s' if len(capped) > 1 else ''} {', '.join(capped)} "
                f"cap{'' if len(capped) > 1 else 's'} reads: opens charged to "
                f"{'them' if len(capped) > 1 else 'it'} stay in the daemon")
    if rule.latency_needs_reads:
        return MEASURED_IN_DAEMON
    return None


@dataclass(frozen=True, slots=True)
class Control:
    """Who may change the running policy through the control socket besides root."""

    admin_gid: int | None = None


@dataclass(frozen=True, slots=True)
class Cluster:
    """Where cluster-scoped levels meet (``[cluster]``): a Redis every mount can reach.

    The password is never in the policy text: it is read from ``password_file`` or the
    environment variable ``password_env`` (the URL may name a user, not a password).
    """

    redis: str  # redis://host:port/db, rediss:// (TLS), or unix:///path/to.sock
    password_file: str | None = None
    password_env: str = "QOSFS_REDIS_PASSWORD"
    key_prefix: str = "qosfs"
    # Each mount renews its grants this often; a change is in force everywhere within it.
    lease: float = 0.1
    # What a mount enforces while Redis cannot be reached: its last grant (None), or the
    # cluster cap divided by this many nodes.
    fallback_nodes: int | None = None


DEFAULT_USER_SERIES = 100
DEFAULT_USER_SERIES_IDLE = 600.0


@dataclass(frozen=True, slots=True)
class Exported:
    """How much per-uid detail ``/metrics`` carries (``[metrics]``): each uid of a
    ``per_user`` class costs about 120 series, and clusters have thousands of users."""

    # At most this many uids of one class have series of their own; traffic of the
    # others is counted in the class's uid="" series (0: per-uid series off).
    user_series: int = DEFAULT_USER_SERIES
    # A uid with no traffic and no open file this long leaves the exported series; its
    # totals fold into the class's uid="" series, so class sums stay monotonic.
    user_series_idle: float = DEFAULT_USER_SERIES_IDLE


@dataclass(frozen=True, slots=True)
class Policy:
    """A whole validated policy; ``classes[-1]`` is always ``default``."""

    source: str = field(compare=False)
    classes: tuple[ClassRule, ...]
    tenants: tuple[Tenant, ...] = ()
    backend: Backend | None = None
    control: Control = Control()
    exported: Exported = Exported()
    cluster: Cluster | None = None
    # The TOML it was read from, for the lines ``qosfs explain`` names (None: built from
    # tables). A ``ctl set`` keeps it: it changes settings, never a criterion or a name.
    text: str | None = field(default=None, compare=False, repr=False)

    def class_by_name(self, name: str) -> ClassRule | None:
        """The class called ``name``, or None."""
        return next((c for c in self.classes if c.name == name), None)

    def tenant_by_name(self, name: str) -> Tenant | None:
        """The tenant called ``name``, or None."""
        return next((t for t in self.tenants if t.name == name), None)

    @property
    def streaming_target(self) -> ClassRule | None:
        """The class that takes streaming writers (at most one has
        ``detect_streaming_writes``), or None."""
        return next((c for c in self.classes if c.detect_streaming_writes is not None), None)

    @property
    def meta_limited(self) -> bool:
        """Whether anything caps ``meta_iops``: metadata requests are classified and
        charged only then (each costs a path lookup)."""
        limits = [r.limits for r in self.classes] + [t.limits for t in self.tenants]
        if self.backend is not None:
            limits.append(self.backend.limits)
        return any(lim.meta_iops is not None for lim in limits)

    @property
    def needs_job_lookup(self) -> bool:
        """Whether classification needs :func:`qosfs.policy.classify.read_job_info` at open."""
        return any(c.job_env is not None or c.cgroups for c in self.classes) or any(
            t.job_env is not None or t.cgroups for t in self.tenants)

    @property
    def job_envs(self) -> tuple[str, ...]:
        """The environment variables classes and tenants match on, each once, in order."""
        rules: tuple[Tenant | ClassRule, ...] = (*self.tenants, *self.classes)
        names = [r.job_env for r in rules if r.job_env is not None]
        return tuple(dict.fromkeys(names))

    def render(self) -> str:
        """The resolved policy as TOML that parses back to an equal :class:`Policy`."""
        return dump_toml(policy_to_raw(self), self.source)


# ---------------------------------------------------------------------- back to text
# The model's inverse of qosfs.policy.build: kept here so that Policy.render() needs
# nothing above the model.

_FORMAT = {**{k.key: k.show for k in LIMIT_KINDS}, **{k: v[1] for k, v in BURST_KEYS.items()}}


def _limits_raw(limits: Limits) -> dict[str, Any]:
    return {k: _FORMAT[k](v) for k in LIMIT_KEYS if (v := limits.get(k)) is not None}


def _ids_raw(ranges: tuple[IdRange, ...]) -> list[int | str]:
    return [r.lo if r.lo == r.hi else f"{r.lo}-{r.hi}" for r in ranges]


def _class_raw(c: ClassRule) -> dict[str, Any]:
    out: dict[str, Any] = {"paths": list(c.paths), "uids": _ids_raw(c.uids),
                           "gids": _ids_raw(c.gids), "tenants": list(c.tenants),
                           "ops": [op for op in OPS if op in c.ops], "job_env": c.job_env,
                           "jobs": list(c.jobs), "cgroups": list(c.cgroups)}
    named = PRIORITY_WEIGHTS.get(c.priority_name) == c.priority_weight
    out["priority"] = c.priority_name if named else c.priority_weight
    for key in ("min_read_bandwidth", "min_write_bandwidth"):
        out[key] = None if getattr(c, key) is None else format_bandwidth(getattr(c, key))
    if c.scope != "node":
        out["scope"] = c.scope
    if c.passthrough != "auto":
        out["passthrough"] = c.passthrough
    out.update(per_user="fair" if c.per_user else "none", cache=c.cache,
               latency_percentile=c.latency_percentile, latency_measure=c.latency_measure,
               **_limits_raw(c.limits))
    if c.target_read_latency is not None:
        out["target_read_latency"] = format_duration(c.target_read_latency)
    if c.target_read_slowdown is not None:
        out["target_read_slowdown"] = c.target_read_slowdown
    if c.detect_streaming_writes is not None:
        out["detect_streaming_writes"] = format_size(c.detect_streaming_writes)
    for key in ("entry_timeout", "attr_timeout"):
        seconds = getattr(c, key)
        if seconds is not None:
            out[key] = format_duration(seconds) if seconds else "0s"
    return {k: v for k, v in out.items() if v not in (None, [])}


def policy_to_raw(policy: Policy) -> dict[str, Any]:
    """The policy as the dict tomllib would produce from its rendering."""
    raw: dict[str, Any] = {}
    if policy.backend is not None:
        raw["backend"] = _limits_raw(policy.backend.limits)
    if policy.cluster is not None:
        c = policy.cluster
        raw["cluster"] = {"redis": c.redis, "password_env": c.password_env,
                          "key_prefix": c.key_prefix, "lease": format_duration(c.lease),
                          "fallback": "last-grant" if c.fallback_nodes is None
                          else c.fallback_nodes}
        if c.password_file is not None:
            raw["cluster"]["password_file"] = c.password_file
    if policy.control.admin_gid is not None:
        raw["control"] = {"admin_group": policy.control.admin_gid}
    if policy.exported != Exported():
        raw["metrics"] = {"user_series": policy.exported.user_series,
                          "user_series_idle": format_interval(policy.exported.user_series_idle)}
    raw["tenants"] = {t.name: {"uids": _ids_raw(t.uids), "gids": _ids_raw(t.gids),
                               "paths": list(t.paths), "cgroups": list(t.cgroups),
                               "job_env": t.job_env, "jobs": list(t.jobs),
                               "scope": None if t.scope == "node" else t.scope,
                               **_limits_raw(t.limits)}
                      for t in policy.tenants}
    for table in raw["tenants"].values():
        for key in ("uids", "gids", "paths", "cgroups", "job_env", "jobs", "scope"):
            if not table[key]:
                del table[key]
    raw["classes"] = {c.name: _class_raw(c) for c in policy.classes}
    return raw


