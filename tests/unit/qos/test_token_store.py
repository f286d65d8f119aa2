"""The token-store seam: a store plugs into the engine through LevelFactory alone.

A third store, written here and nowhere else, holds levels of any scope in-process and
records what the engine asks of it. The engine builds every class, per-user, tenant and
backend level through it, charges exactly those levels, rebuilds one when its scope
changes, and leaves it to the store to refuse a swap; no line of the engine knows it."""

from __future__ import annotations

import pytest
import trio

from qosfs.policy.loading import parse_policy
from qosfs.policy.model import Policy, PolicyError
from qosfs.qos.bucket import NO_LIMITS, LevelLimits
from qosfs.qos.engine import PolicyQos
from qosfs.qos.levels import Level, RateLevel
from qosfs.qos.store import FairShareGroup, local_level
from tests.mock_clock import mock_clock
from tests.unit.qos.test_engine import open_flow

MiB = 1 << 20


def policy(tenant_scope: str = "cluster", cap: str = "10MiB/s",
           redis: str = "redis://elsewhere:6379/0") -> Policy:
    return parse_policy(f"""
[cluster]
redis = "{redis}"

[backend]
write_bandwidth = "100MiB/s"

[tenants.team]
uids = ["500-599"]
scope = "{tenant_scope}"
write_bandwidth = "30MiB/s"

[classes.ckpt]
paths = ["ckpt/**"]
scope = "cluster"
per_user = "fair"
write_bandwidth = "{cap}"
burst = "1MiB"
""")


class CountingStore:
    """In-process levels of every scope, each recorded with the scope asked for."""

    def __init__(self) -> None:
        self.levels: dict[str, tuple[str, Level]] = {}  # name -> (scope, latest level)
        self.groups: list[tuple[str, str]] = []
        self.swaps: list[tuple[Policy, Policy]] = []

    def __call__(self, name: str, limits: LevelLimits = NO_LIMITS,
                 scope: str = "node") -> Level:
        level = RateLevel(name, limits)
        self.levels[name] = (scope, level)
        return level

    def fair_share(self, name: str, limits: LevelLimits, scope: str = "node") -> FairShareGroup:
        self.groups.append((name, scope))
        return FairShareGroup(name, limits, factory=self, scope=scope)

    def check_swap(self, running: Policy, new: Policy) -> None:
        self.swaps.append((running, new))
        if new.cluster != running.cluster:
            raise PolicyError("this store was set up for another [cluster]", key="cluster")


@mock_clock
async def test_the_engine_builds_and_charges_every_level_through_the_store() -> None:
    store = CountingStore()
    engine = PolicyQos(policy(), level_factory=store)
    assert {name: scope for name, (scope, _) in store.levels.items()} == {
        "ckpt": "cluster", "default": "node", "tenant:team": "cluster", "backend": "node"}
    assert store.groups == [("ckpt", "cluster")]  # the per-user split is the store's too
    flow = open_flow(engine, "ckpt/x", uid=501)
    await flow.admit_write(MiB)
    assert store.levels["ckpt/uid=501"][0] == "node"  # a user's share, built on demand
    for name in ("ckpt/uid=501", "ckpt", "tenant:team", "backend"):
        assert store.levels[name][1].bytes_written == MiB, name
    start = trio.current_time()
    for _ in range(5):  # the store's levels pace them: 10 MiB/s once the burst is spent
        await flow.admit_write(MiB)
    assert trio.current_time() - start == pytest.approx(0.5)


@mock_clock
async def test_a_swap_keeps_the_stores_levels_rebuilds_on_a_new_scope_and_asks_the_store(
        ) -> None:
    store = CountingStore()
    engine = PolicyQos(policy(), level_factory=store)
    assert store.swaps == []  # the first policy is the one the store was set up from
    ckpt, tenant = store.levels["ckpt"][1], store.levels["tenant:team"][1]
    engine.swap(policy(cap="20MiB/s"))
    assert store.levels["ckpt"][1] is ckpt and ckpt.limits.write_bytes.rate == 20 * MiB
    assert store.levels["tenant:team"][1] is tenant
    engine.swap(policy(tenant_scope="node"))
    scope, rebuilt = store.levels["tenant:team"]
    assert scope == "node" and rebuilt is not tenant
    with pytest.raises(PolicyError, match="another"):
        engine.swap(policy(redis="redis://other:6379/0"))
    assert len(store.swaps) == 3 and engine.generation == 3  # the refused one changed nothing


def test_the_local_store_refuses_a_scope_it_cannot_hold_and_a_new_cluster_table() -> None:
    with pytest.raises(ValueError, match="needs a coordinator"):
        PolicyQos(policy())  # the default store: in-process, node scope only
    running = parse_policy("[classes.default]\n")
    with pytest.raises(PolicyError, match="take effect when the mount starts"):
        local_level.check_swap(running, policy())
    local_level.check_swap(running, running)
