"""Where a mount's control socket is, and the files beside it (handover socket, keeper,
journal).

The daemon names its socket from the mountpoint; clients (``qosfs ctl``, ``top``,
``explain``, ``upgrade``) find it the same way. Standard library only and nothing heavy
at import: ``qosfs ctl`` imports this module on every run (issue 38: its whole start
should cost a few tens of milliseconds).
"""

from __future__ import annotations

import os
import re
import socket

__all__ = [
    "SYSTEM_SOCKET_DIR",
    "answers",
    "beside_socket",
    "default_socket_path",
    "socket_dir",
    "socket_dirs",
    "socket_name",
]

SYSTEM_SOCKET_DIR = "/run/qosfs"


def socket_dir() -> str:
    """Where default control sockets live: /run/qosfs for root, else under the user's
    ``$XDG_RUNTIME_DIR`` (a non-root daemon cannot create /run/qosfs)."""
    if os.geteuid() == 0:
        return SYSTEM_SOCKET_DIR
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(runtime, "qosfs") if runtime else SYSTEM_SOCKET_DIR


def socket_dirs() -> list[str]:
    """Where a client looks: its own default directory, then the system one (a user
    reading the status of root's mount)."""
    return list(dict.fromkeys([socket_dir(), SYSTEM_SOCKET_DIR]))


def socket_name(mountpoint: str) -> str:
    """``mnt-mlfs-1a2b3c4d.sock`` for /mnt/mlfs: readable (the path with "/" as "-"),
    unambiguous (a hash of the whole path, so /a-b and /a/b differ) and short enough for
    a Unix socket address (108 bytes)."""
    import hashlib  # here: `qosfs ctl` without --socket MOUNTPOINT should not pay for it

    # The mountpoint itself is not resolved (no stat of it): a mount whose daemon died
    # and whose connection is kept (qosfs.daemon.takeover.keeper) would not answer.
    from qosfs.core.mountinfo import resolve_without_touching

    path = resolve_without_touching(mountpoint)
    readable = re.sub(r"[^A-Za-z0-9_.-]", "_", path.strip("/").replace("/", "-"))[:48] or "root"
    digest = hashlib.sha256(os.fsencode(path)).hexdigest()[:8]
    return f"{readable}-{digest}.sock"


def beside_socket(control_path: str, suffix: str) -> str:
    """A file of the same mount beside its control socket: ``/run/qosfs/NAME.sock`` gives
    ``/run/qosfs/NAME`` + *suffix* (the handover socket, the keeper's, the journal)."""
    return control_path.removesuffix(".sock") + suffix


def default_socket_path(mountpoint: str) -> str:
    """The daemon's control socket for ``mountpoint``, e.g. /run/qosfs/mnt-mlfs-1a2b3c4d.sock."""
    return os.path.join(socket_dir(), socket_name(mountpoint))


def answers(path: str) -> bool:
    """Whether something listens on the Unix socket at *path*: a socket file nobody
    listens on (ECONNREFUSED) is a dead daemon's, stale."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return False
    return True
