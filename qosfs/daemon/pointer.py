"""Where a mount's sockets are, said at the path every command looks at first: its pointer.

A mount's control socket is at a path derived from its mountpoint
(``/run/qosfs/NAME.sock``, :func:`qosfs.control.address.default_socket_path`) unless it
was mounted with ``--socket PATH``; its handover socket, its keeper's socket and its
journal are beside the control socket. A mount made with ``--socket PATH`` leaves a
symbolic link to PATH at the derived path, so that a command given only the mountpoint
finds the mount's sockets: ``qosfs upgrade MOUNTPOINT``, ``qosfs mount`` run again on it
(after a crash, or to upgrade), ``qosfs umount MOUNTPOINT``, and ``qosfs ctl``, ``top``
and ``explain`` with ``--socket MOUNTPOINT`` or alone (``connect()`` follows the link).

The pointer lives as long as the control socket's path (:mod:`qosfs.daemon.takeover.listeners`):
left when the socket is bound, left again by a successor that inherits the socket (an
upgrade), kept when a daemon hands the socket over, and removed with the socket when the
mount ends, if it still names this mount's socket. A daemon killed leaves both behind;
``qosfs mount`` run again on the mount follows them (:func:`running_socket_path`). Where
no qosfs mount is left, a pointer is stale: a new mount of that mountpoint replaces it
(qosfs.control.server replaces a link that nothing answers behind, as a stale socket).

Only root's daemon writes ``/run/qosfs`` (mode 0755); an unprivileged one its own
``$XDG_RUNTIME_DIR/qosfs``. A pointer that cannot be left is logged, not fatal: the mount
serves, and its socket is where ``--socket`` says.
"""

from __future__ import annotations

import logging
import os

from qosfs.control.address import default_socket_path, socket_dirs, socket_name
from qosfs.core.mountinfo import QOSFS_FSTYPE, mount_type, resolve_without_touching

__all__ = ["leave", "mount_socket_path", "pointed", "pointer_path", "remove",
           "running_socket_path"]

log = logging.getLogger(__name__)


def pointer_path(mountpoint: str, socket_path: str) -> str | None:
    """Where the mount at *mountpoint* whose control socket is *socket_path* leaves its
    pointer: the derived path; None if the socket is at the derived path itself."""
    derived = default_socket_path(mountpoint)
    return None if os.path.abspath(socket_path) == derived else derived


def leave(pointer: str, target: str) -> None:
    """Make *pointer* a symbolic link to *target*, replacing what is there at once (a
    client never finds the path missing)."""
    staged = f"{pointer}.{os.getpid()}.new"
    try:
        os.makedirs(os.path.dirname(pointer), mode=0o755, exist_ok=True)
        try:
            os.unlink(staged)
        except FileNotFoundError:
            pass
        os.symlink(target, staged)
        os.replace(staged, pointer)
    except OSError as exc:
        log.warning("cannot point %s at the control socket %s (give --socket %s to "
                    "qosfs upgrade): %s", pointer, target, target, exc.strerror or exc)


def remove(pointer: str, target: str) -> None:
    """Remove *pointer* if it still names *target* (not replaced by a later mount)."""
    try:
        if os.readlink(pointer) == target:
            os.unlink(pointer)
    except OSError:
        pass


def pointed(mountpoint: str) -> str | None:
    """The control socket that a pointer for *mountpoint* names, looked for where clients
    look (:func:`qosfs.control.address.socket_dirs`); None if there is no pointer."""
    name = socket_name(mountpoint)
    for directory in socket_dirs():
        try:
            target = os.readlink(os.path.join(directory, name))
        except OSError:  # none, or a socket: not a pointer
            continue
        return os.path.join(directory, target)  # a relative link: from its directory
    return None


def mount_socket_path(mountpoint: str) -> str:
    """The control socket of the mount at *mountpoint*, as a command given only the
    mountpoint finds it: where its pointer leads, else the derived path."""
    return pointed(mountpoint) or default_socket_path(mountpoint)


def running_socket_path(mountpoint: str) -> str | None:
    """The ``--socket PATH`` of the qosfs mount that is at *mountpoint* now, as its pointer
    says; None if there is no qosfs mount there (a pointer is stale then) or its socket
    is at the derived path. Nothing is asked of the mountpoint: its daemon may be dead."""
    if mount_type(resolve_without_touching(mountpoint)) != QOSFS_FSTYPE:
        return None
    return pointed(mountpoint)
