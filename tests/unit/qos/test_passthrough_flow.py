"""Which opens a flow lets the kernel read alone (``PolicyFlow.passes_reads_through``):
any class that does not opt out (``passthrough = "off"``, a latency target measured on its
own reads) and whose reads no level caps at the time of the open -- configured caps, the
latency controller's automatic ones, a per-uid split, the tenant, the backend."""

from __future__ import annotations

from typing import Any

from qosfs.policy.loading import parse_policy
from qosfs.qos.charge import OpenCharge
from qosfs.qos.engine import PolicyQos
from qosfs.qos.interface import PassThroughQos, QosEngine
from qosfs.qos.stats import AutoCaps
from tests.mock_clock import mock_clock
from tests.unit.qos.test_charge import CTX, Paths, inode

MiB = 1 << 20
POLICY = """
[tenants.slow]
uids = [7]
read_bandwidth = "10MiB/s"

[classes.capped]
paths = ["capped/**"]
passthrough = "reads"
read_iops = 100

[classes.fair]
paths = ["fair/**"]
passthrough = "reads"
per_user = "fair"

[classes.data]
paths = ["data/**"]
passthrough = "reads"

[classes.plain]
paths = ["plain/**"]

[classes.off]
paths = ["off/**"]
passthrough = "off"

[classes.measured]
paths = ["measured/**"]
target_read_latency = "5ms"
latency_measure = "backend"

[classes.canary]
paths = ["canary/**"]
target_read_latency = "5ms"
"""


def passes(engine: QosEngine, path: str, uid: int = 501) -> bool:
    ctx: Any = type(CTX)(uid=uid, gid=uid, pid=1)
    charge = OpenCharge(engine, Paths(), inode(path), ctx, False)  # type: ignore[arg-type]
    try:
        return charge.flow.passes_reads_through()
    finally:
        charge.release()


def test_every_uncapped_class_passes_reads_through_unless_it_opts_out() -> None:
    engine = PolicyQos(parse_policy(POLICY))
    assert passes(engine, "data/x")  # passthrough = "reads": the older spelling
    assert passes(engine, "plain/x")  # the default
    assert passes(engine, "x")  # the default class
    assert passes(engine, "canary/x")  # a target the canary measures
    assert not passes(engine, "off/x")  # opts out
    assert not passes(engine, "measured/x")  # a target measured on its own reads
    assert not passes(engine, "capped/x")  # caps its reads
    assert not passes(engine, "fair/x")  # a per-uid share
    assert not passes(engine, "data/x", uid=7)  # the caller's tenant caps reads
    assert not passes(PassThroughQos(), "data/x")  # no policy: never


@mock_clock
async def test_an_automatic_read_cap_stops_new_opens_until_it_is_lifted() -> None:
    engine = PolicyQos(parse_policy(POLICY))
    assert engine.set_auto_caps("data", AutoCaps(read_bandwidth=50 * MiB))
    assert not passes(engine, "data/x")
    assert engine.set_auto_caps("data", AutoCaps())
    assert passes(engine, "data/x")


def test_a_backend_read_cap_keeps_every_read_in_the_daemon() -> None:
    engine = PolicyQos(parse_policy('[backend]\nread_bandwidth = "4GiB/s"\n' + POLICY))
    assert not passes(engine, "data/x")
    write_only = PolicyQos(parse_policy('[backend]\nwrite_bandwidth = "4GiB/s"\n' + POLICY))
    assert passes(write_only, "data/x")
