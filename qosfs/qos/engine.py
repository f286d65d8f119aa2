"""The QoS engine of a policy: classes, tenants, users and the backend as rate levels.

At open, a file is classified (path, uid, gid, op, job) into a class and a tenant, and
bound to a :class:`~qosfs.qos.flow.PolicyFlow`: the chain of levels it is charged to,
most specific first (user, class, tenant, backend). This module holds the engine's state
and answers both of its faces (:mod:`qosfs.qos.interface`): ``FilesystemQos``, what the
filesystem asks per open and per metadata request, and ``QosControl``, what the control
layer and the daemon ask. Each concern it has is a module of its own that it calls:

- :mod:`qosfs.qos.flow`: a flow's chain of levels, and admission through it (the hot path);
- :mod:`qosfs.qos.memo`: which flow a request gets, memoized on the inode;
- :mod:`qosfs.qos.swap`: a policy put in force whole, and open files rebound;
- :mod:`qosfs.qos.moves`: a charge moved after open (streaming writers, renames);
- :mod:`qosfs.qos.balances`: bucket balances handed to a successor.

Automatic caps (:mod:`qosfs.qos.latency`) are kept apart from the policy: the engine
holds them per class name (:meth:`PolicyQos.set_auto_caps`) and a class level enforces the
lower of its configured cap and its automatic one, so a swap or ``ctl set`` re-applies the
automatic cap at once, bounded by the new configured cap, and the policy stays what the
administrator wrote.

Every level is built through one token store, a :class:`~qosfs.qos.store.LevelFactory`
(the ``level_factory`` argument; in-process token buckets by default): class, per-user
group, tenant and backend levels alike, each with its policy ``scope``. What a store does
with a scope, and which policy changes it refuses, is its own business: a new store
needs no change here.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import trio

from qosfs.policy.classify import Classifier, JobCache
from qosfs.policy.model import Policy, stream_threshold
from qosfs.qos.accounting import AccountKey, Accounts
from qosfs.qos.backend import BackendLevel
from qosfs.qos.balances import export_balances, import_balances
from qosfs.qos.bounds import ParkedCount
from qosfs.qos.bucket import LevelLimits
from qosfs.qos.explanation import Asked, explain
from qosfs.qos.flow import ClassState, PolicyFlow
from qosfs.qos.interface import (
    NO_CALLER_WATCH,
    THREADS_PER_FLOW,
    XATTR_CANARY,
    XATTR_CHARGED,
    XATTR_FREE,
    CallerWatch,
    Classified,
    Flow,
    PathSource,
)
from qosfs.qos.latency.probe import PROBE_XATTR
from qosfs.qos.levels import Level
from qosfs.qos.memo import Classification
from qosfs.qos.moves import move_written, streaming_flow
from qosfs.qos.stats import NO_AUTO_CAPS, AutoCaps, EngineCounters, EngineStatistics
from qosfs.qos.store import LevelFactory, local_level
from qosfs.qos.swap import backend_level, class_states, rebind, retire, tenant_levels

if TYPE_CHECKING:
    import pyfuse3

log = logging.getLogger(__name__)

_CAPABILITY_XATTR = b"security.capability"


class PolicyQos:
    """The QoS engine for a policy (implements :class:`qosfs.qos.interface.QosEngine`:
    both :class:`~qosfs.qos.interface.FilesystemQos` and
    :class:`~qosfs.qos.interface.QosControl`)."""

    needs_paths = True  # classes and tenants match path globs

    def __init__(self, policy: Policy, level_factory: LevelFactory = local_level,
                 callers: CallerWatch = NO_CALLER_WATCH) -> None:
        self.level_factory = level_factory  # builds every class, user, tenant, backend level
        # Who sends a parked request, and whether it is being killed: the mount's FUSE
        # introspection (qosfs.passthrough.interrupts); nobody, off a mount.
        self.callers = callers
        self.meta_limiter = trio.CapacityLimiter(THREADS_PER_FLOW)
        self.classes: dict[str, ClassState] = {}
        self.tenants: dict[str, Level] = {}
        self.backend: BackendLevel | None = None
        self._flows: dict[tuple[str, str | None, int], PolicyFlow] = {}
        self._all_flows: weakref.WeakSet[PolicyFlow] = weakref.WeakSet()
        self._jobs = JobCache()
        self.accounts = Accounts()  # traffic counters per (class, tenant, uid), for metrics
        self.users_expired = 0  # uid accounts folded into their class after going idle
        self._next_sweep = 0.0
        self.auto_caps: dict[str, AutoCaps] = {}  # by class name; see set_auto_caps()
        self.draining = False
        self.generation = 0
        self.parking = ParkedCount()  # bounds on requests waiting for tokens (qosfs.qos.bounds)
        self.policy = policy  # swap() replaces it; set first so swap() can compare
        self.stream_moves: dict[str, int] = {}  # opens moved as streaming writers, by class
        self.rename_charges: dict[str, int] = {}  # bytes charged at a rename, by class
        # Pids of the latency canary (qosfs.qos.latency.probe fills it while it runs).
        self.probe_tids: set[int] = set()
        self.swap(policy)

    # ------------------------------------------------------------------ policy swap

    def check_swap(self, policy: Policy) -> None:
        """PolicyError if `swap` would refuse *policy* (settings the token store was built
        from); callable outside the event loop, which `swap` is not (a successor checks
        the policy ``qosfs mount --policy`` names before its predecessor stops reading)."""
        self.level_factory.check_swap(self.policy, policy)

    def swap(self, policy: Policy) -> None:
        """Put *policy* in force at once; parked requests re-check against it
        (:mod:`qosfs.qos.swap`).

        Raises:
            PolicyError: the token store refuses the change (settings it was built from,
                which take effect only when a mount starts); the running policy stays.
        """
        if self.generation:
            self.check_swap(policy)
        classifier = Classifier(policy)
        factory = self.level_factory
        classes = class_states(policy, self.classes, self.auto_caps, factory)
        tenants = tenant_levels(policy, self.policy, self.tenants, factory)
        backend = backend_level(policy, self.backend, factory)
        old_classes, old_tenants = self.classes, self.tenants
        self.policy = policy
        self._streaming = policy.streaming_target  # the class streaming writers move to
        self.classes, self.tenants, self.backend = classes, tenants, backend
        self.meta_limited = policy.meta_limited
        self.cache_timeouts = classifier.cache_timeouts  # decided where classes are
        rebind(list(self._all_flows), classes, tenants, backend)
        retire(old_classes, classes, old_tenants, tenants)
        self._flows = {k: f for k, f in self._flows.items() if classes.get(k[0]) is f.cls}
        self.accounts.retain(self._account_in_policy)
        for key in self.accounts.set_user_series(policy.exported.user_series):
            self._fold(key)
        self.auto_caps = {k: v for k, v in self.auto_caps.items() if k in classes}
        self.generation += 1
        self.classification = Classification(policy, classifier, self.generation,
                                              self._jobs, self._flow)
        log.info("policy generation %d in force (%d classes, %d tenants, from %s)",
                 self.generation, len(classes), len(tenants), policy.source)

    def _account_in_policy(self, key: AccountKey) -> bool:
        """Keep the accounts of every class and tenant still in the policy. Those of the
        other per_user setting stay too (no longer fed): dropping them made a class's
        recorded bytes vanish from stats and /metrics at every per_user toggle."""
        cls, tenant, _ = key
        return cls in self.classes and (tenant is None or tenant in self.tenants)

    def _fold(self, key: AccountKey) -> bool:
        """Fold a uid's account into its class's uid-less one; flows that counted into it
        count there from now on (qosfs.qos.accounting: no series goes backwards)."""
        folded = self.accounts.fold(key)
        if folded is None:
            return False
        old, into = folded
        for flow in list(self._all_flows):
            if flow.stats is old:
                flow.stats = into
        return True

    def expire_idle_users(self, now: float) -> int:
        """Fold the accounts of uids idle for the policy's ``user_series_idle`` with no
        file open, and forget cached flows with no open file (a later open makes a new
        one, with a fresh per-uid account if the class has room). Call it often (every
        second); it does its work at most every quarter of the idle time (1 s..60 s).
        Returns how many uids were folded."""
        if now < self._next_sweep:
            return 0
        idle_after = self.policy.exported.user_series_idle
        self._next_sweep = now + min(max(idle_after / 4, 1.0), 60.0)
        for state in self.classes.values():  # fair-share levels of users gone quiet
            if state.group is not None:
                state.group.expire()
        busy = {id(flow.stats) for flow in self._all_flows if flow.open_files > 0}
        folded = 0
        for key in self.accounts.idle_uids(now, idle_after):
            stats = self.accounts.get(*key)
            if id(stats) not in busy and self._fold(key):
                folded += 1
        self._flows = {k: f for k, f in self._flows.items() if f.open_files > 0}
        self.users_expired += folded
        return folded

    def drain(self) -> None:
        """Lift every limit at once: the daemon is shutting down.

        Throttling delays, it never drops: a request parked for tokens when SIGTERM
        arrives is still served, and it is served now rather than at the cap's pace, so a
        deep queue of checkpoint writes does not hold the unmount for minutes.
        """
        self.draining = True  # no automatic cap may come back (qosfs.qos.latency)
        for state in self.classes.values():
            state.set_limits(LevelLimits())
        for level in self.tenants.values():
            level.set_limits(LevelLimits())
        if self.backend is not None:
            self.backend.set_limits(LevelLimits())

    def getxattr_admission(self, name: bytes, pid: int) -> int:
        """The canary's getxattr of the probe attribute is answered at once (only its round
        trip matters). The kernel itself asks for security.capability before every write
        (to know whether the write must drop file capabilities): not the caller's
        metadata operation, so not charged (a meta_iops cap would throttle its writes)."""
        if name == PROBE_XATTR and pid in self.probe_tids:
            return XATTR_CANARY
        return XATTR_FREE if name == _CAPABILITY_XATTR else XATTR_CHARGED

    def set_auto_caps(self, name: str, caps: AutoCaps) -> bool:
        """Put the latency controller's caps for class *name* in force (parked requests
        re-check at once); the configured caps still bound them. Returns whether anything
        changed (unknown class, same caps, or shutting down: nothing)."""
        state = self.classes.get(name)
        if state is None or self.draining or state.auto == caps or state.rule.scope != "node":
            return False  # a level shared beyond this mount is its store's to steer
        if caps == NO_AUTO_CAPS:
            self.auto_caps.pop(name, None)
        else:
            self.auto_caps[name] = caps
        state.update(state.rule, caps)
        return True

    # ------------------------------------------------------------------ flows

    def _flow(self, cls: str, tname: str | None, uid: int) -> PolicyFlow:
        """The flow of (class, tenant, uid), made if need be: one per those three."""
        key = (cls, tname, uid)
        flow = self._flows.get(key)
        if flow is None:
            flow = PolicyFlow(self.classes[cls], self.tenants.get(tname) if tname else None,
                              self.backend, uid, tname, self.accounts, self.parking,
                              self.callers)
            self._flows[key] = flow
            self._all_flows.add(flow)
        return flow

    def open_flow(self, paths: PathSource, node: Classified, ctx: pyfuse3.RequestContext,
                  writing: bool) -> PolicyFlow:
        return self.classification.flow(paths, node, ctx, "write" if writing else "read")

    async def admit_meta(self, paths: PathSource, node: Classified,
                         ctx: pyfuse3.RequestContext) -> None:
        await self.classification.flow(paths, node, ctx, "meta").admit_meta()

    def flow_key(self, flow: Flow) -> list[Any]:
        """[class, tenant or None, uid]: a flow is one per those three (`_flow`)."""
        assert isinstance(flow, PolicyFlow)  # this engine's open_flow made it
        return [flow.cls.rule.name, flow.tenant_name, flow.uid]

    def flow_from_key(self, key: Sequence[Any]) -> PolicyFlow:
        """The flow of [class, tenant, uid], made if need be (counting nothing: the open
        that comes with it counts itself). A class or tenant this policy lacks gives way
        to the default class or no tenant, as a policy swap rebinds flows."""
        name, tenant, uid = str(key[0]), key[1], int(key[2])
        if name not in self.classes:
            name = "default"
        if tenant is not None and tenant not in self.tenants:
            tenant = None
        return self._flow(name, None if tenant is None else str(tenant), uid)

    # ------------------------------------------------------------------ moves after open

    def stream_threshold(self, flow: Flow) -> int:
        """Bytes of mostly sequential writes after which a writable open of *flow* moves
        to the streaming class (:mod:`qosfs.qos.moves`); 0: never (no such class, or
        *flow*'s class caps writes itself or is that class)."""
        assert isinstance(flow, PolicyFlow)  # this engine's open_flow made it
        return stream_threshold(flow.cls.rule, self._streaming)

    def moved_to_streaming(self, flow: Flow) -> PolicyFlow:
        """The flow an open of *flow* continues in once it is seen streaming; counts the
        move by the class it leaves."""
        assert isinstance(flow, PolicyFlow)
        target = streaming_flow(flow, self._streaming, self.classes, self._flow)
        if target is None:
            return flow
        name = flow.cls.rule.name
        self.stream_moves[name] = self.stream_moves.get(name, 0) + 1
        return target

    def charge_renamed(self, paths: PathSource, node: Classified, ctx: pyfuse3.RequestContext,
                       charged: Flow, nbytes: int) -> PolicyFlow | None:
        """*node* was renamed; *nbytes* were written to it through *charged* (an uncapped
        class). If writes under its new name belong to a capped class, move the charge
        there now (:func:`qosfs.qos.moves.move_written`). Returns that flow (for the
        file's open handles), or None."""
        assert isinstance(charged, PolicyFlow)
        flow = self.classification.flow(paths, node, ctx, "write")
        if not move_written(flow, charged, nbytes):
            return None
        name = flow.cls.rule.name
        self.rename_charges[name] = self.rename_charges.get(name, 0) + nbytes
        return flow

    # ------------------------------------------------------------------ handover

    def export_balances(self, to_monotonic: float) -> list[list[Any]]:
        """What each limited bucket of this mount's levels holds, for a process that takes
        the mount over or a new event loop (:mod:`qosfs.qos.balances`)."""
        return export_balances(self.classes, self.tenants, to_monotonic)

    def import_balances(self, balances: list[list[Any]], to_trio: float) -> int:
        """Put `export_balances`' figures in force, inside a trio run; returns how many
        buckets took one."""
        return import_balances(self.classes, self.tenants, balances, to_trio)

    # ------------------------------------------------------------------ observation

    def statistics(self) -> EngineStatistics:
        """Every level's counters and limits in force, and the latency controller's caps."""
        users = {
            name: {uid: lvl.statistics() for uid, lvl in st.group.children.items()}
            for name, st in self.classes.items() if st.group is not None
        }
        return EngineStatistics(
            generation=self.generation,
            classes={name: st.level.statistics() for name, st in self.classes.items()},
            users=users,
            tenants={name: lvl.statistics() for name, lvl in self.tenants.items()},
            backend=self.backend.statistics() if self.backend is not None else None,
            auto_caps=dict(self.auto_caps),
        )

    def counters(self) -> EngineCounters:
        """This engine's own counters (what ``ctl status`` shows beside the levels)."""
        parking = self.parking
        return EngineCounters(
            streaming_moves=dict(self.stream_moves),
            rename_charged_bytes=dict(self.rename_charges),
            user_accounts=self.accounts.uid_keys, users_expired=self.users_expired,
            parked_requests=parking.requests, parked_bytes=parking.bytes,
            parking_refused=parking.refused)

    def open_classes(self) -> set[str]:
        """The classes with a file open through them now (the latency controller runs its
        canary only while a class it protects has one)."""
        return {flow.cls.rule.name for flow in list(self._all_flows) if flow.open_files > 0}

    def explain(self, asked: Asked, *, pid: int, uid: int, gid: int, mountpoint: str | None,
                mount_cache: str) -> dict[str, Any]:
        """What *asked* gets under the policy in force, with the limits in force here
        (:func:`qosfs.qos.explanation.explain`)."""
        return explain(self.classification.classifier, asked, pid=pid, uid=uid, gid=gid,
                       mountpoint=mountpoint, live=self.statistics(), mount_cache=mount_cache)
