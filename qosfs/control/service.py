"""What the daemon does for each control request: status, stats, explain, set, reload,
SIGHUP.

A change is built and validated whole, off to the side (:func:`qosfs.policy.loading.with_changes`,
:func:`qosfs.policy.loading.parse_policy`), and only a valid policy reaches the one synchronous
:meth:`QosControl.swap <qosfs.qos.interface.QosControl.swap>`; a rejected change therefore leaves
the running policy exactly as it was. The swap wakes every parked request, so a raised
cap is in force for requests already waiting in the same instant.

A reload that fails is remembered until the next one of the same kind succeeds, with
when, who asked, the file, line, key and reason: ``status`` and ``stats`` carry it as
``last_reload_failure`` (``last_reload_ok`` false), ``/metrics`` as
``qosfs_policy_last_reload_success 0`` (the ``QosfsReloadFailed`` alert), and under systemd
the ``STATUS=`` line ``systemctl status`` shows (:mod:`qosfs.daemon.assembly`). Only reloads of
the mount's *own* policy count: SIGHUP, ``ctl reload`` without a file (what
``systemctl reload`` runs), or ``ctl reload`` of that same file. A refused ``ctl reload
OTHER.toml`` was answered to its caller, who saw file, line and reason, and leaves both
the policy in force and the mount's file as good as they were; an alert that held until
the next reload would page for a typo already reported. It is counted
(``qosfs_policy_changes_total{command="reload",result="rejected"}``) and logged, and it
neither raises nor clears the alert. The alert therefore means one thing: the mount's
policy file, read last, was refused -- the node runs an older policy than its file says,
and a restart would refuse to start.

Who may do what: every peer that can connect may read ``status`` and ``stats`` and ask
``explain``; changing anything needs uid 0 or membership (primary or supplementary, as
the kernel reported at connect time) in the policy's ``[control] admin_group``. On a
``--no-qos`` mount there is no policy to change: ``set`` and ``reload`` are refused with
code ``unavailable`` (turning QoS on would mean swapping the engine under open files;
remount instead), and there is nothing to ``explain``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import trio

from qosfs import __version__
from qosfs.control.protocol import (
    ExplainRequest,
    Peer,
    ReloadRequest,
    Request,
    SetRequest,
    error_reply,
)
from qosfs.control.snapshot import RateSampler, Snapshot, take_snapshot, to_json
from qosfs.policy.loading import default_policy, load_policy, parse_policy, with_changes
from qosfs.policy.model import Policy, PolicyError, policy_to_raw
from qosfs.qos.explanation import Asked

if TYPE_CHECKING:
    from qosfs.qos.cluster import ClusterCoordinator
    from qosfs.qos.interface import QosControl
    from qosfs.qos.latency.loop import LatencyLoop

log = logging.getLogger(__name__)

SAMPLE_INTERVAL = 1.0  # seconds between rate samples ("current rates" cover this window)


class ControlService:
    """The control commands of one mount, run on its event loop.

    Args:
        engine: the mount's engine (:class:`~qosfs.qos.interface.QosControl`); one without
            a policy (``--no-qos``) has nothing to change or explain.
        policy_path: the file the mount was started with (``reload`` without a file and
            SIGHUP re-read it); None: the embedded default policy.
        info: shown in status (source, mountpoint, socket...).
        latency: the mount's :class:`~qosfs.qos.latency.loop.LatencyLoop` (status only).
    """

    def __init__(self, engine: QosControl, policy_path: str | None = None,
                 info: dict[str, Any] | None = None, latency: LatencyLoop | None = None,
                 cluster: ClusterCoordinator | None = None) -> None:
        self.engine = engine
        self.latency = latency  # shown in status
        self.cluster = cluster  # shown in status; `ctl status --cluster` reads Redis through it
        self.policy_path = policy_path
        self.info = dict(info or {})
        self.changes: Counter[tuple[str, str]] = Counter()
        # The last refused reload of the mount's own policy (see the module doc), as
        # status shows it; None once one is applied.
        self.reload_failure: dict[str, Any] | None = None
        self._own_path = os.path.abspath(policy_path) if policy_path is not None else None
        self.sampler = RateSampler()
        self.on_swap: list[Callable[[Policy], None]] = []  # e.g. the socket's admin group
        # Entered around every reload, accepted or not (systemd: RELOADING=1 ... READY=1).
        self.reloading: Callable[[], AbstractContextManager[object]] = nullcontext
        self._started: float | None = None  # set when run() starts
        # More live figures for status (the filesystem's descriptors and handles).
        self.info_sources: list[Callable[[], dict[str, Any]]] = []
        # Run before every snapshot: counters kept outside the engine folded into it first
        # (the kernel's counts of passed-through reads), so that `ctl stats` after a read
        # shows that read, not what was folded up to half a second earlier.
        self.before_snapshot: list[Callable[[], None]] = []
        # The policy in force as raw tables and its hash, per generation (computed once).
        self._in_force: tuple[int, str, dict[str, Any]] = (-1, "", {})

    def __repr__(self) -> str:
        return (f"<ControlService generation={self.engine.generation} "
                f"changes={dict(self.changes)}>")

    @property
    def has_policy(self) -> bool:
        return self.engine.policy is not None

    @property
    def last_reload_ok(self) -> bool:
        """False while the last reload of the mount's own policy stands refused."""
        return self.reload_failure is None

    def status_line(self) -> str:
        """One line for a supervisor (systemd's ``STATUS=``): the policy in force, or why
        the last reload of the mount's policy was refused."""
        failure = self.reload_failure
        if failure is not None:
            when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(failure["time"]))
            line = (f"policy reload refused at {when} ({failure['by']}), previous policy "
                    f"kept: {failure['error']}")
            return " ".join(line.split())  # one line, whatever the reason held
        policy = self.engine.policy
        if policy is None:
            return "serving without a policy (--no-qos)"
        return f"serving; policy {policy.source} generation {self.engine.generation}"

    # ------------------------------------------------------------------ observation

    def snapshot(self) -> Snapshot:
        """A consistent copy of every counter (on the event loop's thread)."""
        for refresh in self.before_snapshot:
            refresh()
        now = trio.current_time()
        started = now if self._started is None else self._started
        info = {**self.info, "pid": os.getpid(), "version": __version__,
                "uptime_seconds": now - started}
        for source in self.info_sources:
            info.update(source())
        if self.has_policy:
            info["policy_hash"] = self._policy_hash()
        info["last_reload_failure"] = self.reload_failure
        return take_snapshot(self.engine, now, changes=dict(self.changes),
                             last_reload_ok=self.last_reload_ok, info=info,
                             latency=self.latency.status() if self.latency else None,
                             cluster=self.cluster.status() if self.cluster else None)

    def _policy_hash(self) -> str:
        """A short hash of the policy in force, as rendered (comments, order and spelling
        of the file do not change it)."""
        return self._policy_in_force()[0]

    def _policy_in_force(self) -> tuple[str, dict[str, Any]]:
        """The policy in force: its hash and its raw tables, computed once per generation."""
        engine = self.engine
        policy = engine.policy
        assert policy is not None  # asked only of a mount with a policy
        if self._in_force[0] != engine.generation:
            text = policy.render().split("\n", 1)[1]  # without the source line
            self._in_force = (engine.generation, hashlib.sha256(text.encode()).hexdigest()[:16],
                              policy_to_raw(policy))
        return self._in_force[1], self._in_force[2]

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Sample rates every second and reload on SIGHUP, until cancelled."""
        if self._started is None:  # not again when restarted (qosfs.daemon.supervise)
            self._started = trio.current_time()
        with trio.open_signal_receiver(signal.SIGHUP) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._sample_rates)
                task_status.started()
                async for _ in signals:
                    log.info("SIGHUP: reloading the policy")
                    reply = await self.reload(ReloadRequest(), "SIGHUP")
                    if not reply["ok"]:
                        log.warning("SIGHUP reload rejected, policy unchanged: %s",
                                    reply["error"])

    async def _sample_rates(self) -> None:
        while True:
            # Idle uids leave the per-uid series (qosfs.qos.accounting).
            self.engine.expire_idle_users(time.monotonic())
            self.sampler.sample(self.snapshot())
            await trio.sleep(SAMPLE_INTERVAL)

    # ------------------------------------------------------------------ requests

    def may_change(self, peer: Peer) -> bool:
        """Root, or a member of the running policy's admin group."""
        if peer.uid == 0:
            return True
        policy = self.engine.policy
        gid = policy.control.admin_gid if policy is not None else None
        return gid is not None and peer.in_group(gid)

    async def handle(self, request: Request, peer: Peer) -> dict[str, Any]:
        """The reply to one validated request from ``peer``."""
        if request.cmd == "status":
            body = to_json(self.snapshot(), self.sampler, accounts=False)
            if self.has_policy:
                # Every setting in force, in the policy's own spelling: it parses back to
                # the same policy (what `ctl status --json` round-trips).
                body["policy"] = self._policy_in_force()[1]
            return body
        if request.cmd == "stats":
            return to_json(self.snapshot(), self.sampler, accounts=True)
        if request.cmd == "cluster":
            return await self.cluster_view()
        if isinstance(request, ExplainRequest):
            return self.explain(request, peer)
        if not self.may_change(peer):
            log.info("refused %s from uid %d (pid %d): not root or admin group",
                     request.cmd, peer.uid, peer.pid)
            return error_reply(f"permission denied: uid {peer.uid} may not change the policy "
                               "(root or the policy's control.admin_group only)", "denied")
        who = f"uid {peer.uid} (pid {peer.pid})"
        if isinstance(request, SetRequest):
            return self.set(request, who)
        if isinstance(request, ReloadRequest):
            return await self.reload(request, who)
        return error_reply(f"unknown command {request.cmd}", "protocol")  # pragma: no cover

    async def cluster_view(self) -> dict[str, Any]:
        """Every mount's use and grant of every cluster level, as Redis holds them now."""
        if self.cluster is None:
            return error_reply("this mount's policy has no [cluster]", "unavailable")
        try:
            with trio.fail_after(2.0):
                view = await trio.to_thread.run_sync(self.cluster.cluster_view,
                                                     abandon_on_cancel=True)
        except Exception as exc:  # Redis down or slow: say so, keep serving
            return error_reply(f"cannot read the cluster from Redis: "
                               f"{type(exc).__name__}: {exc}", "unavailable")
        return {"ok": True, "node": self.cluster.node, "redis": self.cluster.config.redis,
                "state": self.cluster.stats.state, "levels": view}

    def explain(self, request: ExplainRequest, peer: Peer) -> dict[str, Any]:
        """What a request would get on this mount, from the policy and the classifier in
        force (the keys left out are the peer's own). Read-only: every peer may ask, as
        ``status`` already shows the whole policy."""
        asked = Asked(request.path, request.op, request.uid, request.gid, request.env,
                      request.cgroups)
        try:
            body = self.engine.explain(asked, pid=peer.pid, uid=peer.uid, gid=peer.gid,
                                       mountpoint=self.info.get("mountpoint"),
                                       mount_cache=self.info.get("page_cache", "auto"))
        except ValueError as exc:
            return error_reply(str(exc), "path")
        if body is None:
            return error_reply("this mount has no policy (mounted with --no-qos): nothing "
                               "is classified or throttled, traffic is only counted",
                               "unavailable")
        served = body["served_by"]
        kernel = self._passthrough()
        if served.get("passthrough") and kernel is not None and kernel["state"] != "active":
            # The policy would pass it through; this mount cannot (not negotiated at
            # mount, an old kernel, no CAP_SYS_ADMIN...): say why, as ctl status does.
            body["served_by"] = {"by": "daemon", "passthrough": False,
                                 "reason": f"kernel passthrough unavailable on this mount: "
                                           f"{kernel['reason']}",
                                 "page_cache": "bypassed" if body["class"]["cache"] == "direct"
                                 or self.info.get("page_cache") == "never" else "used"}
        return {"ok": True, **body}

    def _passthrough(self) -> dict[str, Any] | None:
        """The filesystem's ``passthrough`` status entry, if it reports one."""
        for source in self.info_sources:
            entry = source().get("passthrough")
            if entry is not None:
                return dict(entry)
        return None

    def _unavailable(self, cmd: str) -> dict[str, Any] | None:
        if self.has_policy:
            return None
        self.changes[(cmd, "rejected")] += 1
        return error_reply("this mount has no policy (mounted with --no-qos); remount with a "
                           "policy to change limits", "unavailable")

    def set(self, request: SetRequest, who: str) -> dict[str, Any]:
        """Apply ``ctl set``: one class/tenant/backend's settings, validated whole."""
        refused = self._unavailable("set")
        if refused is not None:
            return refused
        running = self.engine.policy
        assert running is not None  # _unavailable() said so
        changes = dict(request.changes)
        what = request.target if request.name is None else f"{request.target} {request.name}"
        try:
            policy = with_changes(running, request.target, request.name,
                                  changes)  # type: ignore[arg-type]
        except PolicyError as exc:
            self.changes[("set", "rejected")] += 1
            log.info("ctl set by %s rejected, policy unchanged: %s", who, exc)
            return error_reply(str(exc), "policy")
        shown = " ".join(f"{k}={v}" for k, v in changes.items())
        log.info("ctl set by %s: %s %s", who, what, shown)
        return self._swap(policy, "set")

    async def reload(self, request: ReloadRequest, who: str) -> dict[str, Any]:
        """Replace the whole policy: the text sent, or the mount's own file re-read."""
        with self.reloading():
            return await self._reload(request, who)

    async def _reload(self, request: ReloadRequest, who: str) -> dict[str, Any]:
        own = self._is_own(request)
        refused = self._unavailable("reload")
        if refused is not None:
            if own:
                self._failed(who, refused["error"])
            return refused
        try:
            if request.text is not None:
                policy = parse_policy(request.text, request.source or "<ctl reload>")
            elif self.policy_path is not None:
                policy = await trio.to_thread.run_sync(load_policy, self.policy_path)
            else:
                policy = default_policy()
        except PolicyError as exc:
            self.changes[("reload", "rejected")] += 1
            if own:
                self._failed(who, str(exc), exc)
            log.info("reload by %s rejected, policy unchanged: %s", who, exc)
            return error_reply(str(exc), "policy")
        log.info("reload by %s from %s", who, policy.source)
        reply, error = self._swap_reporting(policy, "reload")
        if own:
            if reply["ok"]:
                self.reload_failure = None
            else:
                self._failed(who, reply["error"], error)
        return reply

    def _is_own(self, request: ReloadRequest) -> bool:
        """Whether *request* reloads the mount's own policy (see the module doc)."""
        if request.text is None:
            return True
        return (self._own_path is not None and request.source is not None
                and os.path.abspath(request.source) == self._own_path)

    def _failed(self, who: str, message: str, exc: PolicyError | None = None) -> None:
        source = self.policy_path if self.policy_path is not None else "<default policy>"
        self.reload_failure = {
            "time": time.time(), "by": who,
            "source": exc.source if exc is not None else source,
            "line": exc.line if exc is not None else None,
            "key": exc.key if exc is not None else None,
            "reason": exc.reason if exc is not None else message, "error": message}

    def _swap(self, policy: Policy, cmd: str) -> dict[str, Any]:
        return self._swap_reporting(policy, cmd)[0]

    def _swap_reporting(self, policy: Policy, cmd: str
                        ) -> tuple[dict[str, Any], PolicyError | None]:
        """Swap *policy* in; the reply, and the PolicyError that refused it if one did."""
        engine = self.engine
        try:
            engine.swap(policy)
        except PolicyError as exc:  # valid alone, but not a change this mount can make
            self.changes[(cmd, "rejected")] += 1
            log.info("%s rejected, policy unchanged: %s", cmd, exc)
            return error_reply(str(exc), "policy"), exc
        except Exception:  # a bug: the daemon must survive it and say so
            log.exception("applying the policy failed")
            self.changes[(cmd, "rejected")] += 1
            return error_reply("internal error while applying the policy (see the daemon's "
                               "log)", "internal"), None
        self.changes[(cmd, "applied")] += 1
        for hook in self.on_swap:
            try:
                hook(policy)
            except Exception:
                log.exception("post-swap hook %r failed", hook)
        return {"ok": True, "generation": engine.generation,
                "policy_source": policy.source}, None

