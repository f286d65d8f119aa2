"""The engine's two faces: both engines answer every question of FilesystemQos and
QosControl (together QosEngine), with typed figures; the engine without a policy answers
with neutral values instead of being asked which engine it is."""

from __future__ import annotations

import inspect
import time
from typing import Any

import pytest
import trio

from qosfs.policy.loading import parse_policy
from qosfs.policy.model import PolicyError
from qosfs.qos.engine import PolicyQos
from qosfs.qos.explanation import Asked
from qosfs.qos.interface import FilesystemQos, PassThroughQos, QosControl, QosEngine
from qosfs.qos.stats import NO_COUNTERS, AutoCaps, EngineCounters, EngineStatistics
from tests.mock_clock import mock_clock
from tests.unit.qos.test_engine import POLICY, open_charge

MiB = 1 << 20


def members(*protocols: type) -> dict[str, Any]:
    """What *protocols* declare: their methods and properties, and their annotated
    attributes (None for those)."""
    declared: dict[str, Any] = {}
    for protocol in protocols:
        declared.update(dict.fromkeys(protocol.__annotations__))
        for name, value in vars(protocol).items():
            if not name.startswith("_"):
                declared[name] = value
    return declared


#: A whole engine: what the filesystem asks, and what control and the daemon ask.
ENGINE_FACES = (FilesystemQos, QosControl)


def engines() -> list[Any]:
    return [PolicyQos(parse_policy(POLICY)), PassThroughQos()]


def test_the_protocol_declares_what_control_and_the_filesystem_ask() -> None:
    declared = members(*ENGINE_FACES)
    # What the daemon and the control layer used to reach by isinstance or getattr.
    assert {"policy", "generation", "swap", "expire_idle_users", "explain", "statistics",
            "counters", "drain", "accounts", "open_flow", "admit_meta"} <= set(declared)
    # Each face is asked by its own clients: the filesystem by one, control by the other.
    assert {"open_flow", "admit_meta", "charge_renamed", "flow_key", "cache_timeouts"} \
        <= set(members(FilesystemQos))
    assert {"policy", "swap", "explain", "statistics", "drain", "export_balances"} \
        <= set(members(QosControl))
    assert not set(members(FilesystemQos)) & set(members(QosControl))
    assert set(QosEngine.__mro__) >= set(ENGINE_FACES)  # what the daemon holds: both


@pytest.mark.parametrize("engine", engines(), ids=lambda e: type(e).__name__)
def test_both_engines_answer_every_member_with_the_protocols_signature(engine: Any) -> None:
    for name, declared in members(*ENGINE_FACES).items():
        assert hasattr(engine, name), f"{type(engine).__name__} lacks {name}"
        if inspect.isfunction(declared):
            wanted = list(inspect.signature(declared).parameters)[1:]  # without self
            got = list(inspect.signature(getattr(engine, name)).parameters)
            assert got == wanted, (name, got, wanted)


def test_the_engine_without_a_policy_answers_with_neutral_values() -> None:
    engine = PassThroughQos()
    assert engine.policy is None and engine.generation == 0
    assert engine.expire_idle_users(time.monotonic()) == 0
    assert engine.explain(Asked("x"), pid=1, uid=0, gid=0, mountpoint=None,
                          mount_cache="auto") is None
    assert engine.statistics() == EngineStatistics(0, {}, {}, {}, None)
    assert engine.counters() == NO_COUNTERS
    with pytest.raises(PolicyError, match="no policy"):
        engine.swap(parse_policy(POLICY))
    engine.drain()  # nothing parked, nothing to lift


@mock_clock
async def test_the_policy_engine_reports_typed_statistics_and_its_own_counters() -> None:
    engine = PolicyQos(parse_policy(POLICY))
    flow = open_charge(engine, "shared/x", uid=501).flow
    await flow.admit_write(MiB)
    engine.set_auto_caps("ckpt", AutoCaps(write_bandwidth=5 * MiB))
    stats = engine.statistics()
    assert isinstance(stats, EngineStatistics) and stats.generation == 1
    assert stats.classes["shared"].bytes_written == MiB
    assert list(stats.users["shared"]) == [501]  # the active user's share
    assert stats.tenants["team"].bytes_written == MiB
    assert stats.backend is not None and stats.backend.bytes_written == MiB
    assert stats.auto_caps == {"ckpt": AutoCaps(write_bandwidth=5 * MiB)}
    counters = engine.counters()
    assert isinstance(counters, EngineCounters)
    assert counters.user_accounts == 1  # uid 501's series of its own (per_user class)
    assert (counters.parked_requests, counters.parked_bytes, counters.parking_refused) \
        == (0, 0, 0)
    assert engine.open_classes() == {"shared"}


@mock_clock
async def test_counters_follow_what_the_engine_does() -> None:
    engine = PolicyQos(parse_policy(POLICY))
    charge = open_charge(engine, "ckpt/x")
    writer = charge.flow
    await writer.admit_write(MiB)  # the burst
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer.admit_write, 4 * MiB)  # parks: 10 MiB/s
        await trio.sleep(0.01)
        parked = engine.counters()
        assert (parked.parked_requests, parked.parked_bytes) == (1, 4 * MiB)
    assert engine.counters().parked_requests == 0
    charge.release()
    shared = open_charge(engine, "shared/x", uid=501)
    await shared.flow.admit_write(MiB)
    shared.release()
    now = time.monotonic()
    assert engine.expire_idle_users(now) == 0  # seen active now
    assert engine.expire_idle_users(now + 3600.0) == 1  # idle beyond user_series_idle
    assert engine.counters().users_expired == 1 and engine.counters().user_accounts == 0
