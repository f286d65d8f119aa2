"""OpenCharge on trio's mock clock, with a real PolicyQos: what one open is charged to as
it writes, is renamed and is closed (qosfs.qos.charge), without a mount."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import trio

from qosfs.policy.loading import parse_policy
from qosfs.qos.charge import CUT_MIN, MAX_WRITE, OpenCharge, charge_renamed
from qosfs.qos.engine import PolicyQos
from qosfs.qos.flow import PolicyFlow
from qosfs.qos.interface import PassThroughQos, QosEngine
from tests.mock_clock import mock_clock

MiB = 1 << 20

# default is uncapped; ckpt caps writes and takes the streams (4 MiB in sequence); ops
# caps write ops only, so that a split write's second op would show.
POLICY = """
[classes.ckpt]
paths = ["ckpt/**"]
write_bandwidth = "4MiB/s"
burst = "1MiB"
detect_streaming_writes = "4MiB"

[classes.ops]
paths = ["ops/**"]
write_iops = 1000
"""


class Paths:
    """The filesystem's PathBook as the engine sees it: an inode's path, a rename epoch."""

    def __init__(self) -> None:
        self.epoch = 0

    def relpath_until(self, node: Any) -> tuple[str, float]:
        return str(node.path), float("inf")


def inode(path: str) -> Any:
    return SimpleNamespace(path=path, qos_memo=None)


CTX = SimpleNamespace(uid=501, gid=501, pid=1)


def open_charge(engine: QosEngine, paths: Paths, node: Any, writing: bool = True) -> OpenCharge:
    return OpenCharge(engine, paths, node, CTX, writing)  # type: ignore[arg-type]


async def write(charge: OpenCharge, off: int, n: int) -> float:
    """One write request as PassthroughOperations.write charges it (the syscall aside)."""
    flow = charge.flow
    waited = await flow.admit_write(n) if flow.limited else 0.0
    flow.stats.record_write(n, waited, 0)
    if charge.watching or CUT_MIN < n < MAX_WRITE:
        charge.wrote(off, n)
    return waited


def cls(charge: OpenCharge) -> str:
    flow = charge.flow
    assert isinstance(flow, PolicyFlow)
    return flow.cls.rule.name


def flows(engine: PolicyQos) -> list[PolicyFlow]:
    return list(engine._flows.values())


@mock_clock
async def test_a_write_the_kernel_split_at_a_page_is_charged_one_op() -> None:
    engine, paths = PolicyQos(parse_policy(POLICY)), Paths()
    charge = open_charge(engine, paths, inode("ops/f"))
    for i in range(4):  # 1 MiB writes from a buffer 48 bytes into a page
        await write(charge, i * MAX_WRITE, MAX_WRITE - 48)
        await write(charge, (i + 1) * MAX_WRITE - 48, 48)
    assert charge.flow.stats.write_ops == 4
    assert charge.flow.stats.write_bytes == 4 * MAX_WRITE
    level = engine.classes["ops"].level.statistics()
    assert level.ops_write == 4 and level.bytes_written == 4 * MAX_WRITE
    # Two full requests and a tail are one 2 MiB write: 2 ops, not 3.
    await write(charge, 10 * MAX_WRITE + 48, MAX_WRITE - 48)
    await write(charge, 11 * MAX_WRITE, MAX_WRITE)
    await write(charge, 12 * MAX_WRITE, 48)
    assert charge.flow.stats.write_ops == 4 + 2
    assert engine.classes["ops"].level.statistics().ops_write == 4 + 2
    # Aligned writes never reach the charge at all.
    assert not charge.watching
    await write(charge, 20 * MAX_WRITE, MAX_WRITE)
    await write(charge, 21 * MAX_WRITE, 4096)
    assert charge.flow.stats.write_ops == 8


@mock_clock
async def test_a_sequential_writer_moves_to_the_streaming_class_after_the_threshold() -> None:
    engine, paths = PolicyQos(parse_policy(POLICY)), Paths()
    charge = open_charge(engine, paths, inode("out/model.bin"))
    default = charge.flow
    assert cls(charge) == "default" and charge.watching
    for i in range(3):
        await write(charge, i * MiB, MiB)
    assert charge.flow is default  # 3 of 4 MiB: not yet
    await write(charge, 3 * MiB, MiB)
    assert cls(charge) == "ckpt" and not charge.watching
    assert engine.stream_moves == {"default": 1}
    assert default.open_files == 0 and charge.flow.open_files == 1
    # From the next write on it is capped: 4 MiB/s, its burst spent by what came before.
    waited = 0.0
    for i in range(4, 12):
        waited += await write(charge, i * MiB, MiB)
    assert waited > 1.0
    charge.release()
    assert all(flow.open_files == 0 for flow in flows(engine))


@mock_clock
async def test_a_scattered_writer_never_moves() -> None:
    engine, paths = PolicyQos(parse_policy(POLICY)), Paths()
    charge = open_charge(engine, paths, inode("out/db"))
    default = charge.flow
    for off in (40, 7, 90, 13, 55):  # as much as the threshold, nowhere in sequence
        await write(charge, off * MiB, MiB)
    for i in range(16):  # then a long sequential run: decided already
        await write(charge, (100 + i) * MiB, MiB)
    assert charge.flow is default and engine.stream_moves == {}
    # The threshold reached in sequence, but with more than a quarter as much elsewhere.
    mixed = open_charge(engine, paths, inode("out/log"))
    for off in (10, 30, 50, 51, 52, 53):  # 4 MiB in sequence, 2 MiB scattered
        await write(mixed, off * MiB, MiB)
    assert mixed.flow is default  # still watched: its bytes may be re-charged at a rename
    assert engine.stream_moves == {}
    # A read-only open is never watched.
    assert not open_charge(engine, paths, inode("out/db"), writing=False).watching


@mock_clock
async def test_a_rename_to_a_capped_name_charges_the_bytes_there_and_moves_its_opens() -> None:
    engine, paths = PolicyQos(parse_policy(POLICY)), Paths()
    node = inode("out/.tmpX")
    writer = open_charge(engine, paths, node)
    reader = open_charge(engine, paths, node, writing=False)
    default = writer.flow
    for i in range(3):  # under the streaming threshold: still default
        await write(writer, i * MiB, MiB)
    node.path, paths.epoch = "ckpt/step1.safetensors", 1  # renamed through the mount
    charge_renamed(engine, paths, node, CTX, [writer, reader])  # type: ignore[arg-type]
    assert engine.rename_charges == {"ckpt": 3 * MiB}
    assert cls(writer) == "ckpt" and writer.flow.open_files == 1
    assert reader.flow is not writer.flow and default.open_files == 1  # the reader stays
    ckpt = engine.classes["ckpt"].level.statistics()
    assert ckpt.bytes_written == 3 * MiB  # charged as if written there
    assert engine.classes["default"].level.statistics().bytes_written == 0
    # The debt (3 MiB beyond a 1 MiB burst at 4 MiB/s) is paid by the next write.
    start = trio.current_time()
    await write(writer, 3 * MiB, MiB)
    assert trio.current_time() - start >= 0.5
    # Settled: a second rename charges nothing more.
    charge_renamed(engine, paths, node, CTX, [writer, reader])  # type: ignore[arg-type]
    assert engine.rename_charges == {"ckpt": 3 * MiB}
    writer.release()
    reader.release()
    assert all(flow.open_files == 0 for flow in flows(engine))


@mock_clock
async def test_a_closed_save_is_recharged_and_an_uncapped_name_changes_nothing() -> None:
    engine, paths = PolicyQos(parse_policy(POLICY)), Paths()
    saved, kept = inode("out/.tmpA"), inode("out/.tmpB")
    for node in (saved, kept):
        charge = open_charge(engine, paths, node)
        await write(charge, 0, 2 * MiB)
        charge.release()
    saved.path, kept.path, paths.epoch = "ckpt/a.pt", "out/b.pt", 1
    charge_renamed(engine, paths, saved, CTX, [])  # type: ignore[arg-type]
    charge_renamed(engine, paths, kept, CTX, [])  # type: ignore[arg-type]
    assert engine.rename_charges == {"ckpt": 2 * MiB}
    assert engine.classes["default"].level.statistics().bytes_written == 2 * MiB


@mock_clock
async def test_open_files_balance_after_moves_and_releases() -> None:
    engine, paths = PolicyQos(parse_policy(POLICY)), Paths()
    charges = [open_charge(engine, paths, inode(f"out/{i}")) for i in range(3)]
    charges.append(open_charge(engine, paths, inode("ckpt/x")))
    assert sum(flow.open_files for flow in flows(engine)) == 4
    for i in range(4):  # the first one streams and moves
        await write(charges[0], i * MiB, MiB)
    assert cls(charges[0]) == "ckpt"
    assert sorted((cls(c), c.flow.open_files) for c in charges) == [
        ("ckpt", 2), ("ckpt", 2), ("default", 2), ("default", 2)]
    for charge in charges:
        charge.release()
    assert all(flow.open_files == 0 for flow in flows(engine))
    # Flows with nothing open are forgotten by the idle sweep, as before.
    engine.expire_idle_users(1e9)
    assert engine._flows == {}


@mock_clock
async def test_the_engine_without_policy_counts_and_never_moves() -> None:
    engine, paths = PassThroughQos(), Paths()
    node = inode("ckpt/x")
    charge = open_charge(engine, paths, node)
    assert charge.flow is engine.flow and engine.flow.open_files == 1
    assert not charge.watching
    await write(charge, 0, MAX_WRITE - 48)  # a split write: one op
    await write(charge, MAX_WRITE - 48, 48)
    for i in range(8):
        await write(charge, MiB + i * MiB, MiB)
    assert engine.flow.stats.write_ops == 1 + 8 and charge.flow is engine.flow
    node.path = "ckpt/y"
    charge_renamed(engine, paths, node, CTX, [charge])  # type: ignore[arg-type]
    assert charge.flow is engine.flow
    charge.release()
    assert engine.flow.open_files == 0
