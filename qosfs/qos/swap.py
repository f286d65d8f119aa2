"""A policy put in force whole: the levels it needs, from those running, and the flows moved.

Levels of classes and tenants that survive by name (and per-user setting and scope) keep
their bucket state and get the new limits through ``set_limits``, which wakes every
request parked there so it re-checks at once; the others are built anew through the
engine's store. Levels that left the policy are opened up (no limits), so nothing parked
there waits for ever, and open files of a class that disappeared are re-bound to
``default``, of a tenant that disappeared to no tenant.

Kept apart from the engine (:meth:`qosfs.qos.engine.PolicyQos.swap` calls these in
order) because none of it runs per request, and each step is read on its own: what
survives a swap, what is woken, what is rebound.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from qosfs.policy.model import Policy
from qosfs.qos.backend import BackendLevel
from qosfs.qos.bucket import LevelLimits
from qosfs.qos.flow import ClassState, PolicyFlow, backend_share, level_limits
from qosfs.qos.levels import Level
from qosfs.qos.stats import NO_AUTO_CAPS, AutoCaps
from qosfs.qos.store import LevelFactory

__all__ = ["backend_level", "class_states", "rebind", "retire", "tenant_levels"]


def class_states(policy: Policy, running: Mapping[str, ClassState],
                 auto_caps: Mapping[str, AutoCaps], factory: LevelFactory
                 ) -> dict[str, ClassState]:
    """The live state of every class of *policy*: a running class of the same name,
    ``per_user`` setting and scope is updated in place (its buckets go on), any other is
    built anew; the latency controller's caps stay on either."""
    classes: dict[str, ClassState] = {}
    for rule in policy.classes:
        old = running.get(rule.name)
        auto = auto_caps.get(rule.name, NO_AUTO_CAPS)
        if old is not None and old.rule.per_user == rule.per_user \
                and old.rule.scope == rule.scope:
            old.update(rule, auto)
            classes[rule.name] = old
        else:
            classes[rule.name] = ClassState(rule, auto, factory)
    return classes


def tenant_levels(policy: Policy, running_policy: Policy, running: Mapping[str, Level],
                  factory: LevelFactory) -> dict[str, Level]:
    """The level of every tenant of *policy*: a running one of the same name and scope
    gets the new limits, any other is built anew."""
    tenants: dict[str, Level] = {}
    scopes = {tenant.name: tenant.scope for tenant in running_policy.tenants}  # in force
    for tenant in policy.tenants:
        level = running.get(tenant.name)
        # Another scope is another level (the store may keep it elsewhere), as for a
        # class (class_states rebuilds a ClassState when its scope changes).
        if level is None or scopes.get(tenant.name) != tenant.scope:
            level = factory(f"tenant:{tenant.name}", level_limits(tenant.limits),
                            tenant.scope)
        else:
            level.set_limits(level_limits(tenant.limits))
        tenants[tenant.name] = level
    return tenants


def backend_level(policy: Policy, running: BackendLevel | None,
                  factory: LevelFactory) -> BackendLevel | None:
    """The declared backend of *policy* (None: none), the running one when there is one,
    with a port for every class; a backend dropped is opened up first."""
    if policy.backend is None:
        if running is not None:
            running.set_limits(LevelLimits())  # wake anything parked there
        return None
    limits = level_limits(policy.backend.limits)
    if running is None:  # built with its limits: the first swap runs before trio
        backend = BackendLevel(limits, factory)
    else:
        backend = running
        backend.set_limits(limits)
    for rule in policy.classes:
        backend.port(rule.name, backend_share(rule))
    backend.retire_ports({rule.name for rule in policy.classes})
    return backend


def rebind(flows: Iterable[PolicyFlow], classes: Mapping[str, ClassState],
           tenants: Mapping[str, Level], backend: BackendLevel | None) -> None:
    """Bind every flow to the levels now in force: its class by name (else ``default``),
    its tenant if still there (else none), the backend."""
    default = classes["default"]
    live_tenants = list(tenants.values())
    for flow in flows:
        cls = classes.get(flow.cls.rule.name)
        if flow.tenant is not None and flow.tenant not in live_tenants:
            flow.tenant = None
            flow.tenant_name = None
        flow.backend = backend
        flow.bind(cls if cls is not None else default)


def retire(old_classes: Mapping[str, ClassState], classes: Mapping[str, ClassState],
           old_tenants: Mapping[str, Level], tenants: Mapping[str, Level]) -> None:
    """Open up the levels that left the policy: anything still parked there must not
    wait for ever."""
    for name, state in old_classes.items():
        if classes.get(name) is not state:
            state.set_limits(LevelLimits())
    for name, level in old_tenants.items():
        if tenants.get(name) is not level:
            level.set_limits(LevelLimits())
