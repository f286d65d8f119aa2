"""``qosfs top``: a live per-class/tenant/user view, like iotop, from the control socket.

Each frame is one ``stats`` request on a kept-open connection. The rates shown are the
daemon's own (over its last one-second sample), so the first frame and ``--once`` show
real rates: when the daemon has not sampled yet, the first request is repeated until it
has.

One row per account (class, tenant, uid; uid only in ``per_user`` classes) with the
limits and queue of the level that account waits at, then the tenant and backend levels.
With thousands of users the table stays readable: users with no traffic fold into one
"N idle users" row per class, rows can be filtered (``class=``, ``tenant=``, ``uid=``,
globs) and sorted by any column, and only as many rows as the terminal holds are drawn.

At 80 columns not every column fits. Rather than squeeze each header to a letter or two,
columns give way in a stated order (``ACCOUNT_FIT``, listed the same in docs/top.md), one
step at a time and only while the table is still too wide, never the column sorted by:

1. THROTTLED total goes
2. WRITTEN total goes
3. READ total goes
4. IO/s goes
5. TENANT goes if no row shown has one
6. UID goes if no row shown has one
7. THROTTLED/s becomes THR/s
8. OPS/s goes
9. LIMITS is cut to what fits, ending in …, but to no fewer than 12 characters
10. TENANT goes
11. QUEUE goes
12. LIMITS goes
13. THROTTLED/s goes

CLASS, UID, READ/s and WRITE/s stay; a terminal too narrow even for them (under about 50
columns) has its lines cut at the right edge, ending in ``…``. The legend explains only
the columns shown, and every line of text wraps or is cut to the width: nothing is left
for the terminal to wrap. ``--once`` fits the terminal too when it writes to one; into a
pipe it prints every column.

The interactive view draws with ``rich`` (the ``top`` extra: a client-side dependency the
daemon never imports); ``--once`` prints plain text with the standard library only, for
scripts. Keys: ``q`` quits, ``s`` or ``>`` (right arrow) and ``<`` (left arrow) choose the
sort column, ``r`` reverses it, ``/`` types a filter (Enter applies), Esc or ``c`` clears
filters, ``i`` shows or folds idle users.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import select
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from qosfs.control.columns import (
    ABBREVIATE,
    DROP,
    DROP_IF_EMPTY,
    SHORTEN,
    Fitted,
    Step,
    crop,
    fit,
    wrap,
)
from qosfs.control.ctl import (
    Client,
    checked,
    format_header,
    format_latency,
    format_limits,
    human_bytes,
    human_count,
    human_seconds,
    level_name,
    resolve_socket,
)
from qosfs.core.errors import EXIT_USAGE, QosfsError

FIRST_SAMPLE_WAIT = 2.0  # seconds the first frame waits for the daemon's first rate sample
FILTER_KEYS = ("class", "tenant", "uid")


class Column(NamedTuple):
    """A column: its header, what it shows (text, a rate or a total since the mount), the
    value it sorts by and how that value is printed."""

    header: str
    kind: str  # "text", "rate", "now" or "total"
    value: Callable[[dict[str, Any]], Any]
    show: Callable[[Any], str]


def _rate(field_name: str) -> Callable[[dict[str, Any]], float]:
    return lambda row: float(row["rates"][field_name])


def _text(value: Any) -> str:
    return str(value)


COLUMNS: tuple[Column, ...] = (
    Column("CLASS", "text", lambda r: r["class"], _text),
    Column("TENANT", "text", lambda r: r["tenant"] or "", _text),
    Column("UID", "text", lambda r: r["uid_label"], _text),
    Column("LIMITS", "text", lambda r: r["limits"], _text),
    Column("IO/s", "rate", lambda r: r["rates"]["read_bytes"] + r["rates"]["write_bytes"],
           lambda v: human_bytes(v, "/s")),
    Column("READ/s", "rate", _rate("read_bytes"), lambda v: human_bytes(v, "/s")),
    Column("WRITE/s", "rate", _rate("write_bytes"), lambda v: human_bytes(v, "/s")),
    Column("OPS/s", "rate", lambda r: sum(r["rates"][k] for k in ("read_ops", "write_ops",
                                                                  "meta_ops")), human_count),
    Column("THROTTLED/s", "rate", _rate("throttled_seconds"), lambda v: f"{v:.2f}"),
    Column("QUEUE", "now", lambda r: r["queue"], _text),
    Column("READ total", "total", lambda r: r["read_bytes"], human_bytes),
    Column("WRITTEN total", "total", lambda r: r["write_bytes"], human_bytes),
    Column("THROTTLED total", "total", lambda r: r["throttled_seconds"], human_seconds),
)
_BY_HEADER = {c.header: i for i, c in enumerate(COLUMNS)}
# What gives way when the accounts are wider than the terminal, most expendable first;
# the module docstring and docs/top.md list the same steps.
ACCOUNT_FIT = (
    Step(DROP, "THROTTLED total"),
    Step(DROP, "WRITTEN total"),
    Step(DROP, "READ total"),
    Step(DROP, "IO/s"),
    Step(DROP_IF_EMPTY, "TENANT"),
    Step(DROP_IF_EMPTY, "UID"),
    Step(ABBREVIATE, "THROTTLED/s", short="THR/s"),
    Step(DROP, "OPS/s"),
    Step(SHORTEN, "LIMITS", floor=12),
    Step(DROP, "TENANT"),
    Step(DROP, "QUEUE"),
    Step(DROP, "LIMITS"),
    Step(DROP, "THROTTLED/s"),
)
LEGEND = ("/s: rate over the daemon's last sample; total: since the mount; QUEUE: parked now; "
          "THROTTLED: seconds spent waiting for tokens")
KEYS = ("q quit", "s/</> sort column", "r reverse", "/ filter", "Esc clear", "i idle users")
ESC = "\x1b"
# Escape sequences a terminal sends for keys: the arrows move the sort column; the others
# are read whole and ignored (their "[" and letters are not keys of their own).
_SEQUENCES = {"\x1b[D": "<", "\x1bOD": "<", "\x1b[C": ">", "\x1bOC": ">"}


def split_keys(data: str) -> list[str]:
    """What one read from the terminal holds, as keys: a lone Esc is a key; an escape
    sequence (``ESC [ ... final`` or ``ESC O x``) is one key, arrows translated."""
    keys: list[str] = []
    i = 0
    while i < len(data):
        if data[i] != ESC or i + 1 >= len(data) or data[i + 1] not in "[O":
            keys.append(data[i])
            i += 1
            continue
        end = i + 2
        if data[i + 1] == "[":  # CSI: parameters, then one final byte in @..~
            while end < len(data) and not "@" <= data[end] <= "~":
                end += 1
        end = min(end + 1, len(data))
        seq = data[i:end]
        keys.append(_SEQUENCES.get(seq, seq))
        i = end
    return keys


@dataclass
class View:
    """What the user chose: sort column and order, filters, whether idle users fold."""

    sort: int = _BY_HEADER["IO/s"]
    reverse: bool = True  # busiest first
    filters: dict[str, str] = field(default_factory=dict)
    collapse_idle: bool = True
    typing: str | None = None  # the filter being typed after "/", None when not typing
    message: str = ""

    def key(self, ch: str) -> bool:
        """Apply one key press; False means quit."""
        if self.typing is not None:
            if ch in ("\r", "\n"):
                self.set_filter(self.typing)
                self.typing = None
            elif ch == ESC:  # Esc clears, as it does when not typing
                self.typing = None
                self.clear()
            elif ch in ("\x7f", "\b"):
                self.typing = self.typing[:-1]
            elif ch.isprintable():
                self.typing += ch
            return True
        if ch in ("q", "Q", "\x03"):
            return False
        if len(ch) > 1:  # an escape sequence that is no key of ours
            return True
        if ch in ("<", ","):
            self.sort = (self.sort - 1) % len(COLUMNS)
            self.reverse = COLUMNS[self.sort].kind != "text"
        elif ch in (">", ".", "s"):
            self.sort = (self.sort + 1) % len(COLUMNS)
            self.reverse = COLUMNS[self.sort].kind != "text"
        elif ch == "r":
            self.reverse = not self.reverse
        elif ch == "i":
            self.collapse_idle = not self.collapse_idle
        elif ch in ("c", ESC):
            self.clear()
        elif ch == "/":
            self.typing = ""
        return True

    def clear(self) -> None:
        """No filters: every row again."""
        self.filters.clear()
        self.message = ""

    def set_filter(self, text: str) -> None:
        """``"class=datasets uid=10*"``: each ``key=glob`` narrows the rows (empty: none)."""
        filters = {}
        for word in text.split():
            key, sep, value = word.partition("=")
            if not sep or key not in FILTER_KEYS or not value:
                self.message = (f"filter {word!r}: expected class=, tenant= or uid= with a "
                                "value (globs allowed)")
                return
            filters[key] = value
        self.filters = filters
        self.message = ""

    def status_parts(self) -> list[str]:
        """The sort, the filters, idle users, and what is being typed or went wrong."""
        order = "descending" if self.reverse else "ascending"
        shown = " ".join(f"{k}={v}" for k, v in self.filters.items()) or "none"
        idle = "folded" if self.collapse_idle else "shown"
        parts = [f"sort: {COLUMNS[self.sort].header} {order}", f"filter: {shown}",
                 f"idle users: {idle}"]
        if self.typing is not None:
            parts.append(f"filter> {self.typing}_")
        elif self.message:
            parts.append(self.message)
        return parts

    def status_line(self) -> str:
        return "   ".join(self.status_parts())


# ------------------------------------------------------------------------ the rows


def _account_rows(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per account, with the limits and queue of the level it waits at."""
    levels = {(lv["name"], lv["uid"]): lv for lv in reply.get("levels", [])
              if lv["level"] in ("class", "user")}
    rows = []
    for acc in reply.get("accounts", []):
        # A user's own level if it has one; its class's limits otherwise, but not the
        # class's queue (that belongs to the class row).
        own = levels.get((acc["class"], acc["uid"]))
        level = own or levels.get((acc["class"], None))
        limits = format_limits(level["limits"]) if level else "-"
        if level and level.get("auto_limits"):
            limits += " (auto)"
        rows.append({**acc, "uid_label": "" if acc["uid"] is None else str(acc["uid"]),
                     "limits": limits, "queue": own["queue_depth"] if own else 0})
    return rows


def _matches(row: dict[str, Any], filters: dict[str, str]) -> bool:
    values = {"class": row["class"], "tenant": row["tenant"] or "", "uid": row["uid_label"]}
    return all(fnmatch.fnmatchcase(values[k], pattern) for k, pattern in filters.items())


def _is_idle(row: dict[str, Any]) -> bool:
    return row["uid"] is not None and not any(row["rates"].values()) and not row["queue"]


def _fold_idle(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Users with no traffic and nothing queued become one "N idle users" row per class."""
    kept: list[dict[str, Any]] = []
    idle: dict[str, dict[str, Any]] = {}
    for row in rows:
        if not _is_idle(row):
            kept.append(row)
            continue
        folded = idle.setdefault(row["class"], {
            "class": row["class"], "tenant": "", "uid": -1, "n": 0, "limits": "",
            "queue": 0, "read_bytes": 0, "write_bytes": 0, "throttled_seconds": 0.0,
            "rates": dict.fromkeys(row["rates"], 0.0)})
        folded["n"] += 1
        for key in ("read_bytes", "write_bytes", "throttled_seconds"):
            folded[key] += row[key]
    for folded in idle.values():
        folded["uid_label"] = f"{folded['n']} idle user" + ("s" if folded["n"] > 1 else "")
        kept.append(folded)
    return kept


def sorted_rows(reply: dict[str, Any], view: View) -> list[dict[str, Any]]:
    """The account rows filtered, folded and sorted as ``view`` says (not yet text: only
    the rows that fit on the screen are formatted)."""
    rows = [r for r in _account_rows(reply) if _matches(r, view.filters)]
    if view.collapse_idle:
        rows = _fold_idle(rows)
    column = COLUMNS[view.sort]
    rows.sort(key=column.value, reverse=view.reverse)
    return rows


def cells(row: dict[str, Any]) -> list[str]:
    """One row as the text of its cells."""
    return [c.show(c.value(row)) for c in COLUMNS]


def table_rows(reply: dict[str, Any], view: View) -> list[list[str]]:
    """The account rows as cells, filtered, folded and sorted as ``view`` says."""
    return [cells(r) for r in sorted_rows(reply, view)]


def other_levels(reply: dict[str, Any]) -> list[list[str]]:
    """Tenant and backend levels: their limits, rates and queues (not per account)."""
    rows = []
    for lv in reply.get("levels", []):
        if lv["level"] in ("tenant", "backend"):
            rates = lv["rates"]
            rows.append([lv["level"], level_name(lv), format_limits(lv["limits"]),
                         human_bytes(rates["read_bytes"], "/s"),
                         human_bytes(rates["write_bytes"], "/s"), str(lv["queue_depth"]),
                         human_seconds(lv["throttled_seconds"])])
    return rows


LEVEL_HEADER = ["LEVEL", "NAME", "LIMITS", "READ/s", "WRITE/s", "QUEUE", "THROTTLED total"]
LEVEL_FIT = (Step(DROP, "THROTTLED total"), Step(SHORTEN, "LIMITS"), Step(DROP, "QUEUE"))


# ------------------------------------------------------------------------ one frame

# A line of a frame: (text, rich style) segments. --once joins the text; the live view
# draws the styles.
Line = list[tuple[str, str]]
_STYLES = {"text": "", "rate": "cyan", "now": "yellow", "total": "dim"}


def fit_accounts(rows: list[dict[str, Any]], view: View, width: int | None,
                 mark: bool = False) -> Fitted:
    """The account rows as a table fitted to ``width`` (``ACCOUNT_FIT``); the column sorted
    by stays, with ``▼``/``▲`` after its header if ``mark``."""
    suffix = {view.sort: " ▼" if view.reverse else " ▲"} if mark else {}
    return fit([c.header for c in COLUMNS], [cells(r) for r in rows], width, ACCOUNT_FIT,
               keep=frozenset({view.sort}), suffix=suffix)


def legend(table: Fitted, width: int | None) -> list[str]:
    """What the shown columns' headers mean, wrapped to ``width``."""
    headers = {COLUMNS[i].header: shown for i, shown in zip(table.columns, table.headers,
                                                              strict=True)}
    parts = ["/s: rate over the daemon's last sample"]
    if any(COLUMNS[i].kind == "total" for i in table.columns):
        parts.append("total: since the mount")
    if "QUEUE" in headers:
        parts.append("QUEUE: parked now")
    if headers.get("THROTTLED/s", "").startswith("THR/s"):  # abbreviated (maybe marked)
        parts.append("THR: throttled, seconds spent waiting for tokens")
    elif "THROTTLED/s" in headers or "THROTTLED total" in headers:
        parts.append("THROTTLED: seconds spent waiting for tokens")
    return wrap(parts, "; ", width)


def _table_lines(table: Fitted, right: frozenset[int], styles: list[str]) -> list[Line]:
    """The fitted table as lines: the header bold, each column in its style."""
    lines = []
    for n, cells_ in enumerate(table.aligned(right)):
        line: Line = []
        for col, cell in zip(table.columns, cells_, strict=True):
            if line:
                line.append(("  ", ""))
            line.append((cell, "bold" if n == 0 else styles[col]))
        lines.append(line)
    return lines


def frame_lines(reply: dict[str, Any], view: View, width: int | None, height: int | None,
                live: bool = False) -> list[Line]:
    """One frame, each line at most ``width`` characters once cropped, at most ``height``
    lines: the header, legend and view, the accounts that fit, and then either the other
    levels and the latency controller (``--once``, no height) or the keys (``live``)."""
    plain = [(text, "") for text in [*format_header(reply), _window_line(reply)]]
    status = wrap(view.status_parts(), "   ", width)
    keys = wrap(KEYS, "  ", width) if live else []
    rows = sorted_rows(reply, view)
    spacer = [] if live else [""]
    shown = rows
    if height is not None:  # room for the rows: all else, with the longest legend
        above = len(plain) + len(wrap(LEGEND.split("; "), "; ", width)) + len(status)
        room = height - above - len(spacer) - 1 - 1 - len(keys)  # header, "... more"
        shown = rows[:max(1, room)]
    table = fit_accounts(shown, view, width, mark=live)
    right = frozenset(i for i, c in enumerate(COLUMNS) if c.kind != "text")
    lines: list[Line] = [[line] for line in plain]
    lines += [[(text, "dim")] for text in legend(table, width)]
    lines += [[(text, "bold")] for text in status]
    lines += [[(text, "")] for text in spacer]
    lines += _table_lines(table, right, [_STYLES[c.kind] for c in COLUMNS])
    if len(shown) < len(rows):
        lines.append([(f"... {len(rows) - len(shown)} more rows (filter with /)", "dim")])
    if height is None and not live:
        levels = other_levels(reply)
        if levels:
            fitted = fit(LEVEL_HEADER, levels, width, LEVEL_FIT)
            numbers = frozenset(range(LEVEL_HEADER.index("READ/s"), len(LEVEL_HEADER)))
            lines += [[("", "")], *([(t, "")] for t in fitted.lines(numbers))]
        latency = format_latency(reply)
        if latency:
            lines += [[("", "")], *([(t, "")] for t in latency)]
    lines += [[(text, "reverse")] for text in keys]
    return lines


def render_frame(reply: dict[str, Any], width: int | None = None,
                 view: View | None = None, height: int | None = None) -> str:
    """One frame as plain text (``--once``), fitted to ``width`` characters if given."""
    lines = frame_lines(reply, view or View(), width, height)
    return "".join(crop("".join(t for t, _ in line).rstrip(), width) + "\n"
                   for line in lines)


def _window_line(reply: dict[str, Any]) -> str:
    window = reply.get("window_seconds") or 0.0
    when = time.strftime("%H:%M:%S")
    return f"{when}  rates over the last {window:.1f}s" if window else f"{when}  no rate yet"


# ------------------------------------------------------------------------ the live view


def _rich_frame(reply: dict[str, Any], view: View, width: int, height: int) -> Any:
    """The frame as a rich renderable: lines of at most ``width`` cells (a line still too
    wide ends in ``…``, never wraps), at most ``height`` of them."""
    from rich.console import Group
    from rich.text import Text

    return Group(*(Text.assemble(*line, no_wrap=True, overflow="ellipsis")
                   for line in frame_lines(reply, view, width, height, live=True)))


def _first_reply(client: Client) -> dict[str, Any]:
    """A stats reply with rates in it: a daemon that just started has no sample yet."""
    deadline = time.monotonic() + FIRST_SAMPLE_WAIT
    while True:
        reply = checked(client.request({"cmd": "stats"}))
        if reply.get("window_seconds") or time.monotonic() > deadline:
            return reply
        time.sleep(0.1)


class _Keyboard:
    """Single key presses from a terminal (cbreak, no echo); nothing when not a terminal.
    The terminal's settings come back on exit, whatever ends the view."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self._saved: Any = None

    def __enter__(self) -> _Keyboard:
        if sys.stdin.isatty():
            import termios
            import tty

            self.fd = sys.stdin.fileno()
            self._saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)

    def read(self, timeout: float) -> str:
        """Keys pressed within ``timeout`` seconds ("" if none)."""
        if self.fd is None:
            time.sleep(timeout)
            return ""
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
        return os.read(self.fd, 64).decode(errors="ignore") if ready else ""


def _live(path: str, interval: float, view: View) -> int:
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError:
        raise QosfsError("the live view needs the 'rich' package: pip install 'qosfs[top]' "
                         "(qosfs top --once works without it)", EXIT_USAGE) from None
    console = Console()
    client: Client | None = None
    reply: dict[str, Any] = {}
    error = ""
    with _Keyboard() as keys, Live(console=console, screen=True, auto_refresh=False) as live:
        next_fetch = 0.0
        while True:
            if time.monotonic() >= next_fetch:
                try:
                    if client is None:
                        client = Client(path)
                        reply = _first_reply(client)
                    else:
                        reply = checked(client.request({"cmd": "stats"}))
                    error = ""
                except QosfsError as exc:  # the daemon restarted or went away: keep trying
                    if client is not None:
                        client.close()
                        client = None
                    error = f"qosfs top: {exc} (retrying)"
                next_fetch = time.monotonic() + interval
            if error:
                from rich.text import Text

                live.update(Text(error), refresh=True)
            else:
                size = console.size
                live.update(_rich_frame(reply, view, size.width, size.height), refresh=True)
            for ch in split_keys(keys.read(next_fetch - time.monotonic())):
                if not view.key(ch):
                    if client is not None:
                        client.close()
                    return 0


def add_parser(sub: Any) -> None:
    """Add ``qosfs top`` to the main parser's subcommands."""
    t = sub.add_parser("top", help="live per-class/tenant/user rates, limits and queues")
    t.add_argument("--socket", metavar="PATH",
                   help="control socket, or a mountpoint (default: the only one in /run/qosfs)")
    t.add_argument("--interval", type=float, default=1.0, metavar="SECONDS")
    t.add_argument("--once", action="store_true",
                   help="print one frame as plain text and exit (no terminal needed)")
    for key in FILTER_KEYS:
        t.add_argument(f"--{key}", metavar="GLOB", help=f"only rows whose {key} matches")
    t.add_argument("--sort", choices=list(_BY_HEADER), metavar="COLUMN",
                   help="sort by this column (default IO/s, busiest first)")
    t.add_argument("--all-users", action="store_true", help="do not fold idle users")
    t.set_defaults(func=run)


def view_from_args(args: argparse.Namespace) -> View:
    """The view the options ask for: filters, sort column, idle users shown or folded."""
    view = View(filters={k: v for k in FILTER_KEYS if (v := getattr(args, k)) is not None},
                collapse_idle=not args.all_users)
    if args.sort is not None:
        view.sort = _BY_HEADER[args.sort]
        view.reverse = COLUMNS[view.sort].kind != "text"
    return view


def run(args: argparse.Namespace) -> int:
    view = view_from_args(args)
    path = resolve_socket(args.socket)
    if args.once:
        with Client(path) as once:
            # Fitted to a terminal; a script reading a pipe gets every column.
            width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
            sys.stdout.write(render_frame(_first_reply(once), width=width, view=view))
        return 0
    try:
        return _live(path, max(0.1, args.interval), view)
    except KeyboardInterrupt:
        return 0

