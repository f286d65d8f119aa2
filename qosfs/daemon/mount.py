"""Mount lifecycle: checks, daemonizing, the trio main loop, signals and clean unmount.

Order matters and is deliberate:

1. every check that can fail with a clear message runs before anything is mounted;
2. the source directory is opened *before* mounting, so mounting in place over it works
   (all later access goes through that descriptor);
3. without ``--foreground`` the process forks; the parent waits on a pipe and exits 0 only
   once the child's mount answers a ``stat`` (or prints the child's one-line error);
4. the child runs pyfuse3 under trio; SIGTERM/SIGINT call ``pyfuse3.terminate()``, which
   lets in-flight requests finish before ``main()`` returns, then the mount is removed.

Under systemd (``Type=notify``, :mod:`qosfs.daemon.notify`) the daemon reports ``READY=1`` where
step 3 reports to the parent, ``STOPPING=1`` as step 4 begins, and ``RELOADING=1`` ...
``READY=1`` around every policy reload.

The control socket and the metrics listener are bound in step 1 (a busy path or port is
a clear error, not a half-started daemon) and served from the same trio loop as the
filesystem (:mod:`qosfs.control.server`, :mod:`qosfs.control.exporter`); SIGHUP reloads the policy.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import pyfuse3
import trio

from qosfs.control.address import default_socket_path
from qosfs.control.service import ControlService
from qosfs.core.errors import (
    EXIT_FUSE,
    EXIT_MOUNTPOINT,
    EXIT_SOURCE,
    EXIT_USAGE,
    QosfsError,
)
from qosfs.core.failures import Failures
from qosfs.core.mountinfo import lies_within, mount_type, resolve_without_touching
from qosfs.daemon import tuning
from qosfs.daemon.crash_guard import CrashGuard
from qosfs.daemon.filesystem import build_filesystem
from qosfs.daemon.listeners import Listeners
from qosfs.daemon.notify import notify, reloading
from qosfs.daemon.offer import FAILURES, HandoverOffer, daemon_version
from qosfs.daemon.pointer import pointer_path
from qosfs.daemon.privileges import shed_resource_privileges
from qosfs.daemon.supervise import Service, supervised
from qosfs.daemon.topology import QOSFS_FSTYPE, check_before_stat, check_topology
from qosfs.passthrough import interrupts
from qosfs.passthrough.backing_io import IoMode, backing_mount, choose_io_mode
from qosfs.passthrough.kernel import stack_depth
from qosfs.passthrough.operations import FsOptions, PassthroughOperations
from qosfs.policy.loading import default_policy, load_policy
from qosfs.policy.model import ClassRule, Policy, PolicyError, passthrough_blocker
from qosfs.qos.cluster import ClusterCoordinator
from qosfs.qos.engine import PolicyQos
from qosfs.qos.interface import PassThroughQos, QosEngine
from qosfs.qos.latency_control import LatencyLoop
from qosfs.qos.latency_probe import LatencyProbe
from qosfs.qos.levels import local_level

log = logging.getLogger(__name__)

# pyfuse3 gives every request its own task, up to max_tasks, and stops reading
# /dev/fuse when they are all busy. A request parked by QoS holds a task, so the limit
# must exceed what may be parked at once (qosfs.qos.bounds bounds it at 3,072 in all) by a
# reserve for requests that need no tokens; trio tasks are cheap, so be generous.
MAX_TASKS = 4096
MIN_TASKS = 4

# SIGTERM: limits are lifted, parked requests are served (waiting at most DRAIN_DEADLINE,
# well below the unit's TimeoutStopSec=60), then requests are served DRAIN_GRACE more so
# that a write split in two requests, and the close after it, finish; then the mount goes.
DRAIN_GRACE = 0.25
DRAIN_DEADLINE = 10.0


@dataclass(frozen=True, slots=True)
class MountConfig:
    """Everything ``qosfs mount`` was asked to do."""

    source: str
    mountpoint: str
    foreground: bool = False
    fuse_options: tuple[str, ...] = ()
    io_mode: str = "auto"
    fs_options: FsOptions = field(default_factory=FsOptions)
    max_background: int = tuning.DEFAULT_MAX_BACKGROUND
    read_ahead_kb: int = tuning.DEFAULT_READ_AHEAD_KB
    policy_path: str | None = None  # None: the embedded default policy
    qos: bool = True  # False: pure pass-through that only counts (benchmark baseline)
    socket_path: str | None = None  # None: derived from the mountpoint under /run/qosfs
    metrics: str | None = None  # "[HOST:]PORT" to serve /metrics; None: no exporter
    allow_stacked: bool = False  # a source in a qosfs mount (qosfs.daemon.topology)
    # False (--no-passthrough): never ask the kernel for passthrough, whatever the policy.
    kernel_passthrough: bool = True
    # Who keeps the FUSE connection across a crash (qosfs.daemon.keeper): "holder",
    # "systemd" (its descriptor store) or "none"; and how long a holder waits for a new
    # daemon before letting the connection end (callers then get ENOTCONN).
    keeper: str = "holder"
    recover_within: float = 30.0


def check_mount_args(source: str, mountpoint: str, allow_stacked: bool = False) -> None:
    """Fail early, with one line, on everything that would make the mount fail later (or
    misbehave: qosfs over qosfs, a mountpoint inside the source; qosfs.daemon.topology)."""
    # A stale mount first: mounting in place after a crash, the source is that same dead
    # mount, and would look missing ("does not exist") until it is cleaned.
    if _statfs_errno(mountpoint) == errno.ENOTCONN:
        clean_stale_mount(mountpoint)
    check_before_stat(source, mountpoint, allow_stacked)  # before stat() reaches into it
    if not os.path.exists(source):
        raise QosfsError(f"source {source} does not exist", EXIT_SOURCE)
    if not os.path.isdir(source):
        raise QosfsError(f"source {source} is not a directory", EXIT_SOURCE)
    try:
        os.stat(mountpoint)
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            clean_stale_mount(mountpoint)
        elif exc.errno == errno.ENOENT:
            raise QosfsError(f"mountpoint {mountpoint} does not exist", EXIT_MOUNTPOINT) from None
        else:
            raise QosfsError(f"mountpoint {mountpoint}: {exc.strerror}", EXIT_MOUNTPOINT) from None
    if not os.path.isdir(mountpoint):
        raise QosfsError(f"mountpoint {mountpoint} is not a directory", EXIT_MOUNTPOINT)
    if mount_type(os.path.realpath(mountpoint)) == QOSFS_FSTYPE:
        raise QosfsError(f"{mountpoint} is already mounted by qosfs", EXIT_MOUNTPOINT)
    check_topology(source, mountpoint, allow_stacked)
    if not os.path.exists("/dev/fuse"):
        raise QosfsError("/dev/fuse is missing (load the fuse module)", EXIT_FUSE)
    if os.geteuid() != 0 and shutil.which("fusermount3") is None:
        raise QosfsError("fusermount3 not found (install the fuse3 package)", EXIT_FUSE)


def serves_qosfs(mountpoint: str) -> bool:
    """Whether a live qosfs daemon serves *mountpoint* (``qosfs mount`` on it hands the
    mount over instead of mounting again, :func:`qosfs.daemon.upgrade.adopt_mount`). A
    dead one (ENOTCONN) is not live: it is cleaned by `check_mount_args`."""
    return (_statfs_errno(mountpoint) == 0
            and mount_type(os.path.realpath(mountpoint)) == QOSFS_FSTYPE)


def check_own_paths(mountpoint: str, paths: dict[str, str | None]) -> None:
    """Refuse daemon files (the control socket, the log file) under the mountpoint.

    The daemon would reach them through its own mount: the log handler stats its file
    for every record and the control socket's path is checked at reload, from the one
    thread that must answer that very request, so the first of them would hang the
    mount for every user. (A socket there would not even be reachable: clients would
    connect to the FUSE inode, not to the bound one.) *paths* maps what each is, as the
    message should name it, to its path or None.
    """
    top = resolve_without_touching(mountpoint)
    for what, path in paths.items():
        if path is None:
            continue
        where = os.path.realpath(path)
        if lies_within(where, top):
            raise QosfsError(f"{what} {path} is under the mountpoint {mountpoint}: the "
                             "daemon would wait on its own mount; put it elsewhere",
                             EXIT_USAGE)


def _statfs_errno(path: str) -> int:
    """statfs, not stat: for up to --attr-timeout after its daemon died, a FUSE mount's
    root attributes still come from the kernel's cache, so stat succeeds (and the dead
    mount would look "already mounted by qosfs"); statfs always asks the daemon."""
    try:
        os.statvfs(path)
    except OSError as exc:
        return exc.errno or 0
    return 0


def clean_stale_mount(mountpoint: str) -> None:
    """Remove a mount whose daemon died ("Transport endpoint is not connected")."""
    log.warning("%s is a stale mount (daemon gone); unmounting it", mountpoint)
    for cmd in (["fusermount3", "-u", "-z", mountpoint], ["umount", "-l", mountpoint]):
        if shutil.which(cmd[0]) and subprocess.run(cmd, capture_output=True).returncode == 0:
            return
    raise QosfsError(f"{mountpoint} is a stale mount and could not be unmounted",
                     EXIT_MOUNTPOINT)


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


@dataclass
class Daemon:
    """What serves one mount, built before the session starts (`build_daemon`): the
    first process of a mount builds it in `run_mount`, a successor in
    :func:`qosfs.daemon.upgrade.adopt_mount` from what its predecessor sent."""

    cfg: MountConfig
    mountpoint: str  # resolved: never resolved again once served
    root_fd: int
    engine: QosEngine
    policy_engine: PolicyQos | None
    ops: PassthroughOperations
    latency: LatencyLoop | None
    cluster: ClusterCoordinator | None
    failures: Failures
    backing_options: frozenset[str]
    handovers: int = 0  # how many times the mount changed process before this one
    # Handovers that failed, by how (qosfs.daemon.offer.FAILURES), over the mount's
    # processes: carried to a successor, so a failure stays counted after a retry.
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
    # inherited by a successor (qosfs.daemon.listeners); None until then.
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


def run_mount(cfg: MountConfig, on_ready: Callable[[], None] | None = None) -> int:
    """Mount and serve until unmounted, signalled or handed over. Returns the exit code."""
    check_mount_args(cfg.source, cfg.mountpoint, cfg.allow_stacked)
    policy = load_policy(cfg.policy_path) if cfg.policy_path else default_policy()
    root_fd = os.open(cfg.source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    daemon = build_daemon(cfg, policy if cfg.qos else None, root_fd,
                          os.path.realpath(cfg.mountpoint))  # resolved before we serve it

    def start() -> None:
        try:
            pyfuse3.init(daemon.ops, daemon.mountpoint, daemon.fuse_options)
        except RuntimeError as exc:
            raise QosfsError(f"mounting {daemon.mountpoint} failed: {exc}", EXIT_FUSE) from None

    return serve_mount(daemon, start, on_ready)


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
    ops = build_filesystem(root_fd, mode, engine, cfg.fs_options, write_as_caller, failures)
    # Kernel passthrough is negotiated at INIT, once per mount: asked for only if the
    # policy in force now wants it (a later policy cannot add it; ctl status says so).
    _request_passthrough(cfg, ops, engine, fstype)
    latency = (LatencyLoop(policy_engine, LatencyProbe(mountpoint, policy_engine.probe_tids),
                           reads_bypass=_reads_bypass(ops, policy_engine),
                           backing_file=ops.kernel_opens.recent_file)
               if policy_engine is not None else None)
    guard = CrashGuard(cfg.keeper, control_socket_path(cfg, mountpoint), cfg.recover_within)
    return Daemon(cfg, mountpoint, root_fd, engine, policy_engine, ops, latency, cluster,
                  failures, backing_options, guard=guard)


def serve_mount(daemon: Daemon, start: Callable[[], None],
                on_ready: Callable[[], None] | None = None, adopting: bool = False) -> int:
    """Serve *daemon*'s mount: bind the services, *start* the session (``pyfuse3.init``),
    serve until unmounted, signalled or handed over to a successor
    (:mod:`qosfs.daemon.upgrade`), then close what the process holds. A successor that
    fails after this process stopped reading gives the session back here
    (`upgrade.HandoverOffer.take_back`), and serving goes on.

    *adopting*: *start* takes the session over from a predecessor. Its control socket
    and metrics listener came with the session (``daemon.listeners``), or, from a
    predecessor that did not pass them, are bound after it: a failure to bind them is
    then logged, not fatal (nobody else serves the mount by then).
    """
    cfg, mountpoint, ops = daemon.cfg, daemon.mountpoint, daemon.ops
    handed_over = False
    # Whether the control socket's path is this process's to remove at the end: not
    # while a successor that failed to start hands it back to its predecessor.
    owns_path = not adopting
    try:
        with ExitStack() as stack:
            guard = daemon.guard
            if adopting:
                start()  # a failure here leaves the mount alone: the predecessor takes it back
                owns_path = True
                services, offer = _services_after_adoption(daemon, stack)
            else:
                services, offer = _services(daemon, stack)
                if guard is not None:
                    guard.attach(daemon)  # before the first request: the journal starts empty
                start()

            def after_init() -> None:
                ops.kernel_opens.log()
                if guard is not None:
                    guard.keep(daemon)  # the keeper's copy: a crash from here on loses nothing

            unmounted_by_us = False
            try:
                while True:
                    # SIGHUP reloads while the control service listens; ignored, not
                    # fatal, in the pause before that service is restarted after a failure.
                    signal.signal(signal.SIGHUP, signal.SIG_IGN)
                    trio.run(_serve, cfg, mountpoint, daemon.engine, on_ready, services,
                             daemon.latency, daemon.failures, after_init,
                             offer.stopping if offer is not None else None,
                             daemon.adopted_at, daemon.restore_carried)
                    daemon.adopted_at = None
                    if offer is None or offer.successor is None:
                        unmounted_by_us = True
                        break
                    stack.close()  # the handover socket: the successor binds its own
                    if offer.commit():
                        handed_over = True
                        break
                    offer.take_back()  # serving again, with the same tables and listeners
                    if guard is not None and guard.state is not None:
                        guard.attach(daemon, guard.state)  # the successor replaced the journal
                    daemon.adopted_at = offer.stopped_at
                    daemon.balances = daemon.engine.export_balances(offer.to_monotonic)
                    if daemon.latency is not None:  # its times were on the last run's clock
                        daemon.latency_state = daemon.latency.export_state(offer.to_monotonic)
                    services, offer = _services_after_adoption(daemon, stack)
                    on_ready = _notify_ready
            finally:
                still_mounted = not handed_over and mount_type(mountpoint) == QOSFS_FSTYPE
                pyfuse3.close(unmount=still_mounted)
                if guard is not None:
                    guard.end(unmounted=not handed_over)
                ops.close_all()
                if handed_over:
                    log.info("%s handed over; this process exits", mountpoint)
                else:
                    log.info("unmounted %s (%s)", mountpoint,
                             "clean" if unmounted_by_us else "after an error")
    finally:
        if daemon.listeners is not None:  # a successor serves them, or nobody will
            if owns_path and not handed_over:
                daemon.listeners.close()
            else:
                daemon.listeners.release()
    return 0


def _services(daemon: Daemon,
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


def _services_after_adoption(
        daemon: Daemon,
        stack: ExitStack) -> tuple[list[tuple[str, Service]], HandoverOffer | None]:
    """`_services` for a process that serves already: without the ones that cannot be
    bound (said in the log; the mount is what must not stop)."""
    try:
        return _services(daemon, stack)
    except QosfsError as exc:
        log.error("serving %s without its control socket and metrics: %s",
                  daemon.mountpoint, exc)
        return [], None


def control_socket_path(cfg: MountConfig, mountpoint: str) -> str:
    """Where the mount's control socket is: --socket, or derived from the mountpoint."""
    return os.path.abspath(cfg.socket_path or default_socket_path(mountpoint))


def _reads_bypass(ops: PassthroughOperations,
                  engine: PolicyQos) -> Callable[[ClassRule], bool]:
    """Whether a class's reads bypass the daemon on this mount: kernel passthrough is
    active and nothing in the policy keeps the class's read-only opens in the daemon. The
    latency controller then judges the class by its canary and sees it active by its
    opens and metadata (qosfs.qos.latency_control)."""

    def bypass(rule: ClassRule) -> bool:
        return (rule.passthrough == "reads" and ops.kernel_opens.active()
                and passthrough_blocker(engine.policy, rule) is None)

    return bypass


def _request_passthrough(cfg: MountConfig, ops: PassthroughOperations, engine: QosEngine,
                         fstype: str | None) -> None:
    """Ask for kernel passthrough at INIT when some class of the policy wants it, for
    backing files as deep as the source's filesystem stacks them (qosfs.passthrough.kernel)."""
    policy = engine.policy
    if not cfg.kernel_passthrough:
        ops.kernel_opens.off("turned off (--no-passthrough)")
    elif policy is None:
        ops.kernel_opens.off("no policy (--no-qos)")
    elif not any(c.passthrough == "reads" for c in policy.classes):
        ops.kernel_opens.off('no class of the policy at mount set passthrough = "reads" '
                             "(it is negotiated with the kernel at mount: a later policy "
                             "needs a remount to use it)")
    else:
        ops.kernel_opens.request(ops, stack_depth(fstype))


def open_services(daemon: Daemon) -> list[tuple[str, Service]]:
    """The services of the control socket and metrics port (``daemon.listeners``, bound)
    and the daemon's own."""
    assert daemon.listeners is not None
    return _open_services(daemon.cfg, daemon.mountpoint, daemon.engine, daemon.listeners,
                          daemon.latency, daemon.ops.resources, daemon.cluster,
                          _daemon_info(daemon))


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
                   ) -> list[tuple[str, Service]]:
    """The control service on the bound *listeners*, and the daemon's own services."""
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


async def _serve(cfg: MountConfig, mountpoint: str, engine: QosEngine,
                 on_ready: Callable[[], None] | None,
                 services: Sequence[tuple[str, Service]] = (),
                 latency: LatencyLoop | None = None, failures: Failures | None = None,
                 after_init: Callable[[], None] | None = None,
                 handing_over: Callable[[], bool] | None = None,
                 adopted_at: float | None = None,
                 before_reading: Callable[[], None] | None = None) -> None:
    """Serve requests and the services until the session ends. *adopted_at*: the session
    was taken over from a process that stopped reading at that ``time.monotonic()``;
    requests wait in the kernel until this one reads, so it reads before the services
    start, and says how long nobody read. *before_reading* runs first, in the loop."""
    failures = failures if failures is not None else Failures()
    async with trio.open_nursery() as nursery:

        async def serve_requests() -> None:
            if adopted_at is not None:
                log.info("adopted %s: %.1f ms without a reader of /dev/fuse", mountpoint,
                         (time.monotonic() - adopted_at) * 1000)
            await pyfuse3.main(min_tasks=MIN_TASKS, max_tasks=MAX_TASKS)
            if handing_over is None or not handing_over():
                _notify_stopping()  # the kernel ended the session (fusermount3 -u)
            nursery.cancel_scope.cancel()

        if before_reading is not None:
            before_reading()
        if adopted_at is not None:
            nursery.start_soon(serve_requests)
        nursery.start_soon(_watch_signals, engine, latency, failures)
        for name, service in services:  # already bound: "started" means "answering"
            await nursery.start(supervised, name, service, failures)
        nursery.start_soon(_become_ready, cfg, mountpoint, on_ready, failures, after_init)
        if adopted_at is None:
            await serve_requests()


async def _become_ready(cfg: MountConfig, mountpoint: str,
                        on_ready: Callable[[], None] | None, failures: Failures,
                        after_init: Callable[[], None] | None = None) -> None:
    # stat() through our own mount needs the main loop running, so ask from a thread.
    st = await trio.to_thread.run_sync(os.stat, mountpoint)
    if after_init is not None:  # the kernel answered INIT: what it negotiated is known
        # In a thread: it may start the crash keeper (a process, ~0.1-1 s under load),
        # and the mount serves meanwhile; READY=1 waits for it.
        await trio.to_thread.run_sync(after_init)
    try:
        tuning.tune_connection(st.st_dev, cfg.max_background, cfg.read_ahead_kb)
    except Exception as exc:  # the mount works untuned: not worth taking it down
        failures.record("tuning", exc, "serving with the kernel's defaults")
    log.info("qosfs serving %s on %s", cfg.source, mountpoint)
    # The services were started (listening) before this task: all three now answer.
    (on_ready or _notify_ready)()


def _notify_ready() -> None:
    """Tell systemd (Type=notify) the mount, the control socket and /metrics answer."""
    notify("READY=1")


@functools.cache  # once per process, whichever comes first: a signal or the kernel
def _notify_stopping() -> bool:
    return notify("STOPPING=1")


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


async def _watch_signals(engine: QosEngine, latency: LatencyLoop | None = None,
                         failures: Failures | None = None) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("received %s: finishing in-flight requests, then unmounting",
                     signal.Signals(signum).name)
            _notify_stopping()
            try:
                if latency is not None:  # its canary must not be left waiting on the mount
                    await latency.stop_probe()
                emptied = await _drain(engine)
                log.info("%s; unmounting", "parked requests served" if emptied else
                         f"requests still parked after {DRAIN_DEADLINE:g} s")
            except Exception as exc:  # asked to stop: a bug in draining must not stop that
                (failures or Failures()).record("stopping", exc, "unmounting without draining")
            # No new request is read after terminate(); those already read are served.
            pyfuse3.terminate()
            return


async def _drain(engine: QosEngine) -> bool:
    """Lift every limit, wait until nothing is parked (at most DRAIN_DEADLINE), then serve
    DRAIN_GRACE more; True if the lot emptied in time.

    Parked requests then finish at once, and so does what directly follows them: an
    unaligned 1 MiB O_DIRECT write reaches us as two requests, the second sent only once
    the first is answered, and its caller's close() comes next; unmounting in between
    left callers with a short write and ENOTCONN. New requests during the grace are
    served too; those that arrive after it find the mount gone.
    """
    engine.drain()
    deadline = trio.current_time() + DRAIN_DEADLINE
    emptied = True
    while engine.counters().parked_requests:
        if trio.current_time() >= deadline:
            emptied = False
            break
        await trio.sleep(0.01)
    await trio.sleep(DRAIN_GRACE)
    return emptied


def daemonize(serve: Callable[[Callable[[], None]], int]) -> int:
    """Fork; the child runs ``serve(on_ready)``, the parent returns 0 once the child
    called on_ready (its mount answers), or the child's error."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            report = pipe.read().decode(errors="replace")
        if report.startswith("OK"):
            # Under Type=notify without --foreground: the daemon is the child, not us.
            notify(f"MAINPID={pid}\nREADY=1")
            return 0
        _, waited = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(waited)
        message = report.partition(" ")[2].strip() or f"the daemon exited with code {code}"
        raise QosfsError(message, code if code > 0 else EXIT_FUSE)
    # Child: detach from the terminal, report success or failure through the pipe.
    os.close(read_end)
    os.setsid()
    to_parent = os.fdopen(write_end, "wb", buffering=0)

    def ready() -> None:
        to_parent.write(b"OK\n")
        to_parent.close()
        _detach_stdio()

    try:
        code = serve(ready)
    except QosfsError as exc:
        if not to_parent.closed:
            to_parent.write(f"ERR {exc}\n".encode())
        os._exit(exc.exit_code)
    except BaseException as exc:
        log.exception("daemon failed")
        if not to_parent.closed:
            to_parent.write(f"ERR daemon failed: {exc}\n".encode())
        os._exit(8)
    os._exit(code)


def _detach_stdio() -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115
