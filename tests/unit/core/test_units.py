"""Sizes, bandwidths, IOPS and durations: strict parsing, exact round trips."""

from __future__ import annotations

import contextlib
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qosfs.core.units import (
    UnitError,
    format_bandwidth,
    format_duration,
    format_iops,
    format_size,
    parse_bandwidth,
    parse_duration,
    parse_interval,
    parse_iops,
    parse_size,
)

KIB, MIB, GIB, TIB = 2**10, 2**20, 2**30, 2**40


@pytest.mark.parametrize(("text", "expected"), [
    ("400MiB/s", 400 * MIB),
    ("1.5GiB/s", 1.5 * GIB),
    ("4GiB/s", 4 * GIB),
    ("1TiB/s", TIB),
    ("100B/s", 100),
    ("64KiB/s", 64 * KIB),
    ("400MB/s", 400e6),
    ("1GB/s", 1e9),
    ("2KB/s", 2000),
    ("1TB/s", 1e12),
    (" 400 MiB/s ", 400 * MIB),
    ("0.5KiB/s", 512),
    (".5MiB/s", MIB / 2),
])
def test_parse_bandwidth(text: str, expected: float) -> None:
    assert parse_bandwidth(text) == expected


@pytest.mark.parametrize(("value", "message"), [
    ("400MB", 'expected a bandwidth like "400MiB/s", got "400MB"'),
    ("400", 'expected a bandwidth like "400MiB/s", got "400"'),
    (400, 'expected a bandwidth like "400MiB/s", got 400'),
    (True, 'expected a bandwidth like "400MiB/s", got true'),
    ("400mib/s", 'expected a bandwidth like "400MiB/s", got "400mib/s"'),
    ("4G/s", 'expected a bandwidth like "400MiB/s", got "4G/s"'),
    ("4Gi/s", 'expected a bandwidth like "400MiB/s", got "4Gi/s"'),
    ("1e3MiB/s", 'expected a bandwidth like "400MiB/s", got "1e3MiB/s"'),
    ("nan", 'expected a bandwidth like "400MiB/s", got "nan"'),
    (float("nan"), 'expected a bandwidth like "400MiB/s", got nan'),
    ("unlimited", 'expected a bandwidth like "400MiB/s", got "unlimited"'),
    ([1], 'expected a bandwidth like "400MiB/s", got a list'),
    ("0MiB/s", 'expected a bandwidth above zero, got "0MiB/s"'),
    ("-5MiB/s", 'expected a bandwidth above zero, got "-5MiB/s"'),
    ("0.5B/s", 'expected a bandwidth of at least 1B/s, got "0.5B/s"'),
    ("1025TiB/s", 'expected a bandwidth of at most 1024TiB/s, got "1025TiB/s"'),
    pytest.param("9" * 400 + "B/s", 'expected a bandwidth of at most 1024TiB/s, got "999',
                 id="huge-str"),
])
def test_parse_bandwidth_rejects(value: object, message: str) -> None:
    with pytest.raises(UnitError) as info:
        parse_bandwidth(value)
    assert str(info.value).startswith(message)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(("value", "expected"), [
    (4096, 4096), ("4096", 4096), ("128MiB", 128 * MIB), ("64MiB", 64 * MIB), ("1KB", 1000),
    ("1.5GiB", 3 * GIB // 2), ("0.3KiB", 307), ("1B", 1), ("2TiB", 2 * TIB),
])
def test_parse_size(value: object, expected: int) -> None:
    assert parse_size(value) == expected
    assert isinstance(parse_size(value), int)


@pytest.mark.parametrize(("value", "message"), [
    (0, "expected a size above zero, got 0"),
    (-1, "expected a size above zero, got -1"),
    ("0.1B", 'expected a size of at least 1B, got "0.1B"'),
    (1.5, 'expected a size like "128MiB" or a whole number of bytes, got 1.5'),
    ("4G", 'expected a size like "128MiB" or a whole number of bytes, got "4G"'),
    ("4MiB/s", 'expected a size like "128MiB" or a whole number of bytes, got "4MiB/s"'),
    (False, 'expected a size like "128MiB" or a whole number of bytes, got false'),
    (2**51, "expected a size of at most 1024TiB, got 2251799813685248"),
    ("\u00b2", 'expected a size like "128MiB" or a whole number of bytes, got "\u00b2"'),
])
def test_parse_size_rejects(value: object, message: str) -> None:
    with pytest.raises(UnitError, match=f"^{re.escape(message)}$"):
        parse_size(value)


@pytest.mark.parametrize(("value", "expected"), [
    (2000, 2000.0), (0.5, 0.5), ("2k", 2000.0), ("1.5M", 1.5e6), ("150", 150.0),
    ("2.5", 2.5), (10**9, 1e9),
])
def test_parse_iops(value: object, expected: float) -> None:
    assert parse_iops(value) == expected


@pytest.mark.parametrize(("value", "message"), [
    (0, "expected an IOPS rate above zero, got 0"),
    (-3, "expected an IOPS rate above zero, got -3"),
    (True, 'expected an IOPS rate like 2000 or "2k", got true'),
    (math.inf, 'expected an IOPS rate like 2000 or "2k", got inf'),
    (math.nan, 'expected an IOPS rate like 2000 or "2k", got nan'),
    ("2K", 'expected an IOPS rate like 2000 or "2k", got "2K"'),
    ("2k/s", 'expected an IOPS rate like 2000 or "2k", got "2k/s"'),
    (10**9 + 1, "expected an IOPS rate of at most 1e9, got 1000000001"),
    ("1001M", 'expected an IOPS rate of at most 1e9, got "1001M"'),
    pytest.param(10**400, "expected an IOPS rate of at most 1e9, got 1000000000000000000000000"
                 "00...", id="huge-int"),
])
def test_parse_iops_rejects(value: object, message: str) -> None:
    with pytest.raises(UnitError, match=f"^{re.escape(message)}$"):
        parse_iops(value)


@pytest.mark.parametrize(("text", "expected"), [
    ("5ms", 0.005), ("250us", 0.00025), ("250\u00b5s", 0.00025), ("1s", 1.0), ("7ns", 7e-9),
])
def test_parse_duration(text: str, expected: float) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("value", ["5", 5, "5 min", "0ms", "2h", "3601s"])
def test_parse_duration_rejects(value: object) -> None:
    with pytest.raises(UnitError, match="duration"):
        parse_duration(value)


@pytest.mark.parametrize(("text", "expected"), [
    ("30m", 1800.0), ("30min", 1800.0), ("1.5h", 5400.0), ("60s", 60.0), ("2d", 172800.0),
    (" 90 m ", 5400.0), ("0.5s", 0.5), ("30d", 30 * 86400.0),
])
def test_parse_interval(text: str, expected: float) -> None:
    assert parse_interval(text) == expected


@pytest.mark.parametrize(("value", "message"), [
    ("30", 'expected a time like "30m", "1.5h" or "60s", got "30"'),
    (1800, 'expected a time like "30m", "1.5h" or "60s", got 1800'),
    ("5ms", 'expected a time like "30m", "1.5h" or "60s", got "5ms"'),
    ("30M", 'expected a time like "30m", "1.5h" or "60s", got "30M"'),
    ("1h30m", 'expected a time like "30m", "1.5h" or "60s", got "1h30m"'),
    ("0m", 'expected a time above zero, got "0m"'),
    ("-1h", 'expected a time above zero, got "-1h"'),
    ("0.0001s", 'expected a time of at least 1ms, got "0.0001s"'),
    ("31d", 'expected a time of at most 30d, got "31d"'),
])
def test_parse_interval_rejects(value: object, message: str) -> None:
    with pytest.raises(UnitError, match=f"^{re.escape(message)}$"):
        parse_interval(value)


@pytest.mark.parametrize(("bps", "text"), [
    (400 * MIB, "400MiB/s"), (1.5 * GIB, "1.5GiB/s"), (4 * GIB, "4GiB/s"), (1e9, "1GB/s"),
    (1024, "1KiB/s"), (3, "3B/s"), (400e6, "400MB/s"), (1234.5, "1234.5B/s"),
])
def test_format_bandwidth(bps: float, text: str) -> None:
    assert format_bandwidth(bps) == text


def test_format_others() -> None:
    assert format_size(64 * MIB) == "64MiB"
    assert format_size(1_048_577) == "1048577B"
    assert format_size(1000) == "1KB"
    assert format_iops(2000.0) == "2k"
    assert format_iops(150.0) == "150"
    assert format_iops(1.5e6) == "1.5M"
    assert format_duration(0.005) == "5ms"
    assert format_duration(0.00025) == "250us"


@settings(derandomize=True, max_examples=300)
@given(st.floats(min_value=1.0, max_value=2.0**50))
def test_bandwidth_round_trip(bps: float) -> None:
    assert parse_bandwidth(format_bandwidth(bps)) == bps


@settings(derandomize=True, max_examples=300)
@given(st.integers(min_value=1, max_value=2**50))
def test_size_round_trip(nbytes: int) -> None:
    assert parse_size(format_size(nbytes)) == nbytes


@settings(derandomize=True, max_examples=300)
@given(st.floats(min_value=0.01, max_value=1e9))
def test_iops_and_duration_round_trip(x: float) -> None:
    assert parse_iops(format_iops(x)) == x
    seconds = x / 1e6 + 1e-9
    assert parse_duration(format_duration(seconds)) == seconds


@settings(derandomize=True, max_examples=500)
@given(st.one_of(st.text(max_size=20), st.integers(), st.floats(), st.booleans(), st.none()))
def test_parsers_raise_only_unit_error(value: object) -> None:
    for parse in (parse_bandwidth, parse_size, parse_iops, parse_duration):
        with contextlib.suppress(UnitError):
            parse(value)


# Quantities as a hostile or careless policy writes them: hundreds of digits, signs,
# zeros, fractions far below a unit, NaN/inf spellings, any unit or none.
_HOSTILE_QUANTITY = st.builds(
    lambda sign, whole, frac, space, unit, per: f"{sign}{whole}{frac}{space}{unit}{per}",
    st.sampled_from(["", "+", "-"]),
    st.one_of(st.integers(0, 10**400).map(str), st.from_regex(r"0[0-9]{0,30}", fullmatch=True),
              st.sampled_from(["nan", "inf", "1e400", ""])),
    st.one_of(st.just(""), st.from_regex(r"\.[0-9]{0,400}", fullmatch=True)),
    st.sampled_from(["", " "]),
    st.sampled_from(["", "B", "KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "TB", "k", "M",
                     "ns", "us", "ms", "s", "m", "h", "d", "b", "mib", "\u00b5s"]),
    st.sampled_from(["", "/s"]))


@settings(derandomize=True, max_examples=400, deadline=None)
@given(_HOSTILE_QUANTITY)
def test_hostile_quantities_are_values_or_unit_errors(value: str) -> None:
    for parse in (parse_bandwidth, parse_size, parse_iops, parse_duration, parse_interval):
        try:
            x = parse(value)
        except UnitError as exc:
            assert "\n" not in str(exc) and str(exc).startswith("expected ")
        else:
            assert 0 < x < float("inf")


def test_a_size_with_hundreds_of_digits_is_out_of_range_not_a_crash() -> None:
    with pytest.raises(UnitError, match="^expected a size of at most 1024TiB, got "):  # noqa: RUF043
        parse_size("9" * 400 + "KiB")
