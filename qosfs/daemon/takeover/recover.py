"""A crash of the daemon loses nothing a job can see: the serving side and the restart.

While a mount is served, :class:`CrashGuard` keeps two things outside the process:

* the session journal (:mod:`qosfs.passthrough.journal`), written as the tables change;
* a copy of the FUSE descriptor and of the source's root, in the keeper
  (:mod:`qosfs.daemon.takeover.keeper`: systemd's descriptor store, or the project's holder).

When the daemon dies, the kernel connection lives on in the keeper and callers' requests
wait in the kernel. ``qosfs mount`` started again on the same mountpoint (by systemd's
``Restart=``, a supervisor, or an administrator) finds the kept descriptors before it
touches the mountpoint (a stat there would wait on the dead daemon; :mod:`qosfs.daemon.start`
chooses this path then), and
:func:`recover_mount` rebuilds the tables from the journal, adopts the connection without
a new INIT, asks the kernel to send again every request the dead process had read and
not answered (FUSE_NOTIFY_RESEND), and serves on.

What holds after a crash (docs/administration.md says it for administrators):

* every descriptor a job has open keeps working, with the same node ids, unless its file
  was unlinked while open (the dead process held its last reference): ESTALE then;
* writes acknowledged (and fsync'd, for the disk) are never lost: they were in the
  backing store before the reply;
* a request the dead daemon was executing is answered once: reads, writes at an offset,
  getattr, setattr and fsync are executed again and give the same result; a rename,
  unlink, rmdir, link, mkdir, symlink, mknod or O_EXCL create is answered with the
  outcome the dead daemon recorded by request id (:mod:`qosfs.passthrough.intents`)
  instead of being done twice, where pyfuse3 tells request ids (else it may answer
  EEXIST or ENOENT the second time); an O_APPEND write may be appended twice;
* callers wait for the new daemon; if none takes over within ``--recover-within``
  seconds (holder) they get ENOTCONN. If the journal cannot be read, the kept connection
  is let go at once (ENOTCONN) and the mount is made afresh: never a hang.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from collections.abc import Callable

from qosfs.core.errors import EXIT_MOUNTPOINT, QosfsError
from qosfs.core.mountinfo import mount_type, resolve_without_touching
from qosfs.daemon import notify
from qosfs.daemon.assembly import build_daemon
from qosfs.daemon.config import MountConfig, control_socket_path
from qosfs.daemon.preflight import clean_stale_mount
from qosfs.daemon.serve import serve_mount
from qosfs.daemon.takeover import fuse_session, keeper
from qosfs.daemon.takeover.crash_guard import FUSE_NAME, ROOT_NAME, release_store
from qosfs.daemon.topology import QOSFS_FSTYPE
from qosfs.passthrough.intents import request_ids_known
from qosfs.passthrough.journal import JournalError, read_journal
from qosfs.passthrough.recovery import rebuild
from qosfs.policy.loading import default_policy, load_policy

log = logging.getLogger(__name__)


class Unrecoverable(QosfsError):
    """The kept connection was let go (its callers got ENOTCONN): mount afresh."""


# ----------------------------------------------------------------------- restarting


def kept_descriptors(cfg: MountConfig) -> tuple[int, int] | None:
    """The (FUSE, root) descriptors kept for *cfg*'s mountpoint by systemd's store or a
    holder, if its daemon is dead; None if nothing is kept (or a live daemon serves it).
    No system call reaches the mountpoint: ask this before anything else does."""
    if cfg.keeper == "none":
        return None
    control_path = control_socket_path(cfg, cfg.mountpoint)
    if cfg.keeper == "systemd":
        fds = notify.inherited_fds()
        fuse_fd, root_fd = fds.get(FUSE_NAME), fds.get(ROOT_NAME)
        if fuse_fd is not None and root_fd is not None:
            return fuse_fd, root_fd
        return None
    if mount_type(resolve_without_touching(cfg.mountpoint)) != QOSFS_FSTYPE:
        return None
    return keeper.claim(keeper.keeper_socket_path(control_path))


def recover_mount(cfg: MountConfig, fds: tuple[int, int], control_path: str,
                  on_ready: Callable[[], None] | None = None) -> int:
    """Serve *cfg*'s mount on the kept connection a dead daemon left (see the module
    docstring). If its journal cannot be used, the connection is let go (callers get
    ENOTCONN), the dead mount removed, and QosfsError raised for a fresh mount."""
    fuse_fd, root_fd = fds
    mountpoint = resolve_without_touching(cfg.mountpoint)
    path = keeper.journal_path(control_path)
    try:
        journal = read_journal(path)
        state = fuse_session.check_state(journal.session["state"])
        fuse_session.check_fuse_fd(fuse_fd)
        st = os.fstat(root_fd)
        if not stat.S_ISDIR(st.st_mode) or [st.st_dev, st.st_ino] != journal.session["root"]:
            raise JournalError("the kept source root is not the journal's")
    except (OSError, JournalError, fuse_session.HandoverError, KeyError, ValueError) as exc:
        _let_go(cfg, fds, control_path)
        clean_stale_mount(mountpoint)
        raise Unrecoverable(f"{mountpoint}: the dead daemon's state cannot be rebuilt "
                            f"({exc}); its callers got ENOTCONN", EXIT_MOUNTPOINT) from None
    policy = load_policy(cfg.policy_path) if cfg.policy_path else default_policy()
    daemon = build_daemon(cfg, policy if cfg.qos else None, root_fd, mountpoint)
    rebuilt = rebuild(daemon.fs, journal)
    log.warning("%s: recovering after the death of pid %s: %d inodes, %d open files "
                "(%d lost), %d open directories", mountpoint, journal.session.get("pid"),
                rebuilt.inodes, rebuilt.open_files, rebuilt.lost_files, rebuilt.open_dirs)
    daemon.recovered = {"dead_pid": journal.session.get("pid"), **dataclasses.asdict(rebuilt)}
    if not request_ids_known():
        log.warning("%s: resent requests are executed again: a rename, unlink, mkdir... "
                    "the dead daemon had done may answer ENOENT or EEXIST (pyfuse3 without "
                    "RequestContext.unique: deploy/libfuse/README.md)", mountpoint)

    guard = daemon.guard
    assert guard is not None  # build_daemon made it

    def start() -> None:
        guard.attach(daemon, state)
        fuse_session.adopt(daemon.fs.ops, fuse_session.Session(fuse_fd, state), daemon.mountpoint,
                       daemon.fuse_options)
        fuse_session.resend()  # what the dead process read and never answered comes again

    return serve_mount(daemon, start, on_ready, adopting=True)


def _let_go(cfg: MountConfig, fds: tuple[int, int], control_path: str) -> None:
    for fd in fds:
        os.close(fd)
    if cfg.keeper == "systemd":
        release_store()
    else:
        keeper.drop(keeper.keeper_socket_path(control_path))

