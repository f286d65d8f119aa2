"""The daemon: the command line, the mount's lifecycle (descriptors, privileges, the
nursery of servers, clean unmount), logging, systemd notification, FUSE connection
tuning."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qosfs.core.faces import lazy_face

if TYPE_CHECKING:
    from qosfs.daemon.cli import main
    from qosfs.daemon.mount import MountConfig, daemonize_and_mount, mount_type, run_mount

_EXPORTS = {
    "cli": ("main",),
    "mount": ("MountConfig", "daemonize_and_mount", "mount_type", "run_mount"),
}
__all__ = [
    "MountConfig", "daemonize_and_mount", "main", "mount_type", "run_mount",
]

if not TYPE_CHECKING:  # type checkers read the imports above
    __getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
