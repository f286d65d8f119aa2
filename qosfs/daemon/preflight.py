"""Before anything is mounted: every check that can fail with a clear message, on the
source and the mountpoint, and the mountpoint's state as ``qosfs mount`` finds it.

:func:`check_own_paths` runs on the command line, before the process forks; the
arguments' checks (:func:`check_mount_args`, :mod:`qosfs.daemon.topology` among them) in
the process that will serve, after the fork (its error reaches the command line through
:mod:`qosfs.daemon.daemonize`), and before the source is opened. A stale mount (its daemon
dead, no keeper holding its connection) is removed there. :func:`serves_qosfs` tells
:mod:`qosfs.daemon.start` whether a live daemon serves the mountpoint.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess

from qosfs.core.errors import (
    EXIT_FUSE,
    EXIT_MOUNTPOINT,
    EXIT_SOURCE,
    EXIT_USAGE,
    QosfsError,
)
from qosfs.core.mountinfo import lies_within, mount_type, resolve_without_touching
from qosfs.daemon.topology import QOSFS_FSTYPE, check_before_stat, check_topology

log = logging.getLogger(__name__)


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
    mount over instead of mounting again,
    :func:`qosfs.daemon.takeover.upgrade.adopt_mount`). A dead one (ENOTCONN) is not
    live: it is cleaned by `check_mount_args`."""
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
