"""From ``tomllib``'s dicts to a validated :class:`~qosfs.policy.model.Policy` and back.

Validate once at the edge, trust inside: every key is type-, unit- and range-checked here,
and the first problem raises :class:`~qosfs.policy.model.PolicyError` naming the dotted
key (:func:`qosfs.policy.loading.parse_policy` adds the file and line).
"""

from __future__ import annotations

import difflib
import grp
import re
from typing import Any

from qosfs.core.limit_kinds import BURST_KEYS, CAP_KEYS, LIMIT_KINDS
from qosfs.core.units import (
    UnitError,
    format_bandwidth,
    format_size,
    parse_bandwidth,
    parse_duration,
    parse_interval,
    parse_size,
    show_value,
)
from qosfs.policy.globs import GlobError, compile_cgroup_glob, compile_glob, compile_value_glob
from qosfs.policy.keys import (
    CACHE_MODES,
    CLASS_KEYS,
    CLUSTER_KEYS,
    LATENCY_MEASURES,
    LIMIT_KEYS,
    MATCH_KEYS,
    MAX_ID,
    OPS,
    PASSTHROUGH_MODES,
    PRIORITY_WEIGHTS,
    SCOPES,
    TENANT_KEYS,
)
from qosfs.policy.model import (
    DEFAULT_USER_SERIES,
    DEFAULT_USER_SERIES_IDLE,
    Backend,
    ClassRule,
    Cluster,
    Control,
    Exported,
    IdRange,
    Limits,
    Policy,
    PolicyError,
    Tenant,
)
from qosfs.policy.text import quote_key

# How each limit key is read from and written to policy text: from the table of kinds.
_PARSE = {**{k.key: k.parse for k in LIMIT_KINDS}, **{k: v[0] for k, v in BURST_KEYS.items()}}
_FORMAT = {**{k.key: k.show for k in LIMIT_KINDS}, **{k: v[1] for k, v in BURST_KEYS.items()}}
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,63}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ID_RANGE = re.compile(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?")


def unknown_key(key: str, allowed: tuple[str, ...], noun: str = "key") -> str:
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
            raise PolicyError(unknown_key(key, allowed, noun), key=f"{path}.{quote_key(key)}"
                              if path else quote_key(key))


def _nonempty_list(table: dict[str, Any], key: str, path: str, what: str) -> list[Any]:
    value = table.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not value:
        raise PolicyError(f"expected a non-empty list of {what}, got {show_value(value)}",
                          key=f"{path}.{key}")
    return value


MIN_STREAM_BYTES = 1 << 20


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
    job_env, jobs = _job_keys(table, path)
    tenant = Tenant(name, _ids(table, "uids", path), _ids(table, "gids", path),
                    _strings(table, "paths", path, "path globs", compile_glob),
                    _limits(table, path),
                    _strings(table, "cgroups", path, "cgroup globs", compile_cgroup_glob),
                    job_env, jobs, _choice(table, "scope", path, SCOPES, "node"))
    if not (tenant.uids or tenant.gids or tenant.paths or tenant.cgroups or tenant.job_env):
        raise PolicyError("a tenant needs at least one of uids, gids, paths, cgroups or "
                          "job_env", key=path)
    return tenant


def _job_keys(table: dict[str, Any], path: str) -> tuple[str | None, tuple[str, ...]]:
    """``job_env`` (a variable name) and ``jobs`` (globs over its value), as classes and
    tenants both spell them."""
    job_env = table.get("job_env")
    if job_env is not None and not (isinstance(job_env, str) and _ENV_NAME.fullmatch(job_env)):
        raise PolicyError(f'expected an environment variable name like "SLURM_JOB_ID", got '
                          f"{show_value(job_env)}", key=f"{path}.job_env")
    jobs = _strings(table, "jobs", path, "job id globs", compile_value_glob)
    if jobs and job_env is None:
        raise PolicyError('jobs needs job_env, the variable holding the value (e.g. '
                          '"SLURM_JOB_ID")', key=f"{path}.jobs")
    return job_env, jobs


def _check_tenant_overlap(tenants: tuple[Tenant, ...]) -> None:
    """Two tenants defined by ids alone must not share a uid or gid: the first in file
    order would silently take every shared user's traffic. With paths, cgroups or an
    environment value, sharing users is how one team is split by project (``qosfs check``
    names the precedence then)."""
    for i, first in enumerate(tenants):
        for second in tenants[i + 1:]:
            if any(t.paths or t.cgroups or t.job_env for t in (first, second)):
                continue
            for key in ("uids", "gids"):
                shared = _shared_id(getattr(first, key), getattr(second, key))
                if shared is not None:
                    raise PolicyError(
                        f"{key[:-1]} {shared} is also in tenants.{quote_key(first.name)}."
                        f"{key} (a request belongs to one tenant; give each id to one, or "
                        "tell them apart by paths)", key=f"tenants.{quote_key(second.name)}"
                        f".{key}")


def _shared_id(a: tuple[IdRange, ...], b: tuple[IdRange, ...]) -> int | None:
    for x in a:
        for y in b:
            if x.lo <= y.hi and y.lo <= x.hi:
                return max(x.lo, y.lo)
    return None


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
    job_env, jobs = _job_keys(table, path)
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
        scope=_choice(table, "scope", path, SCOPES, "node"),
        cache=_choice(table, "cache", path, CACHE_MODES, "auto"),
        passthrough=_choice(table, "passthrough", path, PASSTHROUGH_MODES, "auto"),
        target_read_latency=_unit(table, "target_read_latency", path, parse_duration, False),
        target_read_slowdown=_slowdown(table, path),
        latency_percentile=float(percentile),
        latency_measure=_choice(table, "latency_measure", path, LATENCY_MEASURES, "request"),
        detect_streaming_writes=_streaming(table, path),
        entry_timeout=_cache_timeout(table, "entry_timeout", path, name),
        attr_timeout=_cache_timeout(table, "attr_timeout", path, name))


#: target_read_slowdown bounds: at most 1.0 would throttle for noise, past 100 protects nothing.
MIN_SLOWDOWN, MAX_SLOWDOWN = 1.0, 100.0


def _slowdown(table: dict[str, Any], path: str) -> float | None:
    value = table.get("target_read_slowdown")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            MIN_SLOWDOWN < value <= MAX_SLOWDOWN):
        raise PolicyError(f"expected a factor above {MIN_SLOWDOWN:g} and at most "
                          f"{MAX_SLOWDOWN:g} (1.5: reads may take 1.5x what they take while "
                          f"the classes below are quiet), got {show_value(value)}",
                          key=f"{path}.target_read_slowdown")
    return float(value)


def _cache_timeout(table: dict[str, Any], key: str, path: str, name: str) -> float | None:
    """entry_timeout/attr_timeout: 0 .. 1 h. Only the default class and classes with
    paths may set them: the kernel caches a name or an inode for every caller, so the
    object's path is all that can decide how long."""
    value = table.get(key)
    if value is None:
        return None
    if value in (0, "0", "0s"):
        seconds = 0.0
    else:
        seconds = _unit(table, key, path, parse_duration, False)
    if name != "default" and not table.get("paths"):
        raise PolicyError(f"{key} needs paths: the kernel caches an object for every "
                          "caller, so only its path can decide how long (uids, gids, "
                          "tenants, ops and jobs cannot)", key=f"{path}.{key}")
    return float(seconds)


def _streaming(table: dict[str, Any], path: str) -> int | None:
    size = _unit(table, "detect_streaming_writes", path, parse_size, False)
    if size is not None and size < MIN_STREAM_BYTES:
        raise PolicyError(f"expected at least {format_size(MIN_STREAM_BYTES)} (smaller files are "
                          f"not streams), got {show_value(table['detect_streaming_writes'])}",
                          key=f"{path}.detect_streaming_writes")
    return None if size is None else int(size)


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


#: The bounds of [metrics] settings: a uid label per class costs ~120 series.
MAX_USER_SERIES = 100_000
MIN_USER_SERIES_IDLE = 1.0


def _exported(table: dict[str, Any]) -> Exported:
    _check_keys(table, ("user_series", "user_series_idle"), "metrics")
    limit = table.get("user_series", DEFAULT_USER_SERIES)
    if isinstance(limit, bool) or not isinstance(limit, int) or not (
            0 <= limit <= MAX_USER_SERIES):
        raise PolicyError(f"expected a number of uids 0..{MAX_USER_SERIES} (0: no per-uid "
                          f"series), got {show_value(limit)}", key="metrics.user_series")
    idle = _unit(table, "user_series_idle", "metrics", parse_interval, False)
    if idle is not None and idle < MIN_USER_SERIES_IDLE:
        raise PolicyError(f"expected at least 1s, got {show_value(table['user_series_idle'])}",
                          key="metrics.user_series_idle")
    return Exported(limit, DEFAULT_USER_SERIES_IDLE if idle is None else idle)


#: How often a mount may renew its cluster grants: below 10 ms Redis does the work of
#: the data path; above 5 s a change or an idle node's share takes that long to move.
MIN_LEASE, MAX_LEASE = 0.01, 5.0
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def _cluster(table: dict[str, Any]) -> Cluster | None:
    if not table:
        return None
    _check_keys(table, CLUSTER_KEYS, "cluster")
    url = table.get("redis")
    if not isinstance(url, str) or not url.startswith(_REDIS_SCHEMES):
        raise PolicyError('expected a Redis URL: "redis://host:6379/0", "rediss://..." (TLS) '
                          f'or "unix:///run/redis.sock", got {show_value(url)}',
                          key="cluster.redis")
    if ":" in url.split("://", 1)[1].split("@", 1)[0] and "@" in url:
        raise PolicyError("a password does not belong in the policy: put it in password_file "
                          "or the environment variable named by password_env",
                          key="cluster.redis")
    password_file = table.get("password_file")
    if password_file is not None and not (isinstance(password_file, str) and
                                          password_file.startswith("/")):
        raise PolicyError(f"expected an absolute path, got {show_value(password_file)}",
                          key="cluster.password_file")
    password_env = table.get("password_env", "QOSFS_REDIS_PASSWORD")
    if not (isinstance(password_env, str) and _ENV_NAME.fullmatch(password_env)):
        raise PolicyError(f"expected an environment variable name, got "
                          f"{show_value(password_env)}", key="cluster.password_env")
    prefix = table.get("key_prefix", "qosfs")
    if not (isinstance(prefix, str) and _NAME.fullmatch(prefix)):
        raise PolicyError(f'expected a key prefix of letters, digits, "_" and "-", got '
                          f"{show_value(prefix)}", key="cluster.key_prefix")
    lease = _unit(table, "lease", "cluster", parse_duration, False)
    if lease is not None and not MIN_LEASE <= lease <= MAX_LEASE:
        raise PolicyError(f"expected a lease of 10ms..5s, got {show_value(table['lease'])}",
                          key="cluster.lease")
    fallback = table.get("fallback", "last-grant")
    if fallback == "last-grant":
        nodes = None
    elif isinstance(fallback, int) and not isinstance(fallback, bool) and fallback >= 1:
        nodes = fallback
    else:
        raise PolicyError('expected "last-grant" or a number of nodes (each mount then '
                          f"enforces the cluster cap divided by it), got {show_value(fallback)}",
                          key="cluster.fallback")
    return Cluster(url, password_file, password_env, prefix, 0.1 if lease is None else lease,
                   nodes)


def _check_scopes(cluster: Cluster | None, tenants: tuple[Tenant, ...],
                  classes: list[ClassRule]) -> None:
    """A cluster scope needs a [cluster] to meet in, and a cap to share."""
    scoped = [(f"tenants.{quote_key(t.name)}", t.limits) for t in tenants
              if t.scope == "cluster"]
    scoped += [(f"classes.{quote_key(c.name)}", c.limits) for c in classes
               if c.scope == "cluster"]
    for path, limits in scoped:
        if cluster is None:
            raise PolicyError('scope = "cluster" needs a [cluster] table (redis = "...")',
                              key=f"{path}.scope")
        if limits.is_unlimited:
            raise PolicyError('scope = "cluster" shares caps across mounts; this one sets none',
                              key=f"{path}.scope")


def build_policy(raw: dict[str, Any], source: str) -> Policy:
    _check_keys(raw, ("backend", "control", "metrics", "cluster", "tenants", "classes"), "")
    backend_table = _table(raw, "backend", "backend")
    _check_keys(backend_table, LIMIT_KEYS, "backend")
    backend_limits = _limits(backend_table, "backend")
    control_table = _table(raw, "control", "control")
    _check_keys(control_table, ("admin_group",), "control")
    tenants_table = _table(raw, "tenants", "tenants")
    tenants = tuple(_build_tenant(name, _table(tenants_table, name, f"tenants.{quote_key(name)}"),
                                  f"tenants.{quote_key(name)}") for name in tenants_table)
    _check_tenant_overlap(tenants)
    tenant_names = tuple(t.name for t in tenants)
    classes_table = _table(raw, "classes", "classes")
    classes = [_build_class(name, _table(classes_table, name, f"classes.{quote_key(name)}"),
                            f"classes.{quote_key(name)}", tenant_names)
               for name in classes_table]
    streaming = [c.name for c in classes if c.detect_streaming_writes is not None]
    if len(streaming) > 1:
        raise PolicyError(f"only one class may take streaming writers; "
                          f"classes.{quote_key(streaming[0])} already has it",
                          key=f"classes.{quote_key(streaming[1])}.detect_streaming_writes")
    default = next((c for c in classes if c.name == "default"), ClassRule("default"))
    classes = [c for c in classes if c.name != "default"] + [default]
    for direction in ("read", "write"):
        _check_minimums(classes, backend_limits, direction)
    backend = None if backend_limits == Limits() else Backend(backend_limits)
    cluster = _cluster(_table(raw, "cluster", "cluster"))
    _check_scopes(cluster, tenants, classes)
    return Policy(source, tuple(classes), tenants, backend, Control(_admin_gid(control_table)),
                  _exported(_table(raw, "metrics", "metrics")), cluster)


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
