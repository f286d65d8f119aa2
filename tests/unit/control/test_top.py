"""``qosfs top``'s rows without a daemon: sorting, filtering, folding idle users, keys,
and what a frame says about rates and totals; and its cost with a thousand users."""

from __future__ import annotations

import argparse
import importlib.util
import io
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from qosfs.control import top
from qosfs.core.errors import EXIT_USAGE, QosfsError

MiB = 1 << 20
ZERO = {"read_bytes": 0.0, "write_bytes": 0.0, "read_ops": 0.0, "write_ops": 0.0,
        "meta_ops": 0.0, "throttled_seconds": 0.0}


def _account(cls: str, uid: int | None, write_rate: float = 0.0, tenant: str | None = None,
             written: int = 0) -> dict[str, Any]:
    return {"class": cls, "tenant": tenant, "uid": uid, "read_bytes": 0,
            "write_bytes": written, "read_ops": 0, "write_ops": 0, "meta_ops": 0,
            "throttled_seconds": 0.0,
            "rates": {**ZERO, "write_bytes": write_rate, "write_ops": write_rate / MiB}}


def _reply(accounts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"ok": True, "qos": True, "generation": 1, "policy_source": "p.toml",
            "source": "/srv", "mountpoint": "/mnt", "pid": 7, "uptime_seconds": 9.0,
            "changes": [], "last_reload_ok": True, "window_seconds": 1.0,
            "levels": [{"level": "class", "name": "ckpt", "uid": None,
                        "limits": {"write_bandwidth": 400 * MiB}, "queue_depth": 3,
                        "throttled_seconds": 1.0, "rates": ZERO},
                       {"level": "tenant", "name": "team", "uid": None,
                        "limits": {"write_bandwidth": 1 << 30}, "queue_depth": 0,
                        "throttled_seconds": 0.0, "rates": ZERO}],
            "accounts": accounts}


REPLY = _reply([
    _account("data", None, 0.0, written=5 * MiB),
    _account("ckpt", 1001, 300 * MiB, tenant="team"),
    _account("ckpt", 1002, 100 * MiB),
    _account("ckpt", 1003), _account("ckpt", 1004), _account("ckpt", 1005),
])
HEADERS = [c.header for c in top.COLUMNS]
UID = HEADERS.index("UID")
CLASS = HEADERS.index("CLASS")
WRITTEN = HEADERS.index("WRITTEN total")


def test_busiest_first_and_idle_users_fold_into_one_row() -> None:
    rows = top.table_rows(REPLY, top.View())
    assert [r[UID] for r in rows] == ["1001", "1002", "", "3 idle users"]
    assert rows[0][[c.header for c in top.COLUMNS].index("WRITE/s")] == "300MiB/s"
    assert rows[0][[c.header for c in top.COLUMNS].index("LIMITS")] == "w:400MiB/s"
    unfolded = top.table_rows(REPLY, top.View(collapse_idle=False))
    assert len(unfolded) == 6
    view = top.View()
    view.key("i")
    assert len(top.table_rows(REPLY, view)) == 6 and "idle users: shown" in view.status_line()
    view.key("i")
    assert len(top.table_rows(REPLY, view)) == 4


def test_idle_users_fold_per_class_and_keep_their_totals() -> None:
    reply = _reply([_account("ckpt", 1, 0.0, written=3), _account("ckpt", 2, 0.0, written=4),
                    _account("data", 5, 0.0, written=10), _account("data", 6, MiB)])
    rows = top.table_rows(reply, top.View(sort=CLASS, reverse=False))
    assert [(r[CLASS], r[UID]) for r in rows] == [("ckpt", "2 idle users"), ("data", "6"),
                                                   ("data", "1 idle user")]
    assert rows[0][WRITTEN] == "7B"


def test_keys_choose_the_sort_column_and_its_order() -> None:
    view = top.View()
    assert view.key(">") and top.COLUMNS[view.sort].header == "READ/s"
    assert view.key("<") and view.key("<") and top.COLUMNS[view.sort].header == "LIMITS"
    while top.COLUMNS[view.sort].header != "UID":
        view.key("<")
    assert view.reverse is False  # text sorts A to Z first
    assert [r[UID] for r in top.table_rows(REPLY, view)][:3] == ["", "1001", "1002"]
    view.key("r")
    assert view.reverse is True
    assert "sort: UID descending" in view.status_line()


def test_s_cycles_through_every_column_and_the_arrows_move_it() -> None:
    view = top.View()
    seen = []
    for _ in top.COLUMNS:
        seen.append(top.COLUMNS[view.sort].header)
        view.key("s")
    assert sorted(seen) == sorted(HEADERS) and top.COLUMNS[view.sort].header == "IO/s"
    for key in top.split_keys("\x1b[D\x1b[D"):  # left arrow twice
        view.key(key)
    assert top.COLUMNS[view.sort].header == "UID"
    for key in top.split_keys("\x1b[C\x1bOC"):  # right arrow (normal, application mode)
        view.key(key)
    assert top.COLUMNS[view.sort].header == "IO/s"
    # Sorting by a total puts the biggest first, whatever the rates say.
    while top.COLUMNS[view.sort].header != "WRITTEN total":
        view.key("s")
    assert view.reverse and top.table_rows(REPLY, view)[0][CLASS] == "data"


def test_keys_are_split_so_escape_sequences_are_not_letters() -> None:
    assert top.split_keys("q") == ["q"]
    assert top.split_keys("\x1b") == ["\x1b"]
    assert top.split_keys("\x1b[A/x") == ["\x1b[A", "/", "x"]
    assert top.split_keys("\x1b[1;5C") == ["\x1b[1;5C"]
    assert top.split_keys("\x1b[D") == ["<"]
    view = top.View(filters={"class": "data"})
    for key in top.split_keys("\x1b[A\x1b[B"):  # up, down: nothing
        assert view.key(key)
    assert view.filters == {"class": "data"} and top.COLUMNS[view.sort].header == "IO/s"


def test_a_typed_filter_narrows_rows_and_a_bad_one_says_why() -> None:
    view = top.View()
    for ch in "/class=data\r":
        assert view.key(ch)
    assert view.filters == {"class": "data"}
    assert [r[CLASS] for r in top.table_rows(REPLY, view)] == ["data"]
    for ch in "/uid=100[12]\r":
        view.key(ch)
    assert [r[UID] for r in top.table_rows(REPLY, view)] == ["1001", "1002"]
    for ch in "/tenant=team\r":
        view.key(ch)
    assert [r[UID] for r in top.table_rows(REPLY, view)] == ["1001"]
    for ch in "/owner=me\r":
        view.key(ch)
    assert view.filters == {"tenant": "team"} and "expected class=" in view.message
    view.key("/")
    view.key("x")
    view.key("\x1b")  # Esc while typing: the typed text and the filters go
    assert view.typing is None and view.filters == {}
    for ch in "/class=ckpt\r":
        view.key(ch)
    assert {r[CLASS] for r in top.table_rows(REPLY, view)} == {"ckpt"}
    view.key("\x1b")  # Esc: every row again
    assert view.filters == {} and len(top.table_rows(REPLY, view)) == 4
    view.set_filter("class=ckpt")
    view.key("c")
    assert view.filters == {}
    assert view.key("q") is False


def test_filter_options_start_the_view_filtered() -> None:
    parser = argparse.ArgumentParser()
    top.add_parser(parser.add_subparsers())
    args = parser.parse_args(["top", "--class", "ckpt", "--uid", "1001", "--tenant", "team"])
    view = top.view_from_args(args)
    assert view.filters == {"class": "ckpt", "tenant": "team", "uid": "1001"}
    assert [r[UID] for r in top.table_rows(REPLY, view)] == ["1001"]
    args = parser.parse_args(["top", "--sort", "UID", "--all-users"])
    view = top.view_from_args(args)
    assert top.COLUMNS[view.sort].header == "UID" and not view.reverse
    assert not view.collapse_idle


def test_a_frame_says_which_columns_are_rates_and_which_totals() -> None:
    frame = top.render_frame(REPLY)
    assert "\x1b" not in frame
    assert "/s: rate over the daemon's last sample; total: since the mount" in frame
    header = next(line for line in frame.splitlines() if line.startswith("CLASS"))
    assert header.split("  ")[0] == "CLASS"
    for name in ("READ/s", "WRITE/s", "OPS/s", "READ total", "WRITTEN total",
                 "THROTTLED total"):
        assert name in header, name
    assert "tenant  team" in frame  # the tenant level below the accounts


def test_rows_beyond_the_terminal_are_counted_not_drawn() -> None:
    many = _reply([_account("ckpt", uid, float(uid)) for uid in range(1000, 1100)])
    frame = top.render_frame(many, height=30)
    assert len(frame.splitlines()) <= 30
    assert "more rows (filter with /)" in frame


class _Daemon:
    """A client whose daemon has sampled nothing for the first ``empty`` requests."""

    def __init__(self, empty: int) -> None:
        self.empty = empty
        self.requests = 0

    def request(self, req: dict[str, Any]) -> dict[str, Any]:
        assert req == {"cmd": "stats"}
        self.requests += 1
        return {**REPLY, "window_seconds": 0.0 if self.requests <= self.empty else 1.0}


def test_the_first_frame_waits_for_the_daemons_first_sample() -> None:
    daemon = _Daemon(empty=2)
    reply = top._first_reply(daemon)  # type: ignore[arg-type]
    assert daemon.requests == 3 and reply["window_seconds"] == 1.0
    assert "rates over the last 1.0s" in top.render_frame(reply)


def test_a_daemon_that_never_samples_still_gives_a_frame(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(top, "FIRST_SAMPLE_WAIT", 0.2)
    reply = top._first_reply(_Daemon(empty=1000))  # type: ignore[arg-type]
    assert "no rate yet" in top.render_frame(reply)


def test_without_rich_the_live_view_says_so_in_one_line_and_once_still_works(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("rich", "rich.console", "rich.live", "rich.table", "rich.text"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    with pytest.raises(QosfsError) as err:
        top._live("/nonexistent.sock", 1.0, top.View())
    message = str(err.value)
    assert "\n" not in message and "rich" in message and "--once" in message
    assert err.value.exit_code == EXIT_USAGE
    assert "CLASS" in top.render_frame(REPLY)


def test_a_thousand_users_render_fast() -> None:
    import rich
    del rich
    from rich.console import Console

    users = _reply([_account("ckpt", uid, float(uid % 7) * MiB) for uid in range(1000)])
    console = Console(width=160, height=50, file=open("/dev/null", "w"))  # noqa: SIM115
    start = time.perf_counter()
    for _ in range(10):
        console.print(top._rich_frame(users, top.View(), 160, 50))
    per_frame = (time.perf_counter() - start) / 10
    console.file.close()
    # Well inside a 1 s refresh on a loaded 2-CPU machine (measured ~25 ms).
    assert per_frame < 0.5, per_frame


# ------------------------------------------------------------------ at 80 columns

WORDS = {*HEADERS, *(s.short for s in top.ACCOUNT_FIT if s.short)}


def _header_cells(frame: str) -> list[str]:
    """The account table's headers, sort marks taken off."""
    line = next(line for line in frame.splitlines() if line.startswith("CLASS"))
    return [re.sub(r" [▼▲]$", "", cell) for cell in re.split(r"\s{2,}", line.strip())]


def _rich_text(reply: dict[str, Any], view: top.View, width: int, height: int = 40) -> str:
    from rich.console import Console

    console = Console(width=width, height=height, file=io.StringIO(), color_system=None,
                      legacy_windows=False)
    console.print(top._rich_frame(reply, view, width, height))
    return console.file.getvalue()  # type: ignore[attr-defined,no-any-return]


def _frames(width: int, view: top.View | None = None,
            reply: dict[str, Any] = REPLY) -> dict[str, str]:
    frames = {"--once": top.render_frame(reply, width=width, view=view or top.View())}
    if importlib.util.find_spec("rich") is not None:
        frames["live"] = _rich_text(reply, view or top.View(), width)
    return frames


@pytest.mark.parametrize("width", [80, 60, 50])
def test_narrow_the_headers_stay_whole_words_and_class_and_rates_stay(width: int) -> None:
    for name, frame in _frames(width).items():
        assert max(len(line) for line in frame.splitlines()) <= width, (name, frame)
        headers = _header_cells(frame)
        assert set(headers) <= WORDS, (name, frame)
        assert {"CLASS", "UID", "READ/s", "WRITE/s", "IO/s"} <= set(headers), (name, frame)
        # IO/s stays because it is sorted by; what it displaces is stated in ACCOUNT_FIT.
        assert "THROTTLED total" not in headers and "…" not in frame.split("CLASS")[1], frame


def test_at_80_columns_the_documented_order_gives_way() -> None:
    for name, frame in _frames(80).items():
        headers = _header_cells(frame)
        assert headers == ["CLASS", "UID", "LIMITS", "IO/s", "READ/s", "WRITE/s", "THR/s",
                           "QUEUE"], (name, frame)
        # The legend explains the abbreviation and leaves out what is not shown.
        assert "THR: throttled, seconds spent waiting for tokens" in frame, (name, frame)
        assert "total: since the mount" not in frame, (name, frame)


def test_at_200_columns_every_column_is_there() -> None:
    for name, frame in _frames(200).items():
        assert _header_cells(frame) == HEADERS, (name, frame)
        assert ("/s: rate over the daemon's last sample; total: since the mount; QUEUE: "
                "parked now; THROTTLED: seconds spent waiting for tokens") in frame, name


def test_the_column_sorted_by_never_gives_way() -> None:
    view = top.View(sort=HEADERS.index("THROTTLED total"))
    for name, frame in _frames(80, view).items():
        headers = _header_cells(frame)
        assert "THROTTLED total" in headers and "IO/s" not in headers, (name, frame)
        assert max(len(line) for line in frame.splitlines()) <= 80, (name, frame)


def test_long_limits_are_cut_and_say_so() -> None:
    reply = _reply([_account("ckpt", 1001, MiB)])
    reply["levels"][0]["limits"] = {"read_bandwidth": 3 << 30, "write_bandwidth": 400 * MiB,
                                    "read_iops": 2000, "write_iops": 2000, "meta_iops": 5000}
    wide = top.render_frame(reply)
    assert "r:3GiB/s w:400MiB/s" in wide
    for name, frame in _frames(80, reply=reply).items():
        assert "LIMITS" in _header_cells(frame), (name, frame)
        row = next(line for line in frame.splitlines() if line.startswith("ckpt"))
        assert "r:3GiB/s" in row and "…" in row and "MiB/s" in row, (name, frame)
        assert max(len(line) for line in frame.splitlines()) <= 80, (name, frame)


def test_every_width_keeps_every_line_inside_it() -> None:
    for width in range(20, 201, 7):
        frame = top.render_frame(REPLY, width=width)
        assert max(len(line) for line in frame.splitlines()) <= width, (width, frame)
        if width >= 50:  # narrower, the last header may be cut (the docstring says so)
            assert set(_header_cells(frame)) <= WORDS, (width, frame)


def test_the_order_is_documented_where_it_is_stated() -> None:
    steps = [step.describe() for step in top.ACCOUNT_FIT]
    docs = (Path(__file__).resolve().parents[3] / "docs" / "top.md").read_text()
    for where, text in (("docs/top.md", docs.replace("`", "")),
                        ("top's docstring", top.__doc__ or "")):
        listed = re.findall(r"^(\d+)\. (.*)$", text, re.MULTILINE)
        assert [item for _, item in listed] == steps, where
        assert [int(n) for n, _ in listed] == list(range(1, len(steps) + 1)), where
