"""Kernel-side knobs of a FUSE connection, set through sysfs after mounting.

None of these can be set through pyfuse3's init, and all need root; a non-root mount
keeps the kernel defaults and says so in the log.

* ``max_background`` (kernel default 12) bounds the asynchronous requests (readahead,
  async direct I/O) the kernel keeps outstanding for the whole mount, all classes
  together; ``congestion_threshold`` (default 9) is where writers start to be throttled.
  With QoS, a throttled class's parked readahead would otherwise occupy the few slots a
  protected class needs, so the queue is made much deeper than the kernel default.
* ``read_ahead_kb`` of the mount's bdi (default 128 KiB) caps how much a sequential
  reader asks for at once; 1 MiB lets readahead use the largest FUSE request.
"""

from __future__ import annotations

import logging
import os
import subprocess

log = logging.getLogger(__name__)

DEFAULT_MAX_BACKGROUND = 256
DEFAULT_READ_AHEAD_KB = 1024
FUSECTL = "/sys/fs/fuse/connections"


def _write(path: str, value: int) -> bool:
    try:
        with open(path, "w", encoding="ascii") as f:
            f.write(f"{value}\n")
        return True
    except OSError as exc:
        log.info("could not set %s to %d: %s", path, value, exc.strerror)
        return False


def _ensure_fusectl() -> None:
    if os.path.isdir(FUSECTL) and not os.listdir(FUSECTL) and os.geteuid() == 0:
        # fusectl is not mounted on minimal systems; mount it so the knobs exist.
        subprocess.run(["mount", "-t", "fusectl", "none", FUSECTL], capture_output=True)


def connection_dir(st_dev: int) -> str:
    """sysfs directory of the FUSE connection serving a mount with device *st_dev*."""
    return os.path.join(FUSECTL, str(os.minor(st_dev)))


def tune_connection(st_dev: int, max_background: int, read_ahead_kb: int) -> None:
    """Apply the queue depth and readahead to the connection behind *st_dev*."""
    if os.geteuid() != 0:
        log.info("not root: keeping the kernel's FUSE queue and readahead defaults")
        return
    _ensure_fusectl()
    conn = connection_dir(st_dev)
    if max_background > 0 and _write(os.path.join(conn, "max_background"), max_background):
        _write(os.path.join(conn, "congestion_threshold"), max(1, max_background * 3 // 4))
    bdi = f"/sys/class/bdi/{os.major(st_dev)}:{os.minor(st_dev)}/read_ahead_kb"
    if read_ahead_kb > 0:
        _write(bdi, read_ahead_kb)
