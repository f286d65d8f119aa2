"""Latency targets: cap lower-priority classes automatically while a protected class is slow.

A class with ``target_read_latency = "5ms"`` (on ``latency_percentile``, default p99) is
*protected*. Every window (:data:`WINDOW`, 0.5 s) the controller estimates that
percentile of the class's read latency over the window and adjusts the automatic
bandwidth caps of the *lower* classes: those whose priority weight is below a protected
class's and that have no target themselves.

* **Missed** (the estimate of some protected class above it is over its target): a low
  class's cap is multiplied by :data:`DECREASE` (0.7), or by ``target / latency`` when the
  miss is worse than that, but never by less than :data:`DEEPEST` (0.25): a storm that
  makes the reader 16x slower is cut to a quarter at once instead of in four windows. A
  class not yet capped starts from what it moved over the last window (bytes/s, per
  direction, bounded by its configured cap); a direction it did not use (under the floor)
  is left alone. A cap that did not bind decreases from what the class really moved.
* **Met** (every protected class above it meets its target): the cap grows by a share
  of itself per window that depends on the headroom: ``(1 - latency / target) / 2``,
  between :data:`INCREASE` (5 %, close to the target) and :data:`CLIMB` (25 %, at half the
  target or below). A step that is a fixed fraction of the rate the storm
  started from (additive increase proper) is too coarse: a storm of 4 GiB/s that the
  target holds at 200 MiB/s would climb 200 MiB/s per window, twice the equilibrium in one
  step. With 5 % steps and 0.7 cuts the sawtooth around the equilibrium spans a factor of
  at most 1.05/0.7 = 1.5, and a window over the target overshoots by one 5 % step.
* **Idle** (no protected class above it read anything in the window): the cap doubles per
  window; nothing needs protecting, but a reader pausing between epochs should not come
  back into a full storm.
* **Released** (automatic cap removed): when it is back at the rate it started from or at
  the configured cap, or when it has not bound for :data:`RELEASE_WINDOWS` windows (the
  class moved under 90 % of it and nothing waited at its level) -- after a storm, within
  three windows, even while a target is still missed (then it was not the storm).
* **Floor**: never below the class's ``min_*_bandwidth``, nor below :data:`FLOOR`
  (1 MiB/s). A target that is missed while every low class is at its floor (or there is
  none) is reported as ``unreachable``: the storm is not what makes the class slow (on a
  2-CPU machine, the daemon's own CPU can be), and the low classes keep their floor rather
  than being starved for ever.
* Windows in which a protected class read something but has fewer than
  :data:`MIN_SAMPLES` latency samples change nothing (``few-samples``) -- except at its
  start, below.
* **Starting** (protection from the first request): a protected class is *active* in a
  window when it opened a file, made a metadata request, read, or holds files open --
  not only when its reads are seen, since a class whose reads the kernel sends straight
  to the backing file (FUSE passthrough) shows nothing else. The loop looks for a class
  becoming active every :data:`PROBE_CHECK` (50 ms) and then decides at once instead of
  at the end of the window. Until the class's first judged window (at most
  :data:`STARTING_WINDOWS`), the classes below it are cut as for a large miss
  (:data:`DEEPEST`): the canary needs a few hundred ms to report, a training step is
  shorter than that, and a reader starting into a running storm was left unprotected
  for 1.3 s, 3.3 s with a relative target (``python -m bench latency-target``; the
  issue: half a 5.7 s epoch). A relative target without a baseline is cut
  the same way until a quiet window teaches it one (``learning``, below). From its first
  judged window on, the usual rules apply: met, the caps climb back. The first cut of
  the class's activity, its reason and the baseline's source show in ``ctl status``.

Caps are applied through :meth:`qosfs.qos.engine.PolicyQos.set_auto_caps`: the level's
``set_limits`` wakes parked requests, the policy is never mutated, and the configured cap
still bounds the automatic one, so a ``ctl set`` of a cap bounds the controller from then
on; a swap re-applies the automatic caps at once. Only bandwidth is controlled (not IOPS).
One decision per class per window, each logged at DEBUG.

What latency (``latency_measure``):

``backend``
    the backing syscall time of the class's reads, as the issue puts it: what storage
    contention shows up in (NFS, Lustre, disks).
``request`` (default)
    what a caller waits for: the time a request waits before the daemon's handler runs
    (the kernel's FUSE queue and the daemon's loop, behind the other classes' requests)
    plus the backing syscall. The first part cannot be seen from inside a handler, so it
    is measured by a canary (:mod:`qosfs.qos.latency_probe`): a zero-cost request sent through
    the mount every 2 ms while a protected class has files open. The estimate is the
    percentile of the canary's round trips plus the percentile of the class's backend
    times (an upper bound). On a memory-backed source the backend time hardly moves under
    a checkpoint storm while the readers' latency grows tenfold (bench/latency_target.py
    measures both), which is why this is the default.

**Reads not seen** (:meth:`LatencyLoop.reads_unobserved`): a class whose reads bypass the
daemon (kernel passthrough) has no read or backend histogram, and its reads wait in no
queue of the daemon's. Its estimate is the percentile of the canary's timed reads of a
file the class has open (``backing_file``;
:meth:`qosfs.qos.latency_probe.LatencyProbe.watch_backing`), plus the percentile of
the canary's round trips in a window in which the class sent the daemon opens or
metadata requests (those do queue behind the storm: a small-file loader pays them per
file). Until the canary has read a file of the class, the round trips
alone. Its activity comes from opens, metadata and the files it holds open. A relative
target learns its baseline from the same estimate in quiet windows.

Latencies come from :class:`qosfs.qos.accounting.FineHistogram` (8 buckets per octave, upper
bounds, so estimates are at most 12.5 % high), differenced per window.

:class:`LatencyDecider` is the decision logic, pure (no trio, time passed in);
:class:`LatencyLoop` is the daemon task that measures, decides and applies.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from qosfs.policy.model import ClassRule, Policy
from qosfs.qos.accounting import AccountKey, FineHistogram
from qosfs.qos.engine import PolicyQos
from qosfs.qos.latency_probe import INTERVAL as PROBE_INTERVAL
from qosfs.qos.latency_probe import QUIET_INTERVAL as PROBE_QUIET_INTERVAL
from qosfs.qos.stats import NO_AUTO_CAPS, AutoCaps

__all__ = ["ClassSample", "LatencyDecider", "LatencyLoop", "ProtectedSample"]

log = logging.getLogger(__name__)

WINDOW = 0.5  # seconds per decision
DECREASE = 0.7  # cap factor per missed window (at most)
DEEPEST = 0.25  # cap factor per missed window (at least), for a large miss
INCREASE = 0.05  # of the cap, added per met window at least
CLIMB = 0.25  # ... at most, when the latency is at half the target or below
RELEASE_WINDOWS = 3  # windows without binding before a cap is removed
FLOOR = float(1 << 20)  # bytes/s: the lowest automatic cap (above min_*_bandwidth)
MIN_SAMPLES = 10  # latency samples a window needs to be judged
PROBE_CHECK = 0.05  # seconds between checks whether the canary should run (and activity)
BASELINE_WINDOWS = 20  # quiet windows a relative target's baseline is the median of
STARTING_WINDOWS = 3  # windows a class that became active is protected before a judgement
QUIET = 1.1  # a low class moving at most this times FLOOR is quiet (a floored storm too)
_DIRECTIONS = ("read", "write")


@dataclass(frozen=True, slots=True)
class ProtectedSample:
    """One window of a protected class: its latency estimate (None: not judged).

    ``active``: it opened, read, made a metadata request or held files open in the
    window (reads alone say so too); what a class whose reads are not seen still shows.
    """

    name: str
    latency: float | None
    reads: int
    samples: int = 0
    queue: float | None = None  # the canary's part of a "request" estimate
    backend: float | None = None  # the backend syscall part
    active: bool = False


@dataclass(slots=True)
class _Activity:
    """Since when a protected class is active, and how its protection began."""

    since: float
    windows: int = 0  # windows judged "starting" so far
    judged: bool = False  # a window of this activity was judged (met or missed)
    first_cut: float | None = None
    cut_reason: str | None = None  # the verdict that made the first cut
    learned: bool = False  # a baseline window was learned during this activity


@dataclass(frozen=True, slots=True)
class ClassSample:
    """One window of a class: what it moved (bytes/s) and whether a request waited."""

    name: str
    read_rate: float
    write_rate: float
    waited: bool = False


@dataclass(slots=True)
class _Throttle:
    cap: float
    start: float  # the rate it was moving when first capped: the release point
    since: float
    slack: int = 0


@dataclass(slots=True)
class _LowClass:
    throttles: dict[str, _Throttle] = field(default_factory=dict)

    def caps(self) -> AutoCaps:
        r, w = self.throttles.get("read"), self.throttles.get("write")
        return AutoCaps(r.cap if r else None, w.cap if w else None)


def _cap_of(rule: ClassRule, direction: str) -> float:
    value = getattr(rule.limits, f"{direction}_bandwidth")
    return math.inf if value is None else float(value)


def _floor_of(rule: ClassRule, direction: str) -> float:
    minimum = getattr(rule, f"min_{direction}_bandwidth") or 0.0
    return min(max(FLOOR, minimum), _cap_of(rule, direction))


def protected_classes(policy: Policy) -> list[ClassRule]:
    return [c for c in policy.classes if c.latency_protected]


def low_classes(policy: Policy) -> dict[str, list[ClassRule]]:
    """Each class that may be capped, with the protected classes it yields to."""
    guards = protected_classes(policy)
    out = {}
    for rule in policy.classes:
        if not rule.latency_protected and rule.scope == "node":  # the cluster caps those
            above = [g for g in guards if g.priority_weight > rule.priority_weight]
            if above:
                out[rule.name] = above
    return out


class LatencyDecider:
    """The decisions, one window at a time; no I/O, the time is passed in.

    Args:
        policy: The policy in force; call :meth:`set_policy` after every swap.
    """

    def __init__(self, policy: Policy) -> None:
        self.low: dict[str, _LowClass] = {}
        self.verdicts: dict[str, str] = {}
        # Relative targets: the latency of each protected class in recent windows when the
        # classes below it were quiet, and the target each window was judged on.
        self.baselines: dict[str, deque[float]] = {}
        self.targets: dict[str, float | None] = {}
        self.quiet = False  # every class below a protected one moved nothing last window
        # The protected classes active now (see "Starting" in the module docstring).
        self.active: dict[str, _Activity] = {}
        self.state = "idle"
        self.decisions = {"decrease": 0, "increase": 0, "release": 0}
        self.set_policy(policy)

    def __repr__(self) -> str:
        return f"<LatencyDecider {self.state} capped={sorted(self.low)}>"

    def set_policy(self, policy: Policy) -> None:
        """Roles follow the policy; classes that are no longer low lose their caps."""
        self.policy = policy
        self.roles = low_classes(policy)
        self.rules = {c.name: c for c in policy.classes}
        for name in [n for n in self.low if n not in self.roles]:
            del self.low[name]
        guarded = {c.name for c in protected_classes(policy)}
        self.baselines = {k: v for k, v in self.baselines.items() if k in guarded}
        self.active = {k: v for k, v in self.active.items() if k in guarded}
        if not protected_classes(policy):
            self.state = "idle"

    def export_state(self, to_monotonic: float) -> dict[str, Any]:
        """Where the decisions stand, as plain data, for a process that takes the mount
        over (``qosfs upgrade``): the automatic caps with the rate each started from, the
        baselines of relative targets, the protected classes' activity, the state and
        the decision counts. Times go as ``time.monotonic()``: *to_monotonic* is
        ``time.monotonic() - trio.current_time()`` of this run."""
        return {
            "state": self.state, "decisions": dict(self.decisions),
            "verdicts": dict(self.verdicts),
            "low": {name: {d: [t.cap, t.start, t.since + to_monotonic, t.slack]
                           for d, t in low.throttles.items()}
                    for name, low in self.low.items()},
            "baselines": {name: list(values) for name, values in self.baselines.items()},
            "active": {name: [a.since + to_monotonic, a.windows, a.judged,
                              None if a.first_cut is None else a.first_cut + to_monotonic,
                              a.cut_reason, a.learned]
                       for name, a in self.active.items()}}

    def import_state(self, state: dict[str, Any], to_trio: float) -> None:
        """Go on from a predecessor's `export_state` (*to_trio*: ``trio.current_time() -
        time.monotonic()``): a protected reader stays protected, a capped class stays
        capped where it was, instead of both starting over. What the policy in force no
        longer caps or protects is dropped."""
        self.state = str(state["state"])
        for action, n in state["decisions"].items():
            self.decisions[action] = self.decisions.get(action, 0) + int(n)
        self.verdicts = {str(k): str(v) for k, v in state["verdicts"].items()}
        self.low = {name: _LowClass({d: _Throttle(float(cap), float(start),
                                                  float(since) + to_trio, int(slack))
                                     for d, (cap, start, since, slack) in dirs.items()
                                     if d in _DIRECTIONS})
                    for name, dirs in state["low"].items() if dirs}
        self.baselines = {name: deque(map(float, values), maxlen=BASELINE_WINDOWS)
                          for name, values in state["baselines"].items()}
        self.active = {name: _Activity(float(since) + to_trio, int(windows), bool(judged),
                                       None if cut is None else float(cut) + to_trio,
                                       reason, bool(learned))
                       for name, (since, windows, judged, cut, reason, learned)
                       in state["active"].items()}
        self.set_policy(self.policy)  # drops what the policy in force has no role for

    def caps(self) -> dict[str, AutoCaps]:
        """The automatic caps of every class the policy has that may be capped."""
        return {name: (self.low[name].caps() if name in self.low else NO_AUTO_CAPS)
                for name in self.roles}

    def step(self, now: float, protected: Sequence[ProtectedSample],
             classes: Sequence[ClassSample]) -> dict[str, AutoCaps]:
        """Judge one window and return the caps that changed, by class."""
        verdicts = {}
        rates = {c.name: c for c in classes}
        self.quiet = all(self._quiet_below(g.name, rates)
                         for g in protected_classes(self.policy))
        for rule in protected_classes(self.policy):
            name = rule.name
            sample = next((p for p in protected if p.name == name), None)
            active = sample is not None and (sample.reads > 0 or sample.active)
            judged = active and not (sample is None or sample.latency is None
                                     or sample.samples < MIN_SAMPLES)
            if not active:
                self.active.pop(name, None)
                activity = None
            else:
                activity = self.active.get(name)
                if activity is None:
                    activity = self.active[name] = _Activity(now)
            if judged and rule.target_read_slowdown is not None and self._quiet_below(
                    name, rates):
                assert sample is not None and sample.latency is not None
                self.baselines.setdefault(name, deque(maxlen=BASELINE_WINDOWS)).append(
                    sample.latency)
                assert activity is not None  # judged implies active
                activity.learned = True
            target = self.targets[name] = self.target_of(rule)
            if activity is None:
                verdicts[name] = "idle"
            elif not judged:
                if not activity.judged and activity.windows < STARTING_WINDOWS:
                    activity.windows += 1
                    verdicts[name] = "starting"  # nothing to judge yet: protect first
                else:
                    verdicts[name] = "few-samples"
            elif target is None:
                verdicts[name] = "learning"  # no quiet window seen yet: no baseline
            else:
                assert sample is not None and sample.latency is not None  # judged
                activity.judged = True
                verdicts[name] = "missed" if sample.latency > target else "met"
        self.verdicts = verdicts
        pressing = self._pressing(verdicts)
        decreases = self.decisions["decrease"]
        changed = {}
        floored = []  # per class decreased: is it at its floor (or has nothing to give)?
        for name, above in self.roles.items():
            seen = [verdicts.get(g.name, "idle") for g in above]
            before = self.low[name].caps() if name in self.low else NO_AUTO_CAPS
            traffic = rates.get(name, ClassSample(name, 0.0, 0.0))
            if "missed" in seen:
                factor = DECREASE
                for g in above:
                    p = next((x for x in protected if x.name == g.name), None)
                    target = self.targets.get(g.name)
                    if verdicts.get(g.name) == "missed" and p and p.latency and target:
                        factor = min(factor, target / p.latency)
                floored.append(self._decrease(name, traffic, now, max(DEEPEST, factor)))
            elif any(g.name in pressing for g in above):
                # starting, or no baseline yet: protect now, learn after (see _pressing)
                floored.append(self._decrease(name, traffic, now, DEEPEST))
            elif "few-samples" not in seen and "learning" not in seen and name in self.low:
                if all(v == "idle" for v in seen):
                    growth = 1.0  # double: nothing to protect
                else:
                    growth = CLIMB
                    for g in above:  # the least headroom of the guards decides
                        p = next((x for x in protected if x.name == g.name), None)
                        target = self.targets.get(g.name)
                        if p is not None and p.latency is not None and target:
                            headroom = 1.0 - p.latency / target
                            growth = min(growth, max(INCREASE, headroom / 2))
                self._increase(name, traffic, growth)
            after = self.low[name].caps() if name in self.low else NO_AUTO_CAPS
            if after != before:
                changed[name] = after
        if self.decisions["decrease"] > decreases:
            for name, activity in self.active.items():
                if activity.first_cut is None and verdicts.get(name) in (
                        "starting", "learning", "missed"):
                    activity.first_cut, activity.cut_reason = now, verdicts[name]
        missed = any(v == "missed" for v in verdicts.values())
        unreachable = all(floored)  # also when no class could be capped at all
        if not verdicts:
            self.state = "idle"
        elif missed and unreachable:
            self.state = "unreachable"
        elif self.low:
            self.state = "throttling"
        else:
            self.state = "watching"
        return changed

    def _pressing(self, verdicts: dict[str, str]) -> set[str]:
        """The protected classes whose lower classes are cut as for a large miss although
        nothing was judged: those ``starting`` (active, not judged yet) and the relative
        targets ``learning`` (no baseline yet).

        A relative target (``target_read_slowdown``) is judged against the latency its
        class has while the classes below it are quiet. A reader that starts while a
        checkpoint storm runs, and never pauses, would never see such a window and so
        never be protected (measured: 85% AU instead of 94% for a ResNet-like DLIO
        reader, ``bench/ANALYSIS.md``); waiting for one, even 2 s, left half of a 5.7 s
        U-Net3D-like epoch unprotected. So the classes below are cut by :data:`DEEPEST`
        per window, down to their floor, until a window is quiet; the baseline is learned
        there, and from then on the usual rules raise the caps again while the target is
        met. A ``learning`` verdict already says the window was not quiet: a judged
        window that is quiet adds to the baseline before the verdict, which then has a
        target.
        """
        return {name for name, verdict in verdicts.items()
                if verdict in ("starting", "learning")}

    def _quiet_below(self, guard: str, rates: dict[str, ClassSample]) -> bool:
        """Whether every class that yields to *guard* moved next to nothing this window
        (at most its floor, where a cap may hold it): a window to learn from."""
        for name, above in self.roles.items():
            if any(g.name == guard for g in above):
                sample = rates.get(name)
                if sample is not None and max(sample.read_rate, sample.write_rate) > (
                        QUIET * FLOOR):
                    return False
        return True

    def target_of(self, rule: ClassRule) -> float | None:
        """The latency *rule*'s reads are judged on now: its absolute target, its slowdown
        times its baseline (the median latency of recent quiet windows), or the lower of
        the two; None while a relative target has no baseline (and no absolute one)."""
        target = rule.target_read_latency
        seen = self.baselines.get(rule.name)
        if rule.target_read_slowdown is not None and seen:
            relative = rule.target_read_slowdown * statistics.median(seen)
            target = relative if target is None else min(target, relative)
        return target

    def baseline(self, name: str) -> float | None:
        """The baseline latency of protected class *name* (None: none learned)."""
        seen = self.baselines.get(name)
        return statistics.median(seen) if seen else None

    def baseline_source(self, name: str) -> str | None:
        """Where *name*'s baseline comes from: ``learned`` during its current activity,
        ``remembered`` from an earlier one (an earlier epoch: judged on it at once), or
        None (none yet)."""
        if not self.baselines.get(name):
            return None
        activity = self.active.get(name)
        return "learned" if activity is not None and activity.learned else "remembered"

    def _decrease(self, name: str, sample: ClassSample, now: float, factor: float) -> bool:
        """Multiplicative decrease; returns whether every capped direction is at its floor."""
        rule = self.rules[name]
        state = self.low.setdefault(name, _LowClass())
        for direction in _DIRECTIONS:
            rate = getattr(sample, f"{direction}_rate")
            floor = _floor_of(rule, direction)
            thr = state.throttles.get(direction)
            if thr is None:
                start = min(rate, _cap_of(rule, direction))
                if start <= floor:
                    continue  # not moving enough in this direction to be the cause
                thr = state.throttles[direction] = _Throttle(start, start, now)
            binding = sample.waited or rate >= 0.9 * thr.cap
            thr.slack = 0 if binding else thr.slack + 1
            if thr.slack >= RELEASE_WINDOWS:  # not moving: it is not what hurts
                log.debug("latency: %s %s cap released (idle under it)", name, direction)
                self.decisions["release"] += 1
                del state.throttles[direction]
                continue
            base = min(thr.cap, rate) if rate > 0 else thr.cap
            cap = max(floor, base * factor)
            if cap != thr.cap:
                log.debug("latency: %s %s cap %.0f -> %.0f B/s (target missed)", name,
                          direction, thr.cap, cap)
                self.decisions["decrease"] += 1
                thr.cap = cap
        if not state.throttles:
            del self.low[name]
            return True  # nothing of this class to throttle
        return all(t.cap <= _floor_of(rule, d) for d, t in state.throttles.items())

    def _increase(self, name: str, sample: ClassSample, growth: float) -> None:
        """Grow the caps by ``growth`` of themselves; release once they no longer matter."""
        rule = self.rules[name]
        state = self.low[name]
        for direction, thr in list(state.throttles.items()):
            rate = getattr(sample, f"{direction}_rate")
            binding = sample.waited or rate >= 0.9 * thr.cap
            thr.slack = 0 if binding else thr.slack + 1
            cap = thr.cap * (1.0 + growth)
            if cap >= min(thr.start, _cap_of(rule, direction)) or thr.slack >= RELEASE_WINDOWS:
                log.debug("latency: %s %s cap released (target met; was %.0f B/s)", name,
                          direction, thr.cap)
                self.decisions["release"] += 1
                del state.throttles[direction]
            else:
                log.debug("latency: %s %s cap %.0f -> %.0f B/s (target met or idle)", name,
                          direction, thr.cap, cap)
                self.decisions["increase"] += 1
                thr.cap = cap
        if not state.throttles:
            del self.low[name]


def _clock() -> float | None:
    """trio's clock (what ``active_since`` and ``first_cut_at`` are on); None outside a run."""
    try:
        return trio.current_time()
    except RuntimeError:
        return None


class QueueSource(Protocol):
    """What the controller reads of the canary (:class:`qosfs.qos.latency_probe.LatencyProbe`)."""

    @property
    def running(self) -> bool: ...

    def snapshot(self) -> tuple[int, ...]: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def set_interval(self, interval: float) -> None: ...  # seconds between probes

    def watch_backing(self, class_name: str, fd: int | None) -> None: ...

    def backing_snapshot(self, class_name: str) -> tuple[int, ...] | None: ...


class LatencyLoop:
    """The daemon task: every window, measure the protected classes, decide, apply.

    Args:
        engine: The running :class:`~qosfs.qos.engine.PolicyQos`.
        probe: The canary for ``latency_measure = "request"``; None: backend times only.
        window: Seconds per decision.
        reads_bypass: Whether a class's reads bypass the daemon on this mount.
        backing_file: A backing descriptor a class whose reads bypass the daemon has open
            now (None: none), for the canary to time reads of.
    """

    def __init__(self, engine: PolicyQos, probe: QueueSource | None = None,
                 window: float = WINDOW,
                 reads_bypass: Callable[[ClassRule], bool] | None = None,
                 backing_file: Callable[[str], int | None] | None = None) -> None:
        self.engine = engine
        # Whether a class's reads bypass the daemon on this mount (kernel passthrough),
        # asked at every policy check: it depends on the policy and on what INIT gave.
        self._reads_bypass = reads_bypass
        self._backing_file = backing_file
        self._backing_prev: dict[str, tuple[int, ...] | None] = {}
        self.probe = probe
        self.window = window
        self.controller = LatencyDecider(engine.policy)
        self._generation = -1
        self._fine: dict[str, dict[AccountKey, tuple[int, ...]]] = {}
        self._probe_prev: tuple[int, ...] | None = None
        self._levels: dict[str, tuple[int, int, int]] = {}
        self._last: float | None = None
        self.samples: list[ProtectedSample] = []
        self.windows = 0
        self._unobserved: set[str] = set()  # classes whose reads bypass the daemon
        # Per protected class: its activity count at the last tick (Accounts.activity).
        self._activity: dict[str, int] = {}
        self.early_ticks = 0  # windows decided at once because a class became active
        self.on_window: list[Callable[[float, LatencyLoop], None]] = []  # for tests

    def __repr__(self) -> str:
        return f"<LatencyLoop {self.controller!r} windows={self.windows}>"

    def reads_unobserved(self, class_name: str, unobserved: bool = True) -> None:
        """Say that *class_name*'s reads do (not) reach the daemon, e.g. because the kernel
        sends them straight to the backing file (FUSE passthrough). Such a class is
        judged on the canary's timed reads of a file it holds (and its round trips while
        it opens files) and seen active by its opens, metadata requests and the files it
        holds; the canary runs for it whatever its ``latency_measure``."""
        if unobserved:
            self._unobserved.add(class_name)
        else:
            self._unobserved.discard(class_name)

    def unobserved(self) -> frozenset[str]:
        """The classes whose reads are not seen (:meth:`reads_unobserved`)."""
        return frozenset(self._unobserved)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Decide every window until cancelled, and at once when a protected class becomes
        active (checked every :data:`PROBE_CHECK`); the canary runs only when needed."""
        self._sync_policy()
        self._last = trio.current_time()
        self._sample_levels()
        self._activity = self._activity_counts()
        task_status.started()
        try:
            next_tick = self._last + self.window
            while True:
                await trio.sleep(min(PROBE_CHECK, max(0.0, next_tick - trio.current_time())))
                self._sync_policy()
                self._steer_probe()
                now = trio.current_time()
                if now >= next_tick:
                    self.tick(now)
                    next_tick = max(next_tick + self.window, now + self.window / 2)
                elif self._became_active(now):
                    # Protection from the first request: decide now, a window from here on.
                    self.early_ticks += 1
                    self.tick(now)
                    next_tick = now + self.window
        finally:
            if self.probe is not None:
                self.probe.stop()

    async def stop_probe(self, timeout: float = 1.0) -> None:
        """Stop the canary and wait until its last request is answered (call before the
        loop stops serving, so no request of ours is pending when the mount goes)."""
        probe = self.probe
        if probe is None:
            return
        self.probe = None
        probe.stop()
        with trio.move_on_after(timeout):
            while probe.running:
                await trio.sleep(0.005)

    # -- measuring ------------------------------------------------------------------

    def _sync_policy(self) -> None:
        if self._reads_bypass is not None:
            for rule in protected_classes(self.engine.policy):
                self.reads_unobserved(rule.name, self._reads_bypass(rule))
        if self.engine.generation == self._generation:
            return
        self._generation = self.engine.generation
        self.controller.set_policy(self.engine.policy)
        guarded = frozenset(c.name for c in protected_classes(self.engine.policy))
        self.engine.accounts.set_fine_classes(guarded)
        self._fine = {k: v for k, v in self._fine.items() if k in guarded}
        self._apply(self.controller.caps())

    def _activity_counts(self) -> dict[str, int]:
        accounts = self.engine.accounts
        return {c.name: accounts.activity(c.name) for c in protected_classes(self.engine.policy)}

    def _became_active(self, now: float) -> bool:
        """Whether a protected class the last window found idle became active since (see
        :meth:`_active`), at least :data:`PROBE_CHECK` after the last decision (so a
        window's rates are not noise)."""
        if self._last is None or now - self._last < PROBE_CHECK:
            return False
        idle = [c.name for c in protected_classes(self.engine.policy)
                if c.name not in self.controller.active]
        if not idle:
            return False
        accounts = self.engine.accounts
        holding = self.engine.open_classes()
        return any(self._active(name, accounts.activity(name), holding) for name in idle)

    def _active(self, name: str, count: int, holding: set[str]) -> bool:
        """Whether class *name* opened, read or made a metadata request since the last
        decision (its activity count moved) -- or, when its reads are not seen, holds files
        open (it may be reading them through the kernel). A class whose reads are seen and
        that only holds files open is idle: nothing of it waits."""
        before = self._activity.get(name)
        if before is not None and before != count:
            return True
        return name in self._unobserved and name in holding

    def _wants_probe(self) -> bool:
        """A protected class measured as "request", or whose reads are not seen, is
        active: it has files open or was active in the last window."""
        names = {c.name for c in protected_classes(self.engine.policy)
                 if c.latency_measure == "request" or c.name in self._unobserved}
        return bool(names) and not (names.isdisjoint(self.engine.open_classes())
                                    and names.isdisjoint(self.controller.active))

    def _steer_probe(self) -> None:
        if self.probe is None or self.engine.draining:
            return
        wanted = self._wants_probe()
        if wanted and not self.probe.running:
            # The canary's histogram outlives its runs: its first window starts here, or
            # the round trips of its last run (another epoch, a quieter storm) would be
            # judged as this one's -- measured, a reader starting into a storm was "met"
            # on the last epoch's figures and never protected.
            self._probe_prev = self.probe.snapshot()
            self._backing_prev = {n: self.probe.backing_snapshot(n) for n in self._unobserved}
            self.probe.start()
        elif not wanted and self.probe.running:
            self.probe.stop()
        if self.probe.running and self._backing_file is not None:
            for name in self._unobserved:
                self.probe.watch_backing(name, self._backing_file(name))
        # Full rate only while something below a protected class moves (or is capped):
        # a quiet window only feeds a baseline, for which fewer samples do.
        busy = self.controller.low or not self.controller.quiet
        self.probe.set_interval(PROBE_INTERVAL if busy else PROBE_QUIET_INTERVAL)

    def _sample_levels(self) -> dict[str, ClassSample]:
        now = trio.current_time()
        dt = now - self._last if self._last is not None else 0.0
        out = {}
        levels = {}
        for name, state in self.engine.classes.items():
            lv = state.level
            cur = (lv.bytes_read, lv.bytes_written, lv.waits)
            levels[name] = cur
            prev = self._levels.get(name)
            if prev is not None and dt > 0:
                out[name] = ClassSample(name, max(0, cur[0] - prev[0]) / dt,
                                        max(0, cur[1] - prev[1]) / dt,
                                        cur[2] > prev[2] or lv.queue_depth > 0)
        self._levels = levels
        return out

    def _measure(self) -> list[ProtectedSample]:
        accounts = self.engine.accounts
        activity = self._activity_counts()
        holding = self.engine.open_classes()
        queue_counts: tuple[int, ...] | None = None
        if self.probe is not None and self.probe.running:
            snap = self.probe.snapshot()
            queue_counts = FineHistogram.window(snap, self._probe_prev)
            self._probe_prev = snap
        else:
            self._probe_prev = None
        samples = []
        for rule in protected_classes(self.engine.policy):
            now = accounts.fine_by_key(rule.name)
            before = self._fine.get(rule.name, {})
            self._fine[rule.name] = now
            window: tuple[int, ...] | None = None
            for key, counts in now.items():
                d = FineHistogram.window(counts, before.get(key))
                window = d if window is None else tuple(a + b for a, b in zip(window, d,
                                                                                strict=True))
            reads = sum(window) if window is not None else 0
            active = self._active(rule.name, activity[rule.name], holding)
            q = rule.latency_percentile / 100.0
            if rule.name in self._unobserved:
                sent = self._activity.get(rule.name, activity[rule.name]) != activity[rule.name]
                samples.append(self._unobserved_sample(rule, q, queue_counts, sent, active))
                continue
            backend = FineHistogram.quantile(window, q) if window is not None else None
            latency, samples_n, queue = backend, reads, None
            if rule.latency_measure == "request" and self.probe is not None:
                # Judged on the canary's round trips, never on the backend part alone: in
                # the first window of a reader the canary has only just been started, and
                # a storm shows in the queue, not in a memory-backed source's times.
                # The queue part is shown whenever the canary ran (the reads of a file in
                # the page cache never reach us), the estimate only with reads of its own.
                queue = (FineHistogram.quantile(queue_counts, q)
                         if queue_counts is not None else None)
                latency = queue + backend if queue is not None and backend is not None \
                    else None
                samples_n = sum(queue_counts) if queue_counts is not None else 0
            samples.append(ProtectedSample(rule.name, latency, reads, samples_n, queue,
                                           backend, active))
        self._activity = activity
        return samples

    def _unobserved_sample(self, rule: ClassRule, q: float,
                           queue_counts: tuple[int, ...] | None, sent: bool,
                           active: bool) -> ProtectedSample:
        """The window of a class whose reads bypass the daemon (see "Reads not seen" in
        the module docstring): its backing reads as the canary timed them, plus the
        canary's round trips when the class *sent* the daemon requests in the window."""
        name = rule.name
        counts: tuple[int, ...] | None = None
        if self.probe is not None and self.probe.running:
            snap = self.probe.backing_snapshot(name)
            if snap is not None:
                counts = FineHistogram.window(snap, self._backing_prev.get(name))
            self._backing_prev[name] = snap
        queue = (FineHistogram.quantile(queue_counts, q)
                 if queue_counts is not None else None)
        backend = FineHistogram.quantile(counts, q) if counts is not None else None
        if backend is None:  # no file read yet: the round trips alone
            return ProtectedSample(name, queue, 0, sum(queue_counts) if queue_counts else 0,
                                   queue, None, active)
        assert counts is not None
        latency = backend + queue if sent and queue is not None else backend
        return ProtectedSample(name, latency, 0, sum(counts), queue if sent else None,
                               backend, active)

    # -- deciding and applying --------------------------------------------------------

    def tick(self, now: float) -> None:
        """One window: measure, decide, apply."""
        classes = self._sample_levels()
        self._last = now
        self.samples = self._measure()
        changed = self.controller.step(now, self.samples, list(classes.values()))
        self._apply(changed)
        self.windows += 1
        for hook in self.on_window:
            hook(now, self)

    def export_state(self, to_monotonic: float) -> dict[str, Any]:
        """The controller's state for a successor (:meth:`LatencyDecider.export_state`)."""
        return {"decider": self.controller.export_state(to_monotonic),
                "windows": self.windows}

    def import_state(self, state: dict[str, Any], to_trio: float) -> int:
        """Inside the event loop, before any request is read: go on from a predecessor's
        `export_state` and put its automatic caps in force at once (the loop's first
        window is half a second away). Returns how many classes are capped."""
        self._sync_policy()
        self.controller.import_state(state["decider"], to_trio)
        self.windows += int(state["windows"])
        self._apply(self.controller.caps())
        return len(self.controller.low)

    def _apply(self, caps: dict[str, AutoCaps]) -> None:
        for name, value in caps.items():
            self.engine.set_auto_caps(name, value)

    def status(self) -> dict[str, Any]:
        """What ``ctl status``, ``top`` and ``/metrics`` show (plain JSON data)."""
        c = self.controller
        now = _clock()
        protected = []
        by_name = {s.name: s for s in self.samples}
        for rule in protected_classes(c.policy):
            s = by_name.get(rule.name)
            activity = c.active.get(rule.name)
            protected.append({
                "class": rule.name, "target_seconds": c.target_of(rule),
                "slowdown": rule.target_read_slowdown,
                "baseline_seconds": c.baseline(rule.name),
                "percentile": rule.latency_percentile, "measure": rule.latency_measure,
                "latency_seconds": s.latency if s else None,
                "queue_seconds": s.queue if s else None,
                "backend_seconds": s.backend if s else None,
                "reads": s.reads if s else 0, "verdict": c.verdicts.get(rule.name, "idle"),
                # How its protection began (see "Starting" in the module docstring);
                # times on the daemon's monotonic clock (trio.current_time()).
                "reads_observed": rule.name not in self._unobserved,
                "active_since": activity.since if activity else None,
                "first_cut_at": activity.first_cut if activity else None,
                "first_cut_reason": activity.cut_reason if activity else None,
                "baseline_source": c.baseline_source(rule.name),
                # The same as durations, for readers without the daemon's clock.
                "active_seconds": (now - activity.since
                                   if activity is not None and now is not None else None),
                "first_cut_after_seconds": (activity.first_cut - activity.since
                                            if activity and activity.first_cut is not None
                                            else None)})
        throttled = []
        for name, low in sorted(c.low.items()):
            caps = low.caps()
            throttled.append({"class": name, "read_bandwidth": caps.read_bandwidth,
                              "write_bandwidth": caps.write_bandwidth})
        return {"state": c.state, "window_seconds": self.window, "windows": self.windows,
                "early_windows": self.early_ticks, "now": now,
                "decisions": dict(c.decisions),
                "probe_running": bool(self.probe is not None and self.probe.running),
                "protected": protected, "throttled": throttled}
