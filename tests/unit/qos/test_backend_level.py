"""The [backend] level of a policy: built before the trio loop, changed inside it."""

from __future__ import annotations

import trio

from qosfs.policy.loading import parse_policy
from qosfs.qos.engine import PolicyQos

WITH_BACKEND = '[backend]\nwrite_bandwidth = "1GB/s"\nread_bandwidth = "2GB/s"\n'


def test_policy_with_backend_builds_outside_trio() -> None:
    # assembly.build_daemon builds the engine before trio.run; this raised "must be called from
    # async context", so no policy with a [backend] table could be mounted.
    qos = PolicyQos(parse_policy(WITH_BACKEND))
    assert qos.backend is not None
    assert qos.backend.level.limits.write_bytes.rate == 1e9
    assert qos.backend.level.limits.read_bytes.rate == 2e9


def test_backend_limits_change_on_swap() -> None:
    qos = PolicyQos(parse_policy(WITH_BACKEND))
    level = qos.backend

    async def swap() -> None:
        qos.swap(parse_policy(WITH_BACKEND.replace("1GB/s", "3GB/s")))

    trio.run(swap)
    assert qos.backend is level and level is not None
    assert level.level.limits.write_bytes.rate == 3e9


def test_every_class_has_a_port_with_its_priority_and_minimum() -> None:
    qos = PolicyQos(parse_policy(
        WITH_BACKEND + '[classes.data]\npaths = ["d/**"]\npriority = "high"\n'
        'min_read_bandwidth = "1GB/s"\n[classes.ckpt]\npaths = ["c/**"]\npriority = "low"\n'))
    assert qos.backend is not None
    ports = qos.backend.ports
    assert sorted(ports) == ["ckpt", "data", "default"]
    assert ports["data"].weight == 100 and ports["data"].min_rate[0] == 1e9
    assert ports["ckpt"].weight == 1 and ports["ckpt"].min_rate == (0.0, 0.0, 0.0)
