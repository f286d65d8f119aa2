"""The table of limit kinds drives every place a limit is named: policy text, the policy's
Limits, a level's buckets, what a level charges, status and metrics. Each test walks the
whole table, so a row added there is checked end to end without touching this file."""

from __future__ import annotations

import math
import pickle

import pytest
import trio

from qosfs.control.ctl import format_limits
from qosfs.control.metrics import render
from qosfs.control.snapshot import LIMIT_FIELDS, take_snapshot
from qosfs.core.limit_kinds import BURST_KEYS, LIMIT_KINDS, Kind, LimitKind, default_burst
from qosfs.policy.keys import LIMIT_KEYS
from qosfs.policy.loading import parse_policy
from qosfs.policy.model import Limits, policy_to_raw
from qosfs.qos.bucket import LevelLimits, Limit
from qosfs.qos.engine import PolicyQos
from qosfs.qos.flow import level_limits
from qosfs.qos.levels import RateLevel

KINDS = pytest.mark.parametrize("kind", LIMIT_KINDS, ids=lambda k: k.key)
RATE_TEXT = {True: '"5MiB/s"', False: "50"}
RATE = {True: 5.0 * 2**20, False: 50.0}


def _policy(kind: LimitKind) -> str:
    return f"[classes.capped]\npaths = [\"c/**\"]\n{kind.key} = {RATE_TEXT[kind.per_byte]}\n"


def test_keys_are_unique_and_every_kind_is_named_everywhere() -> None:
    assert len({k.key for k in LIMIT_KINDS}) == len({k.bucket for k in LIMIT_KINDS}) \
        == len(LIMIT_KINDS)
    assert Limits.KEYS == LIMIT_KEYS == (*(k.key for k in LIMIT_KINDS), *BURST_KEYS)
    assert tuple(k.bucket for k in LIMIT_KINDS) == LevelLimits.KEYS
    assert tuple((k.key, k.bucket) for k in LIMIT_KINDS) == LIMIT_FIELDS
    assert all(k.burst_key in BURST_KEYS for k in LIMIT_KINDS)


@KINDS
def test_a_cap_goes_from_policy_text_to_the_bucket_and_back(kind: LimitKind) -> None:
    policy = parse_policy(_policy(kind))
    limits = policy.classes[0].limits
    assert limits.get(kind.key) == RATE[kind.per_byte]
    assert [k for k, v in limits.set_items()] == [kind.key]
    buckets = level_limits(limits)
    assert buckets.get(kind.bucket) == Limit(RATE[kind.per_byte],
                                             default_burst(kind, RATE[kind.per_byte]))
    assert [k for k, _ in buckets.set_items()] == [kind.bucket]
    raw = policy_to_raw(policy)["classes"]["capped"]
    assert parse_policy(_policy(kind).replace(
        f"{kind.key} = {RATE_TEXT[kind.per_byte]}", f"{kind.key} = \"{raw[kind.key]}\"")
    ).classes[0].limits == limits


@KINDS
def test_a_level_limits_only_the_requests_a_kind_charges(kind: LimitKind) -> None:
    level = RateLevel("x", LevelLimits(**{kind.bucket: Limit(10.0, 10.0)}))
    assert level.limited == tuple(k == kind.charges for k in Kind)


@KINDS
def test_status_and_metrics_show_every_kind(kind: LimitKind) -> None:
    async def snap() -> bytes:
        qos = PolicyQos(parse_policy(_policy(kind)))
        s = take_snapshot(qos, 0.0)
        row = next(r for r in s.levels if r.name == "capped")
        assert row.limits == {kind.key: RATE[kind.per_byte]}
        assert format_limits(row.limits).startswith(f"{kind.label[0]}:")
        return render(s)

    text = trio.run(snap).decode()
    family = "qosfs_limit_bytes_per_second" if kind.per_byte else "qosfs_limit_ops_per_second"
    label = "direction" if kind.per_byte else "op"
    assert any(line.startswith(family) and 'class="capped"' in line
               and f'{label}="{kind.label}"' in line for line in text.splitlines()), text


def test_keyed_values_behave_like_a_frozen_dataclass() -> None:
    a = Limits(read_bandwidth=1.0, burst=2)
    assert a == Limits(burst=2, read_bandwidth=1.0) and hash(a) == hash(Limits(
        read_bandwidth=1.0, burst=2))
    assert a != Limits(read_bandwidth=1.0) and a.write_iops is None
    assert repr(a) == "Limits(read_bandwidth=1.0, burst=2)"
    assert pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        Limits(read_bandwith=1.0)
    with pytest.raises(AttributeError):
        a.read_bandwidth = 3.0  # type: ignore[misc]
    with pytest.raises(AttributeError):
        _ = a.no_such_key
    assert LevelLimits().read_bytes.rate == math.inf
