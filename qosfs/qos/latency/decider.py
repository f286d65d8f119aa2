"""Latency targets: cap lower-priority classes automatically while a protected class is slow.

A class with ``target_read_latency = "5ms"`` (on ``latency_percentile``, default p99) is
*protected*. Every window (:data:`~qosfs.qos.latency.loop.WINDOW`, 0.5 s) the controller
estimates that percentile of the class's read latency over the window and adjusts the
automatic bandwidth caps of the *lower* classes: those whose priority weight is below a protected
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
  becoming active every :data:`~qosfs.qos.latency.loop.PROBE_CHECK` (50 ms) and then
  decides at once instead of at the end of the window. Until the class's first judged
  window (at most :data:`STARTING_WINDOWS`), the classes below it are cut as for a large miss
  (:data:`DEEPEST`): the canary needs a few hundred ms to report, a training step is
  shorter than that, and a reader starting into a running storm was left unprotected
  for 1.3 s, 3.3 s with a relative target (``python -m bench latency-target``; the
  issue: half a 5.7 s epoch). A relative target without a baseline is cut
  the same way until a quiet window teaches it one (``learning``, below). From its first
  judged window on, the usual rules apply: met, the caps climb back -- and faster than
  the usual steps as long as they are under what the class moved before these cuts,
  which no judgement asked for: each met window takes a cap halfway back there, in
  ratio (the geometric mean of the cap and that rate), until it is reached or a window
  is missed. Three starting cuts take a storm to 1/64 of its rate; at 5-25 % a window it
  took 19-85 windows (9-43 s) to come back even when the reader never missed its
  target, so a checkpoint next to a short read kept 9-22 % of its capped rate
  (``python -m bench demo``, whose reader met its target throughout). The first cut of
  the class's activity, its reason and the baseline's source show in ``ctl status``.

Caps are applied through :meth:`qosfs.qos.engine.PolicyQos.set_auto_caps`: the level's
``set_limits`` wakes parked requests, the policy is never mutated, and the configured cap
still bounds the automatic one, so a ``ctl set`` of a cap bounds the controller from then
on; a swap re-applies the automatic caps at once. Only bandwidth is controlled (not IOPS).
One decision per class per window, each logged at DEBUG.

The estimates a window is judged on are the loop's (:mod:`qosfs.qos.latency.loop`: what
latency, and how a class whose reads are not seen is measured); the decider is given them.

:class:`LatencyDecider` is the decision logic, pure: no trio, no I/O, the time passed in,
so every rule above is tested window by window without a clock or a mount.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from qosfs.policy.model import ClassRule, Policy
from qosfs.qos.stats import NO_AUTO_CAPS, AutoCaps

__all__ = ["ClassSample", "LatencyDecider", "ProtectedSample", "low_classes", "protected_classes"]

log = logging.getLogger(__name__)

DECREASE = 0.7  # cap factor per missed window (at most)
DEEPEST = 0.25  # cap factor per missed window (at least), for a large miss
INCREASE = 0.05  # of the cap, added per met window at least
CLIMB = 0.25  # ... at most, when the latency is at half the target or below
RELEASE_WINDOWS = 3  # windows without binding before a cap is removed
FLOOR = float(1 << 20)  # bytes/s: the lowest automatic cap (above min_*_bandwidth)
MIN_SAMPLES = 10  # latency samples a window needs to be judged
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
    # What it moved before the cuts made without a judgement (starting, learning) of the
    # present episode, which met windows climb back to faster (_increase); 0: none. Not
    # handed to a successor, which then climbs back at the usual pace.
    undo: float = 0.0


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
                floored.append(self._decrease(name, traffic, now, DEEPEST, precaution=True))
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

    def _decrease(self, name: str, sample: ClassSample, now: float, factor: float,
                  precaution: bool = False) -> bool:
        """Multiplicative decrease; returns whether every capped direction is at its floor.
        *precaution*: a cut no judgement asked for (starting, learning), which met windows
        undo faster (``_Throttle.undo``); a judged miss ends that."""
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
            thr.undo = max(thr.undo, base) if precaution else 0.0
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
            if thr.undo > cap:  # back from precautions: halfway there, in ratio, per window
                cap = max(cap, math.sqrt(thr.cap * thr.undo))
            if cap >= thr.undo:
                thr.undo = 0.0
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
