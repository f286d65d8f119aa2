"""Fitting a table to a width: steps apply in order and only while it is too wide, the
kept column never gives way, cut cells say so, and wrapped text keeps its parts whole."""

from __future__ import annotations

import pytest

from qosfs.control.columns import ABBREVIATE, DROP, DROP_IF_EMPTY, SHORTEN, Step, fit, wrap

HEADERS = ["NAME", "OWNER", "LIMITS", "THROTTLED", "TOTAL"]
ROWS = [["ckpt", "", "r:1GiB/s w:400MiB/s", "0.25", "12GiB"],
        ["data", "", "r:2GiB/s", "0.00", "3GiB"]]
STEPS = (Step(DROP, "TOTAL"), Step(DROP_IF_EMPTY, "OWNER"),
         Step(ABBREVIATE, "THROTTLED", short="THR"), Step(SHORTEN, "LIMITS", floor=10),
         Step(DROP, "THROTTLED"))


def _names(width: int | None, **kwargs: object) -> tuple[str, ...]:
    return fit(HEADERS, ROWS, width, STEPS, **kwargs).headers  # type: ignore[arg-type]


def test_wide_enough_nothing_gives_way() -> None:
    full = fit(HEADERS, ROWS, None, STEPS)
    assert full.headers == tuple(HEADERS) and full.rows == tuple(map(tuple, ROWS))
    width = len(full.lines()[1])
    assert fit(HEADERS, ROWS, width, STEPS) == full
    assert _names(width - 1) == ("NAME", "OWNER", "LIMITS", "THROTTLED")


def test_steps_apply_in_order_until_the_table_fits() -> None:
    assert _names(49) == ("NAME", "OWNER", "LIMITS", "THROTTLED")
    assert _names(42) == ("NAME", "LIMITS", "THROTTLED")  # then the empty OWNER
    assert _names(35) == ("NAME", "LIMITS", "THR")
    cut = fit(HEADERS, ROWS, 30, STEPS)
    assert cut.headers == ("NAME", "LIMITS", "THR") and cut.lines()[1] == (
        "ckpt  r:1GiB/s w:400MiB…  0.25")  # cut to what fits, ending in …
    assert all(len(line) <= 30 for line in cut.lines())
    # Below the floor the next step drops a column, and the cut column gets the room back.
    assert fit(HEADERS, ROWS, 21, STEPS).lines() == [
        "NAME  LIMITS", "ckpt  r:1GiB/s w:400…", "data  r:2GiB/s"]


def test_a_column_with_values_is_not_dropped_as_empty() -> None:
    rows = [[*ROWS[0][:1], "team", *ROWS[0][2:]], ROWS[1]]
    assert "OWNER" in fit(HEADERS, rows, 49, STEPS).headers


def test_the_kept_column_never_gives_way_and_its_suffix_counts() -> None:
    kept = fit(HEADERS, ROWS, 20, STEPS, keep=frozenset({4}), suffix={4: " ▼"})
    assert kept.headers == ("NAME", "LIMITS", "TOTAL ▼")
    assert kept.rows[0] == ("ckpt", "r:1GiB/s…", "12GiB")  # cut to its floor, not below
    assert len(kept.lines()[1]) > 20  # the caller crops what still does not fit


def test_narrower_never_shows_more() -> None:
    wider = set(range(len(HEADERS)))
    for width in range(60, 0, -1):
        shown = set(fit(HEADERS, ROWS, width, STEPS).columns)
        assert shown <= wider, width
        wider = shown


def test_a_step_naming_no_column_is_a_bug() -> None:
    with pytest.raises(ValueError):
        fit(HEADERS, ROWS, 80, (Step(DROP, "NOSUCH"),))


def test_no_rows_still_fit_by_their_headers() -> None:
    assert fit(HEADERS, [], 25, STEPS).headers == ("NAME", "LIMITS", "THROTTLED")


def test_wrap_keeps_parts_whole_and_cuts_only_a_part_too_long_for_a_line() -> None:
    parts = ["sort: IO/s descending", "filter: none", "idle users: folded"]
    assert wrap(parts, "   ", None) == ["sort: IO/s descending   filter: none   idle users: folded"]
    assert wrap(parts, "   ", 40) == ["sort: IO/s descending   filter: none", "idle users: folded"]
    assert wrap(parts, "   ", 12) == ["sort: IO/s…", "filter: none", "idle users:…"]
    assert wrap([], "; ", 10) == []
