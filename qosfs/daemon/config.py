"""What ``qosfs mount`` was asked to do (:class:`MountConfig`), as the command line gives
it to every path of a mount (:mod:`qosfs.daemon.start`) and a predecessor sends it to its
successor (:mod:`qosfs.daemon.takeover.upgrade`), and where its control socket is."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from qosfs.control.address import default_socket_path
from qosfs.daemon import tuning
from qosfs.passthrough.operations import FsOptions


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
    # False (--no-read-counting): the kernel's reads of passed-through opens are not counted
    # (qosfs.passthrough.read_counting), saving its BPF programs' cost on every read.
    read_counting: bool = True
    # How long, at most, the daemon polls /dev/fuse for the next request before sleeping
    # (qosfs.daemon.serve: pyfuse3-busy-poll.patch); 0: never.
    busy_poll_us: int = 50
    # Who keeps the FUSE connection across a crash (qosfs.daemon.takeover.keeper): "holder",
    # "systemd" (its descriptor store) or "none"; and how long a holder waits for a new
    # daemon before letting the connection end (callers then get ENOTCONN).
    keeper: str = "holder"
    recover_within: float = 30.0


def control_socket_path(cfg: MountConfig, mountpoint: str) -> str:
    """Where the mount's control socket is: --socket, or derived from the mountpoint."""
    return os.path.abspath(cfg.socket_path or default_socket_path(mountpoint))
