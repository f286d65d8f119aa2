"""``qosfs ctl``: the control socket's client, and how its replies are shown.

Standard library only (no trio, no pyfuse3), so ``qosfs ctl`` starts fast and any
Python can talk to a mount. Of qosfs it imports only what is light: the socket's
address, the table of limit kinds and the policy's key names, not the protocol's request
dataclasses or the policy model (:mod:`dataclasses` alone costs ~6 ms of import; issue
38 holds ``qosfs ctl status`` to 60 ms in all): tests/unit/daemon/test_cli_imports.py
keeps it so.

Exit codes: 0 done; 2 (usage) a malformed ``set`` target or ``KEY=VALUE``, refused before
anything is sent; 6 (policy) the daemon rejected an invalid ``set``/``reload`` and kept
its policy; 7 (control) the socket is unreachable, the request was refused (permissions,
``--no-qos``) or malformed.

Which socket: ``--socket PATH``; ``--socket MOUNTPOINT`` (a directory) means that mount's
default socket, or where the pointer there leads for a mount made with ``--socket PATH``
(qosfs.daemon.pointer; ``connect()`` follows it); without it, the only mount's socket in
/run/qosfs (an error lists them if there are several).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import sys
import time
from typing import Any

from qosfs.control.address import socket_dirs, socket_name
from qosfs.control.kernel_status import format_passthrough
from qosfs.core.errors import EXIT_CONTROL, EXIT_POLICY, EXIT_USAGE, QosfsError
from qosfs.core.limit_kinds import BY_KEY
from qosfs.policy.keys import CLASS_SETTINGS, MATCH_KEYS

MAX_REPLY_BYTES = 64 << 20
TIMEOUT = 10.0


def resolve_socket(arg: str | None) -> str:
    """The control socket path from ``--socket`` (a socket, a mountpoint, or nothing)."""
    dirs = socket_dirs()
    if arg is not None:
        if not os.path.isdir(arg):
            return arg
        paths = [os.path.join(d, socket_name(arg)) for d in dirs]
        return next((p for p in paths if os.path.exists(p)), paths[0])
    found = []
    for directory in dirs:
        try:
            found += sorted(os.path.join(directory, n) for n in os.listdir(directory)
                            if n.endswith(".sock"))
        except OSError:
            pass
    # A mount made with --socket PATH has a pointer to PATH (a symbolic link) here too:
    # one mount, whether PATH is in these directories or not.
    mounts: dict[str, str] = {}  # the socket's real path -> the first path found to it
    for path in found:
        if os.path.islink(path) and not os.path.exists(path):
            continue  # a pointer to nothing: its mount is gone
        mounts.setdefault(os.path.realpath(path), path)
    found = list(mounts.values())
    if len(found) == 1:
        return found[0]
    where = " or ".join(dirs)
    if not found:
        raise QosfsError(f"no qosfs control socket in {where} (is a mount running? "
                         "pass --socket PATH or --socket MOUNTPOINT)", EXIT_CONTROL)
    raise QosfsError(f"several qosfs mounts ({', '.join(found)}): pass --socket PATH or "
                     "--socket MOUNTPOINT", EXIT_CONTROL)


class Client:
    """One connection to a control socket; :meth:`request` sends a line, reads a line."""

    def __init__(self, path: str, timeout: float = TIMEOUT) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.settimeout(timeout)
        self._buf = b""
        try:
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            raise QosfsError(_connect_error(path, exc), EXIT_CONTROL) from None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    def request(self, body: dict[str, Any]) -> dict[str, Any]:
        """Send one request; return the reply (``ok`` true or false), or raise if the
        daemon did not answer."""
        try:
            self._sock.sendall(json.dumps(body, separators=(",", ":")).encode() + b"\n")
            while b"\n" not in self._buf:
                data = self._sock.recv(1 << 16)
                if not data:
                    raise QosfsError(f"{self.path}: the daemon closed the connection",
                                     EXIT_CONTROL)
                self._buf += data
                if len(self._buf) > MAX_REPLY_BYTES:
                    raise QosfsError(f"{self.path}: reply too large", EXIT_CONTROL)
        except OSError as exc:
            raise QosfsError(f"{self.path}: {exc.strerror or exc}", EXIT_CONTROL) from None
        line, _, self._buf = self._buf.partition(b"\n")
        try:
            reply = json.loads(line)
        except ValueError:
            raise QosfsError(f"{self.path}: the daemon sent a malformed reply",
                             EXIT_CONTROL) from None
        if not isinstance(reply, dict):
            raise QosfsError(f"{self.path}: the daemon sent a malformed reply", EXIT_CONTROL)
        return reply


def _connect_error(path: str, exc: OSError) -> str:
    if exc.errno in (errno.ENOENT, errno.ECONNREFUSED):
        return f"cannot reach the qosfs control socket {path}: is the mount running?"
    if exc.errno == errno.EACCES:
        return (f"permission denied on {path} (root or the policy's control.admin_group; "
                "an administrator may chmod 0666 the socket to let everyone read status)")
    return f"cannot connect to {path}: {exc.strerror or exc}"


def checked(reply: dict[str, Any]) -> dict[str, Any]:
    """The reply, or the daemon's error as a QosfsError with the matching exit code."""
    if reply.get("ok") is True:
        return reply
    code = EXIT_POLICY if reply.get("code") == "policy" else EXIT_CONTROL
    raise QosfsError(str(reply.get("error", "request failed")), code)


def call(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One request on a fresh connection; raises on an error reply."""
    with Client(path) as client:
        return checked(client.request(body))


# ----------------------------------------------------------------------- formatting

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float, suffix: str = "") -> str:
    """``419430400`` -> ``"400MiB"``; one decimal under 100 of a unit."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            text = f"{value:.0f}" if value >= 100 or unit == "B" else f"{value:.1f}"
            return f"{text.removesuffix('.0')}{unit}{suffix}"
        value /= 1024
    raise AssertionError  # pragma: no cover


def human_count(n: float) -> str:
    """``2000`` -> ``"2k"``, ``1.5e6`` -> ``"1.5M"``."""
    for limit, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= limit:
            return f"{n / limit:.1f}".removesuffix(".0") + unit
    return f"{n:.0f}" if n >= 10 or float(n).is_integer() else f"{n:.1f}"


def human_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s == 0:
        return "0s"
    if s >= 100:
        return f"{s:.0f}s"
    if s >= 1:
        return f"{s:.1f}s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g}ms"
    return f"{s * 1e6:.3g}us"


def format_limits(limits: dict[str, float]) -> str:
    parts = []
    for key, value in limits.items():
        kind = BY_KEY.get(key)
        if kind is None:  # a daemon newer than this client: show it as it came
            parts.append(f"{key}:{value:g}")
        elif kind.per_byte:
            parts.append(f"{kind.label[0]}:{human_bytes(value, '/s')}")
        else:
            parts.append(f"{kind.label[0]}:{human_count(value)}op/s")
    return " ".join(parts) or "-"


def table_lines(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
            for r in [header, *rows]]


def level_name(level: dict[str, Any]) -> str:
    if level["level"] == "user":
        return f"{level['name']}/uid={level['uid']}"
    return str(level["name"])


def format_levels(reply: dict[str, Any]) -> list[str]:
    """The per-level table of ``status``/``top``: limits, current rates, queue, throttled."""
    rows = []
    for lv in reply.get("levels", []):
        rates = lv["rates"]
        ops = rates["read_ops"] + rates["write_ops"] + rates["meta_ops"]
        limits = format_limits(lv["limits"])
        if lv.get("auto_limits"):
            limits += " (auto)"  # lowered by the latency controller
        rows.append([lv["level"], level_name(lv), limits,
                     human_bytes(rates["read_bytes"], "/s"),
                     human_bytes(rates["write_bytes"], "/s"), human_count(ops),
                     str(lv["queue_depth"]), human_seconds(lv["throttled_seconds"])])
    if not rows:  # --no-qos: only the traffic counted
        for acc in reply.get("accounts", []):
            rates = acc["rates"]
            rows.append(["flow", acc["class"], "-", human_bytes(rates["read_bytes"], "/s"),
                         human_bytes(rates["write_bytes"], "/s"),
                         human_count(rates["read_ops"] + rates["write_ops"]), "0",
                         human_seconds(acc["throttled_seconds"])])
    return table_lines(["LEVEL", "NAME", "LIMITS", "READ/s", "WRITE/s", "OPS/s", "QUEUE",
                   "THROTTLED"], rows)


def format_crash_protection(reply: dict[str, Any]) -> list[str]:
    """Whether a crash of the daemon would break open files (qosfs.daemon.takeover.recover), and
    what this process took over from a dead one."""
    lines = []
    guard = reply.get("crash_protection")
    if guard is not None:
        if guard["kept"]:
            keeper = ("systemd's descriptor store" if guard["keeper"] == "systemd" else
                      f"a holder process (waits {guard['recover_within']:g} s for a new daemon)")
            lines.append(f"crash protection: connection kept by {keeper}; "
                         f"journal of {guard['journal_records']} records")
        else:
            lines.append(f"crash protection OFF: {guard['reason']}")
    recovered = reply.get("recovered")
    if recovered is not None:
        lines.append(f"recovered after the death of pid {recovered['dead_pid']}: "
                     f"{recovered['open_files']} open files ({recovered['lost_files']} lost), "
                     f"{recovered['open_dirs']} open directories, "
                     f"{recovered['inodes']} inodes")
    return lines


def format_header(reply: dict[str, Any]) -> list[str]:
    served = f"pid {reply.get('pid', '?')}"
    if "version" in reply:  # which code serves: a handover (qosfs upgrade) may change it
        served += f", qosfs {reply['version']}"
    if "handovers" in reply:
        served += f", {reply['handovers']} handover{'s' * (reply['handovers'] != 1)}"
    lines = [f"qosfs {reply.get('source', '?')} on {reply.get('mountpoint', '?')} "
             f"({served}, up {human_seconds(reply.get('uptime_seconds'))})"]
    lines += format_crash_protection(reply)
    if reply.get("qos"):
        applied = sum(c["count"] for c in reply.get("changes", []) if c["result"] == "applied")
        rejected = sum(c["count"] for c in reply.get("changes", [])
                       if c["result"] == "rejected")
        lines.append(f"policy {reply.get('policy_source')} generation {reply['generation']} "
                     f"({applied} changes applied, {rejected} rejected)")
        if not reply.get("last_reload_ok", True):
            lines.append(format_reload_failure(reply.get("last_reload_failure")))
    else:
        lines.append(str(reply.get("message", "no policy")))
    errors = reply.get("internal_errors") or {}
    if errors:  # a bug the daemon survived: say so where operators look first
        kinds = ", ".join(f"{where} {kind} x{n}" for where, by_kind in errors.items()
                          for kind, n in by_kind.items())
        lines.append(f"INTERNAL ERRORS (answered EIO or restarted; the first of each kind "
                     f"is in the daemon's log): {kinds}")
    return lines


def format_reload_failure(failure: dict[str, Any] | None) -> str:
    """The line ``status`` shows while the last reload of the mount's policy stands refused:
    when, who asked, and the daemon's one-line error (file:line: key: reason)."""
    if not failure:  # a daemon that does not keep the reason
        return "LAST RELOAD FAILED (the reason is in the daemon's log); previous policy kept"
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(failure["time"]))
    return (f"LAST RELOAD FAILED at {when} ({failure['by']}), previous policy kept: "
            f"{failure['error']}")


def format_latency(reply: dict[str, Any]) -> list[str]:
    """The latency controller's state, one line per protected and per capped class."""
    lc = reply.get("latency_control")
    if not lc or not lc.get("protected"):
        return []
    lines = [f"latency control: {lc['state']} (window {lc['window_seconds']:g}s, "
             f"{lc['decisions']['decrease']} decreases, {lc['decisions']['increase']} "
             f"increases, {lc['decisions']['release']} releases)"]
    for p in lc["protected"]:
        pct = f"p{p['percentile']:g}"
        relative = "" if p.get("slowdown") is None else (
            f" ({p['slowdown']:g}x baseline {human_seconds(p.get('baseline_seconds'))})")
        lines.append(f"  {p['class']}: {pct} {p['measure']} "
                     f"{human_seconds(p['latency_seconds'])} / target "
                     f"{human_seconds(p['target_seconds'])}{relative}  {p['verdict']}")
    for t in lc["throttled"]:
        caps = {k: v for k, v in (("read_bandwidth", t["read_bandwidth"]),
                                  ("write_bandwidth", t["write_bandwidth"])) if v is not None}
        lines.append(f"  {t['class']}: capped {format_limits(caps)}")
    return lines


def _matches(table: dict[str, Any]) -> str:
    parts = [f"{key}={','.join(map(str, v)) if isinstance(v, list) else v}"
             for key in MATCH_KEYS if (v := table.get(key))]
    return " ".join(parts) or "everything else"


def format_settings(reply: dict[str, Any]) -> list[str]:
    """Every class's and tenant's settings in force beyond the caps: what ``status`` shows
    of ``reply["policy"]`` (``status --json`` has all of it, in the policy's spelling)."""
    policy = reply.get("policy")
    if not policy:
        return []
    auto = {lv["name"]: lv["auto_limits"] for lv in reply.get("levels", [])
            if lv["level"] == "class" and lv.get("auto_limits")}
    rows = []
    for name, table in policy.get("classes", {}).items():
        # Beyond the caps (in the levels table) and the classification (MATCHES).
        settings = [f"{key}={table[key]}" for key in CLASS_SETTINGS
                    if key in table and key not in ("priority", "per_user", "cache")]
        if name in auto:
            settings.append(f"auto caps {format_limits(auto[name])}")
        rows.append([name, str(table.get("priority", "")), str(table.get("per_user", "")),
                     str(table.get("cache", "")), " ".join(settings) or "-", _matches(table)])
    lines = table_lines(["CLASS", "PRIORITY", "PER_USER", "CACHE", "SETTINGS", "MATCHES"], rows)
    tenants = [[name, _matches(table)] for name, table in policy.get("tenants", {}).items()]
    if tenants:
        lines += ["", *table_lines(["TENANT", "MATCHES"], tenants)]
    return lines


def format_status(reply: dict[str, Any]) -> str:
    window = reply.get("window_seconds") or 0.0
    note = f"rates over the last {window:.1f}s" if window else "rates: no sample yet"
    latency = format_latency(reply)
    cluster = format_cluster_state(reply.get("cluster"))
    settings = format_settings(reply)
    kernel = format_passthrough(reply.get("passthrough"))
    return "\n".join([*format_header(reply), note, "", *format_levels(reply),
                      *(["", *kernel] if kernel else []),
                      *(["", *settings] if settings else []),
                      *(["", *latency] if latency else []),
                      *(["", *cluster] if cluster else [])]) + "\n"


def format_cluster_state(c: dict[str, Any] | None) -> list[str]:
    """This mount's side of cluster coordination, for ``status``."""
    if not c:
        return []
    line = (f"cluster {c['redis']} as {c['node']}: {c['state']} for "
            f"{human_seconds(c['state_seconds'])}, lease {human_seconds(c['lease_seconds'])}, "
            f"{c['renewals']} renewals, {c['failures']} failed")
    if c.get("last_error"):
        line += f"; last error: {c['last_error']}"
    rows = [[lv["level"], lv["key"], _rate(lv["key"], lv["cap"]),
             _rate(lv["key"], lv["enforced"])] for lv in c["levels"]]
    return [line, *table_lines(["LEVEL", "LIMIT", "CLUSTER CAP", "THIS MOUNT"], rows)]


def _rate(key: str, value: float | None) -> str:
    if value is None or value == float("inf"):
        return "-"
    kind = BY_KEY.get(key)
    return human_bytes(value, "/s") if kind is None or kind.per_byte else \
        f"{human_count(value)}op/s"


def format_cluster(reply: dict[str, Any]) -> str:
    """``ctl status --cluster``: every mount's use and grant of each cluster level."""
    lines = [f"cluster {reply['redis']} (seen from {reply['node']}, {reply['state']})"]
    for lv in reply["levels"]:
        key = lv["key"]
        used = sum(n["used"] for n in lv["nodes"])
        lines += ["", f"{lv['level']} {key}: cap {_rate(key, lv['cap'])}, "
                      f"{len(lv['nodes'])} mounts using {_rate(key, used)}"]
        lines += table_lines(["MOUNT", "USED", "GRANT", "WANTS MORE", "WEIGHT"],
                        [[n["node"], _rate(key, n["used"]), _rate(key, n["grant"]),
                          "yes" if n["saturated"] else "no", f"{n['weight']:g}"]
                         for n in lv["nodes"]])
    return "\n".join(lines) + "\n"


def format_stats(reply: dict[str, Any]) -> str:
    """Per account: totals, throttled time, request and backend latency quantiles."""
    rows = []
    for acc in reply.get("accounts", []):
        lat = acc.get("latency", {})

        def q(name: str, which: str, lat: dict[str, Any] = lat) -> str:
            return human_seconds(lat.get(name, {}).get(which))

        rows.append([acc["class"], acc["tenant"] or "-",
                     "-" if acc["uid"] is None else str(acc["uid"]),
                     human_bytes(acc["read_bytes"]), human_bytes(acc["write_bytes"]),
                     human_count(acc["read_ops"]), human_count(acc["write_ops"]),
                     human_count(acc["meta_ops"]), human_seconds(acc["throttled_seconds"]),
                     q("read_latency", "p99"), q("read_backend", "p99"),
                     q("write_latency", "p99"), q("write_backend", "p99")])
    table = table_lines(["CLASS", "TENANT", "UID", "READ", "WRITTEN", "R-OPS", "W-OPS", "META",
                    "THROTTLED", "R-p99", "R-BACKEND-p99", "W-p99", "W-BACKEND-p99"], rows)
    return "\n".join([*format_header(reply), "", *table]) + "\n"


# ----------------------------------------------------------------------- command line

def add_parser(sub: Any) -> None:
    """Add ``qosfs ctl`` to the main parser's subcommands."""
    c = sub.add_parser(
        "ctl", help="talk to a running mount: status, set, reload, stats",
        description="Ask a running mount through its control socket: read its state "
        "(status, stats: anyone who may connect) or change its policy live (set, reload: "
        "root or the policy's control.admin_group). Exit codes: 2 usage, 6 change "
        "rejected (the policy in force is kept), 7 socket unreachable or request refused.")
    c.add_argument("--socket", metavar="PATH",
                   help="control socket, or a mountpoint (default: the only one in /run/qosfs)")
    cs = c.add_subparsers(dest="ctl_command", required=True, metavar="COMMAND")
    stp = cs.add_parser(
        "status", help="classes, tenants, limits, current rates, queues",
        description="The policy in force (source, generation, changes applied and "
        "rejected, the last failed reload and why), every level's limits, current rates, "
        "queues and throttled time, and each class's settings and what it matches.")
    stp.add_argument("--cluster", action="store_true",
                     help="every mount's use and grant of the cluster-scoped levels (Redis)")
    stp.add_argument("--json", action="store_true",
                     help="the raw reply: every setting in force (\"policy\", in the policy's "
                     "own keys, parses back to it), levels, rates, counters")
    s = cs.add_parser(
        "set", help="change settings live: set CLASS write_bandwidth=400MiB/s",
        description="Change settings of one class, tenant or the backend in the running "
        "policy, validated whole and in force at once (also for requests already "
        "waiting), until the next reload or restart. Values are spelled as in the policy "
        "file; \"unlimited\" removes a cap. Settable: the limit keys everywhere, and every "
        "class setting but scope; what classifies (paths, uids, ops, ...) changes only by "
        "editing the policy file and reloading.")
    s.add_argument("target", help="CLASS, class:NAME, tenant:NAME or backend")
    s.add_argument("settings", nargs="+", metavar="KEY=VALUE")
    r = cs.add_parser(
        "reload", help="replace the policy (default: re-read the mount's file)",
        description="Replace the whole policy atomically: FILE (read by this command and "
        "sent as text), or without FILE the mount's own --policy file re-read (as SIGHUP "
        "and systemctl reload do). An invalid policy is rejected with file, line and "
        "reason, and the policy in force stays as it was.")
    r.add_argument("file", nargs="?")
    st = cs.add_parser(
        "stats", help="traffic counters and latency per class/tenant/user",
        description="Totals per class, tenant and uid since the mount started: bytes, "
        "operations, throttled time, and request and backend latency quantiles.")
    st.add_argument("--json", action="store_true", help="the raw reply (all counters)")
    c.set_defaults(func=run)


def parse_target(text: str) -> tuple[str, str | None]:
    """``qosfs ctl set`` target syntax -> (kind, name).

    ``backend`` is the backend; ``tenant:NAME`` a tenant; ``class:NAME`` or a bare
    ``NAME`` a class (``class:backend`` reaches a class that happens to be called so).

    Raises:
        QosfsError: (exit code 2, usage) a malformed target.
    """
    if text == "backend":
        return "backend", None
    kind, sep, name = text.partition(":")
    if sep:
        if kind not in ("class", "tenant") or not name:
            raise QosfsError(f"ctl set: bad target {text!r} (expected NAME, class:NAME, "
                             "tenant:NAME or backend)", EXIT_USAGE)
        return kind, name
    return "class", text


def parse_assignments(items: list[str]) -> dict[str, str]:
    """``["write_bandwidth=400MiB/s", ...]`` -> ``{"write_bandwidth": "400MiB/s", ...}``.

    Raises:
        QosfsError: (exit code 2, usage) an item that is not KEY=VALUE, a key given twice,
            or no item.
    """
    changes: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise QosfsError(f"ctl set: bad setting {item!r} (expected KEY=VALUE, e.g. "
                             "write_bandwidth=400MiB/s)", EXIT_USAGE)
        if key in changes:
            raise QosfsError(f"ctl set: {key} is given twice", EXIT_USAGE)
        changes[key] = value
    if not changes:
        raise QosfsError("ctl set: nothing to set (give KEY=VALUE, e.g. "
                         "write_bandwidth=400MiB/s)", EXIT_USAGE)
    return changes


def build_request(args: argparse.Namespace) -> dict[str, Any]:
    """The request for parsed ``qosfs ctl`` arguments (reads a reload FILE here)."""
    command = args.ctl_command
    if command == "set":  # a mistake on the command line raises here: nothing is sent
        kind, name = parse_target(args.target)
        changes = parse_assignments(args.settings)
        body: dict[str, Any] = {"cmd": "set", "target": kind, "changes": changes}
        if name is not None:
            body["name"] = name
        return body
    if command == "reload":
        if args.file is None:
            return {"cmd": "reload"}
        from qosfs.policy.loading import read_policy_text  # the parser's imports cost ~20 ms

        path = os.path.abspath(args.file)
        return {"cmd": "reload", "text": read_policy_text(path), "source": path}
    if command == "status" and getattr(args, "cluster", False):
        return {"cmd": "cluster"}
    return {"cmd": command}


def run(args: argparse.Namespace) -> int:
    body = build_request(args)
    reply = call(resolve_socket(args.socket), body)
    out = sys.stdout
    if args.ctl_command == "status" and args.json:
        out.write(json.dumps(reply, indent=2) + "\n")
    elif args.ctl_command == "status":
        out.write(format_cluster(reply) if body["cmd"] == "cluster" else format_status(reply))
    elif args.ctl_command == "stats":
        out.write(json.dumps(reply, indent=2) + "\n" if args.json else format_stats(reply))
    else:
        out.write(f"generation {reply['generation']} in force "
                  f"(policy {reply['policy_source']})\n")
    return 0
