"""``qosfs mount``, from the checked command line to a served mount: one of three paths,
chosen once (:func:`decide`).

- fresh: nothing serves the mountpoint, so it is mounted (:func:`run_mount`);
- recover: a keeper holds the connection of a daemon that died (:mod:`qosfs.daemon.takeover`
  says what holds then), so the new daemon takes it over from the journal
  (:func:`qosfs.daemon.takeover.recover.recover_mount`), or mounts afresh if the journal
  cannot be used;
- adopt: a live qosfs daemon serves it, so the mount is handed over to this code as
  ``qosfs upgrade`` does, with the policy named here (if any) in force
  (:func:`qosfs.daemon.takeover.upgrade.adopt_mount`).

In order:

1. on the command line (:mod:`qosfs.daemon.cli`): the daemon's own paths are refused
   under the mountpoint, the policy file and the metrics address parsed, logging set up;
2. what is at the mountpoint: the kept descriptors first, without touching the
   mountpoint (a stat there would wait on the dead daemon whose connection is kept), then
   whether a live qosfs serves it; the path is chosen;
3. without ``--foreground`` the process forks (:mod:`qosfs.daemon.daemonize`): the
   parent waits until the child serves, or prints its one-line error;
4. the path, in the child: fresh, the mount's checks (:mod:`qosfs.daemon.preflight`: a
   stale mount is removed, a wrong source or mountpoint refused), the policy loaded, the
   source opened (before mounting, so mounting in place over it works: all later access
   goes through that descriptor), the daemon built (:mod:`qosfs.daemon.assembly`), and
   served (:mod:`qosfs.daemon.serve`, which binds the services, mounts and says when the
   mount is ready). Recovering and adopting build the daemon on the descriptors they were
   given and serve the same way.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
from collections.abc import Callable

import pyfuse3

from qosfs.core.errors import EXIT_FUSE, QosfsError
from qosfs.daemon.assembly import build_daemon
from qosfs.daemon.config import MountConfig, control_socket_path
from qosfs.daemon.daemonize import daemonize
from qosfs.daemon.preflight import check_mount_args, serves_qosfs
from qosfs.daemon.serve import serve_mount
from qosfs.daemon.takeover.recover import Unrecoverable, kept_descriptors, recover_mount
from qosfs.daemon.takeover.upgrade import adopt_mount
from qosfs.policy.loading import default_policy, load_policy

log = logging.getLogger(__name__)


class Start(enum.Enum):
    """How a ``qosfs mount`` starts serving its mountpoint."""

    FRESH = "fresh"  # nothing serves it: mount
    RECOVER = "recover"  # a keeper holds a dead daemon's connection: take it over
    ADOPT = "adopt"  # a live daemon serves it: have it handed over


def decide(kept: bool, live: Callable[[], bool]) -> Start:
    """The path, from what was found: *kept*, whether a keeper holds the connection of
    the mountpoint's dead daemon; *live*, asked only if not, whether a live qosfs daemon
    serves it (asking stats the mountpoint, which would wait on a kept connection)."""
    if kept:
        return Start.RECOVER
    if live():
        return Start.ADOPT
    return Start.FRESH


def start_mount(cfg: MountConfig, foreground: bool) -> int:
    """Serve *cfg*'s mount on the path :func:`decide` chooses, in this process
    (*foreground*) or in a child (:func:`qosfs.daemon.daemonize.daemonize`). Returns the
    exit code."""
    kept = kept_descriptors(cfg)  # first, without touching the mountpoint
    start = decide(kept is not None, functools.partial(serves_qosfs, cfg.mountpoint))
    run: Callable[..., int]
    if start is Start.RECOVER:
        assert kept is not None
        run = functools.partial(_recover_or_mount, cfg, kept)
    elif start is Start.ADOPT:
        log.info("%s is served by a live qosfs daemon: taking it over", cfg.mountpoint)
        run = functools.partial(adopt_mount, cfg.mountpoint, cfg.socket_path, foreground,
                                requested=cfg)
    else:
        run = functools.partial(run_mount, cfg)
    return run() if foreground else daemonize(run)


def _recover_or_mount(cfg: MountConfig, kept: tuple[int, int],
                      on_ready: Callable[[], None] | None = None) -> int:
    """Take over the mount whose daemon died while a keeper held its connection
    (*kept*), else (its journal cannot be used: the connection was let go) mount
    afresh."""
    control = control_socket_path(cfg, cfg.mountpoint)
    try:
        return recover_mount(cfg, kept, control, on_ready)
    except Unrecoverable as exc:
        log.error("%s", exc)  # the connection was let go: mount afresh
    return run_mount(cfg, on_ready)


def run_mount(cfg: MountConfig, on_ready: Callable[[], None] | None = None) -> int:
    """Mount and serve until unmounted, signalled or handed over. Returns the exit code."""
    check_mount_args(cfg.source, cfg.mountpoint, cfg.allow_stacked)
    policy = load_policy(cfg.policy_path) if cfg.policy_path else default_policy()
    root_fd = os.open(cfg.source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    daemon = build_daemon(cfg, policy if cfg.qos else None, root_fd,
                          os.path.realpath(cfg.mountpoint))  # resolved before we serve it

    def start() -> None:
        try:
            pyfuse3.init(daemon.fs.ops, daemon.mountpoint, daemon.fuse_options)
        except RuntimeError as exc:
            raise QosfsError(f"mounting {daemon.mountpoint} failed: {exc}", EXIT_FUSE) from None

    return serve_mount(daemon, start, on_ready)
