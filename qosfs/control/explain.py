"""``qosfs explain``: which class and tenant a request would get, the policy lines that
decided it, the levels it is charged to and who serves it.

Asked of a running mount (its control socket's ``explain`` request: the daemon answers
from the policy, classifier and limits in force, so the answer is what the mount does),
or of a policy file with ``--policy`` (classified here, nothing mounted). Both answers
come from :func:`qosfs.qos.explanation.explain`.

Which mount: ``--socket PATH`` or ``--socket MOUNTPOINT`` as for ``ctl``; without it, the
qosfs mount an absolute PATH lies in, else the only socket in /run/qosfs. PATH is
relative to the mount root (as the policy's globs are), or absolute in the mount (its
symlinks resolved, as the mount follows them).

Keys not given are the asking process's own, as the mount would see them if it made
the request: uid and gid (effective), and the environment and cgroups the mount reads
from ``/proc``. So ``qosfs explain ckpt/x.pt --op write`` run in a job's shell answers for
that job's writes; ``--uid``/``--gid``/``--env``/``--cgroup`` ask for someone else.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from typing import Any

from qosfs.control.ctl import Client, checked, format_limits, resolve_socket
from qosfs.core.errors import EXIT_USAGE, QosfsError
from qosfs.core.mountinfo import QOSFS_FSTYPE, containing, mounts
from qosfs.core.units import format_bandwidth

WIDTH = 80
LABEL = 9  # the column the values start at
WHERE = 50  # the column a file:line starts at, when it fits

__all__ = ["add_parser", "format_explanation", "run"]


def add_parser(sub: Any) -> None:
    """Add ``qosfs explain`` to the main parser's subcommands."""
    e = sub.add_parser(
        "explain", help="which class and tenant a request gets, and why",
        description="Which class and tenant a request would get, the policy lines that "
        "decided it, the levels it is charged to and who serves it. Keys not given are "
        "yours (this process's uid, gid, environment and cgroups).")
    e.add_argument("path", metavar="PATH",
                   help="relative to the mount root, or absolute in the mount")
    e.add_argument("--op", choices=["read", "write", "meta"], default="read",
                   help="what the request does (default: read; an open for reading and "
                   "writing is a write)")
    e.add_argument("--uid", type=int, metavar="N", help="the caller's uid (default: yours)")
    e.add_argument("--gid", type=int, metavar="N", help="the caller's gid (default: yours)")
    e.add_argument("--env", action="append", metavar="NAME=VALUE",
                   help="a variable of the caller's environment; repeat for several (given: "
                   "exactly these; default: yours)")
    e.add_argument("--cgroup", action="append", metavar="PATH",
                   help="the caller's cgroup, like /slurm/uid_1000/job_55; repeat for the v1 "
                   "paths of a hybrid hierarchy (default: yours)")
    where = e.add_mutually_exclusive_group()
    where.add_argument("--policy", metavar="FILE",
                       help="explain with this policy file instead of a mount's")
    where.add_argument("--socket", metavar="PATH",
                       help="a mount's control socket, or its mountpoint (default: the "
                       "mount PATH is in, or the only one in /run/qosfs)")
    e.add_argument("--json", action="store_true",
                   help="the answer as JSON (keys in docs/policy.md)")
    e.set_defaults(func=run)


def _env(items: list[str] | None) -> dict[str, str] | None:
    if items is None:
        return None
    env: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise QosfsError(f"--env {item}: expected NAME=VALUE (an empty VALUE is unset)",
                             EXIT_USAGE)
        env[name] = value
    return env


def _ids(args: argparse.Namespace) -> None:
    for key in ("uid", "gid"):
        value = getattr(args, key)
        if value is not None and not 0 <= value < 2**32:
            raise QosfsError(f"--{key} {value}: expected 0 to {2**32 - 1}", EXIT_USAGE)
    for cgroup in args.cgroup or ():
        if not cgroup.startswith("/"):
            raise QosfsError(f"--cgroup {cgroup}: cgroup paths are absolute (start with /)",
                             EXIT_USAGE)


def _qosfs_mount(path: str) -> str | None:
    """The qosfs mount *path* (absolute, resolved) lies in, from the mount table."""
    entry = containing(path, mounts())
    return entry.mountpoint if entry is not None and entry.fstype == QOSFS_FSTYPE else None


def run(args: argparse.Namespace) -> int:
    _ids(args)
    env = _env(args.env)
    path = os.path.realpath(args.path) if args.path.startswith("/") else args.path
    if args.policy is not None:
        body = _local(args, path, env)
    else:
        body = _ask(args, path, env)
    out = sys.stdout
    if args.json:
        out.write(json.dumps(body, indent=2) + "\n")
    else:
        out.write(format_explanation(body, sorted(env or ())))
    return 0


def _local(args: argparse.Namespace, path: str, env: dict[str, str] | None) -> dict[str, Any]:
    """Classified here, with the policy file (its parser is imported only for this)."""
    from qosfs.policy.classify import Classifier
    from qosfs.policy.loading import load_policy
    from qosfs.qos.explanation import Asked, explain

    classifier = Classifier(load_policy(args.policy))
    mountpoint = _qosfs_mount(path) if path.startswith("/") else None
    asked = Asked(path, args.op, args.uid, args.gid,
                  None if env is None else tuple(env.items()),
                  None if args.cgroup is None else tuple(args.cgroup))
    try:
        return explain(classifier, asked, pid=os.getpid(), uid=os.geteuid(),
                       gid=os.getegid(), mountpoint=mountpoint)
    except ValueError as exc:
        raise QosfsError(str(exc), EXIT_USAGE) from None


def _ask(args: argparse.Namespace, path: str, env: dict[str, str] | None) -> dict[str, Any]:
    """Asked of the mount's daemon: the policy, classifier and limits in force there."""
    socket = args.socket
    if socket is None and path.startswith("/"):
        socket = _qosfs_mount(path)
        if socket is None:
            raise QosfsError(f"{path} is not in a qosfs mount (give PATH relative to the "
                             "mount root with --socket, or --policy FILE)", EXIT_USAGE)
    body: dict[str, Any] = {"cmd": "explain", "path": path, "op": args.op}
    for key, value in (("uid", args.uid), ("gid", args.gid), ("env", env),
                       ("cgroups", args.cgroup)):
        if value is not None:
            body[key] = value
    with Client(resolve_socket(socket)) as client:
        reply = client.request(body)
    if reply.get("code") == "path":  # not in that mount: a usage error, not a refusal
        raise QosfsError(str(reply.get("error")), EXIT_USAGE)
    checked(reply).pop("ok")
    return reply


# ----------------------------------------------------------------------- text

def _where(source: str, line: int | None) -> str:
    return f"{source}:{line}" if line is not None else ""


def _row(label: str, text: str, where: str = "") -> list[str]:
    """One labelled row, wrapped to WIDTH, with a file:line at column WHERE (or under)."""
    indent = " " * LABEL
    lines = textwrap.wrap(text, WIDTH - LABEL, break_long_words=False,
                          break_on_hyphens=False) or [""]
    out = [(label.ljust(LABEL) if i == 0 else indent) + part for i, part in enumerate(lines)]
    if where:
        column = max(len(out[-1]) + 2, WHERE)
        if column + len(where) <= WIDTH:
            out[-1] = out[-1].ljust(column) + where
        else:
            out.append(" " * max(WIDTH - len(where), LABEL) + where)
    return out


def _criterion(c: dict[str, Any]) -> str:
    key, value, caller = c["key"], c["value"], c["caller"]
    if key == "paths":
        return f'paths "{value}" matches {caller}'
    if key in ("uids", "gids"):
        return f"{key} {value} holds {key[:-1]} {caller}"
    if key == "job_env":
        return f"job_env: {caller}"
    if key in ("jobs", "cgroups"):
        return f'{key} "{value}" matches {caller}'
    return f"{key}: {value}"


_FAILED = {"paths": "no glob of paths matches {}", "ops": "ops exclude {}",
           "tenants": "tenants exclude {}", "job_env": "job_env: {}",
           "jobs": "jobs exclude {}", "cgroups": "cgroups exclude {}"}


def _passed(skipped: dict[str, Any]) -> str:
    key, caller = skipped["key"], skipped["caller"]
    if key in ("uids", "gids") and "," in caller:  # a tenant with both: either would do
        failed = f"neither uids nor gids hold {caller}"
    else:
        failed = _FAILED.get(key, key + " exclude {}").format(caller)
    return f"  not {skipped['name']}: {failed}"


def _limits(level: dict[str, Any]) -> str:
    text = format_limits(level["limits"])
    text = "no cap" if text == "-" else text
    configured = level.get("configured")
    if level.get("auto_limits"):
        text += " (lowered by the latency target)"
    if configured is not None and configured != level["limits"]:
        text += f"; policy: {format_limits(configured)}"
    if level.get("scope") == "cluster":
        text += " (this mount's grant of a cluster-wide cap)"
    return text


def _level(level: dict[str, Any]) -> str:
    kind = level["level"]
    if kind == "user":
        users = level.get("active_users")
        name = f"user {level['name']}/uid={level['uid']}"
        if users is None:
            return f"{name}: an equal share of the class's caps among its active users"
        share = "the only active user" if users == 1 else f"1/{users}: {users} active users"
        return f"{name}: {_limits(level)} ({share})"
    if kind == "backend":
        mins = [f"{d}:{format_bandwidth(v)}" for d, v in (
            ("r", level.get("min_read_bandwidth")), ("w", level.get("min_write_bandwidth")))
            if v is not None]
        share = f"priority {level['priority']} (weight {level['weight']})"
        if mins:
            share += ", guaranteed " + " ".join(mins)
        return f"backend: {_limits(level)}; {share}"
    return f"{kind} {level['name']}: {_limits(level)}"


def _caller(body: dict[str, Any]) -> list[str]:
    request, policy = body["request"], body["policy"]
    mine = set(request.get("from_caller", ()))

    def origin(key: str) -> str:
        return " (yours)" if key in mine else ""

    ids = f"uid {request['uid']}, gid {request['gid']}"
    if mine >= {"uid", "gid"}:
        ids += " (yours)"
    elif mine & {"uid", "gid"}:
        ids = ", ".join(f"{k} {request[k]} ({'yours' if k in mine else 'given'})"
                        for k in ("uid", "gid"))
    lines = [f"{body['path'] or '/'}: {request['op']} by {ids}"]
    if policy.get("job_env"):
        env = request["env"]
        shown = ", ".join(f"{n}={env[n]}" if n in env else f"{n} unset"
                          for n in policy["job_env"])
        lines += _row("env", shown + origin("env"))
    if policy.get("cgroups"):
        lines += _row("cgroups", (", ".join(request["cgroups"]) or "none") + origin("cgroups"))
    return lines


def format_explanation(body: dict[str, Any], given_env: list[str] | None = None) -> str:
    """The answer as text, at most 80 columns wide (long file names aside)."""
    policy, source = body["policy"], body["policy"]["source"]
    lines = _caller(body)
    if policy.get("generation") is not None:
        lines += _row("policy", f"{source}, generation {policy['generation']}, in force on "
                      f"{body.get('mount')}")
    else:
        on = f" (PATH in {body['mount']})" if body.get("mount") else ""
        lines += _row("policy", f"{source}: the file, not a mount{on}")
    cls = body["class"]
    head = cls["name"] if cls["line"] is not None else \
        f"{cls['name']} (not in the file: the loader adds it)"
    lines += _row("class", head, _where(source, cls["line"]))
    for c in cls["matched"]:
        lines += _row("", "  " + _criterion(c), _where(source, c["line"]))
    for skipped in body["classes_passed"]:
        lines += _row("", _passed(skipped), _where(source, skipped["line"]))
    tenant = body["tenant"]
    if tenant is None:
        lines += _row("tenant", "none")
    else:
        lines += _row("tenant", tenant["name"], _where(source, tenant["line"]))
        for c in tenant["matched"]:
            lines += _row("", "  " + _criterion(c), _where(source, c["line"]))
    for skipped in body["tenants_passed"]:
        lines += _row("", _passed(skipped), _where(source, skipped["line"]))
    for i, level in enumerate(body["levels"]):
        lines += _row("charged" if i == 0 else "", _level(level))
    served = body["served_by"]
    text = f"the {served['by']}"
    if served.get("passthrough"):
        text += (" (kernel passthrough: no level caps the class's reads): read-only opens "
                 "are passed through, their reads never reach the daemon, and are counted "
                 "in the class's read counters where the kernel's counting runs")
    elif served.get("reason"):
        text += f" ({served['reason']})"
    cache = served.get("page_cache")
    if cache == "used":
        text += "; pages already in the page cache are read from it by the kernel, uncharged"
    elif cache == "bypassed":
        text += "; the page cache is bypassed: every read reaches the daemon"
    lines += _row("served", text)
    notes = [*body["notes"], *(f"--env {name}: this policy matches no variable {name}"
                               for name in given_env or () if name not in policy["job_env"])]
    for note in notes:
        lines += _row("note", note)
    return "\n".join(lines) + "\n"
