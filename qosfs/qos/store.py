"""Token stores: where the engine gets every level it charges, and the per-user split.

The engine (:class:`qosfs.qos.engine.PolicyQos`, its ``level_factory``) builds every class,
per-user, tenant and backend level through a :class:`LevelFactory` and knows nothing else
of the store, so a new store (:class:`qosfs.qos.cluster.ClusterCoordinator` shares levels
between mounts) is a new implementation here, not an edit of the engine or of admission.
A ``per_user`` class is a :class:`FairShareGroup` that a store builds: which users count
is the store's business too (a cluster one counts them on every mount).

Kept apart from :mod:`qosfs.qos.levels` (what a level is and how a request is admitted at
a chain of them): nothing here runs per request, except :meth:`FairShareGroup.level_for`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

import trio

from qosfs.policy.model import PolicyError
from qosfs.qos.bucket import NO_LIMITS, LevelLimits
from qosfs.qos.levels import Level, RateLevel

if TYPE_CHECKING:
    from qosfs.policy.model import Policy

__all__ = ["FairShareGroup", "LevelFactory", "LocalLevels", "local_level"]

_INF = math.inf

class LevelFactory(Protocol):
    """A token store: where the engine gets every level it charges.

    The engine (:class:`qosfs.qos.engine.PolicyQos`, its ``level_factory``) builds every
    class, per-user, tenant and backend level through one of these and knows nothing else
    of the store: a new store is a new implementation of this protocol, not an edit of the
    engine. :data:`local_level` keeps buckets in this daemon's memory;
    :class:`qosfs.qos.cluster.ClusterCoordinator` shares ``scope = "cluster"`` levels
    between mounts.
    """

    def __call__(self, name: str, limits: LevelLimits, scope: str = "node") -> Level:
        """A level named *name* (a class, a tenant, a user's share, the backend) holding
        *limits* over *scope*; ValueError for a scope this store cannot hold."""

    def fair_share(self, name: str, limits: LevelLimits, scope: str = "node") -> FairShareGroup:
        """A ``per_user`` class: *limits* split equally among its active users (the store
        decides how users beyond this mount count, for a scope that spans mounts)."""

    def check_swap(self, running: Policy, new: Policy) -> None:
        """Refuse a policy swap that changes what this store was set up from.

        Raises:
            PolicyError: such settings take effect only when a mount starts.
        """


class LocalLevels:
    """The in-process :class:`LevelFactory`: token buckets in this daemon's memory, for
    ``scope = "node"`` only."""

    def __call__(self, name: str, limits: LevelLimits = NO_LIMITS,
                 scope: str = "node") -> Level:
        if scope != "node":
            raise ValueError(f"a {scope!r} level needs a coordinator (qosfs.qos.cluster)")
        return RateLevel(name, limits)

    def fair_share(self, name: str, limits: LevelLimits, scope: str = "node") -> FairShareGroup:
        return FairShareGroup(name, limits, factory=self, scope=scope)

    def check_swap(self, running: Policy, new: Policy) -> None:
        """A ``[cluster]`` table chooses the store when the mount starts (the daemon builds
        a coordinator for it), so a swap may not add, change or drop one."""
        if new.cluster != running.cluster:
            raise PolicyError("[cluster] settings take effect when the mount starts: "
                              "remount to change them", source=new.source, key="cluster")

    def __repr__(self) -> str:
        return "<LocalLevels>"


#: The in-process store, the engine's default.
local_level = LocalLevels()


class FairShareGroup:
    """A class level whose limits are split equally among its currently active users.

    ``parent`` carries the class's full limits and caps the total; each active uid gets a
    child level with ``parent.limits / active_users``. The split is work-conserving at the
    granularity of activity: a user is active while it has a request parked at its level
    or made one within ``idle_after`` seconds; when it goes idle its share is re-split
    among the others (by ``set_limits``, which wakes their waiters), and when a new user
    arrives everybody's share shrinks. Idle children are dropped (memory stays bounded by
    the users active at once; per-user counters restart, the parent's are authoritative).

    Expiry is lazy -- checked when :meth:`level_for` is called and the earliest possible
    expiry has passed -- so no background task is needed; a scheduler may also call
    :meth:`expire` from a periodic tick.

    Charge a request at ``[group.level_for(uid), group.parent, <tenant>, <backend>]``.
    """

    __slots__ = ("_children", "_factory", "_next_expiry", "_seen", "idle_after", "parent")

    def __init__(
        self, name: str, limits: LevelLimits = NO_LIMITS, *, idle_after: float = 2.0,
        factory: LevelFactory = local_level, scope: str = "node",
    ) -> None:
        if not idle_after > 0.0:
            raise ValueError(f"idle_after must be > 0, got {idle_after!r}")
        self._factory = factory
        self.parent = factory(name, limits, scope)  # users' own levels are always local
        self.idle_after = idle_after
        self._children: dict[int, Level] = {}
        self._seen: dict[int, float] = {}
        self._next_expiry = _INF

    @property
    def children(self) -> dict[int, Level]:
        """The active users' levels by uid (a copy)."""
        return dict(self._children)

    def set_limits(self, limits: LevelLimits) -> None:
        """Change the class limits live and re-split them among the active users."""
        self.parent.set_limits(limits)
        self.resplit()

    def level_for(self, uid: int) -> Level:
        """The level of ``uid``, created (and shares re-split) if the user was idle.

        Call it once per request: it also records the user's activity.
        """
        now = trio.current_time()
        if now >= self._next_expiry:
            self._expire(now)
        child = self._children.get(uid)
        if child is None:
            share = self.parent.limits.scaled(1.0 / (len(self._children) + 1))
            child = self._factory(f"{self.parent.name}/uid={uid}", share)
            self._children[uid] = child
            self.resplit()
            self._next_expiry = min(self._next_expiry, now + self.idle_after)
        self._seen[uid] = now
        return child

    def expire(self) -> int:
        """Drop the users idle for ``idle_after`` seconds now; return how many went."""
        return self._expire(trio.current_time())

    def _expire(self, now: float) -> int:
        cutoff = now - self.idle_after
        idle = []
        for uid, seen in self._seen.items():
            if seen <= cutoff:
                if self._children[uid].queue_depth:
                    self._seen[uid] = now  # parked requests keep a user active
                else:
                    idle.append(uid)
        for uid in idle:
            del self._children[uid], self._seen[uid]
        if idle:
            self.resplit()
        self._next_expiry = min(self._seen.values(), default=_INF) + self.idle_after
        return len(idle)

    def resplit(self) -> None:
        """Give each active user an equal part of the parent's limits in force now."""
        if self._children:
            share = self.parent.limits.scaled(1.0 / len(self._children))
            for child in self._children.values():
                child.set_limits(share)

    def __repr__(self) -> str:
        return f"<FairShareGroup {self.parent.name!r} active_users={len(self._children)}>"
