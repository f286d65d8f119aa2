"""Loading a policy: parse its TOML, read its file, the embedded default, live changes.

The model itself is :mod:`qosfs.policy.model`; this module is the way in. Validate once at
the edge, trust inside: everything the QoS engine and the classifier read has been type-,
unit- and range-checked on the way in (:mod:`qosfs.policy.build`), and a bad file is
rejected as a whole (a live reload that fails leaves the running policy untouched).
Errors are one line that names the file, line and dotted key:
``mlfs.toml:12: classes.ckpt.write_bandwidth: expected ...``.

Schema (every key optional)::

    [backend]                     # what the storage delivers in total; needed for min_*
    read_bandwidth = "4GiB/s"     # any limit key (below)
    [control]
    admin_group = "storage-admins"  # group name or gid that may change limits via the socket
    [metrics]                     # per-uid detail in /metrics (per_user classes):
    user_series = 100             # at most this many uids per class get series (0: none);
    user_series_idle = "10m"      # a uid idle this long leaves; totals fold into uid=""
    [tenants.NAME]                # who. NAME: letters, digits, "_" and "-"
    uids = ["1000-1999", 42]      # ids or "lo-hi" ranges; member if uid OR gid matches
    gids = [100]                  # (no uids/gids: membership by paths alone)
    paths = ["teams/a/**"]        # AND, if given, the path matches one of these globs
    cgroups = ["/kubepods.slice/**/*pod<uid>*/**"]  # AND the caller's cgroup matches
    job_env = "POD_NAMESPACE"     # AND the caller's environment sets this variable (to a
    jobs = ["team-a*"]            # value one of these globs matches): advisory, see check
    write_bandwidth = "1GiB/s"    # limit keys: caps over all of the tenant's traffic
    [classes.NAME]                # what. The first class in file order whose every given
    paths = ["data/**"]           # criterion matches wins; a list matches if any element does.
    uids = [...]                  # Globs are relative to the mount root: "**" is any number
    gids = [...]                  # of components (even none), "*", "?", "[...]" stay within
    tenants = ["team-a"]          # one. tenants: the caller's tenant is one of these.
    ops = ["read", "write", "meta"]
    job_env = "SLURM_JOB_ID"      # the caller's (exec-time) environment sets this variable;
    jobs = ["1234", "55*"]        # and its value matches one of these globs (needs job_env).
    cgroups = ["/slurm/uid_*/job_*/**"]  # the caller's cgroup (v2, or any v1) path matches
    priority = "normal"           # "low" (weight 1), "normal" (10), "high" (100) or 1..10000
    min_read_bandwidth = "1GiB/s"   # guaranteed share; needs [backend] read_bandwidth, the
    min_write_bandwidth = "..."     # sum over classes must fit in it, and so must any cap
    per_user = "none"             # "fair": active uids share the class's limits equally
    cache = "auto"                # "auto": a read cap bypasses the page cache, throttled
                                  # writes through write-only opens do too; "keep";
                                  # "direct"; "direct-writes": every writable open (a
                                  # shared mmap of a writable open then fails, ENODEV)
    passthrough = "auto"          # read-only opens go to the kernel's passthrough while
                                  # no cap (class, per_user, tenant, [backend]) covers
                                  # their reads and no latency_measure = "backend" target
                                  # needs them seen; "reads" means the same; "off": every
                                  # read is served by the daemon (docs/policy.md)
    entry_timeout = "60s"         # how long the kernel trusts names and attributes of
    attr_timeout = "60s"          # objects under this class's paths (by path alone;
                                  # needs paths; default: the mount's --attr-timeout)
    target_read_slowdown = 1.5    # or relative: reads may take 1.5x what they take while
                                  # the lower classes are quiet (learned; both: the lower)
    target_read_latency = "5ms"   # protect this class's reads: lower-priority classes are
    latency_percentile = 99       # capped automatically while the percentile (0 < p < 100)
    latency_measure = "request"   # of its read latency over a window misses the target;
                                  # "request": as a caller waits for it (queue + backend),
                                  # "backend": the backing syscall only (qosfs.qos.latency.loop)
    [classes.default]             # always exists and always last; limits only, no criteria

Limit keys (backend, tenants, classes): ``read_bandwidth``, ``write_bandwidth`` (like
``"400MiB/s"``); ``read_iops``, ``write_iops``, ``meta_iops`` (like ``2000`` or ``"2k"``);
``"unlimited"`` or no key means no cap. ``burst`` (like ``"128MiB"``) is the depth of each
bandwidth bucket, by default 100 ms of the cap but at least 1 MiB; ``burst_iops`` likewise,
by default 100 ms of the cap but at least 8 ops (see :meth:`Limits.bandwidth_burst`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
import tomllib
from os import PathLike

from qosfs.core.units import show_value
from qosfs.policy.build import build_policy, unknown_key
from qosfs.policy.keys import CLASS_KEYS, LIMIT_KEYS, SETTABLE, TENANT_KEYS
from qosfs.policy.model import Policy, PolicyError, passthrough_blocker, policy_to_raw
from qosfs.policy.text import DEFAULT_POLICY_TEXT, locate_key, quote_key

__all__ = [
    "MAX_POLICY_BYTES", "default_policy", "load_policy", "parse_policy", "policy_notes",
    "read_policy_text", "with_changes",
]


def parse_policy(text: str, source: str = "<string>") -> Policy:
    """Parse and validate a policy; raises :class:`PolicyError` for anything wrong."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _syntax_error(str(exc), text, source) from None
    except RecursionError:
        raise PolicyError("invalid TOML: nested too deeply", source=source) from None
    try:
        policy = build_policy(raw, source)
    except PolicyError as exc:
        raise PolicyError(exc.reason, source=source, line=locate_key(text, exc.key),
                          key=exc.key) from None
    return dataclasses.replace(policy, text=text)


def load_policy(path: str | PathLike[str]) -> Policy:
    """Read and parse a policy file; unreadable or non-UTF-8 files are PolicyErrors too."""
    return parse_policy(read_policy_text(path), str(path))


def read_policy_text(path: str | PathLike[str]) -> str:
    """The text of a policy file (``qosfs ctl reload FILE`` reads it as the caller and
    sends it, so the daemon never opens files on a client's behalf).

    Only a regular file of at most :data:`MAX_POLICY_BYTES` is read: a symlink to
    ``/dev/zero`` read until memory ran out, and a FIFO blocked ``check`` (and the daemon's
    SIGHUP reload) for ever. ``O_NONBLOCK`` keeps the open itself from waiting on a FIFO.
    """
    name = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise PolicyError(f"cannot read policy: {exc.strerror or exc}", source=name) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PolicyError(f"cannot read policy: not a regular file ({_file_kind(st.st_mode)})",
                              source=name)
        if st.st_size > MAX_POLICY_BYTES:
            raise PolicyError(f"cannot read policy: larger than {MAX_POLICY_BYTES} bytes "
                              f"({st.st_size} bytes)", source=name)
        chunks, size = [], 0
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_POLICY_BYTES:  # grew while we read
                raise PolicyError(_too_large(size), source=name)
        data = b"".join(chunks)
    except OSError as exc:
        raise PolicyError(f"cannot read policy: {exc.strerror or exc}", source=name) from None
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise PolicyError("not UTF-8 text", source=name,
                          line=data[:exc.start].count(b"\n") + 1) from None


#: The largest policy file read (a policy of thousands of classes is a few hundred KiB).
MAX_POLICY_BYTES = 1 << 20


def _too_large(size: int) -> str:
    return f"cannot read policy: larger than {MAX_POLICY_BYTES} bytes ({size} bytes read)"


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"))
    return next((kind for test, kind in kinds if test(mode)), "not a file")


def policy_notes(policy: Policy) -> list[str]:
    """What an administrator should know about a valid policy: rules a caller can steer,
    where file order decides between tenants, and which classes that take reads keep
    their read-only opens in the daemon, and why (every other class passes them through
    to the kernel where the mount can; ``qosfs check`` prints these)."""
    notes = []
    for c in policy.classes:
        blocker = passthrough_blocker(policy, c)
        if blocker is not None and c.passthrough != "off" and (not c.ops or "read" in c.ops):
            notes.append(f"classes.{quote_key(c.name)}: its reads are served by the daemon, "
                         f"not passed through to the kernel: {blocker}")
        if c.job_env is not None and c.jobs:
            notes.append(
                f"classes.{quote_key(c.name)} matches jobs by the environment variable "
                f"{c.job_env}, which the caller sets (env {c.job_env}=... picks or escapes "
                "this class): advisory only; for classification users cannot forge, match "
                "the cgroup their scheduler puts them in (cgroups = [...])")
    for t in policy.tenants:
        if t.job_env is not None:
            notes.append(
                f"tenants.{quote_key(t.name)} matches by the environment variable {t.job_env}, "
                f"which the caller sets (env {t.job_env}=... joins or leaves this tenant): fine "
                "where only the platform starts processes (a pod spec's env, set by an "
                "admission controller); where users start them, match cgroups instead")
    for i, first in enumerate(policy.tenants):
        for second in policy.tenants[i + 1:]:
            for key in ("uids", "gids"):
                if any(x.lo <= y.hi and y.lo <= x.hi for x in getattr(first, key)
                       for y in getattr(second, key)):
                    notes.append(
                        f"tenants {first.name} and {second.name} share {key}: where both "
                        f"match a request (their paths), {first.name} wins (file order)")
                    break
    return notes


def default_policy() -> Policy:
    """The embedded policy used when ``qosfs mount`` gets no ``--policy``."""
    return parse_policy(DEFAULT_POLICY_TEXT, "<default policy>")


def with_changes(policy: Policy, target_kind: str, name: str | None,
                 changes: dict[str, str]) -> Policy:
    """A new validated policy with settings of one class/tenant/backend changed (``ctl set``).

    Values are spelled as in the file (``"800MiB/s"``, ``"2k"``, ``"high"``); ``"unlimited"``
    removes the key (no cap, or back to the default), and so does ``target_read_latency=none``
    (or ``target_read_slowdown=none``).
    Unknown targets or keys, bad values and broken constraints raise :class:`PolicyError`
    with source ``"ctl"``.
    """
    raw = policy_to_raw(policy)
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
            raise PolicyError(_not_settable(key, target_kind), source="ctl",
                              key=f"{path}.{quote_key(key)}")
        if value == "unlimited" or (value == "none" and key.startswith("target_read_")):
            table.pop(key, None)
        elif key in ("latency_percentile", "target_read_slowdown") and isinstance(value, str):
            try:
                table[key] = float(value)
            except ValueError:
                table[key] = value  # rejected with the file's message by _build
        else:
            numeric = key == "priority" and isinstance(value, str) and value.isdecimal()
            table[key] = int(value) if numeric else value
    try:
        changed = build_policy(raw, policy.source)
    except PolicyError as exc:
        raise PolicyError(exc.reason, source="ctl", key=exc.key) from None
    return dataclasses.replace(changed, text=policy.text)  # settings only: the lines hold


def _not_settable(key: str, target_kind: str) -> str:
    """Why ``ctl set`` refuses *key*: a key of the policy file that only a reload changes,
    a key of another kind of table, or no key at all (with a close match)."""
    settable = SETTABLE[target_kind]
    where = "the backend" if target_kind == "backend" else f"a {target_kind}"
    listed = f"settable live on {where}: {', '.join(settable)}"
    tables = {"class": CLASS_KEYS, "tenant": TENANT_KEYS, "backend": LIMIT_KEYS}
    if key in tables[target_kind]:
        return ("not settable live: change it in the policy file, then `qosfs ctl reload` "
                f"({listed})")
    owners = [f"{kind}es" if kind == "class" else f"{kind}s" for kind, keys in tables.items()
              if key in keys]
    if owners:
        return f"a key of {' and '.join(owners)}, not of {where} ({listed})"
    return unknown_key(key, settable)


def _syntax_error(message: str, text: str, source: str) -> PolicyError:
    match = re.search(r" \(at line (\d+), column (\d+)\)$", message)
    line = int(match[1]) if match else (text.count("\n") + 1 if "end of document" in message
                                        else None)
    reason = message[:match.start()] + f" (column {match[2]})" if match else message
    return PolicyError(f"invalid TOML: {reason[:1].lower()}{reason[1:]}", source=source,
                       line=line)


