"""What a request would get, and why: the answer of ``qosfs explain``.

One function, :func:`explain`, answers for a policy file (``qosfs explain --policy``) and
for a running mount (the control socket's ``explain`` request), so the two cannot say
different things. For a mount, the engine asks it (:meth:`qosfs.qos.engine.PolicyQos.
explain`): the class and tenant then come from the very
:class:`~qosfs.policy.classify.Classifier` the mount uses, and the limits are those in
force, from the engine's statistics (``ctl set``, automatic caps, a fair share split
among active users), not those of the file. It reads nothing of a request's path on
disk and changes nothing: no flow, account or level is made for an explained request.

The answer is plain JSON-ready data (its keys are documented in docs/policy.md, "Which
class, and why"): the class and tenant with the criteria that matched and their
lines in the policy file, the classes and tenants passed over and the criterion each
failed, the levels the request is charged to in the order it passes them (user, class,
tenant, backend, as :class:`~qosfs.qos.flow.PolicyFlow` chains them), who serves it,
and notes on what can still move it (streaming writers, temporary names).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qosfs.core.mountinfo import lies_within
from qosfs.core.units import format_size
from qosfs.policy.classify import CallerKey, Classifier, JobInfo, read_job_info
from qosfs.policy.globs import compile_cgroup_glob, compile_glob, compile_value_glob
from qosfs.policy.model import (
    ClassRule,
    IdRange,
    Policy,
    Tenant,
    passthrough_blocker,
    stream_threshold,
)
from qosfs.policy.text import locate_key, quote_key

if TYPE_CHECKING:
    from qosfs.qos.stats import EngineStatistics

__all__ = ["PASSTHROUGH_READS_ONLY", "Asked", "explain", "job_of",
           "mount_relative"]

#: Why a request is served by the daemon although kernel passthrough (the kernel reading
#: the backing file itself) exists: only reads of read-only opens are passed through,
#: and only for a class whose reads nothing keeps in the daemon: ``passthrough = "off"``,
#: a cap, a latency target measured on its own reads
#: (:func:`qosfs.policy.model.passthrough_blocker`); :func:`_served_by` says which.
PASSTHROUGH_READS_ONLY = "only read-only opens are passed through to the kernel"


def mount_relative(path: str, mountpoint: str | None) -> str:
    """*path* as classification sees it: relative to the mount root, normalized, without
    a leading ``/`` (``""`` is the root). An absolute *path* must lie in *mountpoint*.

    Raises:
        ValueError: an absolute path without a mountpoint or outside it, or a relative
            one that climbs out of the root with ``..``.
    """
    if path.startswith("/"):
        if mountpoint is None:
            raise ValueError(f"{path} is absolute: give PATH relative to the mount root "
                             "(or a path in a qosfs mount)")
        top = posixpath.normpath(mountpoint)
        norm = posixpath.normpath("/" + path.lstrip("/"))
        if not lies_within(norm, top):
            raise ValueError(f"{path} is not in the mount {mountpoint}")
        rel = posixpath.relpath(norm, top)
        return "" if rel == "." else rel
    norm = posixpath.normpath(path) if path else "."
    if norm == ".." or norm.startswith("../"):
        raise ValueError(f"{path} is outside the mount root")
    return "" if norm == "." else norm


def job_of(env: dict[str, str], cgroups: list[str], names: tuple[str, ...]) -> JobInfo:
    """The :class:`JobInfo` of a caller with environment *env* and cgroup paths *cgroups*
    (the v2 one first, then v1 ones): what the mount would read of it in ``/proc``. Only
    the variables in *names* are kept, and an empty value counts as unset, as there."""
    kept = tuple((name, env[name]) for name in names if env.get(name))
    return JobInfo(kept, cgroups[0] if cgroups else None, tuple(cgroups[1:]))


def _cgroups(job: JobInfo) -> list[str]:
    return ([job.cgroup] if job.cgroup is not None else []) + list(job.v1_cgroups)


def _ids(r: IdRange) -> str:
    return str(r.lo) if r.lo == r.hi else f"{r.lo}-{r.hi}"


class _Where:
    """Lines of a policy's keys in the text it was read from (None: not in the text)."""

    def __init__(self, text: str | None) -> None:
        self.text = text

    def line(self, top: str, name: str, key: str | None = None) -> int | None:
        if self.text is None:
            return None
        dotted = f"{top}.{quote_key(name)}" + ("" if key is None else f".{key}")
        return locate_key(self.text, dotted, within=2)  # the table itself, at least


def _first(patterns: tuple[str, ...], value: str,
           compile_one: Callable[[str], re.Pattern[str]]) -> str | None:
    return next((p for p in patterns if compile_one(p).fullmatch(value) is not None), None)


def _matched(rule: ClassRule | Tenant, path: str, caller: CallerKey, job: JobInfo | None,
             tenant: Tenant | None) -> list[tuple[str, str, str]]:
    """(key, the policy's value that matched, the caller's) of each criterion *rule* has,
    in file-key order. Display only: the decision is the classifier's."""
    out: list[tuple[str, str, str]] = []
    if rule.paths:
        out.append(("paths", _first(rule.paths, path, compile_glob) or "?", path or "/"))
    for key, ranges, caller_id in (("uids", rule.uids, caller.uid),
                                   ("gids", rule.gids, caller.gid)):
        hit = next((r for r in ranges if caller_id in r), None)
        if hit is not None:  # a tenant needs its uids OR its gids: only the one that held
            out.append((key, _ids(hit), str(caller_id)))
    if isinstance(rule, ClassRule):
        if rule.tenants and tenant is not None:
            out.append(("tenants", tenant.name, tenant.name))
        if rule.ops:
            out.append(("ops", caller.op, caller.op))
    value = job.value(rule.job_env) if job is not None and rule.job_env else None
    if rule.job_env is not None:
        out.append(("job_env", rule.job_env, f"{rule.job_env}={value}"))
        if rule.jobs and value is not None:
            out.append(("jobs", _first(rule.jobs, value, compile_value_glob) or "?", value))
    if rule.cgroups and job is not None:
        for cgroup in _cgroups(job):
            glob = _first(rule.cgroups, cgroup.lstrip("/"), compile_cgroup_glob)
            if glob is not None:
                out.append(("cgroups", glob, cgroup))
                break
    return out


def _missed(key: str, path: str, caller: CallerKey, job: JobInfo | None,
            tenant: Tenant | None, failed: ClassRule | Tenant | None) -> str:
    """What the caller had for the criterion *key* of *failed* it failed."""
    if key == "paths":
        return path or "/"
    if isinstance(failed, Tenant) and failed.uids and failed.gids:
        return f"uid {caller.uid}, gid {caller.gid}"  # a member by either: neither held
    if key in ("uids", "gids"):
        return f"{key[:-1]} {caller.uid if key == 'uids' else caller.gid}"
    if key == "tenants":
        return tenant.name if tenant is not None else "no tenant"
    if key == "ops":
        return caller.op
    if key in ("job_env", "jobs"):
        job_env = failed.job_env if failed is not None else None
        value = job.value(job_env) if job is not None and job_env else None
        return f"{job_env} unset" if value is None else f"{job_env}={value}"
    cgroups = _cgroups(job) if job is not None else []
    return ", ".join(cgroups) or "no cgroup"


def _levels(policy: Policy, rule: ClassRule, tenant: Tenant | None, caller: CallerKey,
            live: EngineStatistics | None) -> list[dict[str, Any]]:
    """The levels a request of *rule* and *tenant* passes, in order (user, class, tenant,
    backend), each with its limits in force (*live*, a mount's) or configured (a file's)."""
    levels: list[dict[str, Any]] = []
    state = live.classes[rule.name] if live is not None else None
    class_caps = state.limits.caps() if state is not None else rule.limits.caps()
    if rule.per_user:
        user: dict[str, Any] = {"level": "user", "name": rule.name, "uid": caller.uid,
                                "limits": class_caps, "active_users": None}
        active = live.users.get(rule.name) if live is not None else None
        if state is not None and active is not None:
            child = active.get(caller.uid)
            users = len(active) + (child is None)  # this uid's request would join them
            user["limits"] = (child.limits.caps() if child is not None
                              else state.limits.scaled(1.0 / users).caps())
            user["active_users"] = users
        levels.append(user)
    level: dict[str, Any] = {"level": "class", "name": rule.name, "limits": class_caps,
                             "configured": rule.limits.caps(), "scope": rule.scope}
    auto = live.auto_caps.get(rule.name) if live is not None else None
    if auto is not None:
        level["auto_limits"] = {k: v for k, v in (("read_bandwidth", auto.read_bandwidth),
                                                  ("write_bandwidth", auto.write_bandwidth))
                                if v is not None}
    levels.append(level)
    if tenant is not None:
        in_force = live.tenants.get(tenant.name) if live is not None else None
        configured = tenant.limits.caps()
        levels.append({"level": "tenant", "name": tenant.name,
                       "limits": in_force.limits.caps() if in_force is not None else configured,
                       "configured": configured, "scope": tenant.scope})
    if policy.backend is not None:
        backend = live.backend if live is not None else None
        configured = policy.backend.limits.caps()
        levels.append({
            "level": "backend", "name": "backend",
            "limits": backend.limits.caps() if backend is not None else configured,
            "configured": configured,
            # How this class competes there (qosfs.qos.flow.backend_share).
            "priority": rule.priority_name, "weight": rule.priority_weight,
            "min_read_bandwidth": rule.min_read_bandwidth,
            "min_write_bandwidth": rule.min_write_bandwidth})
    return levels


def _served_by(policy: Policy, rule: ClassRule, tenant: Tenant | None, op: str,
               levels: list[dict[str, Any]], mount_cache: str) -> dict[str, Any]:
    """Who answers the request: the kernel for reads of a read-only open of a class whose
    reads nothing keeps in the daemon (:func:`qosfs.policy.model.passthrough_blocker`) and
    no level caps (configured or, on a mount, the latency controller's automatic caps in
    force now), else the daemon, with the reason.
    A mount that could not negotiate passthrough says so instead
    (:meth:`qosfs.control.service.ControlService.explain`). A read served by the daemon
    from a class that keeps the page cache may also be answered from it by the kernel,
    uncharged, unless the mount bypasses it for every class (``--cache never``)."""
    reason = None
    if op != "read":
        reason = PASSTHROUGH_READS_ONLY
    else:
        reason = passthrough_blocker(policy, rule, () if tenant is None else (tenant,))
        if reason is None:
            capped = next((lv for lv in levels if "read_bandwidth" in lv["limits"]
                           or "read_iops" in lv["limits"]), None)
            if capped is not None:
                reason = f"the {capped['level']} level caps reads now"
    if reason is None:
        return {"by": "kernel", "passthrough": True,
                "reason": "no level caps the class's reads and its passthrough is not "
                          "off: read-only opens are passed through to the kernel, their "
                          "reads never reach the daemon (an open for writing is served "
                          "by it)"}
    served: dict[str, Any] = {"by": "daemon", "passthrough": False, "reason": reason}
    if op == "read":
        bypassed = rule.reads_bypass_cache or mount_cache == "never"
        served["page_cache"] = "bypassed" if bypassed else "used"
    return served


@dataclass(frozen=True, slots=True)
class Asked:
    """A request to explain; each key left None is the asking process's own, as the mount
    would see it if that process made the request (uid and gid, its environment and
    cgroups from ``/proc``)."""

    path: str  # relative to the mount root, or absolute in the mount
    op: str = "read"
    uid: int | None = None
    gid: int | None = None
    env: tuple[tuple[str, str], ...] | None = None
    cgroups: tuple[str, ...] | None = None


def explain(classifier: Classifier, asked: Asked, *, pid: int, uid: int, gid: int,
            mountpoint: str | None = None, live: EngineStatistics | None = None,
            mount_cache: str = "auto", proc_root: str = "/proc") -> dict[str, Any]:
    """What the request *asked* gets under the classifier's policy, with *live* (the
    statistics of the engine whose classifier it is) the limits in force there.

    Args:
        pid, uid, gid: the asking process: what keys left out default to.
        mountpoint: where the policy is in force; an absolute path must lie in it.
        mount_cache: the mount's ``--cache`` (``never``: no read uses the page cache).

    Raises:
        ValueError: the path is not in the mount (see :func:`mount_relative`).
    """
    policy = classifier.policy
    path = mount_relative(asked.path, mountpoint)
    names = policy.job_envs
    own = read_job_info(pid, names, proc_root=proc_root) if (
        asked.env is None or asked.cgroups is None) else JobInfo()
    env = dict(own.env if asked.env is None else asked.env)
    job = job_of(env, list(_cgroups(own) if asked.cgroups is None else asked.cgroups), names)
    caller = CallerKey(asked.op, uid if asked.uid is None else asked.uid,
                       gid if asked.gid is None else asked.gid, 0)
    from_caller = [key for key in ("uid", "gid", "env", "cgroups")
                   if getattr(asked, key) is None]
    return _explained(classifier, path, caller, job, live, mountpoint, from_caller,
                      mount_cache)


def _explained(classifier: Classifier, path: str, caller: CallerKey, job: JobInfo,
               live: EngineStatistics | None, mountpoint: str | None, from_caller: list[str],
               mount_cache: str) -> dict[str, Any]:
    policy = classifier.policy
    # As the engine asks (qosfs.qos.memo.Classification.classified): no job unless the
    # policy reads jobs.
    seen = job if policy.needs_job_lookup else None
    decision = classifier.decide(path, caller, seen)
    rule, tenant = decision.rule, decision.tenant
    where = _Where(policy.text)
    # The class's tenants criterion sees the tenant of the path it was decided on.
    class_tenant = classifier.tenant_of(caller.uid, caller.gid, decision.path, seen)

    def criteria(top: str, r: ClassRule | Tenant, on: str, t: Tenant | None
                 ) -> list[dict[str, Any]]:
        return [{"key": key, "value": value, "caller": had, "line": where.line(top, r.name, key)}
                for key, value, had in _matched(r, on, caller, seen, t)]

    def passed(top: str, skipped: tuple[tuple[str, str], ...], on: str
               ) -> list[dict[str, Any]]:
        out = []
        for name, key in skipped:
            r = policy.class_by_name(name) if top == "classes" else policy.tenant_by_name(name)
            out.append({"name": name, "key": key, "line": where.line(top, name, key),
                        "caller": _missed(key, on, caller, seen, class_tenant, r)})
        return out

    notes = []
    if decision.path != path:
        notes.append(f"{path} looks like the temporary name of an atomic save: it is "
                     f"classified as {decision.path}, the name it will be renamed to")
    if caller.op == "meta" and not policy.meta_limited:
        notes.append("nothing in this policy caps meta_iops: metadata requests are then "
                     "neither classified nor counted (each would cost a path lookup)")
    moves = stream_threshold(rule, policy.streaming_target) if caller.op == "write" else 0
    if moves and policy.streaming_target is not None:
        notes.append(f"a writable open that writes {format_size(moves)} mostly "
                     f"sequentially moves to class {policy.streaming_target.name} "
                     "(detect_streaming_writes)")
    levels = _levels(policy, rule, tenant, caller, live)
    return {
        "path": path,
        "mount": mountpoint,
        "request": {"op": caller.op, "uid": caller.uid, "gid": caller.gid,
                    "env": dict(job.env), "cgroups": _cgroups(job),
                    "from_caller": from_caller},
        "policy": {"source": policy.source,
                   "generation": live.generation if live is not None else None,
                   # What of the caller beyond uid, gid and path it can match on.
                   "job_env": list(policy.job_envs),
                   "cgroups": any(c.cgroups for c in policy.classes)
                   or any(t.cgroups for t in policy.tenants)},
        "class": {"name": rule.name, "line": where.line("classes", rule.name),
                  "decided_on": decision.path,
                  "matched": criteria("classes", rule, decision.path, class_tenant),
                  "priority": rule.priority_name, "per_user": rule.per_user,
                  "cache": rule.cache},
        "classes_passed": passed("classes", decision.skipped_classes, decision.path),
        "tenant": None if tenant is None else {
            "name": tenant.name, "line": where.line("tenants", tenant.name),
            "matched": criteria("tenants", tenant, path, None)},
        "tenants_passed": passed("tenants", decision.skipped_tenants, path),
        "levels": levels,
        "served_by": _served_by(policy, rule, tenant, caller.op, levels, mount_cache),
        "notes": notes,
    }
