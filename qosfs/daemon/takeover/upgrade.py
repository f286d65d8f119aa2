"""Planned handover of a live mount to a new daemon process: ``qosfs upgrade MOUNTPOINT``.

A training job must not notice that the daemon serving its mount was replaced (issue
31): its open descriptors, node ids and caps carry on. The native piece
(:mod:`qosfs.daemon.takeover.fuse_session`) lets a process serve a connection another one
initialised; this module is the successor's side of the daemon's protocol over it, and
:mod:`qosfs.daemon.takeover.offer` the serving daemon's, on a Unix socket next to the
control socket (``/run/qosfs/NAME.handover`` for ``/run/qosfs/NAME.sock``):

1. hello: the successor says ``adopt`` with the handover protocols it speaks and its
   version; the old daemon refuses one that does not speak its protocol (and keeps
   serving). This build's daemon hands over in protocol 2; its successor takes a mount
   over in 1 too, from the build before (:data:`qosfs.daemon.takeover.offer.PROTOCOLS`);
2. prepare, while the old daemon serves on: it sends the FUSE descriptor, the source's
   root descriptor and the listening control socket and metrics listener (SCM_RIGHTS,
   :mod:`qosfs.daemon.takeover.listeners`), the state negotiated at INIT, the mount's
   configuration and the policy in force (text and source; ``ctl set`` changes
   included). The successor builds everything that serves the mount from them and
   answers ``ready``, or ``refuse`` with a reason: the old daemon then serves on as if
   nothing happened;
3. commit: the old daemon stops accepting on the listeners (it answers the control
   requests and scrapes it holds; new connections wait in the backlog for the
   successor), stops reading /dev/fuse (the latency canary stopped first,
   ``pyfuse3.terminate``: requests already read are answered, parked ones within their
   waits, under their caps), and sends its tables (:mod:`qosfs.passthrough.transfer`;
   descriptors in batches of at most 253) and the policy again. The successor takes
   them over, adopts the session, answers ``serving`` and serves the listeners too;
   the old daemon closes its own copies (the control socket's path stays) and exits 0,
   leaving the mount in place.

If the successor fails between ``ready`` and ``serving`` (it died, said something else,
or hangs past :func:`qosfs.daemon.takeover.offer.commit_timeout`), nothing it did can have been
seen by the kernel but requests it never read: the old daemon kills it, adopts its own
session again with the tables it never changed, and serves on
(:meth:`qosfs.daemon.takeover.offer.HandoverOffer.take_back`). Failed handovers are counted
(``qosfs_handovers_total{result}``), and the counts travel with the mount.

The buckets' balances travel too (debt included, on ``time.monotonic()``), so a cap goes
on from where it stood instead of from a full burst, and so does the latency
controller's state (its automatic caps and where each started, relative targets'
baselines, the protected classes' activity), put in force before the successor reads a
request: a protected reader stays protected. What starts fresh in the successor:

- the backend's dispatch tags: they order only requests parked at the backend, and none
  is parked across a handover (the old daemon answers them first); a class that had
  just had more than its share starts level with the others;
- this mount's cluster grants: to Redis the successor is the same node (host and
  mountpoint), so the cluster's sums carry on; it renews within one lease (100 ms by
  default) and until then enforces what a new mount does (the cap divided by
  ``[cluster] fallback`` nodes, or the whole cap);
- the control socket's open connections (closed between requests: a client reconnects);
- the counters of levels (``qosfs_level_throttled_seconds_total``), policy changes,
  internal errors, parking and passthrough registrations: a counter reset, which
  Prometheus' rate() takes as one. The traffic counters per account (bytes, requests,
  throttled time, duration histograms: what dashboards and rates are built on) and
  the handover counts do travel.

``ctl status`` says which process and version serve and how many handovers the mount
has had.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import stat
from collections.abc import Callable
from typing import Any

from qosfs.core.errors import EXIT_DAEMON, EXIT_MOUNTPOINT, QosfsError
from qosfs.core.mountinfo import lies_within
from qosfs.daemon.assembly import Daemon, build_daemon
from qosfs.daemon.config import MountConfig, control_socket_path
from qosfs.daemon.pointer import mount_socket_path, pointer_path
from qosfs.daemon.serve import serve_mount
from qosfs.daemon.takeover import fuse_session
from qosfs.daemon.takeover.listeners import Listeners
from qosfs.daemon.takeover.offer import (
    FAILURES,
    PROTOCOLS,
    adopt_hello,
    handover_socket_path,
)
from qosfs.passthrough.operations import FsOptions
from qosfs.passthrough.transfer import import_state
from qosfs.policy.loading import load_policy, parse_policy
from qosfs.policy.model import Policy, PolicyError

log = logging.getLogger(__name__)


def config_from_payload(raw: dict[str, Any], foreground: bool) -> MountConfig:
    """The predecessor's MountConfig (:func:`qosfs.daemon.takeover.offer.config_payload`);
    HandoverError if it lacks a field this version needs, or has one it does not know."""
    try:
        fields = dict(raw)
        fields["fs_options"] = FsOptions(**fields["fs_options"])
        fields["fuse_options"] = tuple(fields["fuse_options"])
        fields["foreground"] = foreground
        return MountConfig(**fields)
    except (KeyError, TypeError) as exc:
        raise fuse_session.HandoverError(f"the mount's configuration is not this version's: "
                                     f"{exc}") from None


def adopt_mount(mountpoint: str, socket_path: str | None, foreground: bool,
                on_ready: Callable[[], None] | None = None,
                requested: MountConfig | None = None) -> int:
    """Take the live mount at *mountpoint* over from the daemon serving it and serve it
    until unmounted, signalled or handed over again. QosfsError, with the old daemon
    serving on, if anything fails before commit.

    *requested*: what a ``qosfs mount`` on the live mount asked for (None: ``qosfs
    upgrade``). Its source must be the mount's. Its policy file, if it names one,
    replaces the policy in force, as a ``ctl reload`` of that file would; a policy this
    mount cannot take live is refused before the old daemon stops reading. Without one,
    the policy in force carries on (a mount command without ``--policy`` does not mean
    "fall back to the default policy"). Every other option is the running mount's:
    they were negotiated with the kernel or built into the mount (a difference is logged
    as a warning).
    """
    top = os.path.realpath(mountpoint)
    close_inherited(top)
    # Without --socket: where the mount's pointer leads (a mount made with --socket
    # PATH), else the path derived from the mountpoint.
    control = socket_path or mount_socket_path(top)
    path = handover_socket_path(os.path.abspath(control))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.connect(path)
    except OSError as exc:
        sock.close()
        if requested is not None:  # qosfs mount: say first what the mountpoint is
            raise QosfsError(f"{mountpoint} is already mounted by qosfs, and its daemon "
                             f"offers no handover at {path} ({exc.strerror})",
                             EXIT_MOUNTPOINT) from None
        raise QosfsError(f"no qosfs daemon offers {mountpoint} for handover at {path}: "
                         f"{exc.strerror}", EXIT_MOUNTPOINT) from None
    with sock:
        daemon, session, protocol = _prepare(sock, foreground, requested)
        chosen = requested is not None and requested.policy_path is not None
        return serve_mount(daemon, lambda: _commit(sock, daemon, session, protocol, chosen),
                           on_ready, adopting=True)


def close_inherited(top: str) -> None:
    """Close what this process inherited open under the mount at *top* (a shell that
    runs ``qosfs upgrade`` with a file of the mount open, a job's wrapper): the daemon
    would hold its own mount open, which keeps ``fusermount3 -u`` from unmounting it and
    makes it the server of its own FLUSH at exit. Standard input, output and error stay:
    they are where a --foreground daemon logs. Nothing under the mount is asked: the
    descriptors' paths are read from /proc."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd < 3:
            continue
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own descriptor, closed already
        if lies_within(target, top):
            os.close(fd)


def _prepare(sock: socket.socket, foreground: bool,
             requested: MountConfig | None = None,
             ) -> tuple[Daemon, fuse_session.Session, int]:
    """Phase 1: receive the session and the configuration, build what serves the mount,
    answer ready (or refuse, leaving the old daemon serving). Returns the protocol the
    old daemon hands over in, too."""
    fuse_session.send_message(sock, "adopt", adopt_hello())
    try:
        prepare = fuse_session.receive_message(sock)
    except fuse_session.HandoverError as exc:
        raise QosfsError(f"handover refused: {exc}", EXIT_DAEMON) from None
    if prepare.kind != "prepare":
        raise QosfsError(f"handover refused: {prepare.payload.get('reason', prepare.kind)}",
                         EXIT_DAEMON)
    try:
        p = prepare.payload
        listening = dict(p.get("listeners", {}))  # absent from a predecessor without them
        if len(prepare.fds) != 2 + len(listening):
            raise fuse_session.HandoverError(f"expected {2 + len(listening)} descriptors, got "
                                         f"{len(prepare.fds)}")
        fuse_fd, root_fd = prepare.fds[:2]
        protocol = p.get("protocol")
        if protocol not in PROTOCOLS:
            raise fuse_session.HandoverError(f"handover protocol {protocol} is not "
                                             f"one of this version's {list(PROTOCOLS)}")
        session = fuse_session.Session(fuse_fd, fuse_session.check_state(p["state"]))
        fuse_session.check_fuse_fd(fuse_fd)
        if not stat.S_ISDIR(os.fstat(root_fd).st_mode):
            raise fuse_session.HandoverError("the source's descriptor is not a directory")
        cfg = config_from_payload(p["config"], foreground)
        if requested is not None:
            _check_requested(requested, cfg)
        policy = _policy(p["policy"])
        daemon = build_daemon(cfg, policy, root_fd, str(p["mountpoint"]))
        if requested is not None and requested.policy_path is not None:
            _put_chosen_policy(daemon, requested.policy_path)
        daemon.handovers = int(p["handovers"]) + 1
        failed = p.get("handover_failures", {})  # absent from a predecessor that had none
        daemon.handover_failures = {k: int(failed.get(k, 0)) for k in FAILURES}
        if listening:  # served from this process's first loop: never a refused connection
            control = control_socket_path(cfg, daemon.mountpoint)
            daemon.listeners = Listeners.inherit(
                control, policy.control.admin_gid if policy is not None else None,
                cfg.metrics, prepare.fds[int(listening["control"])],
                prepare.fds[int(listening["metrics"])] if "metrics" in listening else None,
                pointer_path(daemon.mountpoint, control))
    except (fuse_session.HandoverError, PolicyError, OSError, KeyError, ValueError) as exc:
        for fd in prepare.fds:
            os.close(fd)
        fuse_session.send_message(sock, "refuse", {"reason": str(exc)})
        raise QosfsError(f"handover refused here: {exc}", EXIT_DAEMON) from None
    log.info("taking %s over from pid %s (qosfs %s, handover protocol %s, %d handovers "
             "before)", daemon.mountpoint, p.get("pid"), p.get("version"), protocol,
             daemon.handovers - 1)
    fuse_session.send_message(sock, "ready", {})
    return daemon, session, int(protocol)


def _check_requested(requested: MountConfig, running: MountConfig) -> None:
    """HandoverError if ``qosfs mount`` named another source than the mount's; a warning
    for each other option that differs from the running mount's (which stays)."""
    if os.path.realpath(requested.source) != os.path.realpath(running.source):
        raise fuse_session.HandoverError(
            f"{requested.mountpoint} is a mount of {running.source}, not of "
            f"{requested.source}: unmount it first to mount another source there")
    kept = ("source", "mountpoint", "foreground", "policy_path")
    for option in dataclasses.fields(MountConfig):
        asked, has = getattr(requested, option.name), getattr(running, option.name)
        if option.name not in kept and asked != has:
            log.warning("%s: %s=%r differs from the running mount's %r, which stays "
                        "(unmount and mount to change it)", requested.mountpoint,
                        option.name, asked, has)


def _put_chosen_policy(daemon: Daemon, path: str) -> None:
    """Put the policy file ``qosfs mount --policy`` named in force on the idle successor,
    in place of the one that travelled, and make it the mount's own (SIGHUP and ``ctl
    reload`` re-read it). PolicyError if the file is invalid or the mount cannot take
    it live (the old daemon then serves on with the policy it has)."""
    if daemon.policy_engine is None:
        raise fuse_session.HandoverError("the mount runs without QoS (--no-qos): a policy "
                                     "needs a new mount")
    policy = load_policy(path)
    daemon.policy_engine.check_swap(policy)
    daemon.policy_to_apply = policy  # swapped in as the loop starts, before any request
    daemon.cfg = dataclasses.replace(daemon.cfg, policy_path=os.path.abspath(path))
    log.info("policy %s to be in force in place of the running mount's", policy.source)


def _policy(raw: dict[str, Any] | None) -> Policy | None:
    return None if raw is None else parse_policy(str(raw["text"]), str(raw["source"]))


def _commit(sock: socket.socket, daemon: Daemon, session: fuse_session.Session,
            protocol: int, chosen_policy: bool = False) -> None:
    """Phase 2 (serve_mount's start): the tables and descriptors come (written in
    *protocol*), the session is adopted, and the old daemon is told so. *chosen_policy*:
    ``qosfs mount --policy`` put another policy in force, which the old daemon's does
    not replace."""
    fds: list[int] = []
    while True:
        message = fuse_session.receive_message(sock)
        fds.extend(message.fds)
        if message.kind == "commit":
            break
        if message.kind != "fds":
            raise QosfsError(f"handover failed: the old daemon sent {message.kind}",
                             EXIT_DAEMON)
    payload = message.payload
    if len(fds) != payload["fd_count"]:
        raise QosfsError(f"handover failed: {len(fds)} descriptors of "
                         f"{payload['fd_count']}", EXIT_DAEMON)
    import_state(daemon.fs, payload["filesystem"], fds, protocol)
    # The traffic counters go on (absent from older daemons): no reset in /metrics.
    daemon.engine.accounts.import_totals(payload.get("accounts", []))
    if daemon.guard is not None:
        daemon.guard.attach(daemon, session.state)  # this process's journal from now on
    policy = _policy(payload["policy"])
    if policy is not None and daemon.engine.policy is not None and not chosen_policy \
            and policy.render() != daemon.engine.policy.render():
        daemon.policy_to_apply = policy  # changed (ctl set) while we prepared
    fuse_session.adopt(daemon.fs.ops, session, daemon.mountpoint, daemon.fuse_options)
    chosen = daemon.policy_to_apply
    if chosen_policy and daemon.listeners is not None and chosen is not None:
        daemon.listeners.control.set_admin_group(chosen.control.admin_gid)
    daemon.adopted_at = float(payload["stopped_at"])  # CLOCK_MONOTONIC: one per system
    daemon.balances = list(payload["balances"])  # put in force when the loop starts
    daemon.latency_state = payload.get("latency")  # likewise (absent from older daemons)
    fuse_session.send_message(sock, "serving", {})
    sock.close()  # the predecessor exits now
