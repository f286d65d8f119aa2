"""What ``qosfs check`` warns about in a valid policy: rules that cannot do what they say.

A warning is not an error: the policy loads and a mount runs it; ``qosfs check`` prints
each one with its file and line and exits 0 (``--strict`` makes them errors, exit 6).
Each check warns only where it can show the problem from the policy alone:

- **shadowed** -- a class that can never match, because one earlier class matches every
  request it would (the first matching class wins). Checked one earlier class at a time,
  criterion by criterion: the earlier one must leave the criterion out, or cover it --
  ``ops`` a superset, every uid/gid range inside its ranges, every tenant named, the same
  ``job_env`` with every ``jobs`` glob covered, and every path (or cgroup) glob covered
  by one of its globs, component by component (``**`` covers any run of components,
  ``*`` any one component, a glob covers the literal names it matches, and otherwise only
  an identical component). Two earlier classes that only together cover a later one are
  not detected. A class that takes streaming writers is left out: streams reach it
  whatever it matches.
- **no-effect** -- a ``priority`` that nothing reads: priorities share out a declared
  ``[backend]`` cap (only the caps on the ops the class takes) and decide which classes a
  latency target may cap; with neither, a weight changes nothing. A ``min_*_bandwidth``
  on a class that takes no requests of that direction (``ops``). A minimum without
  ``[backend]`` is not a warning but an error.
- **passthrough** -- ``passthrough = "reads"`` (the older spelling of the default,
  ``"auto"``) written on a class whose reads the policy keeps in the daemon for some
  caller (a cap of the class itself, ``per_user``, a tenant, the ``[backend]``, a latency
  target measured on the class's own reads): the line asks for what cannot happen
  (:func:`qosfs.policy.model.passthrough_blocker`). Likewise on a class whose ``ops``
  leave out reads. The default itself is never warned about: that a capped class stays
  in the daemon is what its cap asks, and ``qosfs check`` says it as a note
  (:func:`qosfs.policy.loading.policy_notes`).
- **fractional-iops** -- an IOPS figure that is not a whole number (``write_iops = 2.5``):
  requests are whole operations, and such a figure is most often a thousand-fold slip
  (``"2.5k"``).
- **glob** -- a path glob that matches nothing a training job writes: jobs write files
  inside directories, while (1) a glob of one component (``"*.pt"``, no ``/``) matches
  only names directly in the mount's root (globs are anchored there, not matched at any
  depth as in ``.gitignore``), and (2) a glob whose last component is a well-known
  directory name (:data:`DIRECTORY_NAMES`, e.g. ``"**/checkpoints"``) matches that
  directory itself, not the files in it. ``"**"`` alone is not warned about.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from qosfs.core.limit_kinds import BY_KEY, CAP_KEYS
from qosfs.core.units import format_iops
from qosfs.policy.globs import glob_covers, value_glob_covers
from qosfs.policy.keys import PRIORITY_WEIGHTS
from qosfs.policy.model import (
    MEASURED_IN_DAEMON,
    ClassRule,
    IdRange,
    Limits,
    Policy,
    passthrough_blocker,
)
from qosfs.policy.text import locate_key, quote_key

__all__ = ["DIRECTORY_NAMES", "PolicyWarning", "policy_warnings"]

#: Names that are directories in the layouts training jobs write (the embedded default
#: policy's checkpoint and dataset directories, and the usual run output directories).
DIRECTORY_NAMES = frozenset({
    "checkpoints", "checkpoint", "ckpt", "ckpts", "data", "datasets", "output", "outputs",
    "runs", "logs", "models", "weights",
})
_IOPS_KEYS = (*(k for k in CAP_KEYS if not BY_KEY[k].per_byte), "burst_iops")


@dataclass(frozen=True, slots=True)
class PolicyWarning:
    """One warning: ``str()`` is ``source:line: key: message``, like a PolicyError."""

    kind: str  # "shadowed", "no-effect", "passthrough", "fractional-iops" or "glob"
    key: str  # the dotted key it is about, e.g. classes.ckpt.paths
    message: str
    source: str = "<string>"
    line: int | None = None

    def __str__(self) -> str:
        where = self.source if self.line is None else f"{self.source}:{self.line}"
        return f"{where}: {self.key}: {self.message}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "source": self.source, "line": self.line, "key": self.key,
                "message": self.message}


def policy_warnings(policy: Policy, text: str | None = None) -> list[PolicyWarning]:
    """Every warning about *policy*; *text* (the file it was parsed from) gives each its
    line, and the warnings come in the order of their lines."""
    found: list[tuple[str, str, str, str | None]] = []  # kind, key, message, item
    rules = policy.classes[:-1]  # the default has no criteria and always comes last
    for index, rule in enumerate(rules):
        path = f"classes.{quote_key(rule.name)}"
        earlier = next((a for a in rules[:index] if _shadows(a, rule)), None)
        if earlier is not None and rule.detect_streaming_writes is None:
            found.append(("shadowed", path, _shadowed(earlier, rule), None))
    for rule in policy.classes:
        found += _no_effect(policy, rule)
        found += _passthrough(policy, rule)
    for owner, limits in _limit_tables(policy):
        for key in _IOPS_KEYS:
            value = limits.get(key)
            if value is not None and not float(value).is_integer():
                found.append(("fractional-iops", f"{owner}.{key}", _fractional(value), None))
    for owner, globs in [*((f"classes.{quote_key(c.name)}", c.paths) for c in policy.classes),
                         *((f"tenants.{quote_key(t.name)}", t.paths) for t in policy.tenants)]:
        for glob in globs:
            problem = glob_problem(glob)
            if problem is not None:
                found.append(("glob", f"{owner}.paths", problem, glob))
    warnings = [PolicyWarning(kind, key, message, policy.source, _line(text, key, item))
                for kind, key, message, item in found]
    return sorted(warnings, key=lambda w: w.line or 0)  # stable: file order, then checks


# ------------------------------------------------------------------------ shadowed

def _shadows(a: ClassRule, b: ClassRule) -> bool:
    """Whether every request *b* matches is matched by *a* too (see the module doc)."""
    if a.ops and not (b.ops and b.ops <= a.ops):
        return False
    if a.tenants and not (b.tenants and set(b.tenants) <= set(a.tenants)):
        return False
    if a.job_env is not None:
        if a.job_env != b.job_env:
            return False
        if a.jobs and not (b.jobs and all(any(value_glob_covers(p, q) for p in a.jobs)
                                          for q in b.jobs)):
            return False
    return (_ids_cover(a.uids, b.uids) and _ids_cover(a.gids, b.gids)
            and _globs_cover(a.paths, b.paths, absolute=False)
            and _globs_cover(a.cgroups, b.cgroups, absolute=True))


def _shadowed(a: ClassRule, b: ClassRule) -> str:
    keys = [k for k, v in (("paths", a.paths), ("uids", a.uids), ("gids", a.gids),
                           ("tenants", a.tenants), ("ops", a.ops), ("job_env", a.job_env),
                           ("cgroups", a.cgroups)) if v]
    earlier = f"classes.{quote_key(a.name)}"
    why = (f"its {_and(keys)} cover this class's" if keys else "it has no criteria")
    return (f"never matches: {earlier}, earlier in the file, matches every request this "
            f"class would ({why}), and the first class that matches wins; move this class "
            f"above it or narrow {earlier}")


def _and(words: list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def _ids_cover(a: tuple[IdRange, ...], b: tuple[IdRange, ...]) -> bool:
    if not a:
        return True
    if not b:
        return False
    merged: list[list[int]] = []
    for r in sorted(a, key=lambda r: r.lo):
        if merged and r.lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], r.hi)
        else:
            merged.append([r.lo, r.hi])
    return all(any(lo <= r.lo and r.hi <= hi for lo, hi in merged) for r in b)


def _globs_cover(a: tuple[str, ...], b: tuple[str, ...], *, absolute: bool) -> bool:
    if not a:
        return True
    if not b:
        return False
    return all(any(glob_covers(x, y, absolute=absolute) for x in a) for y in b)


# ----------------------------------------------------------------------- no effect

def _takes(rule: ClassRule, op: str) -> bool:
    return not rule.ops or op in rule.ops


def _no_effect(policy: Policy, rule: ClassRule) -> list[tuple[str, str, str, str | None]]:
    path = f"classes.{quote_key(rule.name)}"
    out: list[tuple[str, str, str, str | None]] = []
    if rule.priority_weight != PRIORITY_WEIGHTS["normal"] and not any(
            c.latency_protected for c in policy.classes):
        backend = policy.backend.limits if policy.backend is not None else None
        shared = backend is not None and any(
            backend.get(key) is not None and _takes(rule, BY_KEY[key].label)
            for key in CAP_KEYS)
        if not shared:
            where = ("there is no [backend]" if backend is None
                     else "the [backend] declares no cap" if backend.is_unlimited
                     else f"the [backend] caps none of the ops this class takes "
                          f"({', '.join(sorted(rule.ops))})")
            out.append(("no-effect", f"{path}.priority",
                        f"priority {json.dumps(rule.priority_name)} has no effect: priorities "
                        "share out the caps declared in [backend] and decide which classes "
                        f"a latency target may cap, and {where} and no class has a latency "
                        "target", None))
    for direction in ("read", "write"):
        key = f"min_{direction}_bandwidth"
        if getattr(rule, key) is not None and not _takes(rule, direction):
            out.append(("no-effect", f"{path}.{key}",
                        f"{key} has no effect: the class takes no {direction}s "
                        f"(ops = {json.dumps(sorted(rule.ops))})", None))
    return out


def _passthrough(policy: Policy, rule: ClassRule) -> list[tuple[str, str, str, str | None]]:
    if rule.passthrough != "reads":  # "auto" is the default, "off" always holds
        return []
    key = f"classes.{quote_key(rule.name)}.passthrough"
    if not _takes(rule, "read"):
        return [("passthrough", key, "passthrough has no effect: the class takes no reads "
                 f"(ops = {json.dumps(sorted(rule.ops))})", None)]
    blocker = passthrough_blocker(policy, rule)
    if blocker is None:
        return []
    where = "" if blocker == MEASURED_IN_DAEMON else ", where the cap holds"
    return [("passthrough", key, f"{blocker}: those reads stay in the daemon{where}, and "
             "such opens are not passed through to the kernel", None)]


# ------------------------------------------------------------------ fractional IOPS

def _limit_tables(policy: Policy) -> list[tuple[str, Limits]]:
    tables = [("backend", policy.backend.limits)] if policy.backend is not None else []
    tables += [(f"tenants.{quote_key(t.name)}", t.limits) for t in policy.tenants]
    tables += [(f"classes.{quote_key(c.name)}", c.limits) for c in policy.classes]
    return tables


def _fractional(value: float) -> str:
    shown = format_iops(value)
    hint = f'; did you mean "{shown}k"?' if value < 1000 else ""
    return (f"{shown} is not a whole number of operations per second (requests are whole "
            f"operations){hint}")


# ---------------------------------------------------------------------------- globs

def glob_problem(glob: str) -> str | None:
    """Why a path glob matches nothing a training job writes, or None (module doc)."""
    parts = glob.split("/")
    last = parts[-1]
    if last in DIRECTORY_NAMES:
        return (f"{json.dumps(glob)} matches the directory {json.dumps(last)} itself, not the "
                f"files written in it; {json.dumps(glob + '/**')} matches both")
    if len(parts) == 1 and glob != "**":
        return (f"{json.dumps(glob)} matches only names directly in the mount's root: globs "
                "are anchored there, not matched at any depth as in .gitignore; "
                f"{json.dumps('**/' + glob)} matches at any depth")
    return None


# ---------------------------------------------------------------------------- lines

def _line(text: str | None, key: str, item: str | None) -> int | None:
    """The line of *key*, or of *item* (a string of its list) where the list spans lines."""
    if text is None:
        return None
    line = locate_key(text, key)
    if line is None or item is None:
        return line
    quoted = (json.dumps(item, ensure_ascii=False), f"'{item}'")
    lines = text.split("\n")
    for number in range(line, len(lines) + 1):
        row = lines[number - 1]
        if any(q in row for q in quoted):
            return number
        if number > line and row.lstrip().startswith("["):  # the next table
            break
    return line
