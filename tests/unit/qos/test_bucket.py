"""TokenBucket arithmetic: pure functions of an injected clock, so every figure is exact."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qosfs.qos.bucket import TokenBucket

MiB = 1024 * 1024


def test_starts_full_without_a_clock() -> None:
    b = TokenBucket(rate=10.0, burst=5.0)
    assert b.delay_for(5.0, now=123.0) == 0.0
    assert b.tokens == 5.0
    assert b.updated == 123.0


def test_refill_is_lazy_and_capped_at_burst() -> None:
    b = TokenBucket(rate=10.0, burst=5.0, tokens=0.0, updated=0.0)
    b.refill(0.2)
    assert b.tokens == pytest.approx(2.0)
    b.refill(100.0)
    assert b.tokens == 5.0


def test_stale_now_never_removes_tokens() -> None:
    b = TokenBucket(rate=10.0, burst=5.0, tokens=1.0, updated=10.0)
    b.refill(9.0)
    assert (b.tokens, b.updated) == (1.0, 10.0)


def test_take_within_balance_has_no_delay() -> None:
    b = TokenBucket(rate=10.0, burst=5.0)
    assert b.take(5.0, now=0.0) == 0.0
    assert b.tokens == 0.0


def test_take_larger_than_burst_goes_into_debt() -> None:
    b = TokenBucket(rate=MiB, burst=MiB)
    assert b.take(10 * MiB, now=0.0) == pytest.approx(9.0)
    assert b.tokens == -9 * MiB
    # The next request pays: 9 s of debt plus its own 1 MiB.
    assert b.delay_for(MiB, now=0.0) == pytest.approx(10.0)


def test_try_take_admits_oversized_request_on_a_full_bucket_only() -> None:
    b = TokenBucket(rate=MiB, burst=MiB, tokens=0.5 * MiB, updated=0.0)
    assert not b.try_take(10 * MiB, now=0.0)
    assert b.tokens == 0.5 * MiB  # a refusal changes nothing
    assert b.delay_for(10 * MiB, now=0.0) == pytest.approx(0.5)
    assert b.try_take(10 * MiB, now=0.5)
    assert b.tokens == pytest.approx(-9 * MiB)


def test_delay_for_does_not_charge() -> None:
    b = TokenBucket(rate=4.0, burst=4.0, tokens=1.0, updated=0.0)
    assert b.delay_for(3.0, now=0.0) == pytest.approx(0.5)
    assert b.tokens == 1.0
    assert b.delay_for(3.0, now=0.5) == 0.0


def test_refund_restores_and_caps_at_burst() -> None:
    b = TokenBucket(rate=10.0, burst=5.0)
    b.take(4.0, now=0.0)
    b.refund(4.0)
    assert b.tokens == 5.0
    b.refund(100.0)
    assert b.tokens == 5.0


def test_unlimited_is_a_no_op() -> None:
    b = TokenBucket()
    assert b.unlimited
    assert b.take(1e18, now=0.0) == 0.0
    assert b.try_take(1e18, now=0.0)
    assert b.delay_for(1e18, now=0.0) == 0.0
    b.refund(5.0)
    assert b.tokens == math.inf


@pytest.mark.parametrize(
    ("rate", "burst", "message"),
    [
        (0.0, 1.0, r"rate must be > 0 \(math.inf = unlimited\), got 0.0"),
        (-1.0, 1.0, r"rate must be > 0"),
        (math.nan, 1.0, r"rate must be > 0"),
        (1.0, 0.0, r"burst must be finite and > 0 for a finite rate, got 0.0"),
        (1.0, math.inf, r"burst must be finite and > 0 for a finite rate, got inf"),
    ],
)
def test_rejects_invalid_parameters(rate: float, burst: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TokenBucket(rate, burst)
    with pytest.raises(ValueError, match=message):
        TokenBucket(1.0, 1.0).set_rate(rate, burst, now=0.0)


def test_set_rate_refills_at_old_rate_first() -> None:
    b = TokenBucket(rate=1.0, burst=10.0, tokens=0.0, updated=0.0)
    b.set_rate(100.0, 10.0, now=2.0)
    assert b.tokens == pytest.approx(2.0)  # earned at 1/s, not 100/s
    assert b.updated == 2.0


def test_set_rate_keeps_fill_fraction_of_positive_balance() -> None:
    b = TokenBucket(rate=MiB, burst=MiB, tokens=0.4 * MiB, updated=0.0)
    b.set_rate(1024 * MiB, 64 * MiB, now=0.0)
    assert b.tokens == pytest.approx(0.4 * 64 * MiB)
    b.set_rate(MiB, MiB, now=0.0)  # lowering scales down too: never above the new burst
    assert b.tokens == pytest.approx(0.4 * MiB)


def test_raising_rate_keeps_debt_in_tokens() -> None:
    b = TokenBucket(rate=MiB, burst=MiB)
    b.take(10 * MiB, now=0.0)  # 9 MiB of debt: 9 s at 1 MiB/s
    b.set_rate(1024 * MiB, 64 * MiB, now=0.0)
    assert b.tokens == -9 * MiB
    assert b.take(0, now=0.0) == pytest.approx(9 / 1024)


def test_lowering_rate_never_lengthens_the_debt_wait() -> None:
    b = TokenBucket(rate=1024 * MiB, burst=64 * MiB)
    b.take(64 * MiB + 512 * MiB, now=0.0)  # 0.5 s of debt at 1 GiB/s
    b.set_rate(MiB, MiB, now=0.0)
    assert b.take(0, now=0.0) == pytest.approx(0.5)  # not 512 s
    assert b.tokens == pytest.approx(-0.5 * MiB)


def test_same_rate_change_keeps_debt() -> None:
    b = TokenBucket(rate=MiB, burst=MiB)
    b.take(10 * MiB, now=0.0)
    b.set_rate(MiB, 2 * MiB, now=0.0)
    assert b.tokens == -9 * MiB


def test_switching_between_limited_and_unlimited() -> None:
    b = TokenBucket(rate=10.0, burst=5.0)
    b.take(50.0, now=0.0)
    b.set_rate(math.inf, math.inf, now=1.0)
    assert b.unlimited and b.take(1e9, now=1.0) == 0.0
    b.set_rate(10.0, 5.0, now=2.0)
    assert (b.tokens, b.updated) == (5.0, 2.0)  # fresh and full: unlimited has no debt


@given(
    rate=st.floats(1.0, 1e9),
    burst_s=st.floats(0.01, 2.0),
    sizes=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=60),
)
def test_greedy_admission_follows_the_fluid_envelope(
    rate: float, burst_s: float, sizes: list[float]
) -> None:
    """Admitting each request at the instant ``delay_for`` names is exact: the n-th request
    goes at ``(admitted_before + min(n, burst) - burst) / rate`` (or at 0), never earlier --
    the cap holds -- and never later -- no token is lost to rounding or to the burst cap."""
    burst = rate * burst_s
    b = TokenBucket(rate, burst)
    now = before = 0.0
    for factor in sizes:
        n = factor * burst
        now += b.delay_for(n, now)
        b.take(n, now)
        expected = max(0.0, (before + min(n, burst) - burst) / rate)
        assert now == pytest.approx(expected, rel=1e-9, abs=1e-9)
        assert b.tokens <= burst
        before += n
