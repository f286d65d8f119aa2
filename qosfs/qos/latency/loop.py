"""The latency controller's daemon task: every window, measure the protected classes,
let the decider judge them (:mod:`qosfs.qos.latency.decider`), and put the caps it
decides in force through :meth:`qosfs.qos.engine.PolicyQos.set_auto_caps`.

It also starts a window early when a protected class becomes active (checked every
:data:`PROBE_CHECK`, once a window on an idle mount: :meth:`LatencyLoop._idle`; see
"Starting" in the decider), runs the canary
(:mod:`qosfs.qos.latency.probe`) only while a class needs it, and reports what ``ctl
status``, ``top`` and ``/metrics`` show.

What latency (``latency_measure``):

``backend``
    the backing syscall time of the class's reads, as the issue puts it: what storage
    contention shows up in (NFS, Lustre, disks).
``request`` (default)
    what a caller waits for: the time a request waits before the daemon's handler runs
    (the kernel's FUSE queue and the daemon's loop, behind the other classes' requests)
    plus the backing syscall. The first part cannot be seen from inside a handler, so it
    is measured by a canary (:mod:`qosfs.qos.latency.probe`): a zero-cost request sent
    through the mount every 2 ms while a protected class has files open. The estimate is the
    percentile of the canary's round trips plus the percentile of the class's backend
    times (an upper bound). On a memory-backed source the backend time hardly moves under
    a checkpoint storm while the readers' latency grows tenfold (bench/latency_target.py
    measures both), which is why this is the default.

**Reads not seen** (:meth:`LatencyLoop.reads_unobserved`): a class whose reads bypass the
daemon (kernel passthrough) has no read or backend histogram, and its reads wait in no
queue of the daemon's. Its estimate is the percentile of the canary's timed reads of a
file the class has open (``backing_file``;
:meth:`qosfs.qos.latency.probe.LatencyProbe.watch_backing`), plus the percentile of
the canary's round trips in a window in which the class sent the daemon opens or
metadata requests (those do queue behind the storm: a small-file loader pays them per
file). Until the canary has read a file of the class, the round trips
alone. Its activity comes from opens, metadata, the files it holds open and the reads the
kernel served it, where they are counted (:mod:`qosfs.passthrough.read_counting`); those
reads never queue in the daemon, so they are not what makes a window one in which it
*sent* requests (:meth:`qosfs.qos.accounting.Accounts.sent`). A relative
target learns its baseline from the same estimate in quiet windows.

Latencies come from :class:`qosfs.qos.accounting.FineHistogram` (8 buckets per octave, upper
bounds, so estimates are at most 12.5 % high), differenced per window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import trio

from qosfs.policy.model import ClassRule
from qosfs.qos.accounting import AccountKey, FineHistogram
from qosfs.qos.engine import PolicyQos
from qosfs.qos.latency.decider import (
    ClassSample,
    LatencyDecider,
    ProtectedSample,
    protected_classes,
)
from qosfs.qos.latency.probe import INTERVAL as PROBE_INTERVAL
from qosfs.qos.latency.probe import QUIET_INTERVAL as PROBE_QUIET_INTERVAL
from qosfs.qos.stats import AutoCaps

__all__ = ["PROBE_CHECK", "WINDOW", "LatencyLoop", "QueueSource"]

WINDOW = 0.5  # seconds per decision
PROBE_CHECK = 0.05  # seconds between checks whether the canary should run (and activity)


def _clock() -> float | None:
    """trio's clock (what ``active_since`` and ``first_cut_at`` are on); None outside a run."""
    try:
        return trio.current_time()
    except RuntimeError:
        return None


class QueueSource(Protocol):
    """What the controller reads of the canary (:class:`qosfs.qos.latency.probe.LatencyProbe`)."""

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
        self._sent: dict[str, int] = {}  # Accounts.sent per class at the last window
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
        active (checked every :data:`PROBE_CHECK` unless the mount is idle: :meth:`_idle`);
        the canary runs only when needed."""
        self._sync_policy()
        self._last = trio.current_time()
        self._sample_levels()
        self._activity = self._activity_counts()
        self._sent = {c.name: self.engine.accounts.sent(c.name)
                      for c in protected_classes(self.engine.policy)}
        task_status.started()
        try:
            next_tick = self._last + self.window
            while True:
                until_tick = max(0.0, next_tick - trio.current_time())
                await trio.sleep(until_tick if self._idle() else min(PROBE_CHECK, until_tick))
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

    def _idle(self) -> bool:
        """Whether the checks between windows have nothing to find before the next one:
        no class is protected, or no file is open through any class, the canary is not
        running and the last window found nothing active, moving below a protected
        class or capped. An idle mount then wakes once a window, not every
        :data:`PROBE_CHECK`: each wake-up (the checks and trio's timer) cost ~0.4 ms of
        CPU here, and an idle mount spent 1% of a core on twenty of them a second. A
        class that starts on an idle mount is noticed at the next window instead:
        nothing was moving below it, and a storm that starts with it is judged on that
        window's reads (a miss cuts it at once)."""
        if not protected_classes(self.engine.policy):
            return True  # nothing to protect: the windows only follow policy changes
        c = self.controller
        return (not c.active and c.quiet and not c.low
                and not (self.probe is not None and self.probe.running)
                and not self.engine.open_classes())

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
                # Sent: requests that queue in the daemon (not the kernel's reads, which
                # the class's counters have too: qosfs.passthrough.read_counting).
                sent_now = accounts.sent(rule.name)
                sent = self._sent.get(rule.name, sent_now) != sent_now
                self._sent[rule.name] = sent_now
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
