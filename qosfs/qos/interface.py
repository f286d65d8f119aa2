"""The two faces of a QoS engine, by who asks, and the engine without a policy.

:class:`FilesystemQos` is what the filesystem (:mod:`qosfs.passthrough`) asks, and it
knows nothing about policies: at open it takes an :class:`~qosfs.qos.charge.OpenCharge`,
which asks the engine for a *flow* (the set of rate levels a file's traffic is charged
to), and on every read/write it asks that flow to admit the request; metadata requests,
moves of a charge after open and the handles handed to a successor go through it too.
Keeping this seam small lets the engine change without touching the filesystem.

:class:`QosControl` is what the control layer (:mod:`qosfs.control`) and the daemon ask:
the policy in force, swapping it, what a request would get (explain), typed figures
(:mod:`qosfs.qos.stats`), draining at shutdown and the balances handed to a successor.
:class:`QosEngine` is both: what the daemon builds, hands to the filesystem as the first
and to the control layer as the second. Nobody asks which engine it is: the engine
without a policy answers every question too, with empty or neutral values.

The engine is given a :class:`CallerWatch` at construction: who sent the request being
parked and whether its caller is being killed is FUSE's to know
(:mod:`qosfs.passthrough.interrupts`), not the engine's. Token stores (in-process
buckets, the cluster's shared caps) sit behind the engine, at
:class:`qosfs.qos.store.LevelFactory`, and change nothing here.

:class:`PassThroughQos` is the engine without a policy (``--no-qos``): every request is
counted in one flow and nothing waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import trio

from qosfs.policy.classify import CacheTimeouts
from qosfs.policy.model import PolicyError
from qosfs.qos.accounting import Accounts, FlowStats, record_latency
from qosfs.qos.stats import NO_COUNTERS, EngineCounters, EngineStatistics

if TYPE_CHECKING:
    import pyfuse3

    from qosfs.policy.model import Policy
    from qosfs.qos.explanation import Asked

# Threads one flow may occupy at once for blocking backing-store calls (fsync, network
# filesystems). Bounded per flow so that a class whose calls hang cannot take them all.
THREADS_PER_FLOW = 16


class Classified(Protocol):
    """A filesystem object (an inode) the engine keeps its last classification on.

    The QoS layer owns the value (:class:`qosfs.qos.charge.InodeCharge`); the filesystem
    only stores it (None: nothing noted yet).
    """

    qos_memo: Any


class PathSource(Protocol):
    """Where an engine that classifies by path learns an object's path
    (:class:`qosfs.passthrough.paths.PathBook`)."""

    @property
    def epoch(self) -> int:
        """Bumped by every rename through the mount: classifications before it are stale."""

    def relpath_until(self, node: Any, /) -> tuple[str, float]:
        """*node*'s path relative to the mount root, and until when (monotonic) it is
        trusted without asking the kernel again."""


class Flow(Protocol):
    """What an open file's traffic is charged to; chosen once at open."""

    limited: bool  # False: admit_* would never wait, so the hot path skips the call
    threads: trio.CapacityLimiter  # worker threads this flow may use for blocking calls
    stats: FlowStats  # traffic counters and latency histograms (qosfs.qos.accounting)
    open_files: int  # files open through it now (the engine forgets flows at 0)

    @property
    def throttled_writes(self) -> bool:
        """Whether a cap bounds its writes now (their large ones then use a thread)."""

    def reads_capped(self) -> bool:
        """Whether a level caps its reads now (then nothing is read before it admits)."""
        ...

    @property
    def class_name(self) -> str: ...  # the class it is charged to (logs, per-class counts)

    @property
    def uid(self) -> int | None:
        """The uid whose opens it charges; None for a flow every user shares (whose
        reads the kernel served are then all its own: qosfs.passthrough.read_counting)."""

    def passes_reads_through(self) -> bool:
        """Whether a read-only open made now may be passed through to the kernel."""
        ...

    def direct_io_for(self, accmode: int) -> bool: ...  # bypass the page cache for an open

    async def admit_read(self, nbytes: int) -> float: ...  # returns seconds waited

    async def admit_write(self, nbytes: int) -> float: ...

    def refund_read(self, nbytes: int) -> None: ...

    def refund_write_op(self) -> None:
        """Give back the op (charged and counted) of a request that only finishes a
        caller's write the kernel split (:mod:`qosfs.qos.charge`)."""

    def read_done(self, asked: int, nbytes: int, waited: float, backend_ns: int) -> None:
        """After a read of *asked* bytes that returned *nbytes*, waited *waited* s and
        took *backend_ns* at the backing store: counted, and what a short read (EOF)
        did not transfer given back. The one call of the read path after the syscall."""


# What the filesystem does with a getxattr (QosEngine.getxattr_admission).
XATTR_CANARY = 0  # the latency canary's own: answered ENODATA, no syscall, not charged
XATTR_FREE = 1  # not the caller's metadata operation: not charged
XATTR_CHARGED = 2  # admitted as a metadata operation of the caller


class FilesystemQos(Protocol):
    """What the filesystem asks of the QoS machinery.

    ``paths`` is where an engine that classifies by path reads it (a
    :class:`PathSource`); the filesystem keeps it informed of the names it sees (lookup,
    create) only when ``needs_paths`` is set. ``node`` is the object asked about.
    """

    needs_paths: bool
    # Pids of the latency canary process (qosfs.qos.latency.probe fills it): their
    # getxattr of the probe's attribute is not a caller's request (getxattr_admission).
    probe_tids: set[int]

    meta_limited: bool
    meta_limiter: trio.CapacityLimiter
    # (entry_timeout, attr_timeout) for an object's path, None where the mount's options
    # apply (the Classifier's, qosfs.policy.classify.CacheTimeouts); the attribute is None when
    # nothing depends on the path.
    cache_timeouts: CacheTimeouts | None

    def open_flow(self, paths: PathSource, node: Classified, ctx: pyfuse3.RequestContext,
                  writing: bool) -> Flow:
        """The flow an open of *node* by this caller is charged to (the open's
        :class:`~qosfs.qos.charge.OpenCharge` counts it in ``open_files``)."""

    async def admit_meta(self, paths: PathSource, node: Classified,
                         ctx: pyfuse3.RequestContext) -> None: ...

    def stream_threshold(self, flow: Flow) -> int:
        """Sequential bytes after which a writable open of *flow* moves (0: never)."""

    def moved_to_streaming(self, flow: Flow) -> Flow:
        """The flow a streaming writer of *flow* continues in."""

    def charge_renamed(self, paths: PathSource, node: Classified, ctx: pyfuse3.RequestContext,
                       charged: Flow, nbytes: int) -> Flow | None:
        """Bytes written under a name that said nothing: charge them to the final name's
        class; returns its flow (None: nothing moved)."""

    # -- the filesystem's small decisions, asked once per request where they apply ------

    def getxattr_admission(self, name: bytes, pid: int) -> int:
        """What a getxattr of *name* by *pid* is: XATTR_CANARY (the latency canary's, whose
        pids the engine holds in ``probe_tids``), XATTR_FREE or XATTR_CHARGED."""

    def flow_key(self, flow: Flow) -> list[Any]:
        """What names *flow* in this engine, as plain data (JSON): an open's flow travels
        to a successor process by it (:mod:`qosfs.passthrough.transfer`)."""

    def flow_from_key(self, key: Sequence[Any]) -> Flow:
        """The flow `flow_key` named, made if need be; where the key names what this
        engine's policy lacks, the flow an open of the default class would have."""



class QosControl(Protocol):
    """What the control layer and the daemon ask of the QoS machinery: observing it,
    steering it, and shutting it down or handing it over."""

    accounts: Accounts  # every flow's FlowStats, for status and metrics

    @property
    def policy(self) -> Policy | None:
        """The policy in force; None: nothing is classified or limited (``--no-qos``)."""

    @property
    def generation(self) -> int:
        """Bumped by every swap; 0 without a policy."""

    def swap(self, policy: Policy) -> None:
        """Put *policy* in force at once (parked requests re-check against it).

        Raises:
            PolicyError: not a change this engine can make; the running policy stays.
        """

    def expire_idle_users(self, now: float) -> int:
        """Fold the per-uid accounts of users gone idle (call it about every second,
        *now* monotonic); returns how many were folded."""

    def explain(self, asked: Asked, *, pid: int, uid: int, gid: int, mountpoint: str | None,
                mount_cache: str) -> dict[str, Any] | None:
        """What the request *asked* would get here (:func:`qosfs.qos.explanation.explain`);
        None when nothing is classified on this mount.

        Raises:
            ValueError: the path is not in the mount.
        """

    def statistics(self) -> EngineStatistics:
        """A frozen snapshot of every level's counters and limits (none without a policy)."""

    def counters(self) -> EngineCounters:
        """The engine's own counters: streaming moves, rename charges, per-uid series,
        the parked count."""

    def drain(self) -> None:
        """Shutdown: let every parked request through now (they are delayed, never dropped)."""

    def export_balances(self, to_monotonic: float) -> list[list[Any]]:
        """The buckets' balances, on ``time.monotonic()`` (a successor takes them over)."""

    def import_balances(self, balances: list[list[Any]], to_trio: float) -> int:
        """Put `export_balances`' figures in force, inside a trio run."""


class QosEngine(FilesystemQos, QosControl, Protocol):
    """A whole engine, both faces: what the daemon builds and holds, and hands to the
    filesystem as a :class:`FilesystemQos` and to the control layer as a
    :class:`QosControl` (:class:`qosfs.qos.engine.PolicyQos`, :class:`PassThroughQos`)."""


class Caller(Protocol):
    """Who sent a request that must park (:meth:`CallerWatch.current_caller`)."""

    @property
    def uid(self) -> int:
        """The caller's uid (who is charged the parked request's bounds)."""


class CallerWatch(Protocol):
    """What the engine may learn of the request being admitted, from the layer that
    receives it: who sent it, and a cancel scope that ends its wait if its caller dies.
    Asked only on the slow path, when a request must park."""

    def current_caller(self, nbytes: int) -> Caller | None:
        """The caller of the read/write of *nbytes* whose handler runs now (None: not
        known). Must be called before the handler's first checkpoint."""

    def cancelled_if_killed(self, caller: Caller | None) -> AbstractContextManager[object]:
        """A cancel scope cancelled when *caller* is being killed (never, for None)."""


class NoCallerWatch:
    """The :class:`CallerWatch` of an engine off a mount (tests, benchmarks): no caller is
    known, so a parked request is charged to its opener and never cancelled."""

    def current_caller(self, nbytes: int) -> Caller | None:
        return None

    def cancelled_if_killed(self, caller: Caller | None) -> AbstractContextManager[object]:
        return trio.CancelScope()


NO_CALLER_WATCH = NoCallerWatch()


class CountingFlow:
    """A flow that never waits and only counts (the traffic of a mount without policy)."""

    __slots__ = ("limited", "name", "open_files", "stats", "threads")

    throttled_writes = False  # nothing is ever capped without a policy
    uid = None  # every user's

    def __init__(self, name: str, stats: FlowStats | None = None) -> None:
        self.name = name
        self.limited = False
        self.threads = trio.CapacityLimiter(THREADS_PER_FLOW)
        self.stats = stats if stats is not None else FlowStats()
        self.open_files = 0

    def __repr__(self) -> str:
        return f"CountingFlow({self.name!r}, {self.stats!r}, open={self.open_files})"

    @property
    def class_name(self) -> str:
        return self.name

    def passes_reads_through(self) -> bool:
        return False  # no policy (--no-qos): every read is counted by the daemon

    def reads_capped(self) -> bool:
        return False

    def direct_io_for(self, accmode: int) -> bool:
        return False

    async def admit_read(self, nbytes: int) -> float:
        return 0.0

    async def admit_write(self, nbytes: int) -> float:
        return 0.0

    def refund_read(self, nbytes: int) -> None:
        return None

    def refund_write_op(self) -> None:
        self.stats.write_ops -= 1

    def read_done(self, asked: int, nbytes: int, waited: float, backend_ns: int) -> None:
        # Nothing was charged: only counted (FlowStats.record_read, inlined).
        stats = self.stats
        stats.read_bytes += nbytes
        stats.read_ops += 1
        record_latency(stats.read_backend, stats.read_latency, backend_ns, waited)
        if stats.read_fine is not None:
            stats.read_fine.observe(backend_ns)


class PassThroughQos:
    """The engine without a policy: one counting flow, no waiting anywhere."""

    meta_limited = False
    needs_paths = False  # nothing is classified
    policy: Policy | None = None
    generation = 0
    cache_timeouts: CacheTimeouts | None = None  # the mount's --attr-timeout for everything

    def __init__(self) -> None:
        self.accounts = Accounts()
        self.flow = CountingFlow("default", self.accounts.get("default", None, None))
        self.meta_limiter = trio.CapacityLimiter(THREADS_PER_FLOW)
        self.probe_tids: set[int] = set()  # no latency canary runs without a policy

    def open_flow(self, paths: PathSource, node: Classified, ctx: pyfuse3.RequestContext,
                  writing: bool) -> CountingFlow:
        return self.flow

    async def admit_meta(self, paths: PathSource, node: Classified,
                         ctx: pyfuse3.RequestContext) -> None:
        return None

    def stream_threshold(self, flow: Flow) -> int:
        return 0  # nothing is classified, so nothing moves

    def moved_to_streaming(self, flow: Flow) -> Flow:
        return flow

    def charge_renamed(self, paths: PathSource, node: Classified, ctx: pyfuse3.RequestContext,
                       charged: Flow, nbytes: int) -> Flow | None:
        return None

    def drain(self) -> None:
        return None

    def getxattr_admission(self, name: bytes, pid: int) -> int:
        return XATTR_FREE  # nothing is charged without a policy

    def flow_key(self, flow: Flow) -> list[Any]:
        return []  # one flow

    def flow_from_key(self, key: Sequence[Any]) -> Flow:
        return self.flow

    def export_balances(self, to_monotonic: float) -> list[list[Any]]:
        return []  # nothing is capped

    def import_balances(self, balances: list[list[Any]], to_trio: float) -> int:
        return 0

    def swap(self, policy: Policy) -> None:
        raise PolicyError("this mount has no policy (mounted with --no-qos); remount with "
                          "a policy to change limits", source=policy.source)

    def expire_idle_users(self, now: float) -> int:
        return 0  # every byte is counted in one uid-less account

    def explain(self, asked: Asked, *, pid: int, uid: int, gid: int, mountpoint: str | None,
                mount_cache: str) -> dict[str, Any] | None:
        return None

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(generation=0, classes={}, users={}, tenants={}, backend=None)

    def counters(self) -> EngineCounters:
        return NO_COUNTERS
