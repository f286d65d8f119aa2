"""Snapshots, rates, the JSON replies and the Prometheus collector, on a fake engine."""

from __future__ import annotations

import math
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from qosfs.control.metrics import render
from qosfs.control.snapshot import RateSampler, take_snapshot, to_json
from qosfs.policy.loading import parse_policy
from qosfs.qos.bucket import NO_LIMITS, LevelLimits, Limit
from qosfs.qos.engine import PolicyQos
from qosfs.qos.interface import PassThroughQos
from qosfs.qos.levels import LevelStatistics
from qosfs.qos.stats import NO_COUNTERS, EngineCounters, EngineStatistics

MiB = 1 << 20
POLICY = parse_policy("""
[tenants.team-a]
uids = ["1000-1999"]
write_bandwidth = "1GiB/s"
[classes.ckpt]
paths = ["ckpt/**"]
write_bandwidth = "400MiB/s"
write_iops = 2000
per_user = "fair"
[classes.default]
""", "fake.toml")


def level(name: str, limits: LevelLimits = NO_LIMITS, **counters: Any) -> LevelStatistics:
    base = {"bytes_read": 0, "bytes_written": 0, "ops_read": 0, "ops_write": 0, "ops_meta": 0,
            "throttled_seconds": 0.0, "queue_depth": 0, "waits": 0}
    return LevelStatistics(name, limits, **{**base, **counters})


class FakeEngine(PolicyQos):
    """An engine of POLICY whose levels' statistics and own counters the test decides."""

    def __init__(self, written: int = 0, queue: int = 0,
                 counters: EngineCounters = NO_COUNTERS) -> None:
        super().__init__(POLICY)
        self.generation = 3
        self.written = written
        self.queue = queue
        self.fake_counters = counters

    def counters(self) -> EngineCounters:
        return self.fake_counters

    def statistics(self) -> EngineStatistics:
        ckpt = LevelLimits(write_bytes=Limit(400 * MiB, 40 * MiB), write_ops=Limit(2000, 200))
        return EngineStatistics(
            generation=3,
            classes={"ckpt": level("ckpt", ckpt, bytes_written=self.written,
                                   ops_write=self.written // MiB, queue_depth=self.queue,
                                   throttled_seconds=1.5),
                     "default": level("default")},
            users={"ckpt": {1000: level("ckpt/uid=1000", ckpt.scaled(0.5),
                                        bytes_written=self.written)}},
            tenants={"team-a": level("tenant:team-a",
                                     LevelLimits(write_bytes=Limit(1 << 30, 100 * MiB)))},
            backend=None)


def families(text: bytes) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text.decode())}


def sample(fams: dict[str, Any], family_name: str, /, **labels: str) -> float:
    family = fams[family_name]
    wanted = family_name + "_total" if family.type == "counter" else family_name
    hits = [s.value for s in family.samples
            if s.name == wanted
            and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (family_name, labels, family.samples)
    return hits[0]


def test_collector_publishes_every_family_with_conventional_names() -> None:
    engine = FakeEngine(written=64 * MiB, queue=7)
    engine.accounts.get("ckpt", "team-a", 1000).record_write(MiB, 0.25, 2_000_000)
    engine.accounts.get("default", None, None).record_read(4096, 0.0, 3_000)
    snap = take_snapshot(engine, 10.0, changes={("reload", "rejected"): 2,
                                                ("set", "applied"): 1},
                         last_reload_ok=False)
    fams = families(render(snap))
    assert set(fams) >= {
        "qosfs_read_bytes", "qosfs_write_bytes", "qosfs_ops", "qosfs_throttled_seconds",
        "qosfs_request_duration_seconds", "qosfs_backend_duration_seconds",
        "qosfs_queue_depth", "qosfs_level_throttled_seconds",
        "qosfs_limit_bytes_per_second", "qosfs_limit_ops_per_second",
        "qosfs_policy_generation", "qosfs_policy_changes", "qosfs_policy_last_reload_success"}
    acct = {"class": "ckpt", "tenant": "team-a", "uid": "1000"}
    assert sample(fams, "qosfs_write_bytes", **acct) == MiB
    assert sample(fams, "qosfs_ops", op="write", **acct) == 1
    assert sample(fams, "qosfs_throttled_seconds", **acct) == 0.25
    assert sample(fams, "qosfs_read_bytes", **{"class": "default", "tenant": "", "uid": ""}) \
        == 4096
    hist = fams["qosfs_request_duration_seconds"]
    buckets = [s for s in hist.samples if s.name.endswith("_bucket")
               and s.labels["class"] == "ckpt" and s.labels["op"] == "write"]
    assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == 1
    assert all(b.value == 0 for b in buckets if float(b.labels["le"]) < 0.25)
    backend = [s for s in fams["qosfs_backend_duration_seconds"].samples
               if s.name.endswith("_sum") and s.labels["class"] == "ckpt"
               and s.labels["op"] == "write"]
    assert backend[0].value == pytest.approx(0.002)
    lvl = {"level": "class", "class": "ckpt", "tenant": "", "uid": ""}
    assert sample(fams, "qosfs_queue_depth", **lvl) == 7
    assert sample(fams, "qosfs_level_throttled_seconds", **lvl) == 1.5
    assert sample(fams, "qosfs_limit_bytes_per_second", direction="write", **lvl) == 400 * MiB
    assert sample(fams, "qosfs_limit_ops_per_second", op="write", **lvl) == 2000
    assert sample(fams, "qosfs_limit_bytes_per_second", direction="write", level="user",
                  **{"class": "ckpt"}, tenant="", uid="1000") == 200 * MiB
    assert sample(fams, "qosfs_limit_bytes_per_second", direction="write", level="tenant",
                  **{"class": ""}, tenant="team-a", uid="") == 1 << 30
    unlimited = [s for s in fams["qosfs_limit_bytes_per_second"].samples
                 if s.labels["class"] == "default"]
    assert unlimited == []  # no cap, no series
    assert sample(fams, "qosfs_policy_generation") == 3
    assert sample(fams, "qosfs_policy_changes", command="reload", result="rejected") == 2
    assert sample(fams, "qosfs_policy_changes", command="reload", result="applied") == 0
    assert sample(fams, "qosfs_policy_last_reload_success") == 0


def test_internal_errors_are_counted_by_where_and_type() -> None:
    errors = {"read": {"KeyError": 1, "ValueError": 5}, "control": {"RuntimeError": 2}}
    fams = families(render(take_snapshot(FakeEngine(), 1.0,
                                         info={"internal_errors": errors})))
    assert sample(fams, "qosfs_internal_errors", where="read", type="ValueError") == 5
    assert sample(fams, "qosfs_internal_errors", where="control", type="RuntimeError") == 2
    assert len(fams["qosfs_internal_errors"].samples) == 3
    none = families(render(take_snapshot(FakeEngine(), 1.0, info={"internal_errors": {}})))
    assert none["qosfs_internal_errors"].samples == []  # the family is there, no series yet


def test_handovers_are_counted_by_result_every_result_from_the_start() -> None:
    fams = families(render(take_snapshot(FakeEngine(), 1.0, info={
        "handovers": 3, "handover_failures": {"refused": 0, "taken_back": 2}})))
    assert sample(fams, "qosfs_handovers", result="completed") == 3
    assert sample(fams, "qosfs_handovers", result="taken_back") == 2
    assert sample(fams, "qosfs_handovers", result="refused") == 0  # there, at 0
    fresh = families(render(take_snapshot(FakeEngine(), 1.0, info={"handovers": 0})))
    assert len(fresh["qosfs_handovers"].samples) == 3


def test_rates_come_from_consecutive_samples() -> None:
    engine = FakeEngine(written=0)
    sampler = RateSampler()
    sampler.sample(take_snapshot(engine, 100.0))
    engine.written = 200 * MiB
    sampler.sample(take_snapshot(engine, 102.0))
    assert sampler.window == 2.0
    assert sampler.levels[("class", "ckpt", None)]["write_bytes"] == 100 * MiB
    assert sampler.levels[("user", "ckpt", 1000)]["write_bytes"] == 100 * MiB
    engine.written = 0  # a level replaced by a swap restarts: no negative rate
    sampler.sample(take_snapshot(engine, 103.0))
    assert sampler.levels[("class", "ckpt", None)]["write_bytes"] == 0.0


def test_status_and_stats_json() -> None:
    engine = FakeEngine(written=10 * MiB, queue=2)
    engine.accounts.get("ckpt", None, 1000).record_write(MiB, 0.0, 5_000)
    sampler = RateSampler()
    snap = take_snapshot(engine, 1.0, info={"mountpoint": "/mnt"})
    status = to_json(snap, sampler, accounts=False)
    assert status["ok"] is True and status["qos"] is True and status["generation"] == 3
    assert status["policy_source"] == "fake.toml" and status["mountpoint"] == "/mnt"
    ckpt = next(lv for lv in status["levels"] if lv["name"] == "ckpt" and lv["level"] == "class")
    assert ckpt["limits"] == {"write_bandwidth": 400 * MiB, "write_iops": 2000}
    assert ckpt["queue_depth"] == 2 and ckpt["per_user"] is True
    assert [lv["level"] for lv in status["levels"]] == ["class", "user", "class", "tenant"]
    assert "latency" not in status["accounts"][0]
    stats = to_json(snap, sampler, accounts=True)
    lat = stats["accounts"][0]["latency"]["write_backend"]
    assert lat["count"] == 1 and lat["p99"] == 8e-6
    assert len(stats["bucket_bounds_seconds"]) + 1 == len(lat["counts"])


def test_json_has_no_infinities() -> None:
    engine = FakeEngine()
    engine.accounts.get("default", None, None).record_read(1, 0.0, 10**12)  # +Inf bucket
    body = to_json(take_snapshot(engine, 1.0), None, accounts=True)
    assert body["accounts"][-1]["latency"]["read_backend"]["p99"] is None
    assert not any(isinstance(v, float) and not math.isfinite(v)
                   for v in body["accounts"][-1]["latency"]["read_backend"].values()
                   if not isinstance(v, list))


def test_no_qos_engine_has_counters_but_no_levels() -> None:
    engine = PassThroughQos()
    engine.flow.stats.record_write(100, 0.0, 1_000)
    snap = take_snapshot(engine, 1.0)
    assert snap.qos is False and snap.levels == () and snap.generation == 0
    body = to_json(snap, None, accounts=False)
    assert body["message"].startswith("no policy")
    assert body["accounts"][0]["write_bytes"] == 100
    fams = families(render(snap))
    assert sample(fams, "qosfs_write_bytes", **{"class": "default"}) == 100
    assert sample(fams, "qosfs_policy_generation") == 0
    # Traffic only, as a --no-qos status always showed: no engine counters.
    assert not set(body) & set(NO_COUNTERS.as_status())
    assert "qosfs_parked_requests" not in fams and "qosfs_streaming_moves" not in fams


def test_the_engines_own_counters_reach_status_and_metrics_from_the_engine() -> None:
    counters = EngineCounters(streaming_moves={"default": 2},
                              rename_charged_bytes={"ckpt": 8 * MiB}, user_accounts=5,
                              users_expired=7, parked_requests=3, parked_bytes=4096,
                              parking_refused=1)
    snap = take_snapshot(FakeEngine(counters=counters), 1.0,
                         info={"inodes": 9, "inode_objects": 4, "inode_thaws": 3})
    status = to_json(snap, None, accounts=False)
    assert status["inodes"] == 9  # the filesystem's figures stay beside them
    assert {k: status[k] for k in counters.as_status()} == {
        "streaming_moves": {"default": 2}, "rename_charged_bytes": {"ckpt": 8 * MiB},
        "user_accounts": 5, "users_expired": 7, "parked_requests": 3, "parked_bytes": 4096,
        "parking_refused": 1}
    fams = families(render(snap))
    assert sample(fams, "qosfs_parked_requests") == 3
    assert sample(fams, "qosfs_parked_bytes") == 4096
    assert sample(fams, "qosfs_parking_refused") == 1
    assert sample(fams, "qosfs_user_accounts") == 5
    assert sample(fams, "qosfs_users_expired") == 7
    assert sample(fams, "qosfs_streaming_moves", **{"class": "default"}) == 2
    assert sample(fams, "qosfs_inodes") == 9
    assert sample(fams, "qosfs_inode_objects") == 4
    assert sample(fams, "qosfs_inode_thaws") == 3
