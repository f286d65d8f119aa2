"""Decide which class and tenant a request belongs to: pure, precompiled, cached.

Why at open time: FUSE gives ``read``/``write`` no caller context, so the filesystem
(:mod:`qosfs.passthrough.operations`) has an open classified once in ``open``/``create``
(where uid, gid and pid are known) and keeps the class in the handle; metadata requests are
classified per request with ``op="meta"``. Only the primary (fs)gid is visible through FUSE,
so ``gids`` criteria see that one group, not supplementary groups.

Path criteria are globs (:mod:`qosfs.policy.globs`).

The kernel's cache timeouts of an object (``entry_timeout``, ``attr_timeout``) are decided
here too (:attr:`Classifier.cache_timeouts`), by the same compiled path globs, by path alone.
"""

from __future__ import annotations

import functools
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from qosfs.policy.globs import (
    compile_cgroup_glob,
    compile_glob,
    compile_value_glob,
    holds_every_entry,
)

if TYPE_CHECKING:  # the types only: qosfs.policy.build imports this module
    from qosfs.policy.model import ClassRule, IdRange, Policy, Tenant

__all__ = ["CacheTimeouts", "Classifier", "Decision", "JobCache", "JobInfo", "read_job_info"]

#: (entry_timeout, attr_timeout) for an object's path relative to the mount root, None
#: where the mount's option applies (:attr:`Classifier.cache_timeouts`).
CacheTimeouts = Callable[[str], tuple[float | None, float | None]]
_Decided = tuple["ClassRule", "Tenant | None"]
#: Directories whose decision for their entries a classifier keeps (per caller); past
#: that, it forgets them all and starts again (a dict, not an LRU: cheaper per hit).
_DIRECTORIES_KEPT = 4096


def _any_of(patterns: tuple[str, ...], compile_one: Callable[[str], re.Pattern[str]]
            ) -> re.Pattern[str] | None:
    """One alternation regex for a list of globs (one ``fullmatch`` instead of N)."""
    if not patterns:
        return None
    return re.compile("|".join(f"(?:{compile_one(p).pattern})" for p in patterns), re.DOTALL)


def _in_ranges(value: int, ranges: tuple[IdRange, ...]) -> bool:
    return any(r.lo <= value <= r.hi for r in ranges)


@dataclass(frozen=True, slots=True)
class JobInfo:
    """What ``/proc`` says about the calling process; ``None``/empty where it could not be
    read. Hashable: classification results are memoized on it."""

    # (name, value) of each environment variable the policy matches on that the caller
    # had set to a non-empty value at exec (SLURM_JOB_ID, a pod's POD_NAMESPACE, ...).
    env: tuple[tuple[str, str], ...] = ()
    cgroup: str | None = None  # the cgroup v2 path (the "0::" line)
    # The distinct cgroup v1 paths other than "/" (v1 and hybrid hierarchies, where
    # Slurm's cgroup plugin puts a job under /slurm/uid_U/job_J/... per controller).
    v1_cgroups: tuple[str, ...] = ()

    def value(self, name: str) -> str | None:
        """The caller's value of environment variable *name*, or None if unset or empty."""
        for key, value in self.env:
            if key == name:
                return value
        return None


def _read_env(pid: int, names: tuple[str, ...], proc_root: str) -> tuple[tuple[str, str], ...]:
    try:
        with open(f"{proc_root}/{pid}/environ", "rb") as stream:
            data = stream.read()
    except OSError:
        return ()
    wanted = {name.encode(): name for name in names}
    found: dict[str, str] = {}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        name = wanted.get(key)
        if sep and name is not None and value and name not in found:
            found[name] = value.decode("utf-8", "surrogateescape")
    return tuple((name, found[name]) for name in names if name in found)


def read_job_info(pid: int, env_vars: tuple[str, ...], *,
                  proc_root: str = "/proc") -> JobInfo:
    """Read the caller's values of *env_vars* (from ``/proc/PID/environ``) and its cgroup
    paths (the v2 one, and the v1 ones of a v1 or hybrid hierarchy).

    ``environ`` is the environment at exec time, which is where schedulers put job ids and
    Kubernetes puts what the pod spec sets. A process that exited, or whose environ we may
    not read, yields empty fields instead of an error: classification must not fail a
    request. An empty value counts as unset.
    """
    if pid <= 0:  # the kernel's own requests (writeback) carry pid 0
        return JobInfo()
    env = _read_env(pid, env_vars, proc_root) if env_vars else ()
    cgroup = None
    try:
        with open(f"{proc_root}/{pid}/cgroup", encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    v1: list[str] = []
    for line in lines:
        if line.startswith("0::"):
            cgroup = line[3:]
            continue
        path = line.split(":", 2)[-1] if line.count(":") >= 2 else ""
        if path.startswith("/") and path != "/" and path not in v1:
            v1.append(path)
    return JobInfo(env, cgroup, tuple(v1))


class JobCache:
    """A bounded LRU of :class:`JobInfo` per (pid, env_vars), with a TTL since pids recycle.

    Lookups happen at open time only, and many opens come from the same rank, so most hit.
    """

    def __init__(self, *, maxsize: int = 4096, ttl: float = 5.0,
                 clock: Callable[[], float] = time.monotonic,
                 reader: Callable[[int, tuple[str, ...]], JobInfo] = read_job_info) -> None:
        self.maxsize = maxsize
        self.ttl = ttl
        self._clock = clock
        self._reader = reader
        self._entries: OrderedDict[tuple[int, tuple[str, ...]], tuple[float, JobInfo]] = (
            OrderedDict())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"JobCache(entries={len(self._entries)}, maxsize={self.maxsize}, ttl={self.ttl})"

    def get(self, pid: int, env_vars: tuple[str, ...]) -> JobInfo:
        """The (possibly cached) job info of ``pid``; reads ``/proc`` on a miss or expiry."""
        key = (pid, env_vars)
        now = self._clock()
        hit = self._entries.get(key)
        if hit is not None and now - hit[0] < self.ttl:
            self._entries.move_to_end(key)
            return hit[1]
        info = self._reader(pid, env_vars)
        self._entries[key] = (now, info)
        self._entries.move_to_end(key)
        while len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)
        return info

    def clear(self) -> None:
        """Forget everything (e.g. after a policy reload changed ``job_env``)."""
        self._entries.clear()


# Temporary names of atomic saves, and what they become: "model.pt.tmp" / "model.pt.tmp42"
# -> "model.pt", ".metadata.tmp" -> ".metadata" (torch.distributed.checkpoint),
# "ckpt-1.index.tempstate8812" -> "ckpt-1.index" (TensorFlow's checkpoint writer), and a
# directory "ckpt_100.orbax-checkpoint-tmp-1234" -> "ckpt_100" (renamed when complete).
_TMP_LEAF = re.compile(r"(?<=[^/])\.(?:tmp|tempstate)[^/]*$")
_TMP_DIR = re.compile(r"(?:\.[^/.]*)?-tmp-[0-9]+(?=/|$)")


def final_name(path: str) -> str | None:
    """The path an atomic save will rename *path* to, or None if it does not look like a
    temporary name. A leaf that is only a temporary name (safetensors' ``.tmpXXXXXX``)
    has no final name to read: streaming-write detection catches those."""
    final = _TMP_DIR.sub("", _TMP_LEAF.sub("", path))
    return final if final != path else None


class _Rule:
    """One class with its criteria precompiled; ``None``/empty means "not a criterion"."""

    __slots__ = (
        "cgroups",
        "gids",
        "job_env",
        "jobs",
        "ops",
        "paths",
        "rule",
        "tenants",
        "uids",
    )

    def __init__(self, rule: ClassRule) -> None:
        self.rule = rule
        self.ops = rule.ops
        self.paths = _any_of(rule.paths, compile_glob)
        self.uids = rule.uids
        self.gids = rule.gids
        self.tenants = frozenset(rule.tenants)
        self.job_env = rule.job_env
        self.jobs = _any_of(rule.jobs, compile_value_glob)
        self.cgroups = _any_of(rule.cgroups, compile_cgroup_glob)

    def holds(self, path: str) -> bool:
        """Whether *path* is under this class's paths (a class without any holds all)."""
        return self.paths is None or self.paths.fullmatch(path) is not None

    def miss(self, path: str, caller: CallerKey, job: JobInfo | None,
             tenant: Tenant | None) -> str | None:
        """The first criterion (its key) the request fails, in the order they are checked;
        None if it meets every one. *tenant* is the caller's, for ``tenants``."""
        if self.ops and caller.op not in self.ops:
            return "ops"
        if self.paths is not None and self.paths.fullmatch(path) is None:  # holds(), inlined
            return "paths"
        return self._miss_after_path(caller, job, tenant)

    def miss_beside_path(self, caller: CallerKey, job: JobInfo | None,
                         tenant: Tenant | None) -> str | None:
        """:meth:`miss` for a request whatever its path: the first other criterion it
        fails."""
        if self.ops and caller.op not in self.ops:
            return "ops"
        return self._miss_after_path(caller, job, tenant)

    def _miss_after_path(self, caller: CallerKey, job: JobInfo | None,
                         tenant: Tenant | None) -> str | None:
        if self.uids and not _in_ranges(caller.uid, self.uids):
            return "uids"
        if self.gids and not _in_ranges(caller.gid, self.gids):
            return "gids"
        if self.tenants and (tenant is None or tenant.name not in self.tenants):
            return "tenants"
        if self.job_env is not None and not _in_jobs(self.job_env, self.jobs, job):
            return _job_miss(self.job_env, job)
        if self.cgroups is not None and (job is None or not _in_cgroups(self.cgroups, job)):
            return "cgroups"
        return None


class _Member:
    __slots__ = ("cgroups", "gids", "job_env", "jobs", "paths", "tenant", "uids")

    def __init__(self, tenant: Tenant) -> None:
        self.tenant = tenant
        self.uids = tenant.uids
        self.gids = tenant.gids
        self.paths = _any_of(tenant.paths, compile_glob)
        self.cgroups = _any_of(tenant.cgroups, compile_cgroup_glob)
        self.job_env = tenant.job_env
        self.jobs = _any_of(tenant.jobs, compile_value_glob)

    def miss(self, path: str, caller: CallerKey, job: JobInfo | None) -> str | None:
        """The first criterion (its key) the caller fails, None if it is a member:
        ``uids`` (or ``gids`` when the tenant has only those) when neither id is in."""
        if (self.uids or self.gids) and not (
                _in_ranges(caller.uid, self.uids) or _in_ranges(caller.gid, self.gids)):
            return "uids" if self.uids else "gids"
        if self.paths is not None and self.paths.fullmatch(path) is None:
            return "paths"
        if self.cgroups is not None and (job is None or not _in_cgroups(self.cgroups, job)):
            return "cgroups"
        if self.job_env is not None and not _in_jobs(self.job_env, self.jobs, job):
            return _job_miss(self.job_env, job)
        return None


def _in_jobs(job_env: str, jobs: re.Pattern[str] | None, job: JobInfo | None) -> bool:
    """Whether the caller set *job_env* (to a value one of the *jobs* globs matches)."""
    value = job.value(job_env) if job is not None else None
    return value is not None and (jobs is None or jobs.fullmatch(value) is not None)


def _job_miss(job_env: str, job: JobInfo | None) -> str:
    """Which job criterion a caller outside it fails: the variable unset, or its value."""
    return "job_env" if job is None or job.value(job_env) is None else "jobs"


def _in_cgroups(pattern: re.Pattern[str], job: JobInfo) -> bool:
    """Whether the v2 cgroup, or any v1 one, of the caller matches a cgroup glob."""
    if job.cgroup is not None and pattern.fullmatch(job.cgroup.lstrip("/")) is not None:
        return True
    return any(pattern.fullmatch(path.lstrip("/")) is not None for path in job.v1_cgroups)


class CallerKey(NamedTuple):
    """Everything classification reads of a request besides its path: what it does and who
    asks. A new classification key is a field here, read where the rules match.

    The engine memoizes an object's classification under this key (with the policy
    generation and the path epoch), and the classifier's caches are keyed on it too, so a
    field added here can never leave a classification stale.
    """

    op: str  # "read", "write" or "meta"
    uid: int  # the caller's fsuid
    gid: int  # the caller's fsgid
    # The caller's pid when the policy reads jobs (environment, cgroups), else 0: with a
    # pid in the key every process would classify afresh for nothing.
    pid: int


@dataclass(frozen=True, slots=True)
class Decision:
    """How a request was classified (:meth:`Classifier.decide`), for ``qosfs explain``."""

    rule: ClassRule
    tenant: Tenant | None
    # The path the class was decided on: the request's, or the name a temporary name of
    # an atomic save will get (final_name) when only the default class matched it.
    path: str
    # (name, key of the first criterion it failed) of the classes, then the tenants,
    # passed over before the one chosen, in policy order.
    skipped_classes: tuple[tuple[str, str], ...] = ()
    skipped_tenants: tuple[tuple[str, str], ...] = ()


class Classifier:
    """Maps (path, :class:`CallerKey`, job) to a class and a tenant of one policy; build a
    new one per policy.

    Results are memoized in a bounded LRU keyed by all inputs, so repeated opens of the same
    file by the same user cost one dict lookup.
    """

    def __init__(self, policy: Policy, *, cache_size: int = 8192) -> None:
        self.policy = policy
        self._rules = tuple(_Rule(rule) for rule in policy.classes)
        self._members = tuple(_Member(tenant) for tenant in policy.tenants)
        self._uses_tenants = any(r.tenants for r in self._rules)
        self._classify = functools.lru_cache(maxsize=cache_size)(self._classify_uncached)
        self._tenant_of = functools.lru_cache(maxsize=cache_size)(self._tenant_of_uncached)
        # (directory, caller) -> the class and tenant of every entry of the directory,
        # or () where they may depend on the entry's name (resolve). Only while no
        # tenant is defined by paths: a tenant's paths are not proved here.
        self._entries_of: dict[tuple[str, CallerKey], _Decided | tuple[()]] | None = (
            None if any(m.paths is not None for m in self._members) else {})
        self.cache_timeouts = self._cache_timeouts()

    def __repr__(self) -> str:
        names = ", ".join(r.rule.name for r in self._rules)
        return f"Classifier(classes=[{names}], tenants={len(self._members)})"

    def classify(self, path: str, uid: int, gid: int, op: str,
                 job: JobInfo | None = None) -> ClassRule:
        """The first class, in policy order, whose every criterion matches.

        Args:
            path: relative to the mount root, no leading ``/``; ``""`` is the root.
            uid, gid: the caller's (fs)uid and (fs)gid.
            op: ``"read"``, ``"write"`` or ``"meta"``.
            job: the caller's :class:`JobInfo`, needed only if ``policy.needs_job_lookup``;
                with ``None`` no job or cgroup criterion matches.
        """
        return self._classify(path, CallerKey(op, uid, gid, 0), job)

    def tenant_of(self, uid: int, gid: int, path: str,
                  job: JobInfo | None = None) -> Tenant | None:
        """The first tenant in policy order with uid in uids OR gid in gids, AND the path in
        its paths, AND the caller in its cgroups, AND its job_env value in its jobs (each if
        it has any): a tenant without uids/gids is defined by the other keys alone."""
        return self._tenant_of(path, CallerKey("", uid, gid, 0), job)

    def resolve(self, path: str, caller: CallerKey,
                job: JobInfo | None = None) -> tuple[ClassRule, Tenant | None]:
        """The class and the tenant of *caller* acting on *path* (what the engine asks).

        A loader opens each file of a directory once per epoch, so each open of a cold
        file is a new path, which missed both caches: two regex matches and two cache
        insertions (each evicting), 12-17 us of the daemon's CPU per cold file
        (docs/performance.md). Where the policy provably gives every entry of the
        directory the same class and tenant (``data/**`` for all of ``data/train``,
        a class whose ``ops`` leave the request out whatever its path), that answer is
        kept per directory and caller instead (:meth:`_decide_entries`).
        """
        memo = self._entries_of
        if memo is not None and job is None and path:
            cut = path.rfind("/")
            key = (path[:cut] if cut >= 0 else "", caller)
            decided = memo.get(key)
            if decided is None:
                if len(memo) >= _DIRECTORIES_KEPT:
                    memo.clear()
                decided = memo[key] = self._decide_entries(key[0], caller) or ()
            if decided:  # () where the name may matter
                return decided
        return self._classify(path, caller, job), self._tenant_of(path, caller, job)

    def _decide_entries(self, directory: str, caller: CallerKey) -> _Decided | None:
        """The class and tenant of *caller* acting on any entry of *directory*, or None
        if they may depend on the entry's name. Classes are taken in policy order as
        :meth:`_first_match` does: one the request fails by a criterion other than the
        path is passed over whatever the name; one that holds every entry of the
        directory (or has no paths) decides; any other one might match some names and
        not others. The default class has no criteria, so the walk always ends. A
        temporary name's final name (:func:`final_name`) changes nothing here: only the
        default class can send a name there, and it is reached only when every other
        class missed whatever the path."""
        tenant = self._tenant_decided(directory, caller, None, None)  # tenants: no paths
        for r in self._rules:
            if r.miss_beside_path(caller, None, tenant) is not None:
                continue
            if r.paths is None or holds_every_entry(r.rule.paths, directory):
                return r.rule, tenant
            return None
        return None

    def decide(self, path: str, caller: CallerKey, job: JobInfo | None = None) -> Decision:
        """What :meth:`resolve` answers, with how it got there (``qosfs explain``): the
        classes and tenants passed over and the criterion each failed. Not memoized."""
        passed: list[tuple[str, str]] = []
        tenant = self._tenant_decided(path, caller, job, passed)
        skipped: list[tuple[str, str]] = []
        rule, decided_on = self._class_decided(path, caller, job, skipped)
        return Decision(rule, tenant, decided_on, tuple(skipped), tuple(passed))

    def _tenant_of_uncached(self, path: str, caller: CallerKey,
                            job: JobInfo | None) -> Tenant | None:
        return self._tenant_decided(path, caller, job, None)

    def _tenant_decided(self, path: str, caller: CallerKey, job: JobInfo | None,
                        skipped: list[tuple[str, str]] | None) -> Tenant | None:
        for m in self._members:
            miss = m.miss(path, caller, job)
            if miss is None:
                return m.tenant
            if skipped is not None:
                skipped.append((m.tenant.name, miss))
        return None

    def _classify_uncached(self, path: str, caller: CallerKey,
                           job: JobInfo | None) -> ClassRule:
        return self._class_decided(path, caller, job, None)[0]

    def _class_decided(self, path: str, caller: CallerKey, job: JobInfo | None,
                       skipped: list[tuple[str, str]] | None) -> tuple[ClassRule, str]:
        """The class, and the path it was decided on."""
        rule = self._first_match(path, caller, job, skipped)
        if rule is self.policy.classes[-1]:
            # Only the default matched: a temporary name of an atomic save takes the class
            # of the name it will be renamed to (written before the rename, or never).
            final = final_name(path)
            if final is not None:
                if skipped is not None:
                    skipped.clear()  # what counts is how the final name fared
                return self._first_match(final, caller, job, skipped), final
        return rule, path

    def _cache_timeouts(self) -> CacheTimeouts | None:
        """What ``entry_timeout``/``attr_timeout`` an object's path gets: for each, the
        first class in policy order that sets it and holds the path (the default class
        holds everything); None for a key no class decides (the mount's option). None
        when no class sets either, so the filesystem skips the path lookup altogether.

        By path alone, not by caller: the kernel caches a name and an inode's attributes
        for every process, so a timeout that depended on who asked would apply to
        everyone anyway.
        """
        rules = [r for r in self._rules
                 if r.rule.entry_timeout is not None or r.rule.attr_timeout is not None]
        if not rules:
            return None

        def first_set(holds: Callable[[_Rule], bool | None],
                      ) -> tuple[float | None, float | None] | None:
            """Each timeout of the first class in order that *holds* the object and sets
            it; None as soon as *holds* cannot tell for a class (None)."""
            entry: float | None = None
            attr: float | None = None
            for r in rules:
                held = holds(r)
                if held is None:
                    return None
                if not held:
                    continue
                if entry is None:
                    entry = r.rule.entry_timeout
                if attr is None:
                    attr = r.rule.attr_timeout
                if entry is not None and attr is not None:
                    break
            return entry, attr

        @functools.lru_cache(maxsize=16384)
        def by_path(path: str) -> tuple[float | None, float | None]:
            found = first_set(lambda r: r.holds(path))
            assert found is not None  # a path is held or not: never "cannot tell"
            return found

        def of_entries(directory: str) -> tuple[float | None, float | None] | tuple[()]:
            """by_path's answer for every entry of *directory*, or () if the name may
            matter: as :meth:`_decide_entries`, a class that holds some entries and not
            provably all of them leaves it open."""
            return first_set(lambda r: True if r.paths is None
                             or holds_every_entry(r.rule.paths, directory) else None) or ()

        # Asked at every lookup of a new name (the entry's timeouts): per directory where
        # the policy allows, as resolve does, and for the same reason.
        directories: dict[str, tuple[float | None, float | None] | tuple[()]] = {}

        def timeouts(path: str) -> tuple[float | None, float | None]:
            if path:
                cut = path.rfind("/")
                directory = path[:cut] if cut >= 0 else ""
                decided = directories.get(directory)
                if decided is None:
                    if len(directories) >= _DIRECTORIES_KEPT:
                        directories.clear()
                    decided = directories[directory] = of_entries(directory)
                if decided:
                    return decided
            return by_path(path)

        return timeouts

    def _first_match(self, path: str, caller: CallerKey, job: JobInfo | None,
                     skipped: list[tuple[str, str]] | None = None) -> ClassRule:
        tenant = self._tenant_of(path, caller, job) if self._uses_tenants else None
        for r in self._rules:
            miss = r.miss(path, caller, job, tenant)
            if miss is None:
                return r.rule
            if skipped is not None:
                skipped.append((r.rule.name, miss))
        return self.policy.classes[-1]  # "default" has no criteria; kept for type safety
