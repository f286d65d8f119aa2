"""bench/core/sampler.py: rates per window from sampled counters, the burst/tail discard and
long-window spans (pure arithmetic, no daemon)."""

from __future__ import annotations

from bench.core.sampler import (
    Sample,
    Window,
    mean_rate,
    parse_status,
    span_rates,
    steady,
    windows,
)

KEY = ("class", "capped", None)


def _samples(counts: list[float], waited: list[float] | None = None,
             dt: float = 1.0) -> list[Sample]:
    waited = waited or [0.0] * len(counts)
    return [Sample(i * dt, {KEY: {"write_bytes": c, "throttled_seconds": w}})
            for i, (c, w) in enumerate(zip(counts, waited, strict=True))]


def test_windows_are_differences_over_their_own_interval() -> None:
    samples = [Sample(0.0, {}), Sample(1.0, {KEY: {"write_bytes": 50.0}}),
               Sample(3.0, {KEY: {"write_bytes": 250.0, "throttled_seconds": 1.0}})]
    ws = windows(samples, KEY, "write_bytes")
    assert [(w.t0, w.t1, w.rate) for w in ws] == [(0.0, 1.0, 50.0), (1.0, 3.0, 100.0)]
    assert ws[1].throttled == 0.5
    # a level replaced by a reload restarts its counters: never a negative rate
    assert windows([samples[2], Sample(4.0, {KEY: {"write_bytes": 0.0}})], KEY,
                   "write_bytes")[0].rate == 0.0


def test_steady_drops_idle_edges_the_burst_window_and_the_last_active_one() -> None:
    ws = windows(_samples([0, 0, 300, 400, 500, 600, 650, 650]), KEY, "write_bytes")
    assert [w.rate for w in ws] == [0, 300, 100, 100, 100, 50, 0]
    assert [w.rate for w in steady(ws)] == [100, 100, 100]
    assert steady(ws[:3]) == []  # too short to have a steady part


def test_span_rates_cover_every_run_of_consecutive_windows() -> None:
    ws = [Window(float(i), i + 1.0, r) for i, r in enumerate([10, 20, 30, 40])]
    assert span_rates(ws, 2.0) == [15.0, 25.0, 35.0]
    assert span_rates(ws, 10.0) == [25.0]  # shorter than asked: the whole span
    assert span_rates([], 10.0) == []
    assert mean_rate(ws, 1.0, 3.0) == 25.0
    assert mean_rate(ws, 5.0, 6.0) is None


def test_parse_status_keeps_counters_per_level() -> None:
    reply = {"levels": [{"level": "user", "name": "shared", "uid": 60001, "read_bytes": 1,
                         "write_bytes": 2, "read_ops": 3, "write_ops": 4, "meta_ops": 5,
                         "throttled_seconds": 0.5, "queue_depth": 2}]}
    sample = parse_status(reply, 7.0)
    assert sample.levels[("user", "shared", 60001)]["write_bytes"] == 2.0
    assert sample.levels[("user", "shared", 60001)]["queue_depth"] == 2.0
    assert parse_status({"levels": []}, 1.0).levels == {}  # --no-qos has no levels
