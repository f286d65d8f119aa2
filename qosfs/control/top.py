"""``qosfs top``: a live per-class/tenant/user view, like iotop, from the control socket.

Each frame is one ``stats`` request on a kept-open connection; the rates shown are the
daemon's own (over its last one-second sample), so ``--once`` shows real rates too. Plain
ANSI redraw (home, clear), standard library only; ``--once`` prints one frame without
escape codes, for scripts and tests. Ctrl-C quits.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from typing import Any

from qosfs.control.ctl import (
    Client,
    checked,
    format_header,
    format_latency,
    format_levels,
    resolve_socket,
)
from qosfs.core.errors import QosfsError

_CLEAR = "\x1b[H\x1b[2J"


def render_frame(reply: dict[str, Any], width: int | None = None) -> str:
    """One frame: header, then one line per level, busiest first within each kind."""
    order = {"class": 0, "user": 1, "tenant": 2, "backend": 3}
    levels = sorted(reply.get("levels", []), key=lambda lv: (
        order.get(lv["level"], 9), -(lv["rates"]["read_bytes"] + lv["rates"]["write_bytes"])))
    lines = [*format_header(reply),
             f"{time.strftime('%H:%M:%S')}  rates over {reply.get('window_seconds', 0):.1f}s",
             "", *format_levels({**reply, "levels": levels})]
    latency = format_latency(reply)
    if latency:
        lines += ["", *latency]
    if width:
        lines = [line[:width] for line in lines]
    return "\n".join(lines) + "\n"


def add_parser(sub: Any) -> None:
    """Add ``qosfs top`` to the main parser's subcommands."""
    t = sub.add_parser("top", help="live per-class/tenant/user rates, limits and queues")
    t.add_argument("--socket", metavar="PATH",
                   help="control socket, or a mountpoint (default: the only one in /run/qosfs)")
    t.add_argument("--interval", type=float, default=1.0, metavar="SECONDS")
    t.add_argument("--once", action="store_true", help="print one frame and exit")
    t.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path = resolve_socket(args.socket)
    out = sys.stdout
    if args.once:
        with Client(path) as once:
            out.write(render_frame(checked(once.request({"cmd": "stats"}))))
        return 0
    interval = max(0.1, args.interval)
    client: Client | None = None
    try:
        while True:
            try:
                if client is None:
                    client = Client(path)
                reply = checked(client.request({"cmd": "stats"}))
                frame = render_frame(reply, shutil.get_terminal_size().columns)
            except QosfsError as exc:  # the daemon restarted or went away: keep trying
                if client is not None:
                    client.close()
                    client = None
                frame = f"qosfs top: {exc} (retrying)\n"
            out.write(_CLEAR + frame)
            out.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
    finally:
        if client is not None:
            client.close()
