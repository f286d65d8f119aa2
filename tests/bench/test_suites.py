"""The pure arithmetic of the benchmark suites: cap errors, step settle times, parked
writer figures, expected priority shares and fair-share phases."""

from __future__ import annotations

import pytest

from bench.core.sampler import Sample, Window
from bench.suites.caps import analyse
from bench.suites.fairshare import IDLE_AFTER, SKIP, UIDS, phase_table
from bench.suites.live_change.writes import analyse_parked, binned_rates, settle_delay
from bench.suites.priorities import expected_shares


def test_cap_analysis_reports_signed_worst_errors() -> None:
    rates = [0, 150, 100, 95, 100, 100, 15]  # idle, burst, steady..., the job's end
    waited = [0, 1, 2, 0, 3, 3, 0]  # seconds waited per second, summed over requests
    ws = [Window(float(i), i + 1.0, r, w) for i, (r, w) in
          enumerate(zip(rates, waited, strict=True))]
    r = analyse(ws, 100.0, 10.0)
    assert r["windows"] == 4
    assert r["worst_1s_pct"] == -5.0
    assert r["worst_long_pct"] == pytest.approx(-1.25)
    assert r["achieved"] == pytest.approx(98.75)
    assert r["idle_windows"] == 1  # one steady window in which nothing waited
    assert r["waiting"] == [2, 0, 3, 3]
    assert analyse([], 100.0, 10.0) == {"windows": 0}


def test_binned_rates_and_settle_delay() -> None:
    block = 10
    # 10 writes/s until t=1 (the change), then 100 writes/s from t=1.2
    done = [i / 10 for i in range(10)] + [1.2 + i / 100 for i in range(100)]
    bins = binned_rates(done, block, 0.0, 2.0, 0.5)
    assert bins == [(0.0, 100.0), (0.5, 100.0), (1.0, 600.0), (1.5, 1000.0)]
    delay = settle_delay(done, block, sent=1.0, until=2.2, cap=1000.0)
    assert delay == pytest.approx(0.2)
    assert settle_delay(done, block, sent=1.0, until=2.2, cap=5000.0) is None


def test_parked_writer_figures() -> None:
    done = [0.0, 1.0, 2.0, 3.05] + [3.05 + (i + 1) / 100 for i in range(20)]
    r = analyse_parked(done, lowered=0.0, sent=3.0, replied=3.002)
    assert r["delay_ms"] == pytest.approx(50.0)
    assert r["round_trip_ms"] == pytest.approx(2.0)
    assert r["rate_after_mib_s"] == pytest.approx(100.0)
    assert r["rate_before_mib_s"] == pytest.approx(1.0)


@pytest.mark.parametrize(("demand", "expected"), [
    ({"high": (100, 0), "low": (1, 0)}, {"high": 1000 * 100 / 101, "low": 1000 / 101}),
    ({"high": (100, 0), "low": (1, 300)}, {"high": 700, "low": 300}),
    ({"high": (100, 600), "low": (1, 300)}, {"high": 700, "low": 300}),  # min is a floor
    ({"low": (1, 0)}, {"low": 1000}),
    ({"a": (10, 500), "b": (10, 0), "c": (10, 0)}, {"a": 500, "b": 250, "c": 250}),
])
def test_expected_shares(demand: dict[str, tuple[float, float]],
                         expected: dict[str, float]) -> None:
    shares = expected_shares(1000.0, demand)
    assert shares == pytest.approx(expected)


def test_fair_share_phases_skip_start_up_and_the_idle_hold_after_a_departure() -> None:
    a, b, c = (("user", "shared", uid) for uid in UIDS)
    phase_s, dt = 4, 0.5
    samples, totals = [], {a: 0.0, b: 0.0, c: 0.0}
    for step in range(int(4 * phase_s / dt) + 1):
        t = step * dt
        samples.append(Sample(t, {k: {"write_bytes": v} for k, v in totals.items()}))
        phase = int(t // phase_s)
        active = [a] + ([b] if phase >= 1 else []) + ([c] if phase == 2 else [])
        held = phase == 3 and t - 3 * phase_s < IDLE_AFTER  # c's share is still held
        for k in active:
            rate = 120.0 / (3 if held else len(active))
            if t - phase * phase_s < SKIP and phase in (1, 2):
                rate *= 0.5  # a newcomer's start-up disturbs the first second
            totals[k] += rate * dt
    table = phase_table(samples, 0.0, phase_s, 120.0)
    assert [row["active"] for row in table] == [[UIDS[0]], list(UIDS[:2]), list(UIDS),
                                               list(UIDS[:2])]
    assert [row["share"] for row in table] == [120.0, 60.0, 40.0, 60.0]
    assert [row["skipped_s"] for row in table] == [SKIP, SKIP, SKIP, SKIP + IDLE_AFTER]
    assert all(row["worst_pct"] == pytest.approx(0.0) for row in table)
