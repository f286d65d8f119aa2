"""PolicyQos on trio's mock clock: flows bound at open, chains, swap, drain, sharing."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from qosfs.passthrough.paths import PATH_MEMO_SECONDS
from qosfs.policy.loading import default_policy, parse_policy
from qosfs.qos import memo as memo_module
from qosfs.qos.charge import OpenCharge
from qosfs.qos.engine import PolicyQos
from qosfs.qos.flow import PolicyFlow
from tests.mock_clock import mock_clock

MiB = 1 << 20

POLICY = """
[backend]
write_bandwidth = "100MiB/s"

[tenants.team]
uids = ["500-599"]
write_bandwidth = "30MiB/s"
burst = "1MiB"

[classes.ckpt]
paths = ["ckpt/**"]
write_bandwidth = "10MiB/s"
burst = "1MiB"
priority = "low"

[classes.shared]
paths = ["shared/**"]
write_bandwidth = "20MiB/s"
burst = "1MiB"
per_user = "fair"

[classes.data]
paths = ["data/**"]
priority = "high"
"""


class FakeFs:
    """What PolicyQos asks of the filesystem: its PathBook (path of an inode, rename epoch)."""

    def __init__(self) -> None:
        self.paths = self
        self.epoch = 0
        self.lookups = 0  # relpath_until() calls: each one is a classification

    def relpath_until(self, inode: Any) -> tuple[str, float]:
        """The path, trusted for PATH_MEMO_SECONDS from now (as a path read from /proc)."""
        self.lookups += 1
        return str(inode.path), memo_module._monotonic() + PATH_MEMO_SECONDS


def fake_inode(path: str) -> Any:
    return SimpleNamespace(path=path, qos_memo=None)


def open_flow(qos: PolicyQos, path: str, uid: int = 0, writing: bool = True) -> PolicyFlow:
    ctx = SimpleNamespace(uid=uid, gid=uid, pid=1)
    return qos.open_flow(FakeFs(), fake_inode(path), ctx, writing)  # type: ignore[arg-type]


def open_charge(qos: PolicyQos, path: str, uid: int = 0, writing: bool = True) -> OpenCharge:
    """An open of *path* by *uid* as the filesystem makes it: its charge counts the open
    in its flow's ``open_files`` until :meth:`~qosfs.qos.charge.OpenCharge.release`."""
    ctx = SimpleNamespace(uid=uid, gid=uid, pid=1)
    return OpenCharge(qos, FakeFs(), fake_inode(path), ctx, writing)  # type: ignore[arg-type]


async def write_for(flow: PolicyFlow, seconds: float, size: int = MiB) -> float:
    """MiB/s one writer gets through *flow* in *seconds* of mock time."""
    start = trio.current_time()
    moved = 0
    while trio.current_time() - start < seconds:
        await flow.admit_write(size)
        moved += size
    return moved / MiB / (trio.current_time() - start)


async def write_then_note(flow: PolicyFlow, done: list[float], writes: int = 1) -> None:
    """Admit *writes* 1 MiB writes through *flow*, then note the time in *done*."""
    for _ in range(writes):
        await flow.admit_write(MiB)
    done.append(trio.current_time())


def test_files_of_one_class_tenant_and_user_share_one_flow() -> None:
    qos = PolicyQos(parse_policy(POLICY))
    a, b = open_flow(qos, "ckpt/a"), open_flow(qos, "ckpt/b")
    assert a is b and a.cls.rule.name == "ckpt"  # counted by opens (test_charge.py)
    assert open_flow(qos, "ckpt/a", uid=42) is not a  # another user
    assert open_flow(qos, "elsewhere").cls.rule.name == "default"


async def _swap(qos: PolicyQos, text: str) -> None:
    qos.swap(parse_policy(text))  # from a trio run, as the daemon does


def test_an_inodes_classification_is_memoized_until_a_rename_swap_or_a_second(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(memo_module, "_monotonic", lambda: clock[0])
    qos, fs, node = PolicyQos(parse_policy(POLICY)), FakeFs(), fake_inode("ckpt/x")
    root, other = SimpleNamespace(uid=0, gid=0, pid=1), SimpleNamespace(uid=42, gid=42, pid=2)

    def cls(ctx: Any = root, writing: bool = True) -> str:
        return qos.open_flow(fs, node, ctx, writing).cls.rule.name

    assert cls() == "ckpt" and fs.lookups == 1
    assert cls() == "ckpt" and fs.lookups == 1  # memo
    node.path = "data/x"  # renamed underneath: trusted for up to a second ...
    assert cls() == "ckpt"
    clock[0] += PATH_MEMO_SECONDS
    assert cls() == "data" and fs.lookups == 2  # ... then seen
    node.path = "ckpt/x"
    fs.epoch += 1  # renamed through the mount: seen at once
    assert cls() == "ckpt" and fs.lookups == 3
    trio.run(_swap, qos, POLICY.replace('paths = ["ckpt/**"]', 'paths = ["none/**"]'))
    assert cls() == "default" and fs.lookups == 4  # a new policy classifies afresh
    assert cls(writing=False) == "default" and fs.lookups == 5  # another op
    assert qos.open_flow(fs, node, other, False).uid == 42 and fs.lookups == 6  # caller
    assert cls(other, writing=False) == "default" and fs.lookups == 6


@mock_clock
async def test_a_class_cap_holds_through_its_flow() -> None:
    qos = PolicyQos(parse_policy(POLICY))
    rate = await write_for(open_flow(qos, "ckpt/x"), 10.0)
    assert rate == pytest.approx(10, rel=0.02)


@mock_clock
async def test_the_tenant_cap_holds_across_its_classes() -> None:
    qos = PolicyQos(parse_policy(POLICY.replace('write_bandwidth = "10MiB/s"',
                                                'write_bandwidth = "25MiB/s"')))
    rates: dict[str, float] = {}

    async def run(name: str, path: str) -> None:
        rates[name] = await write_for(open_flow(qos, path, uid=501), 10.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "ckpt", "ckpt/x")
        nursery.start_soon(run, "other", "misc/y")
    assert rates["ckpt"] + rates["other"] == pytest.approx(30, rel=0.05)


@mock_clock
async def test_per_user_class_splits_its_cap_between_active_users() -> None:
    qos = PolicyQos(parse_policy(POLICY))
    rates: dict[int, float] = {}

    async def run(uid: int) -> None:
        rates[uid] = await write_for(open_flow(qos, "shared/f", uid=uid), 10.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, 1000)
        nursery.start_soon(run, 1001)
    assert rates[1000] == pytest.approx(10, rel=0.1)
    assert rates[1001] == pytest.approx(10, rel=0.1)


@mock_clock
async def test_priority_decides_who_gets_a_contended_backend() -> None:
    qos = PolicyQos(parse_policy(POLICY.replace('write_bandwidth = "10MiB/s"\nburst = "1MiB"\n'
                                                'priority = "low"', 'priority = "low"')))
    rates: dict[str, float] = {}

    async def run(name: str, path: str) -> None:
        rates[name] = await write_for(open_flow(qos, path), 10.0)

    async with trio.open_nursery() as nursery:
        for i in range(2):
            nursery.start_soon(run, f"low{i}", "ckpt/x")
            nursery.start_soon(run, f"high{i}", "data/y")
    high = rates["high0"] + rates["high1"]
    low = rates["low0"] + rates["low1"]
    assert high + low == pytest.approx(100, rel=0.05)
    # Weights 100 : 1 -- but the backend's first 10 MiB burst goes first come, first served
    # (nothing is parked yet), which gives the low class up to 5 MiB more in 10 s.
    assert high > 30 * low
    assert low > 0  # slowed, never starved


@mock_clock
async def test_swap_raising_a_cap_releases_a_parked_write_at_once() -> None:
    qos = PolicyQos(parse_policy(POLICY))
    flow = open_flow(qos, "ckpt/x")
    await flow.admit_write(10 * MiB)  # ~0.9 s of debt at 10 MiB/s
    done: list[float] = []

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write_then_note, flow, done)
        await trio.sleep(0.1)
        assert not done
        qos.swap(parse_policy(POLICY.replace('"10MiB/s"', '"10GiB/s"')))
    assert done and done[0] < 0.11


@mock_clock
async def test_swap_removing_a_class_moves_its_files_to_default_and_frees_waiters() -> None:
    qos = PolicyQos(parse_policy(POLICY))
    flow = open_flow(qos, "ckpt/x")
    await flow.admit_write(30 * MiB)  # ~3 s of debt
    done: list[float] = []

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write_then_note, flow, done)
        await trio.sleep(0.1)
        without_ckpt = POLICY.split("[classes.ckpt]")[0] + "[classes.data]" + \
            POLICY.split("[classes.data]")[1]
        qos.swap(parse_policy(without_ckpt))
    # Free of the class's ~3 s of debt at once; the backend's own debt (the 30 MiB at
    # 100 MiB/s, less its 10 MiB burst: 0.2 s) is real and still paid.
    assert done and done[0] == pytest.approx(0.21, abs=0.02)
    assert flow.cls.rule.name == "default" and qos.generation == 2


@mock_clock
async def test_drain_lifts_every_limit_for_shutdown() -> None:
    qos = PolicyQos(parse_policy(POLICY))
    flow = open_flow(qos, "ckpt/x", uid=501)  # class, tenant and backend all in its chain
    await flow.admit_write(50 * MiB)
    done: list[float] = []

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write_then_note, flow, done, 20)
        await trio.sleep(0.2)
        qos.drain()
    assert done and done[0] < 0.21


@mock_clock
async def test_a_short_read_is_refunded() -> None:
    qos = PolicyQos(parse_policy(POLICY + '\n[classes.reads]\npaths = ["r/**"]\n'
                                 'read_bandwidth = "1MiB/s"\nburst = "1MiB"\n'))
    flow = open_flow(qos, "r/small", writing=False)
    with trio.testing.assert_no_checkpoints():
        await flow.admit_read(MiB)  # the full burst...
        flow.refund_read(MiB - 4096)  # ...but the file held only 4 KiB
        await flow.admit_read(512 * 1024)  # so this one needs no wait
    assert flow.cls.level.bytes_read == 4096 + 512 * 1024


@pytest.mark.parametrize(("cache", "write_cap", "expected"), [
    # (O_RDONLY, O_WRONLY, O_RDWR)
    ("auto", True, (False, True, False)),
    ("auto", False, (False, False, False)),
    ("keep", True, (False, False, False)),
    ("direct-writes", False, (False, True, True)),
    ("direct", False, (True, True, True)),
])
def test_which_opens_bypass_the_page_cache(cache: str, write_cap: bool,
                                           expected: tuple[bool, bool, bool]) -> None:
    cap = 'write_bandwidth = "10MiB/s"' if write_cap else ""
    qos = PolicyQos(parse_policy(f'[classes.c]\npaths = ["c/**"]\ncache = "{cache}"\n{cap}\n'))
    flow = open_flow(qos, "c/f")
    assert tuple(flow.direct_io_for(m) for m in (os.O_RDONLY, os.O_WRONLY, os.O_RDWR)) \
        == expected


def test_cache_timeouts_go_by_path_first_class_that_sets_each() -> None:
    engine = PolicyQos(parse_policy(
        '[classes.ckpt]\npaths = ["**/*.pt"]\nops = ["write"]\nattr_timeout = "1s"\n'
        '[classes.datasets]\npaths = ["data/**"]\nentry_timeout = "60s"\n'
        'attr_timeout = "30s"\n[classes.default]\nentry_timeout = "2s"\n'))
    timeouts = engine.cache_timeouts
    assert timeouts is not None
    assert timeouts("data/x.bin") == (60.0, 30.0)
    assert timeouts("data/x.pt") == (60.0, 1.0)  # ckpt decides attr (ops do not matter)
    assert timeouts("other") == (2.0, None)  # None: the mount's --attr-timeout
    assert PolicyQos(parse_policy("")).cache_timeouts is None  # nothing to look up


def test_the_default_dataset_timeouts_hold_for_dataset_paths_whatever_the_op() -> None:
    """The dataset class takes reads only; its timeouts still go by path (the kernel
    caches a name for every caller, writers included)."""
    timeouts = PolicyQos(default_policy()).cache_timeouts
    assert timeouts is not None
    for path in ("data/imagenet/0001.jpg", "datasets/x", "x/train.h5", "x/features.npy"):
        assert timeouts(path) == (60.0, 60.0), path
    assert timeouts("home/u/notes.txt") == (None, None)
