"""sd_notify(3) and sd_listen_fds(3) without libsystemd: tell systemd the daemon's state
(``Type=notify``), and keep descriptors in its store across a crash.

systemd passes ``$NOTIFY_SOCKET``, a Unix datagram socket: a path, or ``@name`` for one in
the abstract namespace. Each state change is one datagram of ``KEY=VALUE`` lines::

    notify("READY=1")                        # the mount answers, ctl and /metrics serve
    notify(reloading())                      # RELOADING=1 + MONOTONIC_USEC, then READY=1
    notify("STOPPING=1")                     # draining, then unmounting

Without ``$NOTIFY_SOCKET`` (not started by systemd, or not ``Type=notify``) every call is a
no-op returning False, so callers never need to ask first. A failure to send is logged at
DEBUG and returns False: the filesystem must not stop serving because its supervisor did
not hear a status line (systemd's own start timeout handles a lost ``READY=1``).

The descriptor store: a FUSE connection lives as long as some process holds its /dev/fuse
descriptor. Under systemd the daemon hands a copy to the service manager (``FDSTORE=1``
with the descriptor attached; the unit's ``FileDescriptorStoreMax=`` says how many it
keeps); when the daemon dies and ``Restart=`` starts it again, systemd passes the copies
back (``$LISTEN_FDS`` descriptors from 3, named by ``$LISTEN_FDNAMES``, for the PID in
``$LISTEN_PID``), and the mount the jobs use never went away::

    if fd_store_possible():
        store_fd(fuse_fd, FUSE_FD_NAME)        # once the mount is made or adopted
    kept = inherited_fds()                     # at start: {"qosfs-fuse": 3} after a crash
    remove_fd(FUSE_FD_NAME)                    # nothing to come back to (unmounting)

What systemd 252 does with them (tests/mount/test_systemd_box.py): the store is the
unit's, not a process's; it outlives a crash with ``Restart=``, a ``systemctl restart``
and the reload's handovers to a successor; ``systemctl stop`` empties it. The
same open file stored twice is kept once (a successor may store the FUSE descriptor
again). systemd drops a descriptor by itself when polling it reports POLLHUP or POLLERR:
/dev/fuse does once its connection is unmounted or aborted (and before it is mounted:
store it after), so a dead connection is never handed back. With
``FileDescriptorStoreMax=0`` (the default) systemd closes what it is sent and says so only
in its journal: a daemon cannot know whether the store kept the descriptor.
"""

from __future__ import annotations

import array
import fcntl
import logging
import os
import socket
import time
from collections.abc import MutableMapping, Sequence

__all__ = [
    "FUSE_FD_NAME",
    "fd_store_possible",
    "inherited_fds",
    "notify",
    "notify_address",
    "reloading",
    "remove_fd",
    "store_fd",
]

log = logging.getLogger(__name__)

SEND_TIMEOUT = 1.0  # seconds: the loop serving the mount must never wait long on this
FUSE_FD_NAME = "qosfs-fuse"  # the mount's /dev/fuse descriptor
LISTEN_FDS_START = 3  # SD_LISTEN_FDS_START: passed descriptors are 3, 4, ...
FDNAME_MAX = 255  # systemd refuses longer names
LISTEN_VARIABLES = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


def notify(state: str, fds: Sequence[int] = ()) -> bool:
    """Send ``state`` (newline-separated ``KEY=VALUE`` lines) to ``$NOTIFY_SOCKET``, with
    *fds* attached (SCM_RIGHTS) for the messages that carry descriptors (``FDSTORE=1``).

    Returns:
        True if the datagram was sent; False if there is no socket or sending failed.
    """
    path = os.environ.get("NOTIFY_SOCKET")
    address = notify_address(path)
    if address is None:
        if path:
            log.debug("NOTIFY_SOCKET %r: unsupported address, not notifying", path)
        return False
    # socket.send_fds() would do, but Python 3.11's drops its address argument.
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(SEND_TIMEOUT)
            sock.sendmsg([state.encode()], ancillary, 0, address)
    except OSError as exc:
        log.debug("sd_notify %r to %s failed: %s", state, path, exc)
        return False
    return True


def notify_address(path: str | None) -> str | None:
    """The socket address ``$NOTIFY_SOCKET`` names, or None if it names none we can use."""
    if not path:
        return None
    if path.startswith("@"):
        return "\0" + path[1:]  # abstract namespace: no file, the name starts with NUL
    if path.startswith("/"):
        return path
    return None  # e.g. "vsock:CID:PORT" (systemd 254+ in VMs): not something a mount daemon meets


def reloading() -> str:
    """``RELOADING=1`` with the ``MONOTONIC_USEC`` stamp ``Type=notify-reload`` requires."""
    usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return f"RELOADING=1\nMONOTONIC_USEC={usec}"


def fd_store_possible() -> bool:
    """Whether there is a service manager to send descriptors to (``$NOTIFY_SOCKET``).

    Not whether it keeps them: that is the unit's ``FileDescriptorStoreMax=``, which
    systemd 254+ passes as ``$FDSTORE`` (trusted when present) and 252 does not pass."""
    if notify_address(os.environ.get("NOTIFY_SOCKET")) is None:
        return False
    limit = os.environ.get("FDSTORE")
    return limit is None or (limit.isdigit() and int(limit) > 0)


def store_fd(fd: int, name: str) -> bool:
    """Have the service manager keep a copy of *fd* under *name* (sd_pid_notify_with_fds
    ``FDSTORE=1``). False if there is no manager or the message could not be sent."""
    _check_name(name)
    return notify(f"FDSTORE=1\nFDNAME={name}", [fd])


def remove_fd(name: str) -> bool:
    """Have the service manager close every descriptor it keeps under *name*."""
    _check_name(name)
    return notify(f"FDSTOREREMOVE=1\nFDNAME={name}")


def inherited_fds(environ: MutableMapping[str, str] | None = None) -> dict[str, int]:
    """The descriptors the service manager passed to this process, by name, close-on-exec
    (a child must not hold the mount open). The ``LISTEN_*`` variables are removed either
    way, so no child takes them for its own. Nothing if they name another PID (inherited
    from a parent systemd started).

    A descriptor without a name is ``"unknown"``, as sd_listen_fds_with_names(3) says. Two
    under one name: the first is kept, the others closed (a name is one descriptor here).
    """
    env = os.environ if environ is None else environ
    values = {key: env.pop(key, None) for key in LISTEN_VARIABLES}
    pid, count, names = values["LISTEN_PID"], values["LISTEN_FDS"], values["LISTEN_FDNAMES"]
    if pid is None or count is None:
        return {}
    if not (pid.isdigit() and count.isdigit()):
        log.warning("ignoring malformed LISTEN_PID=%r LISTEN_FDS=%r", pid, count)
        return {}
    if int(pid) != os.getpid():
        log.debug("LISTEN_PID=%s is not this process: no descriptors inherited", pid)
        return {}
    labels = names.split(":") if names else []
    if len(labels) != int(count):
        if names:
            log.warning("LISTEN_FDNAMES has %d names for %s descriptors: taken as unknown",
                        len(labels), count)
        labels = ["unknown"] * int(count)
    kept: dict[str, int] = {}
    for fd, label in enumerate(labels, start=LISTEN_FDS_START):
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFD)
        except OSError:
            log.warning("passed descriptor %d (%s) is not open", fd, label)
            continue
        fcntl.fcntl(fd, fcntl.F_SETFD, flags | fcntl.FD_CLOEXEC)
        if label in kept:
            log.warning("a second passed descriptor named %s (%d): closed", label, fd)
            os.close(fd)
            continue
        kept[label] = fd
    return kept


def _check_name(name: str) -> None:
    """systemd's fdname_is_valid(): printable ASCII without ':', at most 255 bytes."""
    if not name or len(name) > FDNAME_MAX or ":" in name \
            or not all(" " <= ch <= "~" for ch in name):
        raise ValueError(f"not a valid descriptor name for systemd: {name!r}")
