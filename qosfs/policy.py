"""The qosfs policy: frozen dataclasses, a strict TOML parser, a renderer, live changes.

Validate once at the edge, trust inside: everything the scheduler and classifier read has
been type-, unit- and range-checked here, and a bad file is rejected as a whole (a live
reload that fails leaves the running policy untouched). Errors are one line that names the
file, line and dotted key: ``mlfs.toml:12: classes.ckpt.write_bandwidth: expected ...``.

Schema (every key optional)::

    [backend]                     # what the storage delivers in total; needed for min_*
    read_bandwidth = "4GiB/s"     # any limit key (below)
    [control]
    admin_group = "storage-admins"  # group name or gid that may change limits via the socket
    [tenants.NAME]                # who. NAME: letters, digits, "_" and "-"
    uids = ["1000-1999", 42]      # ids or "lo-hi" ranges; member if uid OR gid matches
    gids = [100]                  # (no uids/gids: membership by paths alone)
    paths = ["teams/a/**"]        # AND, if given, the path matches one of these globs
    write_bandwidth = "1GiB/s"    # limit keys: caps over all of the tenant's traffic
    [classes.NAME]                # what. The first class in file order whose every given
    paths = ["data/**"]           # criterion matches wins; a list matches if any element does.
    uids = [...]                  # Globs are relative to the mount root: "**" is any number
    gids = [...]                  # of components (even none), "*", "?", "[...]" stay within
    tenants = ["team-a"]          # one. tenants: the caller's tenant is one of these.
    ops = ["read", "write", "meta"]
    job_env = "SLURM_JOB_ID"      # the caller's (exec-time) environment sets this variable;
    jobs = ["1234", "55*"]        # and its value matches one of these globs (needs job_env).
                                  # One job_env name per policy.
    cgroups = ["/slurm/uid_*/job_*/**"]  # the caller's cgroup v2 path matches one of these
    priority = "normal"           # "low" (weight 1), "normal" (10), "high" (100) or 1..10000
    min_read_bandwidth = "1GiB/s"   # guaranteed share; needs [backend] read_bandwidth, the
    min_write_bandwidth = "..."     # sum over classes must fit in it, and so must any cap
    per_user = "none"             # "fair": active uids share the class's limits equally
    cache = "auto"                # "auto": classes with a read cap bypass the page cache;
                                  # "keep"; "direct"
    target_read_latency = "5ms"   # protect this class's reads: lower-priority classes are
    latency_percentile = 99       # capped automatically while the percentile (0 < p < 100)
    latency_measure = "request"   # of its read latency over a window misses the target;
                                  # "request": as a caller waits for it (queue + backend),
                                  # "backend": the backing syscall only (qosfs.latency_control)
    [classes.default]             # always exists and always last; limits only, no criteria

Limit keys (backend, tenants, classes): ``read_bandwidth``, ``write_bandwidth`` (like
``"400MiB/s"``); ``read_iops``, ``write_iops``, ``meta_iops`` (like ``2000`` or ``"2k"``);
``"unlimited"`` or no key means no cap. ``burst`` (like ``"128MiB"``) is the depth of each
bandwidth bucket, by default 100 ms of the cap but at least 1 MiB; ``burst_iops`` likewise,
by default 100 ms of the cap but at least 8 ops (see :meth:`Limits.bandwidth_burst`).
"""

from __future__ import annotations

import contextlib
import difflib
import grp
import json
import re
import tomllib
from dataclasses import dataclass, field
from os import PathLike
from typing import Any

from qosfs.classify import GlobError, compile_cgroup_glob, compile_glob, compile_value_glob
from qosfs.errors import EXIT_POLICY, QosfsError
from qosfs.units import (
    UnitError,
    format_bandwidth,
    format_duration,
    format_iops,
    format_size,
    parse_bandwidth,
    parse_duration,
    parse_iops,
    parse_size,
    show_value,
)

CAP_KEYS = ("read_bandwidth", "write_bandwidth", "read_iops", "write_iops", "meta_iops")
LIMIT_KEYS = (*CAP_KEYS, "burst", "burst_iops")
MATCH_KEYS = ("paths", "uids", "gids", "tenants", "ops", "job_env", "jobs", "cgroups")
CLASS_SETTINGS = ("priority", "min_read_bandwidth", "min_write_bandwidth", "per_user", "cache",
                  "target_read_latency", "latency_percentile", "latency_measure")
CLASS_KEYS = (*MATCH_KEYS, *CLASS_SETTINGS, *LIMIT_KEYS)
TENANT_KEYS = ("uids", "gids", "paths", *LIMIT_KEYS)
SETTABLE = {"backend": LIMIT_KEYS, "tenant": LIMIT_KEYS,
            "class": (*LIMIT_KEYS, "min_read_bandwidth", "min_write_bandwidth", "priority",
                      "per_user", "cache", "target_read_latency", "latency_percentile",
                      "latency_measure")}
PRIORITY_WEIGHTS = {"low": 1, "normal": 10, "high": 100}
OPS = ("read", "write", "meta")
CACHE_MODES = ("auto", "keep", "direct")
LATENCY_MEASURES = ("request", "backend")
BURST_SECONDS = 0.1
MIN_BURST_BYTES = 2**20
MIN_BURST_OPS = 8.0
MAX_ID = 2**32 - 1
_PARSE = {"burst": parse_size, "burst_iops": parse_iops,
          **{k: parse_bandwidth if k.endswith("bandwidth") else parse_iops for k in CAP_KEYS}}
_FORMAT = {"burst": format_size, "burst_iops": format_iops,
           **{k: format_bandwidth if k.endswith("bandwidth") else format_iops for k in CAP_KEYS}}
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,63}")
_BARE = re.compile(r"[A-Za-z0-9_-]+")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_KEY_PART = re.compile(r'\s*(?:([A-Za-z0-9_-]+)|"((?:[^"\\]|\\.)*)"|\'([^\']*)\')\s*(\.)?')
_ID_RANGE = re.compile(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?")


class PolicyError(QosfsError):
    """An invalid policy; ``str()`` is one line: ``source:line: key: reason``."""

    exit_code = EXIT_POLICY

    def __init__(self, reason: str, *, source: str = "<string>", line: int | None = None,
                 key: str | None = None) -> None:
        self.reason, self.source, self.line, self.key = reason, source, line, key
        where = source if line is None else f"{source}:{line}"
        super().__init__(f"{where}: {reason}" if key is None else f"{where}: {key}: {reason}")


@dataclass(frozen=True, slots=True)
class Limits:
    """Caps in bytes/s and ops/s (``None``: no cap) and bucket depths (``None``: default)."""

    read_bandwidth: float | None = None
    write_bandwidth: float | None = None
    read_iops: float | None = None
    write_iops: float | None = None
    meta_iops: float | None = None
    burst: int | None = None
    burst_iops: float | None = None

    @property
    def is_unlimited(self) -> bool:
        """True when no cap is set (bursts alone limit nothing)."""
        return all(getattr(self, key) is None for key in CAP_KEYS)

    def bandwidth_burst(self, cap: float) -> float:
        """Bucket depth in bytes for a bandwidth cap: ``burst``, else 100 ms of it, >= 1 MiB.

        Kept derived rather than stored so a live change of the cap moves the default too.
        """
        return float(self.burst) if self.burst is not None else max(cap * BURST_SECONDS,
                                                                     MIN_BURST_BYTES)

    def iops_burst(self, cap: float) -> float:
        """Bucket depth in ops for an IOPS cap: ``burst_iops``, else 100 ms of it, >= 8."""
        return self.burst_iops if self.burst_iops is not None else max(cap * BURST_SECONDS,
                                                                        MIN_BURST_OPS)


@dataclass(frozen=True, slots=True)
class IdRange:
    """An inclusive range of uids or gids."""

    lo: int
    hi: int

    def __contains__(self, value: object) -> bool:
        return isinstance(value, int) and self.lo <= value <= self.hi


@dataclass(frozen=True, slots=True)
class Backend:
    """What the storage delivers in total; the denominators of guarantees and priorities."""

    limits: Limits


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who: a group of users (and optionally paths) with caps over all of its traffic."""

    name: str
    uids: tuple[IdRange, ...] = ()
    gids: tuple[IdRange, ...] = ()
    paths: tuple[str, ...] = ()
    limits: Limits = Limits()


@dataclass(frozen=True, slots=True)
class ClassRule:
    """What: match criteria (empty: not a criterion) and the treatment of matching traffic."""

    name: str
    paths: tuple[str, ...] = ()
    uids: tuple[IdRange, ...] = ()
    gids: tuple[IdRange, ...] = ()
    tenants: tuple[str, ...] = ()
    ops: frozenset[str] = frozenset()  # empty: every op
    job_env: str | None = None
    jobs: tuple[str, ...] = ()
    cgroups: tuple[str, ...] = ()
    priority_weight: int = PRIORITY_WEIGHTS["normal"]
    priority_name: str = "normal"
    min_read_bandwidth: float | None = None
    min_write_bandwidth: float | None = None
    limits: Limits = Limits()
    per_user: bool = False
    cache: str = "auto"
    target_read_latency: float | None = None
    latency_percentile: float = 99.0
    latency_measure: str = "request"


@dataclass(frozen=True, slots=True)
class Control:
    """Who may change the running policy through the control socket besides root."""

    admin_gid: int | None = None


@dataclass(frozen=True, slots=True)
class Policy:
    """A whole validated policy; ``classes[-1]`` is always ``default``."""

    source: str = field(compare=False)
    classes: tuple[ClassRule, ...]
    tenants: tuple[Tenant, ...] = ()
    backend: Backend | None = None
    control: Control = Control()

    def class_by_name(self, name: str) -> ClassRule | None:
        """The class called ``name``, or None."""
        return next((c for c in self.classes if c.name == name), None)

    def tenant_by_name(self, name: str) -> Tenant | None:
        """The tenant called ``name``, or None."""
        return next((t for t in self.tenants if t.name == name), None)

    @property
    def needs_job_lookup(self) -> bool:
        """Whether classification needs :func:`qosfs.classify.read_job_info` at open."""
        return any(c.job_env is not None or c.cgroups for c in self.classes)

    @property
    def job_env(self) -> str | None:
        """The one environment variable classes match jobs on (the policy allows one)."""
        return next((c.job_env for c in self.classes if c.job_env is not None), None)

    def render(self) -> str:
        """The resolved policy as TOML that parses back to an equal :class:`Policy`."""
        return _dump(_to_raw(self), self.source)


# ---------------------------------------------------------------------------- parsing

def parse_policy(text: str, source: str = "<string>") -> Policy:
    """Parse and validate a policy; raises :class:`PolicyError` for anything wrong."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _syntax_error(str(exc), text, source) from None
    except RecursionError:
        raise PolicyError("invalid TOML: nested too deeply", source=source) from None
    try:
        return _build(raw, source)
    except PolicyError as exc:
        raise PolicyError(exc.reason, source=source, line=_locate(text, exc.key),
                          key=exc.key) from None


def load_policy(path: str | PathLike[str]) -> Policy:
    """Read and parse a policy file; unreadable or non-UTF-8 files are PolicyErrors too."""
    return parse_policy(read_policy_text(path), str(path))


def read_policy_text(path: str | PathLike[str]) -> str:
    """The text of a policy file (``qosfs ctl reload FILE`` reads it as the caller and
    sends it, so the daemon never opens files on a client's behalf)."""
    name = str(path)
    try:
        with open(path, "rb") as stream:
            data = stream.read()
    except OSError as exc:
        raise PolicyError(f"cannot read policy: {exc.strerror or exc}", source=name) from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise PolicyError("not UTF-8 text", source=name,
                          line=data[:exc.start].count(b"\n") + 1) from None


def default_policy() -> Policy:
    """The embedded policy used when ``qosfs mount`` gets no ``--policy``."""
    return parse_policy(DEFAULT_POLICY_TEXT, "<default policy>")


def with_changes(policy: Policy, target_kind: str, name: str | None,
                 changes: dict[str, str]) -> Policy:
    """A new validated policy with settings of one class/tenant/backend changed (``ctl set``).

    Values are spelled as in the file (``"800MiB/s"``, ``"2k"``, ``"high"``); ``"unlimited"``
    removes the key (no cap, or back to the default), and so does ``target_read_latency=none``.
    Unknown targets or keys, bad values and broken constraints raise :class:`PolicyError` with source ``"ctl"``.
    """
    raw = _to_raw(policy)
    if target_kind == "backend":
        path, table = "backend", raw.setdefault("backend", {})
    elif target_kind in ("class", "tenant"):
        top = "classes" if target_kind == "class" else "tenants"
        if name not in raw.get(top, {}):
            known = ", ".join(raw.get(top, {})) or "none"
            raise PolicyError(f'no {target_kind} named {show_value(name)} ({top}: {known})',
                              source="ctl")
        path, table = f"{top}.{name}", raw[top][name]
    else:
        raise PolicyError(f"unknown target {show_value(target_kind)} "
                          '(expected "class", "tenant" or "backend")', source="ctl")
    for key, value in changes.items():
        if key not in SETTABLE[target_kind]:
            raise PolicyError(_unknown(key, SETTABLE[target_kind]), source="ctl",
                              key=f"{path}.{_quote_key(key)}")
        if value == "unlimited" or (value == "none" and key == "target_read_latency"):
            table.pop(key, None)
        elif key == "latency_percentile" and isinstance(value, str):
            try:
                table[key] = float(value)
            except ValueError:
                table[key] = value  # rejected with the file's message by _build
        else:
            numeric = key == "priority" and isinstance(value, str) and value.isdecimal()
            table[key] = int(value) if numeric else value
    try:
        return _build(raw, policy.source)
    except PolicyError as exc:
        raise PolicyError(exc.reason, source="ctl", key=exc.key) from None


def _syntax_error(message: str, text: str, source: str) -> PolicyError:
    match = re.search(r" \(at line (\d+), column (\d+)\)$", message)
    line = int(match[1]) if match else (text.count("\n") + 1 if "end of document" in message
                                        else None)
    reason = message[:match.start()] + f" (column {match[2]})" if match else message
    return PolicyError(f"invalid TOML: {reason[:1].lower()}{reason[1:]}", source=source,
                       line=line)


def _quote_key(part: str) -> str:
    return part if _BARE.fullmatch(part) else _toml_str(part)


def _unknown(key: str, allowed: tuple[str, ...], noun: str = "key") -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f'; did you mean "{close[0]}"?' if close else f" (expected {', '.join(allowed)})"
    return f"unknown {noun} {show_value(key)}{hint}"


def _table(raw: dict[str, Any], key: str, path: str) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise PolicyError(f"expected a table, got {show_value(value)}", key=path)
    return value


def _check_keys(table: dict[str, Any], allowed: tuple[str, ...], path: str) -> None:
    for key, value in table.items():
        if key not in allowed:
            noun = "table" if isinstance(value, dict) else "key"
            raise PolicyError(_unknown(key, allowed, noun), key=f"{path}.{_quote_key(key)}"
                              if path else _quote_key(key))


def _nonempty_list(table: dict[str, Any], key: str, path: str, what: str) -> list[Any]:
    value = table.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not value:
        raise PolicyError(f"expected a non-empty list of {what}, got {show_value(value)}",
                          key=f"{path}.{key}")
    return value


def _ids(table: dict[str, Any], key: str, path: str) -> tuple[IdRange, ...]:
    out = []
    for item in _nonempty_list(table, key, path, 'ids like 1000 or "1000-1999"'):
        match = _ID_RANGE.fullmatch(item) if isinstance(item, str) else None
        if isinstance(item, int) and not isinstance(item, bool):
            lo = hi = item
        elif match:
            lo, hi = int(match[1]), int(match[2] or match[1])
        else:
            raise PolicyError(f'expected ids like 1000 or "1000-1999", got {show_value(item)}',
                              key=f"{path}.{key}")
        if not 0 <= lo <= MAX_ID or not 0 <= hi <= MAX_ID:
            raise PolicyError(f"id {show_value(item)} out of range 0..{MAX_ID}",
                              key=f"{path}.{key}")
        if lo > hi:
            raise PolicyError(f"range {show_value(item)} is backwards (expected lo-hi with "
                              "lo <= hi)", key=f"{path}.{key}")
        out.append(IdRange(lo, hi))
    return tuple(out)


def _strings(table: dict[str, Any], key: str, path: str, what: str,
             check: Any = None) -> tuple[str, ...]:
    items = _nonempty_list(table, key, path, what)
    for item in items:
        if not isinstance(item, str):
            raise PolicyError(f"expected a list of {what}, got {show_value(item)} in it",
                              key=f"{path}.{key}")
        if check is not None:
            try:
                check(item)
            except GlobError as exc:
                raise PolicyError(str(exc), key=f"{path}.{key}") from None
    return tuple(items)


def _choice(table: dict[str, Any], key: str, path: str, choices: tuple[str, ...],
            default: str) -> str:
    value = table.get(key, default)
    if value not in choices or not isinstance(value, str):
        options = ", ".join(f'"{c}"' for c in choices)
        raise PolicyError(f"expected one of {options}, got {show_value(value)}",
                          key=f"{path}.{key}")
    return value


def _unit(table: dict[str, Any], key: str, path: str, parse: Any, unlimited: bool) -> Any:
    value = table.get(key)
    if value is None or (unlimited and value == "unlimited"):
        return None
    try:
        return parse(value)
    except UnitError as exc:
        raise PolicyError(str(exc), key=f"{path}.{key}") from None


def _limits(table: dict[str, Any], path: str) -> Limits:
    return Limits(**{k: _unit(table, k, path, _PARSE[k], k in CAP_KEYS) for k in LIMIT_KEYS})


def _name(name: str, path: str) -> str:
    if not _NAME.fullmatch(name):
        raise PolicyError(f'invalid name {show_value(name)} (use up to 64 letters, digits, "_" '
                          'and "-")', key=path)
    return name


def _build_tenant(name: str, table: dict[str, Any], path: str) -> Tenant:
    _name(name, path)
    _check_keys(table, TENANT_KEYS, path)
    tenant = Tenant(name, _ids(table, "uids", path), _ids(table, "gids", path),
                    _strings(table, "paths", path, "path globs", compile_glob),
                    _limits(table, path))
    if not (tenant.uids or tenant.gids or tenant.paths):
        raise PolicyError("a tenant needs at least one of uids, gids or paths", key=path)
    return tenant


def _priority(table: dict[str, Any], path: str) -> tuple[int, str]:
    value = table.get("priority", "normal")
    if isinstance(value, str) and value in PRIORITY_WEIGHTS:
        return PRIORITY_WEIGHTS[value], value
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 10000:
        return value, str(value)
    raise PolicyError('expected "low", "normal", "high" or a weight 1..10000, got '
                      f"{show_value(value)}", key=f"{path}.priority")


def _build_class(name: str, table: dict[str, Any], path: str,
                 tenants: tuple[str, ...]) -> ClassRule:
    _name(name, path)
    _check_keys(table, CLASS_KEYS, path)
    if name == "default" and (given := [k for k in MATCH_KEYS if k in table]):
        raise PolicyError(f"the default class takes everything no other class matched; it "
                          f'cannot have match keys (remove "{given[0]}")',
                          key=f"{path}.{given[0]}")
    named = _strings(table, "tenants", path, "tenant names")
    for tenant in named:
        if tenant not in tenants:
            raise PolicyError(f"no tenant named {show_value(tenant)} (tenants: "
                              f"{', '.join(tenants) or 'none'})", key=f"{path}.tenants")
    ops = _strings(table, "ops", path, 'ops ("read", "write", "meta")')
    for op in ops:
        if op not in OPS:
            raise PolicyError(f'expected ops from "read", "write", "meta", got {show_value(op)}',
                              key=f"{path}.ops")
    job_env = table.get("job_env")
    if job_env is not None and not (isinstance(job_env, str) and _ENV_NAME.fullmatch(job_env)):
        raise PolicyError(f'expected an environment variable name like "SLURM_JOB_ID", got '
                          f"{show_value(job_env)}", key=f"{path}.job_env")
    jobs = _strings(table, "jobs", path, "job id globs", compile_value_glob)
    if jobs and job_env is None:
        raise PolicyError('jobs needs job_env, the variable holding the job id (e.g. '
                          '"SLURM_JOB_ID")', key=f"{path}.jobs")
    percentile = table.get("latency_percentile", 99.0)
    if isinstance(percentile, bool) or not isinstance(percentile, int | float) or not (
            0 < percentile < 100):
        raise PolicyError(f"expected a percentile between 0 and 100, got {show_value(percentile)}",
                          key=f"{path}.latency_percentile")
    weight, priority = _priority(table, path)
    return ClassRule(
        name=name, paths=_strings(table, "paths", path, "path globs", compile_glob),
        uids=_ids(table, "uids", path), gids=_ids(table, "gids", path), tenants=named,
        ops=frozenset(ops) if len(set(ops)) < len(OPS) else frozenset(), job_env=job_env,
        jobs=jobs, cgroups=_strings(table, "cgroups", path, "cgroup globs", compile_cgroup_glob),
        priority_weight=weight, priority_name=priority,
        min_read_bandwidth=_unit(table, "min_read_bandwidth", path, parse_bandwidth, False),
        min_write_bandwidth=_unit(table, "min_write_bandwidth", path, parse_bandwidth, False),
        limits=_limits(table, path),
        per_user=_choice(table, "per_user", path, ("none", "fair"), "none") == "fair",
        cache=_choice(table, "cache", path, CACHE_MODES, "auto"),
        target_read_latency=_unit(table, "target_read_latency", path, parse_duration, False),
        latency_percentile=float(percentile),
        latency_measure=_choice(table, "latency_measure", path, LATENCY_MEASURES, "request"))


def _admin_gid(table: dict[str, Any]) -> int | None:
    value = table.get("admin_group")
    if value is None:
        return None
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_ID:
        return value
    if isinstance(value, str) and value:
        try:
            return grp.getgrnam(value).gr_gid
        except (KeyError, ValueError):
            raise PolicyError(f"no group named {show_value(value)}",
                              key="control.admin_group") from None
    raise PolicyError(f"expected a group name or gid, got {show_value(value)}",
                      key="control.admin_group")


def _build(raw: dict[str, Any], source: str) -> Policy:
    _check_keys(raw, ("backend", "control", "tenants", "classes"), "")
    backend_table = _table(raw, "backend", "backend")
    _check_keys(backend_table, LIMIT_KEYS, "backend")
    backend_limits = _limits(backend_table, "backend")
    control_table = _table(raw, "control", "control")
    _check_keys(control_table, ("admin_group",), "control")
    tenants_table = _table(raw, "tenants", "tenants")
    tenants = tuple(_build_tenant(name, _table(tenants_table, name, f"tenants.{_quote_key(name)}"),
                                  f"tenants.{_quote_key(name)}") for name in tenants_table)
    tenant_names = tuple(t.name for t in tenants)
    classes_table = _table(raw, "classes", "classes")
    classes = [_build_class(name, _table(classes_table, name, f"classes.{_quote_key(name)}"),
                            f"classes.{_quote_key(name)}", tenant_names)
               for name in classes_table]
    default = next((c for c in classes if c.name == "default"), ClassRule("default"))
    classes = [c for c in classes if c.name != "default"] + [default]
    envs = {c.job_env for c in classes if c.job_env is not None}
    if len(envs) > 1:
        last = next(c for c in reversed(classes) if c.job_env is not None)
        found = ", ".join(sorted(envs))
        raise PolicyError(f"all classes must use the same job_env (found {found})",
                          key=f"classes.{last.name}.job_env")
    for direction in ("read", "write"):
        _check_minimums(classes, backend_limits, direction)
    backend = None if backend_limits == Limits() else Backend(backend_limits)
    return Policy(source, tuple(classes), tenants, backend, Control(_admin_gid(control_table)))


def _check_minimums(classes: list[ClassRule], backend: Limits, direction: str) -> None:
    """Guarantees must be backed by declared capacity and must be reachable under caps."""
    key, total_key = f"min_{direction}_bandwidth", f"{direction}_bandwidth"
    total = getattr(backend, total_key)
    used = 0.0
    for c in classes:
        minimum = getattr(c, key)
        if minimum is None:
            continue
        where = f"classes.{c.name}.{key}"
        if total is None:
            raise PolicyError(f"a guarantee needs [backend] {total_key} to be declared", key=where)
        cap = getattr(c.limits, total_key)
        if cap is not None and minimum > cap:
            raise PolicyError(f"{key} ({format_bandwidth(minimum)}) exceeds the class's own "
                              f"{total_key} cap ({format_bandwidth(cap)})", key=where)
        used += minimum
        if used > total:
            raise PolicyError(f"the sum of {key} over classes ({format_bandwidth(used)}) exceeds "
                              f"backend {total_key} ({format_bandwidth(total)})", key=where)


# ---------------------------------------------------------------------- rendering

def _limits_raw(limits: Limits) -> dict[str, Any]:
    return {k: _FORMAT[k](v) for k in LIMIT_KEYS if (v := getattr(limits, k)) is not None}


def _ids_raw(ranges: tuple[IdRange, ...]) -> list[int | str]:
    return [r.lo if r.lo == r.hi else f"{r.lo}-{r.hi}" for r in ranges]


def _class_raw(c: ClassRule) -> dict[str, Any]:
    out: dict[str, Any] = {"paths": list(c.paths), "uids": _ids_raw(c.uids),
                           "gids": _ids_raw(c.gids), "tenants": list(c.tenants),
                           "ops": [op for op in OPS if op in c.ops], "job_env": c.job_env,
                           "jobs": list(c.jobs), "cgroups": list(c.cgroups)}
    named = PRIORITY_WEIGHTS.get(c.priority_name) == c.priority_weight
    out["priority"] = c.priority_name if named else c.priority_weight
    for key in ("min_read_bandwidth", "min_write_bandwidth"):
        out[key] = None if getattr(c, key) is None else format_bandwidth(getattr(c, key))
    out.update(per_user="fair" if c.per_user else "none", cache=c.cache,
               latency_percentile=c.latency_percentile, latency_measure=c.latency_measure,
               **_limits_raw(c.limits))
    if c.target_read_latency is not None:
        out["target_read_latency"] = format_duration(c.target_read_latency)
    return {k: v for k, v in out.items() if v not in (None, [])}


def _to_raw(policy: Policy) -> dict[str, Any]:
    """The policy as the dict tomllib would produce from its rendering."""
    raw: dict[str, Any] = {}
    if policy.backend is not None:
        raw["backend"] = _limits_raw(policy.backend.limits)
    if policy.control.admin_gid is not None:
        raw["control"] = {"admin_group": policy.control.admin_gid}
    raw["tenants"] = {t.name: {"uids": _ids_raw(t.uids), "gids": _ids_raw(t.gids),
                               "paths": list(t.paths), **_limits_raw(t.limits)}
                      for t in policy.tenants}
    for table in raw["tenants"].values():
        for key in ("uids", "gids", "paths"):
            if not table[key]:
                del table[key]
    raw["classes"] = {c.name: _class_raw(c) for c in policy.classes}
    return raw


def _toml_str(text: str) -> str:
    """A TOML basic string; unlike JSON, TOML forbids raw DEL and surrogate escapes."""
    body = json.dumps(text, ensure_ascii=False)[1:-1].replace("\x7f", "\\u007f")
    return f'"{body}"'


def _toml_value(value: Any) -> str:
    if isinstance(value, str):
        return _toml_str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)  # int, or a finite float (repr keeps the ".0")


def _dump(raw: dict[str, Any], source: str) -> str:
    shown = "".join(ch if ch.isprintable() else "?" for ch in source)
    lines = [f"# qosfs policy, resolved from {shown}"]
    sections: list[tuple[str, dict[str, Any]]] = [
        (top, raw[top]) for top in ("backend", "control") if top in raw]
    sections += [(f"{top}.{name}", table) for top in ("tenants", "classes")
                 for name, table in raw.get(top, {}).items()]
    for header, table in sections:
        lines += ["", f"[{header}]", *(f"{k} = {_toml_value(v)}" for k, v in table.items())]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ error lines

def _split_key(text: str) -> tuple[str, ...] | None:
    """``a."b.c".d`` -> ``("a", "b.c", "d")``; None if it does not look like a TOML key."""
    parts: list[str] = []
    pos = 0
    while match := _KEY_PART.match(text, pos):
        bare, basic, literal = match[1], match[2], match[3]
        if basic is not None:
            with contextlib.suppress(ValueError):  # TOML's escapes are JSON's, \U and \e aside
                basic = json.loads(f'"{basic}"')
        parts.append(bare if bare is not None else basic if basic is not None else literal)
        pos = match.end()
        if match[4] is None:
            return tuple(parts) if pos == len(text) else None
    return None


def _locate(text: str, key: str | None) -> int | None:
    """Best-effort line of ``key`` (or of its nearest enclosing table) in the source text."""
    target = None if key is None else _split_key(key)
    if not target:
        return None
    found: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    for number, line in enumerate(text.split("\n"), 1):  # TOML's newlines, not str's
        stripped = line.strip()
        header = re.fullmatch(r"\[\s*([^\[\]]+?)\s*\]\s*(?:#.*)?", stripped)
        if header:
            table = _split_key(header[1]) or ("\0",)
            key_path = table
        elif assignment := re.match(r"((?:[^=\"']|\"[^\"]*\"|'[^']*')+?)\s*=", stripped):
            key_path = table + (_split_key(assignment[1]) or ("\0",))
        else:
            continue
        for size in range(1, len(key_path) + 1):  # [a.b] also declares a
            found.setdefault(key_path[:size], number)
    for size in range(len(target), 0, -1):
        if target[:size] in found:
            return found[target[:size]]
    return None


DEFAULT_POLICY_TEXT = """\
# qosfs default policy: what `qosfs mount` uses without --policy.
# Print it with `qosfs policy default`, copy it to /etc/qosfs/<name>.toml, edit, then check
# it with `qosfs check FILE`. A request belongs to the first class (in file order) whose
# criteria all match; every request is counted, only capped classes ever wait.

# Declare what the storage delivers to enable guarantees (min_read_bandwidth, ...) and to
# let priorities share a contended backend:
# [backend]
# read_bandwidth = "4GiB/s"
# write_bandwidth = "2GiB/s"

# Tenants group users; their caps hold over all of their traffic:
# [tenants.team-a]
# uids = ["1000-1999"]
# write_bandwidth = "1GiB/s"

# Checkpoint dumps: hundreds of ranks writing at once starve the data loaders, so writes
# are capped. Reading a checkpoint back is not capped.
[classes.checkpoints]
paths = [
    "**/checkpoints/**", "**/*.pt", "**/*.pth", "**/*.safetensors", "**/*.distcp",
    "**/*.ckpt",
]
write_bandwidth = "400MiB/s"
burst = "64MiB"          # bucket depth: a short dump this size goes through at full speed
# per_user = "fair"      # give each writing uid an equal share of the 400MiB/s

# Training data: never throttled here, and first in line when the backend is contended.
[classes.datasets]
paths = [
    "data/**", "datasets/**", "**/*.parquet", "**/*.arrow", "**/*.tfrecord*", "**/*.tar",
    "**/*.mds", "**/*.npy", "**/*.h5", "**/*.hdf5", "**/*.jsonl",
]
priority = "high"
# min_read_bandwidth = "1GiB/s"   # a guaranteed share; needs [backend] read_bandwidth

# Everything else: counted, not capped.
[classes.default]
"""
