"""A mount's daemon assembled: everything that serves one mount, built from its
configuration before the session starts, and the services wired to it.

:func:`build_daemon` builds the :class:`Daemon` on the source's open root (the same for
every path of a mount: :mod:`qosfs.daemon.start`): the QoS engine (and the cluster
coordinator of a policy with a ``[cluster]`` table), the file system's operations, the
latency controller and the crash guard; it also changes the process (its descriptor
limit, root's resource privileges, the umask). :func:`bind_services` binds the control
socket, the metrics listener (bound once per mount: a busy path or port is a clear
error, not a half-started daemon) and the handover socket, and wires the control service
and the daemon's own services to them, for :mod:`qosfs.daemon.serve` to run on the trio
loop beside the file system.
"""

from __future__ import annotations

import functools
import logging
import os
import resource
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import pyfuse3
import trio

from qosfs.control.service import ControlService
from qosfs.core.errors import QosfsError
from qosfs.core.failures import Failures
from qosfs.daemon.config import MountConfig, control_socket_path
from qosfs.daemon.fs_assembly import build_filesystem
from qosfs.daemon.notify import notify, reloading
from qosfs.daemon.pointer import pointer_path
from qosfs.daemon.privileges import shed_resource_privileges
from qosfs.daemon.supervise import Service
from qosfs.daemon.takeover.crash_guard import CrashGuard
from qosfs.daemon.takeover.listeners import Listeners
from qosfs.daemon.takeover.offer import FAILURES, HandoverOffer, daemon_version
from qosfs.passthrough import interrupts
from qosfs.passthrough.backing_io import IoMode, backing_mount, choose_io_mode
from qosfs.passthrough.filesystem import Filesystem
from qosfs.passthrough.kernel import stack_depth
from qosfs.passthrough.read_counting import KernelReadCounting
from qosfs.policy.model import ClassRule, Policy, PolicyError, passthrough_blocker
from qosfs.qos.cluster import ClusterCoordinator
from qosfs.qos.engine import PolicyQos
from qosfs.qos.interface import PassThroughQos, QosEngine
from qosfs.qos.latency.loop import LatencyLoop
from qosfs.qos.latency.probe import LatencyProbe
from qosfs.qos.store import local_level

log = logging.getLogger(__name__)


@dataclass
class Daemon:
    """What serves one mount, built before the session starts (`build_daemon`): the
    first process of a mount builds it in :func:`qosfs.daemon.start.run_mount`, a
    successor in :func:`qosfs.daemon.takeover.upgrade.adopt_mount` from what its
    predecessor sent, and a daemon restarted after a crash in
    :func:`qosfs.daemon.takeover.recover.recover_mount`."""

    cfg: MountConfig
    mountpoint: str  # resolved: never resolved again once served
    root_fd: int
    engine: QosEngine
    policy_engine: PolicyQos | None
    fs: Filesystem  # pyfuse3 serves fs.ops
    latency: LatencyLoop | None
    cluster: ClusterCoordinator | None
    failures: Failures
    backing_options: frozenset[str]
    handovers: int = 0  # how many times the mount changed process before this one
    # Handovers that failed, by how (qosfs.daemon.takeover.offer.FAILURES), over the
    # mount's processes: carried to a successor, so a failure stays counted after a retry.
    handover_failures: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(FAILURES, 0))
    # time.monotonic() when the predecessor stopped reading, while this process has not
    # started to (an adopted session); None otherwise.
    adopted_at: float | None = None
    # Bucket balances to put in force when the event loop starts (QosEngine.
    # export_balances): a predecessor's, or this process's previous loop's.
    balances: list[list[Any]] | None = None
    # The latency controller's state to go on from (LatencyLoop.export_state), likewise.
    latency_state: dict[str, Any] | None = None
    # A policy to swap in when the loop starts (a swap needs the loop): one changed by
    # ctl set while a successor prepared, or the one qosfs mount --policy named.
    policy_to_apply: Policy | None = None
    # The control socket and metrics listener: bound by the first process of the mount,
    # inherited by a successor (qosfs.daemon.takeover.listeners); None until then.
    listeners: Listeners | None = None
    # The journal and keeper that let a restarted daemon take over after a crash.
    guard: CrashGuard | None = None
    # What was rebuilt from a dead predecessor's journal (ctl status), if anything.
    recovered: dict[str, Any] | None = None

    @property
    def fuse_options(self) -> set[str]:
        return _fuse_options(self.cfg, self.backing_options)

    @property
    def config(self) -> MountConfig:
        return self.cfg

    def restore_carried(self) -> None:
        """Inside the event loop, before any request is read: put the policy a
        successor was given in force (`policy_to_apply`), then the carried latency
        controller's state and bucket balances (trio's clock differs per run,
        so they travel on ``time.monotonic()``), so that a protected reader stays
        protected and a cap goes on from where it stood. The automatic caps come first:
        a bucket they limit takes a balance only once it is limited."""
        policy, self.policy_to_apply = self.policy_to_apply, None
        if policy is not None and self.policy_engine is not None:
            try:  # checked before the session was adopted: not refused here
                self.policy_engine.swap(policy)
            except PolicyError as exc:
                log.error("serving on with the policy that travelled: %s", exc)
        to_trio = trio.current_time() - time.monotonic()
        if self.latency_state is not None and self.latency is not None:
            capped = self.latency.import_state(self.latency_state, to_trio)
            log.info("latency control carried over (%d classes capped automatically)",
                     capped)
        self.latency_state = None
        if self.balances is None:
            return
        taken = self.engine.import_balances(self.balances, to_trio)
        self.balances = None
        log.info("%d bucket balances carried over", taken)


def build_daemon(cfg: MountConfig, policy: Policy | None, root_fd: int,
                 mountpoint: str) -> Daemon:
    """Everything that serves the mount, built on the source's open root *root_fd* with
    *policy* (None: --no-qos), before any session: the engine, the operations, the
    latency controller. Changes the process: its descriptor limit, privileges, umask."""
    fstype, backing_options = backing_mount(root_fd)
    if cfg.io_mode == "auto":
        mode = choose_io_mode(fstype)
        log.info("backing filesystem %s: I/O mode %s", fstype or "unknown", mode.value)
    else:
        mode = IoMode(cfg.io_mode)
    _raise_fd_limit()
    # Last thing that could want CAP_SYS_RESOURCE: from here on root's resource
    # privileges (quota limits, ext4's reserve) are not lent to users' writes.
    write_as_caller = os.geteuid() == 0 and shed_resource_privileges(root_fd)
    # The kernel applied the caller's umask already; ours must not mask again.
    os.umask(0)
    # Cluster-scoped levels are built by the coordinator, which renews their grants with
    # the [cluster] Redis; the mount is a node named by host and mountpoint.
    cluster = None
    if policy is not None and policy.cluster is not None:
        node = f"{socket.gethostname()}:{mountpoint}"
        cluster = ClusterCoordinator(policy.cluster, node)
    # The one place that knows which engine it built: everything after it holds a
    # QosEngine, except the latency controller, which only a policy has use for. Parked
    # requests of killed callers are answered at once (qosfs.passthrough.interrupts).
    policy_engine = (PolicyQos(policy, level_factory=cluster or local_level,
                               callers=interrupts.WATCH) if policy is not None else None)
    engine: QosEngine = policy_engine if policy_engine is not None else PassThroughQos()
    if policy is not None:
        interrupts.install()
    # Unexpected failures of handlers and services, answered and counted, not fatal.
    failures = Failures()
    fs = build_filesystem(root_fd, mode, engine, cfg.fs_options, write_as_caller, failures)
    # Kernel passthrough is negotiated at INIT, once per mount: asked for only if the
    # policy in force now wants it (a later policy cannot add it; ctl status says so).
    _request_passthrough(cfg, fs, engine, fstype, mountpoint)
    latency = (LatencyLoop(policy_engine, LatencyProbe(mountpoint, policy_engine.probe_tids),
                           reads_bypass=_reads_bypass(fs, policy_engine),
                           backing_file=fs.kernel_opens.recent_file)
               if policy_engine is not None else None)
    guard = CrashGuard(cfg.keeper, control_socket_path(cfg, mountpoint), cfg.recover_within)
    return Daemon(cfg, mountpoint, root_fd, engine, policy_engine, fs, latency, cluster,
                  failures, backing_options, guard=guard)


def _raise_fd_limit() -> None:
    """Every inode the kernel knows holds a descriptor: allow as many as the system does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _fuse_options(cfg: MountConfig, backing_options: frozenset[str]) -> set[str]:
    opts = set(pyfuse3.default_options)  # default_permissions: the kernel checks modes
    opts.add(f"fsname={os.path.abspath(cfg.source)}")
    opts.add("subtype=qosfs")
    if os.geteuid() == 0:
        opts.add("allow_other")  # a shared filesystem: every user sees it, as underneath
        # FUSE mounts default to nosuid,nodev; mirror the backing mount instead, so setuid
        # programs and device nodes behave exactly as they do underneath.
        opts.add("nosuid" if "nosuid" in backing_options else "suid")
        opts.add("nodev" if "nodev" in backing_options else "dev")
    if "noexec" in backing_options:
        opts.add("noexec")
    opts.update(o for o in cfg.fuse_options if o)
    return opts


def _reads_bypass(fs: Filesystem,
                  engine: PolicyQos) -> Callable[[ClassRule], bool]:
    """Whether a class's reads bypass the daemon on this mount: kernel passthrough is
    active and nothing in the policy keeps the class's read-only opens in the daemon. The
    latency controller then judges the class by its canary and sees it active by its
    opens and metadata (qosfs.qos.latency.loop)."""

    def bypass(rule: ClassRule) -> bool:
        return fs.kernel_opens.active() and passthrough_blocker(engine.policy, rule) is None

    return bypass


def _request_passthrough(cfg: MountConfig, fs: Filesystem, engine: QosEngine,
                         fstype: str | None, mountpoint: str) -> None:
    """Ask for kernel passthrough at INIT unless every class of the policy turns it off
    (by default every class passes the reads no level caps through), for backing files
    as deep as the source's filesystem stacks them (qosfs.passthrough.kernel), and count
    the reads passed through *mountpoint* (qosfs.passthrough.read_counting)."""
    policy = engine.policy
    if not cfg.kernel_passthrough:
        fs.kernel_opens.off("turned off (--no-passthrough)")
    elif policy is None:
        fs.kernel_opens.off("no policy (--no-qos)")
    elif all(c.passthrough == "off" for c in policy.classes):
        fs.kernel_opens.off('every class of the policy at mount sets passthrough = "off" '
                             "(it is negotiated with the kernel at mount: a later policy "
                             "needs a remount to use it)")
    else:
        fs.kernel_opens.request(fs.ops, stack_depth(fstype))
        if fs.kernel_opens.on and not cfg.read_counting:
            fs.kernel_opens.counting = KernelReadCounting(None, "turned off (--no-read-counting)")
        elif fs.kernel_opens.on:
            # This process is the daemon (after the fork): the programs skip its reads.
            fs.kernel_opens.counting = KernelReadCounting.start(os.getpid(), mountpoint)


def bind_services(daemon: Daemon,
              stack: ExitStack) -> tuple[list[tuple[str, Service]], HandoverOffer | None]:
    """Bind the control socket and the metrics port (unless this process has them
    already: a first loop's, or a predecessor's) and the handover socket."""
    if daemon.listeners is None:
        policy = daemon.engine.policy
        control = control_socket_path(daemon.cfg, daemon.mountpoint)
        daemon.listeners = Listeners.bind(
            control, policy.control.admin_gid if policy is not None else None,
            daemon.cfg.metrics, pointer_path(daemon.mountpoint, control))
    services = open_services(daemon)
    offer = HandoverOffer.open(daemon, control_socket_path(daemon.cfg, daemon.mountpoint),
                               stack)
    if offer is not None:
        services.append(("handover", offer.serve))
    return services, offer


def bind_services_after_adoption(
        daemon: Daemon,
        stack: ExitStack) -> tuple[list[tuple[str, Service]], HandoverOffer | None]:
    """`bind_services` for a process that serves already: without the ones that cannot be
    bound (said in the log; the mount is what must not stop)."""
    try:
        return bind_services(daemon, stack)
    except QosfsError as exc:
        log.error("serving %s without its control socket and metrics: %s",
                  daemon.mountpoint, exc)
        return [], None


def open_services(daemon: Daemon) -> list[tuple[str, Service]]:
    """The services of the control socket and metrics port (``daemon.listeners``, bound)
    and the daemon's own."""
    assert daemon.listeners is not None
    counting = daemon.fs.kernel_opens.counting
    services = _open_services(daemon.cfg, daemon.mountpoint, daemon.engine,
                              daemon.listeners, daemon.latency, daemon.fs.resources,
                              daemon.cluster, _daemon_info(daemon),
                              counting.add_counts if counting.on else None)
    if counting.on:
        services.append(("read_counting", counting.run))
    if daemon.fs.kernel_opens.on:
        services.append(("idle_backing_ids", daemon.fs.kernel_opens.run))
    services.append(("forgets", daemon.fs.ops.forgets.run))
    return services


def _daemon_info(daemon: Daemon) -> Callable[[], dict[str, Any]]:
    """Which process and code serve the mount, for ``ctl status``."""
    version = daemon_version()

    def info() -> dict[str, Any]:
        found: dict[str, Any] = {"version": version, "handovers": daemon.handovers,
                                 "handover_failures": dict(daemon.handover_failures)}
        if daemon.guard is not None:
            found["crash_protection"] = daemon.guard.status()
        if daemon.recovered is not None:
            found["recovered"] = daemon.recovered
        return found

    return info


def _open_services(cfg: MountConfig, mountpoint: str, engine: QosEngine,
                   listeners: Listeners,
                   latency: LatencyLoop | None = None,
                   resources: Callable[[], dict[str, Any]] | None = None,
                   cluster: ClusterCoordinator | None = None,
                   identity: Callable[[], dict[str, Any]] | None = None,
                   fold_counts: Callable[[], None] | None = None,
                   ) -> list[tuple[str, Service]]:
    """The control service on the bound *listeners*, and the daemon's own services;
    *fold_counts* runs before every snapshot (``ctl stats``, ``/metrics``, the rate
    sampler), so what they show includes the kernel's reads up to that moment."""
    source = os.path.abspath(cfg.source)
    control = listeners.control
    path = control.path
    controller = ControlService(engine, cfg.policy_path,
                                {"source": source, "mountpoint": mountpoint, "socket": path,
                                 "page_cache": cfg.fs_options.cache},
                                latency=latency, cluster=cluster)
    controller.on_swap.append(lambda p: control.set_admin_group(p.control.admin_gid))
    controller.reloading = functools.partial(_notify_reloading, controller)
    if resources is not None:
        controller.info_sources.append(resources)
    if identity is not None:
        controller.info_sources.append(identity)
    if fold_counts is not None:
        controller.before_snapshot.append(fold_counts)
    # Named as ctl status counts their failures (qosfs.daemon.supervise).
    services: list[tuple[str, Service]] = [
        ("control", controller.run),
        ("control_socket", functools.partial(control.serve, controller.handle))]
    if latency is not None:
        services.append(("latency_control", latency.run))
    if cluster is not None:
        services.append(("cluster", cluster.run))
        log.info("cluster levels renew every %gs with %s as %s", cluster.config.lease,
                 cluster.config.redis, cluster.node)
    log.info("control socket %s", path)
    metrics = listeners.metrics
    if metrics is not None:
        services.append(("metrics", functools.partial(metrics.serve, controller.snapshot)))
        log.info("serving metrics on http://%s:%d/metrics", metrics.host, metrics.port)
    return services


@contextmanager
def _notify_reloading(controller: ControlService) -> Iterator[None]:
    """RELOADING=1 ... READY=1 around a policy reload (SIGHUP, ``ctl reload``), accepted
    or not: either way the daemon serves again afterwards. With READY=1 goes a STATUS=
    line, which ``systemctl status`` shows: why the last reload of the mount's policy
    was refused, until one is applied (a ``kill -HUP`` has no caller to tell)."""
    notify(reloading())
    try:
        yield
    finally:
        notify(f"READY=1\nSTATUS={controller.status_line()}")
