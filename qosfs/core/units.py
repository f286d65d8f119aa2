"""Parse and format the quantities a policy speaks in: sizes, bandwidths, IOPS, durations.

Why strict: a typo such as ``"400MB"`` for a bandwidth (no ``/s``) or ``"4G"`` (binary or
decimal?) that silently shifts a cap by 5% or 1000x is worse than a loud error at load
time. So only the units below are accepted, case-sensitively, and every value is
range-checked (positive, finite, not absurd). Booleans are never numbers here.

- Sizes: ``B KiB MiB GiB TiB`` (powers of 1024) and ``KB MB GB TB`` (powers of 1000); a
  TOML integer or a string of digits means bytes. Fractions round to whole bytes.
- Bandwidths: a size followed by ``/s``: ``"400MiB/s"``, ``"1.5GiB/s"``. At most 1 PiB/s.
- IOPS: a number, or a string with an optional ``k`` (10^3) or ``M`` (10^6) suffix:
  ``2000``, ``"2k"``, ``"1.5M"``. At most 1e9.
- Durations: ``ns us ms s``: ``"5ms"``, ``"250us"``. At most one hour.
- Intervals (``qosfs plan``, not policies): ``s m min h d``: ``"30m"``, ``"1.5h"``, ``"60s"``.
  At most 30 days. Kept apart from durations so a policy's ``"5m"`` stays an error rather
  than silently meaning five minutes where milliseconds were meant.

The ``format_*`` functions return the shortest spelling that parses back to exactly the
same value, which is what makes a rendered policy round-trip.

Example:
    >>> parse_bandwidth("1.5GiB/s")
    1610612736.0
    >>> format_bandwidth(419430400.0)
    '400MiB/s'
"""

from __future__ import annotations

import decimal
import json
import math
import re
from decimal import Decimal
from typing import Any

__all__ = [
    "MAX_BANDWIDTH", "MAX_IOPS", "MAX_SIZE", "UnitError",
    "format_bandwidth", "format_duration", "format_interval", "format_iops", "format_size",
    "parse_bandwidth", "parse_duration", "parse_interval", "parse_iops", "parse_size",
    "show_value",
]

PIB = 2**50
MAX_SIZE = PIB
MAX_BANDWIDTH = float(PIB)
MIN_BANDWIDTH = 1.0  # below one byte per second a "cap" is a typo, not a policy
MAX_IOPS = 1e9
MIN_IOPS = 0.01
MAX_DURATION = 3600.0
MAX_INTERVAL = 30 * 86400.0

# Insertion order matters: on equal length the earlier (binary) spelling wins.
SIZE_UNITS: dict[str, Decimal] = {
    "B": Decimal(1), "KiB": Decimal(2**10), "MiB": Decimal(2**20), "GiB": Decimal(2**30),
    "TiB": Decimal(2**40), "KB": Decimal(10**3), "MB": Decimal(10**6), "GB": Decimal(10**9),
    "TB": Decimal(10**12),
}
IOPS_UNITS: dict[str, Decimal] = {"": Decimal(1), "k": Decimal(10**3), "M": Decimal(10**6)}
DURATION_UNITS: dict[str, Decimal] = {
    "s": Decimal(1), "ms": Decimal("0.001"), "us": Decimal("0.000001"),
    "\u00b5s": Decimal("0.000001"), "ns": Decimal("0.000000001"),
}
INTERVAL_UNITS: dict[str, Decimal] = {
    "s": Decimal(1), "m": Decimal(60), "min": Decimal(60), "h": Decimal(3600),
    "d": Decimal(86400),
}

_BANDWIDTH = 'a bandwidth like "400MiB/s"'
_SIZE = 'a size like "128MiB" or a whole number of bytes'
_IOPS = 'an IOPS rate like 2000 or "2k"'
_DURATION = 'a duration like "5ms", "250us" or "1s"'
_INTERVAL = 'a time like "30m", "1.5h" or "60s"'

# Exact arithmetic: 17 significant digits times a 13-digit multiplier must not round.
_CTX = decimal.Context(prec=80)
_QUANTITY = re.compile(
    r"\s*(?P<num>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))\s*(?P<unit>[A-Za-z\u00b5]*)(?P<per>/s)?\s*"
)


_DIGITS = re.compile(r"\s*[0-9]+\s*")


class UnitError(ValueError):
    """A quantity that is malformed or out of range; the message names value and expectation."""


def show_value(value: Any) -> str:
    """Render a raw policy value the way it would be written in TOML, for error messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        text = value if len(value) <= 60 else value[:57] + "..."
        return json.dumps(text, ensure_ascii=False)
    if isinstance(value, int | float):
        text = repr(value)
        return text if len(text) <= 30 else text[:27] + "..."
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a table"
    return f"a {type(value).__name__}"


def _fail(expected: str, value: Any) -> UnitError:
    return UnitError(f"expected {expected}, got {show_value(value)}")


def _scale(number: str, unit: Decimal) -> float:
    """number * unit, rounded once; parsing and formatting share it so round trips are exact."""
    return float(_CTX.multiply(Decimal(number), unit))


def _split(value: Any, expected: str, units: dict[str, Decimal], per_second: bool
           ) -> tuple[str, Decimal]:
    if not isinstance(value, str):
        raise _fail(expected, value)
    match = _QUANTITY.fullmatch(value)
    if match is None or bool(match["per"]) != per_second or match["unit"] not in units:
        raise _fail(expected, value)
    return match["num"], units[match["unit"]]


def _check(x: float, kind: str, expected: str, value: Any, lo: tuple[float, str],
           hi: tuple[float, str]) -> float:
    """Range-check ``x``; ``lo``/``hi`` are (bound, how the message spells it)."""
    if isinstance(x, float) and math.isnan(x):  # an int (a size) may be too big for float()
        raise _fail(expected, value)
    if x <= 0:
        raise UnitError(f"expected {kind} above zero, got {show_value(value)}")
    if x < lo[0]:
        raise UnitError(f"expected {kind} of at least {lo[1]}, got {show_value(value)}")
    if x > hi[0]:
        raise UnitError(f"expected {kind} of at most {hi[1]}, got {show_value(value)}")
    return x


def parse_bandwidth(value: Any) -> float:
    """Parse ``"400MiB/s"`` into bytes per second; the unit and ``/s`` are mandatory."""
    number, unit = _split(value, _BANDWIDTH, SIZE_UNITS, per_second=True)
    return _check(_scale(number, unit), "a bandwidth", _BANDWIDTH, value,
                  (MIN_BANDWIDTH, "1B/s"), (MAX_BANDWIDTH, "1024TiB/s"))


def parse_size(value: Any) -> int:
    """Parse ``"128MiB"``, ``"4096"`` or the TOML integer ``4096`` into bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise UnitError(f"expected a size above zero, got {show_value(value)}")
        if value > MAX_SIZE:
            raise UnitError(f"expected a size of at most 1024TiB, got {show_value(value)}")
        return value
    if isinstance(value, str) and _DIGITS.fullmatch(value):
        return parse_size(int(value))
    number, unit = _split(value, _SIZE, SIZE_UNITS, per_second=False)
    exact = _CTX.multiply(Decimal(number), unit)
    size = int(exact.to_integral_value(rounding=decimal.ROUND_HALF_UP))
    if exact > 0 and size == 0:
        raise UnitError(f"expected a size of at least 1B, got {show_value(value)}")
    return int(_check(size, "a size", _SIZE, value, (1, "1B"), (MAX_SIZE, "1024TiB")))


def parse_iops(value: Any) -> float:
    """Parse ``2000``, ``2000.0``, ``"2k"`` or ``"1.5M"`` into operations per second."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value > MAX_IOPS:  # compare as int: float(10**400) would overflow
            raise UnitError(f"expected an IOPS rate of at most 1e9, got {show_value(value)}")
        x = float(value)
    elif isinstance(value, float):
        x = value
        if math.isinf(x):
            raise _fail(_IOPS, value)
    else:
        number, unit = _split(value, _IOPS, IOPS_UNITS, per_second=False)
        x = _scale(number, unit)
    return _check(x, "an IOPS rate", _IOPS, value, (MIN_IOPS, "0.01"), (MAX_IOPS, "1e9"))


def parse_duration(value: Any) -> float:
    """Parse ``"5ms"``, ``"250us"`` or ``"1s"`` into seconds; the unit is mandatory."""
    number, unit = _split(value, _DURATION, DURATION_UNITS, per_second=False)
    return _check(_scale(number, unit), "a duration", _DURATION, value, (1e-9, "1ns"),
                  (MAX_DURATION, "3600s"))


def parse_interval(value: Any) -> float:
    """Parse ``"30m"``, ``"1.5h"``, ``"60s"`` or ``"2d"`` into seconds; the unit is mandatory.

    For the human-scale times of capacity planning (checkpoint intervals, tolerable stalls),
    which policy durations (at most an hour, ``m`` not accepted) cannot spell.
    """
    number, unit = _split(value, _INTERVAL, INTERVAL_UNITS, per_second=False)
    return _check(_scale(number, unit), "a time", _INTERVAL, value, (1e-3, "1ms"),
                  (MAX_INTERVAL, "30d"))


def _positional(d: Decimal) -> str:
    """A Decimal as plain digits (no exponent, no trailing zeros): TOML- and regex-friendly."""
    text = format(d, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def _shortest(x: float, units: dict[str, Decimal], suffix: str) -> str:
    """The shortest ``number+unit+suffix`` that :func:`_scale` maps back to exactly ``x``."""
    exact = Decimal(repr(float(x)))  # shortest decimal that round-trips to x
    best: str | None = None
    for name, unit in units.items():
        number = _positional(_CTX.divide(exact, unit))
        if unit != 1 and Decimal(number) < 1:
            continue
        if _scale(number, unit) != x:
            continue
        spelled = f"{number}{name}{suffix}"
        if best is None or len(spelled) < len(best):
            best = spelled
    if best is None:  # unreachable for finite x: the unit-1 spelling is always exact
        raise UnitError(f"cannot format {x!r}")
    return best


def format_bandwidth(bps: float) -> str:
    """Bytes per second as the shortest exact spelling, e.g. ``"400MiB/s"``."""
    return _shortest(bps, SIZE_UNITS, "/s")


def format_size(nbytes: int) -> str:
    """Bytes as the shortest exact spelling, e.g. ``"64MiB"`` or ``"1000B"``."""
    best = f"{nbytes}B"
    for name, unit in SIZE_UNITS.items():
        quotient = _CTX.divide(Decimal(nbytes), unit)
        if quotient >= 1 and len(spelled := f"{_positional(quotient)}{name}") < len(best):
            best = spelled
    return best


def format_iops(iops: float) -> str:
    """Operations per second as the shortest exact spelling, e.g. ``"2k"`` or ``"150"``."""
    return _shortest(iops, IOPS_UNITS, "")


def format_duration(seconds: float) -> str:
    """Seconds as the shortest exact spelling, e.g. ``"5ms"``."""
    return _shortest(seconds, DURATION_UNITS, "")


def format_interval(seconds: float) -> str:
    """Seconds as the shortest exact :func:`parse_interval` spelling, e.g. ``"10m"``."""
    return _shortest(seconds, INTERVAL_UNITS, "")
