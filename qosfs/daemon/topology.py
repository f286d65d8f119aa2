"""Where a mount may go: refuse the source and mountpoint layouts that cannot work.

Two layouts mounted with exit 0 and then misbehaved:

* **qosfs over qosfs.** A source that is a qosfs mount, or a directory inside one,
  throttles every request twice (by the inner policy, then the outer one) and makes
  classification and ``ctl`` figures of one mount describe the other's traffic. Refused
  unless the administrator asks for it (``--allow-stacked``). Found without a system call
  on the source first (the lexically longest mountpoint above it in
  ``/proc/self/mountinfo``: a dead or hung qosfs mount answers ENOTCONN, or nothing at
  all), then by the device number of the source, which also sees through symlinks and
  bind mounts into a qosfs mount.
* **A mountpoint strictly inside its source** (``qosfs mount /srv /srv/mnt``). The daemon
  looks names up relative to the source; once mounted, its lookup of ``mnt`` crosses into
  its own mount and waits for an answer only it could give. Measured before this check:
  the first ``ls -la`` of the mount hung the daemon and every caller of the mount in
  uninterruptible sleep, until the connection was aborted through fusectl. Always
  refused; in place (source = mountpoint) and a source inside the mountpoint are fine,
  since the source is opened before mounting.

Other FUSE filesystems as sources are accepted: their I/O runs on worker threads
(``--io-mode threads``, chosen from the type) so a slow FUSE server cannot stall the loop.
"""

from __future__ import annotations

import os

from qosfs.core.errors import EXIT_MOUNTPOINT, EXIT_SOURCE, QosfsError
from qosfs.core.mountinfo import QOSFS_FSTYPE, MountEntry, containing, lies_within, mounts

__all__ = ["QOSFS_FSTYPE", "check_before_stat", "check_topology"]


def _stacked(source: str, outer: str) -> QosfsError:
    where = "a qosfs mount" if os.path.abspath(source) == outer else \
        f"inside the qosfs mount {outer}"
    return QosfsError(f"source {source} is {where}: qosfs over qosfs throttles every "
                      "request twice (--allow-stacked if that is what you want)", EXIT_SOURCE)


def check_before_stat(source: str, mountpoint: str, allow_stacked: bool,
                      entries: list[MountEntry] | None = None) -> None:
    """Refuse a source lexically inside a qosfs mount; no system call on either path."""
    if allow_stacked:
        return
    table = mounts() if entries is None else entries
    outer = containing(os.path.abspath(source), table)
    if outer is None or outer.fstype != QOSFS_FSTYPE:
        return
    if outer.mountpoint == os.path.abspath(mountpoint):
        # In place over a live qosfs mount: the mountpoint's own message says it best.
        raise QosfsError(f"{mountpoint} is already mounted by qosfs", EXIT_MOUNTPOINT)
    raise _stacked(source, outer.mountpoint)


def check_topology(source: str, mountpoint: str, allow_stacked: bool,
                   entries: list[MountEntry] | None = None) -> None:
    """Refuse qosfs over qosfs (by the source's device) and a mountpoint inside the
    source. Both paths must exist (the caller stat()ed them already)."""
    table = mounts() if entries is None else entries
    if not allow_stacked:
        st = os.stat(source)
        dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        for entry in table:
            if entry.dev == dev and entry.fstype == QOSFS_FSTYPE:
                raise _stacked(source, entry.mountpoint)
    real_source, real_mountpoint = os.path.realpath(source), os.path.realpath(mountpoint)
    if real_mountpoint != real_source and lies_within(real_mountpoint, real_source):
        raise QosfsError(f"mountpoint {mountpoint} is inside the source {source}: the "
                         "daemon's own lookups of it would wait for its own mount and hang "
                         "(mount outside the source, or in place over it)", EXIT_MOUNTPOINT)
