"""sd_notify(3) without libsystemd: tell systemd the daemon's state (``Type=notify``).

systemd passes ``$NOTIFY_SOCKET``, a Unix datagram socket: a path, or ``@name`` for one in
the abstract namespace. Each state change is one datagram of ``KEY=VALUE`` lines::

    notify("READY=1")                        # the mount answers, ctl and /metrics serve
    notify(reloading())                      # RELOADING=1 + MONOTONIC_USEC, then READY=1
    notify("STOPPING=1")                     # draining, then unmounting

Without ``$NOTIFY_SOCKET`` (not started by systemd, or not ``Type=notify``) every call is a
no-op returning False, so callers never need to ask first. A failure to send is logged at
DEBUG and returns False: the filesystem must not stop serving because its supervisor did
not hear a status line (systemd's own start timeout handles a lost ``READY=1``).
"""

from __future__ import annotations

import logging
import os
import socket
import time

__all__ = ["notify", "reloading"]

log = logging.getLogger(__name__)

SEND_TIMEOUT = 1.0  # seconds: the loop serving the mount must never wait long on this


def notify(state: str) -> bool:
    """Send ``state`` (newline-separated ``KEY=VALUE`` lines) to ``$NOTIFY_SOCKET``.

    Returns:
        True if the datagram was sent; False if there is no socket or sending failed.
    """
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):
        address = "\0" + path[1:]  # abstract namespace: no file, the name starts with NUL
    elif path.startswith("/"):
        address = path
    else:  # e.g. "vsock:CID:PORT" (systemd 254+ in VMs): not something a mount daemon meets
        log.debug("NOTIFY_SOCKET %r: unsupported address, not notifying", path)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(SEND_TIMEOUT)
            sock.sendto(state.encode(), address)
    except OSError as exc:
        log.debug("sd_notify %r to %s failed: %s", state, path, exc)
        return False
    return True


def reloading() -> str:
    """``RELOADING=1`` with the ``MONOTONIC_USEC`` stamp ``Type=notify-reload`` requires."""
    usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return f"RELOADING=1\nMONOTONIC_USEC={usec}"
