"""The latency controller: decisions alone, then on a real engine and trio's mock clock
against a synthetic backend whose read latency rises with the write load it is given."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from qosfs.policy.loading import parse_policy, with_changes
from qosfs.qos.accounting import FineHistogram, FlowStats, fine_index, fine_upper_bound
from qosfs.qos.charge import OpenCharge
from qosfs.qos.engine import PolicyQos
from qosfs.qos.flow import PolicyFlow
from qosfs.qos.latency.decider import (
    DEEPEST,
    FLOOR,
    INCREASE,
    STARTING_WINDOWS,
    ClassSample,
    LatencyDecider,
    ProtectedSample,
    low_classes,
    protected_classes,
)
from qosfs.qos.latency.loop import PROBE_CHECK, WINDOW, LatencyLoop
from qosfs.qos.stats import AutoCaps
from tests.mock_clock import mock_clock

MiB = float(1 << 20)
GiB = 1024 * MiB
POLICY = """
[classes.datasets]
paths = ["data/**"]
priority = "high"
target_read_latency = "5ms"
latency_measure = "backend"
[classes.checkpoints]
paths = ["ckpt/**"]
priority = "low"
{ckpt}
[classes.default]
"""


def policy(ckpt: str = "") -> object:
    return parse_policy(POLICY.format(ckpt=ckpt), "test.toml")


def ds(latency: float | None, reads: int = 100) -> list[ProtectedSample]:
    return [ProtectedSample("datasets", latency, reads, reads)]


def ck(write: float, read: float = 0.0, waited: bool = False) -> list[ClassSample]:
    return [ClassSample("checkpoints", read, write, waited)]


# ------------------------------------------------------------------ fine histogram


def test_fine_histogram_resolution_around_milliseconds() -> None:
    for ns in (1_000_000, 4_500_000, 5_000_000, 9_999_999):
        bound = fine_upper_bound(fine_index(ns))
        assert ns / 1e9 < bound <= ns / 1e9 * 1.125 + 1e-6
    h = FineHistogram()
    for _ in range(990):
        h.observe(1_000_000)
    for _ in range(10):
        h.observe(4_700_000)
    assert FineHistogram.quantile(h.snapshot(), 0.99) == pytest.approx(1.024e-3)
    assert FineHistogram.quantile(h.snapshot(), 0.999) == pytest.approx(5.12e-3)
    assert FineHistogram.quantile(FineHistogram.window(h.snapshot(), h.snapshot()), 0.5) is None


# ------------------------------------------------------------------ decisions


def test_roles_lower_priority_without_target() -> None:
    p = parse_policy(POLICY.format(ckpt="") + "", "t")
    assert {k: [g.name for g in v] for k, v in low_classes(p).items()} == {
        "checkpoints": ["datasets"], "default": ["datasets"]}


def test_decrease_starts_from_measured_rate_and_cuts_deeper_for_large_misses() -> None:
    c = LatencyDecider(policy())
    changed = c.step(0.0, ds(0.006), ck(write=1000 * MiB))  # 1.2x target: x0.7
    assert changed == {"checkpoints": AutoCaps(None, 700 * MiB)}
    assert c.state == "throttling"
    changed = c.step(0.5, ds(0.050), ck(write=700 * MiB))  # 10x target: x0.25 at most
    assert changed["checkpoints"].write_bandwidth == pytest.approx(175 * MiB)
    assert c.verdicts == {"datasets": "missed"}


def test_direction_not_used_is_not_capped() -> None:
    c = LatencyDecider(policy())
    c.step(0.0, ds(0.006), ck(write=100 * MiB, read=0.5 * MiB))
    assert c.caps()["checkpoints"] == AutoCaps(None, 70 * MiB)


def test_additive_increase_then_release_when_the_cap_stops_binding() -> None:
    c = LatencyDecider(policy())
    c.step(0.0, ds(0.006), ck(write=100 * MiB))  # 70
    c.step(0.5, ds(0.006), ck(write=70 * MiB))  # 49, ref 70
    assert c.caps()["checkpoints"].write_bandwidth == pytest.approx(49 * MiB)
    c.step(1.0, ds(0.004), ck(write=49 * MiB, waited=True))
    # 4 ms against 5: 20 % headroom, so the cap grows by 10 % of itself
    assert c.caps()["checkpoints"].write_bandwidth == pytest.approx(49 * 1.1 * MiB)
    for t in (1.5, 2.0):  # the storm is over: nothing binds
        c.step(t, ds(0.001), ck(write=0.0))
        assert c.low
    changed = c.step(2.5, ds(0.001), ck(write=0.0))
    assert changed == {"checkpoints": AutoCaps()} and c.state == "watching"
    assert c.decisions["release"] == 1


def test_idle_protected_class_doubles_the_cap_until_released() -> None:
    c = LatencyDecider(policy())
    c.step(0.0, ds(0.05), ck(write=800 * MiB))  # 200
    caps = []
    for i in range(5):
        c.step(0.5 * (i + 1), ds(None, reads=0), ck(write=2000 * MiB, waited=True))
        caps.append(c.caps()["checkpoints"].write_bandwidth)
    assert caps == [400 * MiB, None, None, None, None]  # back at its 800: released


def test_few_samples_hold() -> None:
    c = LatencyDecider(policy())
    c.step(0.0, ds(0.01), ck(write=100 * MiB))
    assert c.step(0.5, ds(0.5, reads=3), ck(write=70 * MiB)) == {}
    assert c.verdicts == {"datasets": "few-samples"}


def test_floor_and_unreachable() -> None:
    c = LatencyDecider(policy())
    rate = 20 * MiB
    for i in range(10):
        c.step(i * 0.5, ds(0.05), ck(write=rate, waited=True))
        rate = c.caps()["checkpoints"].write_bandwidth
    assert rate == FLOOR
    assert c.state == "unreachable"
    c.step(5.0, ds(0.004), ck(write=FLOOR, waited=True))
    assert c.state == "throttling"


def test_min_bandwidth_is_the_floor() -> None:
    p = parse_policy(POLICY.format(ckpt='min_write_bandwidth = "64MiB/s"')
                     + '[backend]\nwrite_bandwidth = "1GiB/s"\n', "t")
    c = LatencyDecider(p)
    for i in range(6):
        c.step(i * 0.5, ds(0.05), ck(write=500 * MiB, waited=True))
    assert c.caps()["checkpoints"].write_bandwidth == 64 * MiB and c.state == "unreachable"


def test_configured_cap_bounds_the_start_and_releases() -> None:
    c = LatencyDecider(policy('write_bandwidth = "100MiB/s"'))
    c.step(0.0, ds(0.006), ck(write=500 * MiB))  # measured above the cap: start at the cap
    assert c.caps()["checkpoints"].write_bandwidth == pytest.approx(70 * MiB)
    lowered = with_changes(c.policy, "class", "checkpoints", {"write_bandwidth": "50MiB/s"})
    c.set_policy(lowered)
    changed = c.step(0.5, ds(0.004), ck(write=50 * MiB, waited=True))
    assert changed == {"checkpoints": AutoCaps()}  # above the new static cap: released


def test_a_class_given_a_target_is_no_longer_capped() -> None:
    c = LatencyDecider(policy())
    c.step(0.0, ds(0.01), ck(write=100 * MiB))
    c.set_policy(with_changes(c.policy, "class", "checkpoints",
                              {"target_read_latency": "50ms"}))
    assert "checkpoints" not in c.caps() and not c.low


# ------------------------------------------------------------------ on the engine


@mock_clock
async def test_engine_applies_the_lower_of_configured_and_automatic_caps() -> None:
    engine = PolicyQos(policy('write_bandwidth = "100MiB/s"\nburst = "128MiB"'))
    level = engine.classes["checkpoints"].level
    assert engine.set_auto_caps("checkpoints", AutoCaps(None, 40 * MiB))
    assert level.limits.write_bytes.rate == 40 * MiB
    assert level.limits.write_bytes.effective_burst == 4 * MiB  # not the static 128MiB
    assert not engine.set_auto_caps("checkpoints", AutoCaps(None, 40 * MiB))
    engine.swap(with_changes(engine.policy, "class", "checkpoints",
                             {"write_bandwidth": "20MiB/s"}))
    assert level.limits.write_bytes.rate == 20 * MiB  # ctl set bounds it at once
    engine.swap(with_changes(engine.policy, "class", "checkpoints",
                             {"write_bandwidth": "unlimited"}))
    assert level.limits.write_bytes.rate == 40 * MiB  # and the automatic cap is back
    assert engine.policy.class_by_name("checkpoints").limits.write_bandwidth is None
    engine.drain()
    assert not engine.set_auto_caps("checkpoints", AutoCaps(None, 1 * MiB))
    assert math.isinf(level.limits.write_bytes.rate)


# ------------------------------------------------------------------ synthetic backend


class Device:
    """Read latency = base + slope * (bytes written in the last 100 ms, per second)."""

    def __init__(self, base: float = 0.001, per_gib_s: float = 0.02) -> None:
        self.base, self.slope = base, per_gib_s / GiB
        self.writes: deque[tuple[float, int]] = deque()
        self.recent = 0

    def write(self, now: float, n: int) -> None:
        self.writes.append((now, n))
        self.recent += n

    def read_latency(self, now: float) -> float:
        while self.writes and self.writes[0][0] < now - 0.1:
            self.recent -= self.writes.popleft()[1]
        return self.base + self.slope * self.recent / 0.1


CTX = SimpleNamespace(uid=1000, gid=1000, pid=1)


def flow_for(engine: PolicyQos, path: str, op: str) -> PolicyFlow:
    """The flow *path* gets for *op* by CTX's caller, classified now."""
    classification = engine.classification
    return classification.classified(path, classification.caller_key(CTX, op))  # type: ignore[arg-type]


async def _scenario(base: float, storm: tuple[float, float], end: float) -> list[dict]:
    engine = PolicyQos(policy())
    control = LatencyLoop(engine)
    device = Device(base=base)
    reader = flow_for(engine, "data/x", "read")
    writer = flow_for(engine, "ckpt/x", "write")
    trace: list[dict] = []
    written = [0]

    def on_window(now: float, lc: LatencyLoop) -> None:
        caps = engine.auto_caps.get("checkpoints", AutoCaps())
        trace.append({"t": now, "p99": lc.samples[0].latency, "state": lc.controller.state,
                      "cap": caps.write_bandwidth, "written": written[0]})

    control.on_window.append(on_window)

    async def read_loop() -> None:
        while trio.current_time() < end:
            waited = await reader.admit_read(65536)
            lat = device.read_latency(trio.current_time())
            await trio.sleep(lat)
            reader.stats.record_read(65536, waited, int(lat * 1e9))

    async def write_loop() -> None:
        await trio.sleep_until(storm[0])
        while trio.current_time() < storm[1]:
            await writer.admit_write(1 << 20)
            device.write(trio.current_time(), 1 << 20)
            written[0] += 1 << 20
            await trio.sleep(0.001)  # 1 GiB/s per writer when not throttled

    async with trio.open_nursery() as nursery:
        await nursery.start(control.run)
        for _ in range(2):
            nursery.start_soon(read_loop)
        for _ in range(4):
            nursery.start_soon(write_loop)
        await trio.sleep_until(end)
        nursery.cancel_scope.cancel()
    return trace


@mock_clock
async def test_converges_stays_in_band_and_recovers() -> None:
    target = 0.005
    trace = await _scenario(base=0.001, storm=(2.0, 22.0), end=28.0)
    before = [w for w in trace if w["t"] <= 2.0]
    assert all(w["cap"] is None and w["state"] == "watching" for w in before)
    during = [w for w in trace if 2.0 < w["t"] <= 22.0]
    # Converged: from the first window at or under 1.5x target on, it stays there.
    late = [i for i, w in enumerate(during) if w["p99"] is None or w["p99"] > 1.5 * target]
    converged_at = during[late[-1] + 1]["t"] if late else during[0]["t"]
    assert converged_at - 2.0 <= 3.0, during[:8]
    steady = [w for w in during if w["t"] >= 12.0]
    caps = [w["cap"] for w in steady]
    assert None not in caps
    # The band: the sawtooth spans 1.05/0.7 in theory, twice that when a cut is followed
    # by a second one (the window after a cut still reads just over the target); measured
    # 92..188 MiB/s with p99 <= 5.12 ms.
    assert max(caps) / min(caps) <= 2.5
    assert all(w["p99"] <= 1.5 * target for w in steady)
    # The storm still gets what the target leaves over: the equilibrium is ~200 MiB/s
    # (latency 1 ms + 20 ms per GiB/s must stay under 5 ms).
    moved = (steady[-1]["written"] - steady[0]["written"]) / (steady[-1]["t"] - steady[0]["t"])
    assert 100 * MiB <= moved <= 260 * MiB
    after = [w for w in trace if w["t"] > 22.0]
    released = next(w["t"] for w in after if w["cap"] is None)
    assert released - 22.0 <= 2.0
    assert all(w["cap"] is None for w in after if w["t"] >= released)


@mock_clock
async def test_unreachable_target_keeps_the_floor_and_recovers() -> None:
    # 8 ms even without a storm: the target cannot be met by capping the storm.
    trace = await _scenario(base=0.008, storm=(1.0, 8.0), end=15.0)
    # At the floor within 5 s of the storm's start (trio's random task order moves the
    # descent by a few windows from run to run), and there until the storm ends.
    during = [w for w in trace if 6.0 <= w["t"] <= 8.0]
    assert all(w["cap"] == FLOOR and w["state"] == "unreachable" for w in during)
    assert during[-1]["written"] - during[0]["written"] > 0  # never starved to zero
    # The four writes parked at 1 MiB/s when the storm ends drain by t=12; then the class
    # is idle under its cap and released, though the target is still missed.
    assert trace[-1]["cap"] is None and trace[-1]["state"] == "unreachable"


# ------------------------------------------------------------------ what status shows


@mock_clock
async def test_status_top_and_metrics_show_the_controller() -> None:
    from qosfs.control.ctl import format_latency, format_levels
    from qosfs.control.metrics import render
    from qosfs.control.snapshot import take_snapshot, to_json

    engine = PolicyQos(policy())
    control = LatencyLoop(engine)
    control._sync_policy()
    control.controller.step(0.0, ds(0.006), ck(write=100 * MiB))
    control._apply(control.controller.caps())
    snap = take_snapshot(engine, trio.current_time(), latency=control.status())
    body = to_json(snap, None, accounts=False)
    lc = body["latency_control"]
    assert lc["state"] == "throttling"
    assert lc["throttled"] == [{"class": "checkpoints", "read_bandwidth": None,
                                "write_bandwidth": 70 * MiB}]
    assert lc["protected"][0]["target_seconds"] == 0.005
    # How its protection began: active (it read), cut in that window, on a miss.
    started = {k: lc["protected"][0][k] for k in (
        "active_since", "first_cut_at", "first_cut_reason", "first_cut_after_seconds",
        "baseline_source", "reads_observed")}
    assert started == {"active_since": 0.0, "first_cut_at": 0.0, "first_cut_reason": "missed",
                       "first_cut_after_seconds": 0.0, "baseline_source": None,
                       "reads_observed": True}
    assert lc["protected"][0]["active_seconds"] == trio.current_time()
    level = next(lv for lv in body["levels"] if lv["name"] == "checkpoints")
    assert level["limits"] == {"write_bandwidth": 70 * MiB}
    assert level["auto_limits"] == {"write_bandwidth": 70 * MiB}
    assert any("(auto)" in line for line in format_levels(body))
    text = "\n".join(format_latency(body))
    assert "latency control: throttling" in text and "checkpoints: capped w:70MiB/s" in text
    metrics = render(snap).decode()
    assert 'qosfs_latency_control_state{state="throttling"} 1.0' in metrics
    assert ('qosfs_latency_auto_limit_bytes_per_second{class="checkpoints",'
            'direction="write"} 7.340032e+07') in metrics
    assert 'qosfs_latency_target_seconds{class="datasets"} 0.005' in metrics
    assert 'qosfs_latency_active{class="datasets"} 1.0' in metrics
    assert ('qosfs_latency_first_cut_after_seconds{class="datasets",reason="missed"} 0.0'
            in metrics)
    assert 'qosfs_latency_reads_observed{class="datasets"} 1.0' in metrics
    control.reads_unobserved("datasets")
    assert control.unobserved() == {"datasets"}
    metrics = render(take_snapshot(engine, trio.current_time(),
                                   latency=control.status())).decode()
    assert 'qosfs_latency_reads_observed{class="datasets"} 0.0' in metrics


RELATIVE = POLICY.replace('target_read_latency = "5ms"', "target_read_slowdown = 1.5")


def test_a_relative_target_learns_its_baseline_while_the_classes_below_are_quiet() -> None:
    c = LatencyDecider(parse_policy(RELATIVE.format(ckpt=""), "t"))
    c.step(0.0, ds(0.004), ck(write=500 * MiB))  # a storm from the start: nothing to go by
    assert c.verdicts == {"datasets": "learning"}  # so it is cut at once, as for a large miss
    assert c.caps()["checkpoints"].write_bandwidth == pytest.approx(500 * MiB * DEEPEST)
    for t in (0.5, 1.0, 1.5):  # the storm pauses (under the floor counts as quiet)
        c.step(t, ds(0.001 if t != 1.0 else 0.0012), ck(write=0.5 * MiB))
    assert c.baseline("datasets") == pytest.approx(0.001)
    assert c.baseline_source("datasets") == "learned"
    assert c.verdicts == {"datasets": "met"} and c.quiet  # the canary may slow down
    assert c.caps()["checkpoints"] == AutoCaps()  # idle under its cap for 3 windows
    changed = c.step(2.0, ds(0.002), ck(write=500 * MiB))  # 2x > 1.5x: capped
    assert not c.quiet
    assert changed["checkpoints"].write_bandwidth == pytest.approx(500 * MiB * 0.7)
    assert c.targets == {"datasets": pytest.approx(0.0015)}
    assert c.baseline("datasets") == pytest.approx(0.001)  # storm windows do not count
    c.step(2.5, ds(0.0012), ck(write=350 * MiB, waited=True))
    assert c.verdicts == {"datasets": "met"} and c.state == "throttling"


def test_a_relative_target_makes_a_quiet_window_when_the_storm_never_pauses() -> None:
    c = LatencyDecider(parse_policy(RELATIVE.format(ckpt=""), "t"))
    t = 0.0
    cap = 400 * MiB
    while cap > FLOOR:  # from the first window, cut the classes below as for a large miss
        changed = c.step(t, ds(0.004), ck(write=cap, waited=True))
        cap = max(FLOOR, cap * DEEPEST)
        assert changed["checkpoints"].write_bandwidth == pytest.approx(cap)
        assert c.verdicts == {"datasets": "learning"} and c.state == "throttling"
        t += 0.5
    assert c.baseline("datasets") is None
    c.step(t, ds(0.001), ck(write=FLOOR, waited=True))  # held at the floor: quiet
    assert c.baseline("datasets") == pytest.approx(0.001)
    assert c.verdicts == {"datasets": "met"}
    assert c.active["datasets"].first_cut == 0.0
    assert c.active["datasets"].cut_reason == "learning"
    changed = c.step(t + 0.5, ds(0.001), ck(write=FLOOR, waited=True))
    assert changed["checkpoints"].write_bandwidth > FLOOR  # met: the caps climb again


def test_a_baseline_is_remembered_from_an_earlier_epoch_and_judged_on_at_once() -> None:
    c = LatencyDecider(parse_policy(RELATIVE.format(ckpt=""), "t"))
    c.step(0.0, ds(0.001), ck(write=0.0))  # epoch 1, alone: the baseline
    assert c.baseline_source("datasets") == "learned"
    c.step(0.5, ds(None, reads=0), ck(write=0.0))  # between epochs: idle
    assert "datasets" not in c.active and c.baseline_source("datasets") == "remembered"
    c.step(1.0, ds(None, reads=0), ck(write=400 * MiB))  # a storm, still idle: no cut
    assert c.caps()["checkpoints"] == AutoCaps()
    c.step(1.5, ds(0.0012), ck(write=400 * MiB))  # epoch 2: judged on the remembered 1 ms
    assert c.verdicts == {"datasets": "met"} and c.caps()["checkpoints"] == AutoCaps()
    c.step(2.0, ds(0.004), ck(write=400 * MiB))
    assert c.verdicts == {"datasets": "missed"}
    assert c.caps()["checkpoints"].write_bandwidth == pytest.approx(400 * MiB * 0.375)
    assert c.active["datasets"].cut_reason == "missed"
    assert c.baseline_source("datasets") == "remembered"


def active(latency: float | None = None, samples: int = 0) -> list[ProtectedSample]:
    """A window in which datasets opened files (or made metadata requests) but no read
    was seen: its first instants, or a class whose reads bypass the daemon."""
    return [ProtectedSample("datasets", latency, 0, samples, latency, None, active=True)]


def test_a_class_becoming_active_protects_itself_before_any_judgement() -> None:
    c = LatencyDecider(policy())
    c.step(0.0, ds(None, reads=0), ck(write=800 * MiB))  # the storm runs, datasets idle
    assert c.caps()["checkpoints"] == AutoCaps() and c.verdicts == {"datasets": "idle"}
    cap = 800 * MiB
    for i in range(STARTING_WINDOWS):  # opens, no latency yet: cut as for a large miss
        changed = c.step(0.05 + i * 0.5, active(), ck(write=cap, waited=True))
        cap *= DEEPEST
        assert changed == {"checkpoints": AutoCaps(None, pytest.approx(cap))}
        assert c.verdicts == {"datasets": "starting"}
    activity = c.active["datasets"]
    assert (activity.since, activity.first_cut, activity.cut_reason) == (0.05, 0.05, "starting")
    # Still nothing to judge: the cut holds (few samples), it does not go deeper.
    assert c.step(2.0, active(0.5, samples=3), ck(write=cap, waited=True)) == {}
    assert c.verdicts == {"datasets": "few-samples"}
    # Judged and met: the usual rules, the cap climbs back.
    c.step(2.5, active(0.001, samples=100), ck(write=cap, waited=True))
    assert c.verdicts == {"datasets": "met"} and c.caps()["checkpoints"].write_bandwidth > cap
    # Idle, then active again: a new start (another epoch), protected again at once.
    c.step(3.0, ds(None, reads=0), ck(write=800 * MiB))
    assert "datasets" not in c.active
    c.step(3.5, active(), ck(write=800 * MiB))
    assert c.verdicts == {"datasets": "starting"} and c.active["datasets"].first_cut == 3.5


def test_cuts_made_before_any_judgement_are_undone_fast_once_the_target_is_met() -> None:
    """Three starting cuts take a storm to 1/64 of what it moved. Met windows take the cap
    halfway back there (in ratio) each: 1/8, 1/2.8, 1/1.7... and a missed window ends
    that, the usual steps again from there."""
    c = LatencyDecider(policy())
    rate = 400 * MiB
    cap = rate
    for i in range(STARTING_WINDOWS):
        c.step(i * 0.5, active(), ck(write=cap, waited=True))
        cap *= DEEPEST
    assert c.caps()["checkpoints"].write_bandwidth == pytest.approx(rate / 64)
    t = STARTING_WINDOWS * 0.5
    climbed = []
    for _ in range(3):  # met, with the least headroom: the usual step is 5 %
        c.step(t, ds(0.0049), ck(write=cap, waited=True))
        cap = c.caps()["checkpoints"].write_bandwidth
        climbed.append(cap)
        t += 0.5
    assert climbed == [pytest.approx(rate / 8), pytest.approx(rate / 8 ** 0.5),
                       pytest.approx(rate / 8 ** 0.25)]
    c.step(t, ds(0.010), ck(write=cap, waited=True))  # missed: cut, and no more shortcut
    cap = c.caps()["checkpoints"].write_bandwidth
    assert cap == pytest.approx(climbed[-1] * 0.5)
    c.step(t + 0.5, ds(0.0049), ck(write=cap, waited=True))
    assert c.caps()["checkpoints"].write_bandwidth == pytest.approx(cap * (1 + INCREASE))


def test_a_class_judged_in_its_first_window_is_not_cut_when_it_meets_its_target() -> None:
    c = LatencyDecider(policy())
    assert c.step(0.0, ds(0.002), ck(write=800 * MiB)) == {}
    assert c.verdicts == {"datasets": "met"} and c.active["datasets"].first_cut is None


def test_absolute_and_relative_targets_together_take_the_lower() -> None:
    both = RELATIVE.replace("target_read_slowdown = 1.5",
                            'target_read_slowdown = 3\ntarget_read_latency = "5ms"')
    c = LatencyDecider(parse_policy(both.format(ckpt=""), "t"))
    c.step(0.0, ds(0.004), ck(write=500 * MiB))
    assert c.verdicts == {"datasets": "met"}  # absolute 5 ms while learning
    c.step(0.5, ds(0.001), ck(write=0.0))
    assert c.targets == {"datasets": pytest.approx(0.003)}  # 3 x 1 ms < 5 ms
    c.step(1.0, ds(0.004), ck(write=500 * MiB))
    assert c.verdicts == {"datasets": "missed"}


# ------------------------------------------------------------------ from the first open


class Paths:
    """Every open is of ``data/x`` (a datasets file)."""

    epoch = 0

    def relpath_until(self, node: Any) -> tuple[str, float]:
        return "data/x", math.inf


def open_dataset(engine: PolicyQos) -> OpenCharge:
    """Open a datasets file as the filesystem does (the charge counts the open)."""
    return OpenCharge(engine, Paths(), SimpleNamespace(qos_memo=None), CTX,  # type: ignore[arg-type]
                      writing=False)


class FakeCanary:
    """A canary reporting one round trip every 2 ms while it runs: what the device's
    read latency is at that moment (it stands for a request queued behind the storm)."""

    def __init__(self, device: Device, backing: Callable[[float], float] | None = None) -> None:
        self.device = device
        self.histogram = FineHistogram()
        self.running = False
        self.started: list[float] = []
        # Reads of a class's backing file (a passthrough class), timed as `backing` says.
        self.backing_latency = backing
        self.backing: dict[str, FineHistogram] = {}
        self.watched: dict[str, int] = {}

    def snapshot(self) -> tuple[int, ...]:
        return self.histogram.snapshot()

    def watch_backing(self, class_name: str, fd: int | None) -> None:
        if fd is None:
            self.watched.pop(class_name, None)
        else:
            self.watched[class_name] = fd
            self.backing.setdefault(class_name, FineHistogram())

    def backing_snapshot(self, class_name: str) -> tuple[int, ...] | None:
        h = self.backing.get(class_name)
        return h.snapshot() if h is not None else None

    def start(self) -> None:
        self.running = True
        self.started.append(trio.current_time())

    def stop(self) -> None:
        self.running = False

    def set_interval(self, interval: float) -> None:
        pass

    async def run(self) -> None:
        while True:
            if self.running:
                now = trio.current_time()
                self.histogram.observe(int(self.device.read_latency(now) * 1e9))
                if self.backing_latency is not None:
                    for name in self.watched:
                        self.backing[name].observe(int(self.backing_latency(now) * 1e9))
            await trio.sleep(0.002)


async def _storm(engine: PolicyQos, device: Device | None = None) -> None:
    """One checkpoint writer: 1 GiB/s when nothing caps it."""
    writer = flow_for(engine, "ckpt/x", "write")
    while True:
        await writer.admit_write(1 << 20)
        if device is not None:
            device.write(trio.current_time(), 1 << 20)
        await trio.sleep(0.001)


async def _until(what: str, probe: Any, timeout: float = 5.0) -> Any:
    deadline = trio.current_time() + timeout
    while not (value := probe()):
        assert trio.current_time() < deadline, f"waited {timeout} s for {what}"
        await trio.sleep(0.005)
    return value


@mock_clock
async def test_the_first_open_into_a_running_storm_is_protected_within_one_check() -> None:
    """The bound: a cut within PROBE_CHECK (50 ms) of the first open, wherever in the
    window the open falls, before a single read is seen."""
    engine = PolicyQos(policy())
    control = LatencyLoop(engine)
    async with trio.open_nursery() as nursery:
        await nursery.start(control.run)
        nursery.start_soon(_storm, engine)
        delays = []
        for offset in (0.3, 0.02, 0.49):  # where in the window the open falls
            await trio.sleep_until(math.floor(trio.current_time() / WINDOW + 2) * WINDOW
                                   + offset)
            assert engine.auto_caps.get("checkpoints", AutoCaps()) == AutoCaps()
            opened = trio.current_time()
            charge = open_dataset(engine)
            assert charge.flow.stats.opens >= 1
            await _until("the first cut", lambda: engine.auto_caps.get("checkpoints"))
            status = control.status()["protected"][0]
            assert status["verdict"] == "starting" and status["first_cut_reason"] == "starting"
            assert status["active_since"] == status["first_cut_at"]
            delays.append(status["first_cut_at"] - opened)
            cap = engine.auto_caps["checkpoints"].write_bandwidth
            assert cap is not None and cap <= DEEPEST * 1.1 * GiB
            charge.release()  # no read, no open: idle, the cap doubles back and goes
            await _until("the release", lambda: "checkpoints" not in engine.auto_caps,
                         timeout=10.0)
        assert max(delays) <= PROBE_CHECK + 1e-6, delays
        assert control.early_ticks == 3
        nursery.cancel_scope.cancel()


def _counted_checks(control: LatencyLoop) -> list[float]:
    """The times of *control*'s checks from now on (each steers the canary once)."""
    checks: list[float] = []
    steer = control._steer_probe

    def counted() -> None:
        checks.append(trio.current_time())
        steer()

    control._steer_probe = counted  # type: ignore[method-assign]
    return checks


@mock_clock
async def test_an_idle_mount_checks_once_a_window_and_every_check_once_a_file_is_open(
        ) -> None:
    """Nothing open, nothing moving: one wake-up a window (each costs the daemon CPU).
    A reader and a storm that start together then: the reader is judged on the reads of
    its first window, missed, and the storm cut, all by the next window at the latest;
    the checks are back to every PROBE_CHECK."""
    engine = PolicyQos(policy())
    device = Device()
    control = LatencyLoop(engine)
    checks = _counted_checks(control)
    reader = flow_for(engine, "data/x", "read")

    async def read_loop() -> None:
        while True:
            waited = await reader.admit_read(65536)
            latency = device.read_latency(trio.current_time())
            await trio.sleep(latency)
            reader.stats.record_read(65536, waited, int(latency * 1e9))

    async with trio.open_nursery() as nursery:
        await nursery.start(control.run)
        await trio.sleep(2 * WINDOW)  # the first window finds everything quiet
        checks.clear()
        await trio.sleep(4 * WINDOW)
        assert 3 <= len(checks) <= 5, checks  # one a window
        charge = open_dataset(engine)
        opened = trio.current_time()
        nursery.start_soon(read_loop)
        nursery.start_soon(_storm, engine, device)
        await _until("the first cut", lambda: engine.auto_caps.get("checkpoints"))
        assert trio.current_time() - opened <= 2 * WINDOW + 1e-6
        checks.clear()
        await trio.sleep(WINDOW)
        assert len(checks) >= WINDOW / PROBE_CHECK - 1, checks  # every check again
        charge.release()
        nursery.cancel_scope.cancel()


@mock_clock
async def test_a_policy_without_a_protected_class_checks_once_a_window() -> None:
    engine = PolicyQos(parse_policy('[classes.ckpt]\npaths = ["ckpt/**"]\n'
                                    'write_bandwidth = "1GiB/s"\n[classes.default]\n', "t"))
    control = LatencyLoop(engine)
    checks = _counted_checks(control)
    async with trio.open_nursery() as nursery:
        await nursery.start(control.run)
        nursery.start_soon(_storm, engine)  # moving, but nothing above it to protect
        await trio.sleep(4 * WINDOW + 0.01)
        assert len(checks) <= 5, checks
        nursery.cancel_scope.cancel()


@mock_clock
async def test_a_class_whose_reads_are_not_seen_is_judged_on_the_canary() -> None:
    """Kernel passthrough: the reader's reads never reach the daemon; its opens and the
    canary do. A relative target still protects it: cut at the open, baseline learned
    from the canary at the floor, then the caps climb while it is met."""
    engine = PolicyQos(parse_policy(RELATIVE.format(ckpt=""), "t"))
    device = Device(base=0.001)
    canary = FakeCanary(device)
    control = LatencyLoop(engine, canary)
    control.reads_unobserved("datasets")
    trace: list[tuple[float, str, float | None]] = []
    control.on_window.append(lambda now, lc: trace.append(
        (now, lc.controller.verdicts.get("datasets", "idle"),
         engine.auto_caps.get("checkpoints", AutoCaps()).write_bandwidth)))
    async with trio.open_nursery() as nursery:
        await nursery.start(control.run)
        nursery.start_soon(canary.run)
        nursery.start_soon(_storm, engine, device)
        await trio.sleep(2.2)
        assert not canary.running and not engine.auto_caps  # idle: no canary, no cut
        opened = trio.current_time()
        charge = open_dataset(engine)  # held open: reads may go on through the kernel
        await _until("the first cut", lambda: engine.auto_caps.get("checkpoints"))
        assert control.controller.active["datasets"].first_cut - opened <= PROBE_CHECK + 1e-6
        assert canary.running and canary.started[0] - opened <= PROBE_CHECK + 1e-6
        await _until("a baseline", lambda: control.controller.baseline("datasets"),
                     timeout=10.0)
        # The device's 1 ms, plus what the storm held at its floor still adds.
        assert 0.001 <= control.controller.baseline("datasets") <= 0.0015
        await trio.sleep(5.0)
        status = control.status()["protected"][0]
        assert status["reads_observed"] is False and status["reads"] == 0
        assert status["baseline_source"] == "learned" and status["backend_seconds"] is None
        assert status["first_cut_reason"] == "starting"
        from qosfs.control.metrics import render
        from qosfs.control.snapshot import take_snapshot

        metrics = render(take_snapshot(engine, trio.current_time(),
                                       latency=control.status())).decode()
        assert 'qosfs_latency_baseline_seconds{class="datasets",source="learned"}' in metrics
        late = [row for row in trace if row[0] >= trio.current_time() - 3.0]
        assert {v for _, v, _ in late} <= {"met", "missed"}
        assert all(cap is not None and cap < 0.5 * GiB for _, _, cap in late)
        assert max(cap for _, _, cap in late if cap) > 2 * FLOOR  # climbed off the floor
        charge.release()
        await _until("the canary to stop", lambda: not canary.running)
        await _until("the release", lambda: "checkpoints" not in engine.auto_caps)
        nursery.cancel_scope.cancel()


@mock_clock
async def test_a_passthrough_class_is_judged_on_its_backing_reads_not_on_a_queue_it_skips(
) -> None:
    """The storm fills the daemon's queue (the canary's round trips grow 20 ms per GiB/s)
    but not the backing store the kernel reads the class's files from: once the canary
    times reads of a file the class holds, the class meets its target and the storm's cap
    is released -- judged on the round trips, it stayed cut (the demo's checkpoints kept
    15-18% of their capped rate)."""
    engine = PolicyQos(parse_policy(RELATIVE.format(ckpt=""), "t"))
    device = Device(base=0.001)  # the queue: what the canary's round trips wait for
    canary = FakeCanary(device, backing=lambda now: 0.0001)
    held: dict[str, int] = {}
    control = LatencyLoop(engine, canary, backing_file=held.get)
    control.reads_unobserved("datasets")
    async with trio.open_nursery() as nursery:
        await nursery.start(control.run)
        nursery.start_soon(canary.run)
        nursery.start_soon(_storm, engine, device)
        await trio.sleep(1.0)  # the storm is running when the reader starts
        charge = open_dataset(engine)
        held["datasets"] = 7
        await _until("the storm to be cut", lambda: engine.auto_caps.get("checkpoints"))
        await _until("a baseline", lambda: control.controller.baseline("datasets"))
        # From the floor the learning cut left it at, 5-25% a window: a few dozen windows.
        await _until("the cut to be released", lambda: "checkpoints" not in engine.auto_caps,
                     timeout=60.0)
        status = control.status()["protected"][0]
        assert status["verdict"] == "met" and status["reads_observed"] is False
        assert status["backend_seconds"] is not None and status["backend_seconds"] < 0.0002
        assert status["queue_seconds"] is None  # it sent the daemon nothing in the window
        assert canary.watched == {"datasets": 7}
        held.clear()  # the file closed: the canary stops reading it
        await _until("the canary to let go", lambda: not canary.watched)
        charge.release()
        nursery.cancel_scope.cancel()


@mock_clock
async def test_reads_the_kernel_served_make_a_passthrough_class_active_not_queued() -> None:
    """The kernel's reads of a passthrough class, counted into its read ops
    (qosfs.passthrough.read_counting), show it active, and do not make a window one in
    which it sent the daemon requests: it is still judged on its backing reads, and the
    storm's cut is released as when nothing counted them."""
    engine = PolicyQos(parse_policy(RELATIVE.format(ckpt=""), "t"))
    device = Device(base=0.001)
    canary = FakeCanary(device, backing=lambda now: 0.0001)
    held: dict[str, int] = {}
    control = LatencyLoop(engine, canary, backing_file=held.get)
    control.reads_unobserved("datasets")

    async def kernel_reads(stats: FlowStats) -> None:
        while True:
            stats.read_ops += 8
            stats.kernel_reads += 8
            await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        await nursery.start(control.run)
        nursery.start_soon(canary.run)
        nursery.start_soon(_storm, engine, device)
        await trio.sleep(1.0)
        charge = open_dataset(engine)
        held["datasets"] = 7
        nursery.start_soon(kernel_reads, charge.flow.stats)
        await _until("the storm to be cut", lambda: engine.auto_caps.get("checkpoints"))
        await _until("the cut to be released", lambda: "checkpoints" not in engine.auto_caps,
                     timeout=60.0)
        status = control.status()["protected"][0]
        assert status["verdict"] == "met" and status["queue_seconds"] is None
        assert engine.accounts.activity("datasets") > engine.accounts.sent("datasets")
        charge.release()
        nursery.cancel_scope.cancel()


@mock_clock
async def test_the_opens_of_a_passthrough_class_still_wait_in_the_queue() -> None:
    """A small-file loader's opens do reach the daemon: in a window in which the class
    opens files, its estimate adds the canary's round trips to its backing reads, and the
    storm that makes them wait stays cut."""
    engine = PolicyQos(parse_policy(RELATIVE.format(ckpt=""), "t"))
    device = Device(base=0.001)
    canary = FakeCanary(device, backing=lambda now: 0.0001)
    held = {"datasets": 7}
    control = LatencyLoop(engine, canary, backing_file=held.get)
    control.reads_unobserved("datasets")

    async def loader() -> None:
        while True:
            open_dataset(engine).release()
            await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        await nursery.start(control.run)
        nursery.start_soon(canary.run)
        nursery.start_soon(loader)
        await _until("a baseline", lambda: control.controller.baseline("datasets"))
        nursery.start_soon(_storm, engine, device)
        await trio.sleep(5.0)
        status = control.status()["protected"][0]
        assert status["queue_seconds"] is not None and status["backend_seconds"] is not None
        assert status["latency_seconds"] == pytest.approx(
            status["queue_seconds"] + status["backend_seconds"])
        cap = engine.auto_caps["checkpoints"].write_bandwidth
        assert cap is not None and cap < 0.5 * GiB
        nursery.cancel_scope.cancel()


@mock_clock
async def test_a_request_target_is_not_judged_on_the_backend_alone_before_the_canary_reports(
) -> None:
    """Reads on a memory-backed source take microseconds while a storm makes the
    requests wait milliseconds in the queue: a reader's first window, before the canary
    has reported, is "starting" (cut), not "met" on the backend time -- nor on what the
    canary reported in an earlier epoch, without the storm."""
    engine = PolicyQos(parse_policy(POLICY.format(ckpt="").replace(
        'latency_measure = "backend"', 'latency_measure = "request"'), "t"))
    device = Device(base=0.001)  # what the canary sees: the storm adds 20 ms per GiB/s
    canary = FakeCanary(device)
    control = LatencyLoop(engine, canary)
    verdicts: list[str] = []
    control.on_window.append(lambda now, lc: verdicts.append(lc.controller.verdicts["datasets"]))

    async def reader(charge: OpenCharge) -> None:
        while True:
            await charge.flow.admit_read(4096)
            charge.flow.stats.record_read(4096, 0.0, 10_000)  # 10 us at the backend
            await trio.sleep(0.001)

    async with trio.open_nursery() as nursery:
        await nursery.start(control.run)
        nursery.start_soon(canary.run)
        async with trio.open_nursery() as epoch:  # epoch 1, alone: the canary sees 1 ms
            charge = open_dataset(engine)
            epoch.start_soon(reader, charge)
            await _until("a judged window", lambda: verdicts and verdicts[-1] == "met")
            await trio.sleep(1.0)
            epoch.cancel_scope.cancel()
        charge.release()
        await _until("the canary to stop", lambda: not canary.running)
        assert sum(canary.histogram.counts) > 100 and not engine.auto_caps
        nursery.start_soon(_storm, engine, device)
        await trio.sleep(1.2)
        nursery.start_soon(reader, open_dataset(engine))  # epoch 2, into the storm
        await _until("the first cut", lambda: engine.auto_caps.get("checkpoints"))
        assert verdicts[-1] == "starting"
        await _until("a judged window", lambda: verdicts[-1] in ("met", "missed"))
        assert verdicts[-1] == "missed"  # the canary's ~5 ms at a quarter of the storm
        nursery.cancel_scope.cancel()


def test_the_mount_says_which_classes_reads_bypass_it_at_every_policy_check() -> None:
    """The daemon hands the loop a predicate (kernel passthrough active and the class
    eligible): a policy change or INIT's answer shows at the next check, no call needed."""
    engine = PolicyQos(parse_policy(POLICY.format(ckpt=""), "t"))
    passing = {"on": False}
    control = LatencyLoop(engine, reads_bypass=lambda rule: passing["on"])
    control._sync_policy()
    assert control.unobserved() == frozenset()
    passing["on"] = True  # INIT answered: passthrough negotiated
    control._sync_policy()
    assert control.unobserved() == {c.name for c in protected_classes(engine.policy)}


def test_a_successor_goes_on_from_where_the_decisions_stood() -> None:
    """qosfs upgrade: the state travels as JSON on time.monotonic(); the successor has the
    same caps, starts, baselines and activity on its own clock, and decides the next
    window as the old controller would have."""
    import json

    old = LatencyDecider(parse_policy(RELATIVE.format(ckpt=""), "t"))
    old.step(10.0, ds(0.004), ck(write=500 * MiB))  # learning: cut to a quarter
    for t in (10.5, 11.0, 11.5):
        old.step(t, ds(0.001), ck(write=0.5 * MiB))  # quiet: a baseline, the cap released
    old.step(12.0, ds(0.002), ck(write=500 * MiB))  # 2x the baseline: cut by 0.7
    assert old.low and old.baselines
    carried = json.loads(json.dumps(old.export_state(1000.0)))  # monotonic = trio + 1000
    new = LatencyDecider(parse_policy(RELATIVE.format(ckpt=""), "t"))
    new.import_state(carried, -1000.0 + 5.0)  # the successor's trio clock runs 5 s ahead
    assert new.caps() == old.caps() and new.state == old.state == "throttling"
    assert new.baseline("datasets") == old.baseline("datasets")
    assert new.active["datasets"].since == old.active["datasets"].since + 5.0
    assert new.low["checkpoints"].throttles["write"].start == \
        old.low["checkpoints"].throttles["write"].start
    assert new.decisions == old.decisions
    assert new.step(17.5, ds(0.003), ck(write=350 * MiB, waited=True)) == \
        old.step(12.5, ds(0.003), ck(write=350 * MiB, waited=True))
    assert new.caps() == old.caps()
    # A policy without the class's role drops what was carried for it.
    plain = LatencyDecider(parse_policy(POLICY.format(ckpt="").replace(
        'target_read_latency = "5ms"', ""), "t"))
    plain.import_state(carried, 0.0)
    assert plain.low == {} and plain.caps() == {}
