"""The control protocol: JSON lines over a Unix socket, parsed and validated here.

Pure functions and data, no I/O: the server (:mod:`qosfs.control.server`) and the command
logic (:mod:`qosfs.control.service`) share them, and the unit tests cover every malformed
input without a socket. The client (:mod:`qosfs.control.ctl`) writes and reads the same
lines with :mod:`json` alone: it does not import this module, whose dataclasses would
cost every ``qosfs ctl`` run the import of :mod:`dataclasses`. Where the socket is:
:mod:`qosfs.control.address`.

Wire format, one request per line, one reply line per request, in order::

    -> {"cmd": "status"}
    <- {"ok": true, "qos": true, "generation": 3, "levels": [...], ...}
    -> {"cmd": "stats"}
    <- {"ok": true, "generation": 3, "levels": [...], "accounts": [...], ...}
    -> {"cmd": "set", "target": "class", "name": "checkpoints",
        "changes": {"write_bandwidth": "400MiB/s", "write_iops": "2000"}}
    <- {"ok": true, "generation": 4, "policy_source": "/etc/qosfs/mlfs.toml"}
    -> {"cmd": "reload"}                                     # re-read the mount's file
    -> {"cmd": "reload", "text": "<TOML>", "source": "/abs/path/new.toml"}
    <- {"ok": false, "code": "policy", "error": "/abs/path/new.toml:3: classes.x...: ..."}
    -> {"cmd": "explain", "path": "ckpt/model.pt", "op": "write", "uid": 1000}
    <- {"ok": true, "path": "ckpt/model.pt", "class": {"name": "checkpoints", ...}, ...}

``target`` is ``"class"``, ``"tenant"`` (both need ``name``) or ``"backend"``; values are
spelled as in the policy file (``"unlimited"`` removes a cap). A line is UTF-8 JSON, an
object, at most :data:`MAX_REQUEST_BYTES` long; unknown commands or keys are refused.
``explain`` asks what a request would get (``qosfs explain``): ``path`` (relative to the
mount root, or absolute in the mount) and optionally ``op`` (``read``, ``write`` or
``meta``), ``uid``, ``gid``, ``env`` (an object of variable: value) and ``cgroups`` (a list
of paths); a key left out is the asking process's own. Error codes: ``protocol``
(malformed request), ``denied`` (the peer may not change the policy), ``policy`` (the
change is invalid; nothing changed), ``path`` (an ``explain`` path outside the mount),
``unavailable`` (mounted with ``--no-qos``), ``busy`` (too many connections),
``internal``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_REQUEST_BYTES",
    "ExplainRequest",
    "Peer",
    "ProtocolError",
    "ReloadRequest",
    "Request",
    "SetRequest",
    "SimpleRequest",
    "encode",
    "error_reply",
    "parse_request",
]

MAX_REQUEST_BYTES = 64 * 1024  # a whole policy fits (reload); anything longer is refused
MAX_CHANGES = 32
MAX_NAME = 64
MAX_SOURCE = 4096
TARGETS = ("class", "tenant", "backend")
_KEYS = {
    "status": frozenset({"cmd"}),
    "stats": frozenset({"cmd"}),
    "set": frozenset({"cmd", "target", "name", "changes"}),
    "reload": frozenset({"cmd", "text", "source"}),
    "cluster": frozenset({"cmd"}),
    "explain": frozenset({"cmd", "path", "op", "uid", "gid", "env", "cgroups"}),
}
OPS = ("read", "write", "meta")  # what an explained request does (the policy's ops)
MAX_ID = 2**32 - 1
MAX_ENV = 64  # variables in an explain request's env (a policy reads a few)
MAX_CGROUPS = 64


class ProtocolError(ValueError):
    """A request that is not well-formed; ``str()`` is the one-line reason."""

    code = "protocol"


@dataclass(frozen=True, slots=True)
class SimpleRequest:
    """``status`` or ``stats``: read-only, allowed to every peer that can connect."""

    cmd: str


@dataclass(frozen=True, slots=True)
class SetRequest:
    """Change settings of one class, tenant or the backend (``qosfs ctl set``)."""

    target: str
    name: str | None
    changes: tuple[tuple[str, str | int | float], ...]
    cmd: str = "set"


@dataclass(frozen=True, slots=True)
class ReloadRequest:
    """Replace the whole policy: ``text`` (sent by the client), or the mount's own file."""

    text: str | None = None
    source: str | None = None
    cmd: str = "reload"


@dataclass(frozen=True, slots=True)
class ExplainRequest:
    """Which class, tenant and levels a request would get (``qosfs explain``); a key left
    None is the asking process's own (uid and gid from ``SO_PEERCRED``, environment and
    cgroups from its ``/proc``), as the mount would see it."""

    path: str
    op: str = "read"
    uid: int | None = None
    gid: int | None = None
    env: tuple[tuple[str, str], ...] | None = None
    cgroups: tuple[str, ...] | None = None
    cmd: str = "explain"


Request = SimpleRequest | SetRequest | ReloadRequest | ExplainRequest


@dataclass(frozen=True, slots=True)
class Peer:
    """Who is on the other end of a control connection (from ``SO_PEERCRED``)."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    def in_group(self, gid: int) -> bool:
        return self.gid == gid or gid in self.groups


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def _string(obj: dict[str, Any], key: str, limit: int, required: bool) -> str | None:
    value = obj.get(key)
    if value is None:
        if required:
            raise ProtocolError(f'"{key}" is required')
        return None
    if not isinstance(value, str):
        raise ProtocolError(f'"{key}" must be a string, got {_type_name(value)}')
    if len(value) > limit:
        raise ProtocolError(f'"{key}" is longer than {limit} characters')
    return value


def parse_request(line: bytes) -> Request:
    """Validate one request line (without its newline) and return what it asks for.

    Raises:
        ProtocolError: not UTF-8, not a JSON object, unknown command or key, wrong types.
    """
    if len(line) > MAX_REQUEST_BYTES:
        raise ProtocolError(f"request longer than {MAX_REQUEST_BYTES} bytes")
    try:
        obj = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise ProtocolError("request is not UTF-8") from None
    except (ValueError, RecursionError):
        raise ProtocolError("request is not valid JSON") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"request must be a JSON object, got {_type_name(obj)}")
    cmd = obj.get("cmd")
    if not isinstance(cmd, str) or cmd not in _KEYS:
        known = ", ".join(_KEYS)
        shown = json.dumps(cmd)[:40] if cmd is not None else "nothing"
        raise ProtocolError(f'unknown command {shown} (expected "cmd" one of {known})')
    extra = sorted(set(obj) - _KEYS[cmd])
    if extra:
        raise ProtocolError(f'unknown key {json.dumps(extra[0])[:70]} for "{cmd}"')
    if cmd == "set":
        return _parse_set(obj)
    if cmd == "reload":
        return ReloadRequest(_string(obj, "text", MAX_REQUEST_BYTES, False),
                             _string(obj, "source", MAX_SOURCE, False))
    if cmd == "explain":
        return _parse_explain(obj)
    return SimpleRequest(cmd)


def _id(obj: dict[str, Any], key: str) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_ID:
        raise ProtocolError(f'"{key}" must be an integer from 0 to {MAX_ID}')
    return value


def _parse_explain(obj: dict[str, Any]) -> ExplainRequest:
    path = _string(obj, "path", MAX_SOURCE, True)
    assert path is not None  # required
    op = _string(obj, "op", 16, False) or "read"
    if op not in OPS:
        raise ProtocolError(f'"op" must be one of {", ".join(OPS)}')
    env = obj.get("env")
    pairs: tuple[tuple[str, str], ...] | None = None
    if env is not None:
        if not isinstance(env, dict) or len(env) > MAX_ENV or not all(
                isinstance(v, str) and len(k) <= MAX_SOURCE and len(v) <= MAX_SOURCE
                for k, v in env.items()):
            raise ProtocolError(f'"env" must be an object of at most {MAX_ENV} '
                                "variable: string value pairs")
        pairs = tuple(env.items())
    cgroups = obj.get("cgroups")
    if cgroups is not None and (not isinstance(cgroups, list) or len(cgroups) > MAX_CGROUPS
                                or not all(isinstance(c, str) and c.startswith("/")
                                           and len(c) <= MAX_SOURCE for c in cgroups)):
        raise ProtocolError(f'"cgroups" must be a list of at most {MAX_CGROUPS} absolute '
                            "cgroup paths")
    return ExplainRequest(path, op, _id(obj, "uid"), _id(obj, "gid"), pairs,
                          None if cgroups is None else tuple(cgroups))


def _parse_set(obj: dict[str, Any]) -> SetRequest:
    target = _string(obj, "target", 16, True)
    if target not in TARGETS:
        raise ProtocolError(f'"target" must be one of {", ".join(TARGETS)}')
    name = _string(obj, "name", MAX_NAME, target != "backend")
    if target == "backend" and name is not None:
        raise ProtocolError('"name" is not used with target "backend"')
    changes = obj.get("changes")
    if not isinstance(changes, dict) or not changes:
        raise ProtocolError('"changes" must be a non-empty object of setting: value')
    if len(changes) > MAX_CHANGES:
        raise ProtocolError(f'at most {MAX_CHANGES} changes per request')
    pairs: list[tuple[str, str | int | float]] = []
    for key, value in changes.items():
        if len(key) > MAX_NAME:
            raise ProtocolError(f"setting name longer than {MAX_NAME} characters")
        if isinstance(value, bool) or not isinstance(value, str | int | float) or (
                isinstance(value, float) and not math.isfinite(value)):
            raise ProtocolError(f'value of "{key}" must be a string or a number')
        if isinstance(value, str) and len(value) > MAX_NAME:
            raise ProtocolError(f'value of "{key}" is longer than {MAX_NAME} characters')
        pairs.append((key, value))
    return SetRequest(target, name, tuple(pairs))


def encode(reply: dict[str, Any]) -> bytes:
    """One reply line. Non-finite floats (unlimited) must already be None."""
    return json.dumps(reply, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def error_reply(message: str, code: str) -> dict[str, Any]:
    return {"ok": False, "code": code, "error": message}
