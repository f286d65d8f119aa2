"""Quiet, user-facing errors with distinct exit codes.

A user mistake (missing source, busy mountpoint, bad policy) is not a bug: the CLI prints
one line naming what is wrong and exits with the code below, no traceback unless --debug.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_USAGE = 2  # argparse uses 2 as well
EXIT_SOURCE = 3  # source directory missing or unusable
EXIT_MOUNTPOINT = 4  # mountpoint missing, busy or already mounted
EXIT_FUSE = 5  # /dev/fuse or fusermount3 unavailable, mount refused by the kernel
EXIT_POLICY = 6  # policy file invalid
EXIT_CONTROL = 7  # control socket unreachable or request refused
EXIT_DAEMON = 8  # the daemon failed after starting
EXIT_PLAN = 9  # qosfs plan: inputs out of range, or a plan the storage cannot carry out


class QosfsError(Exception):
    """An error the user can fix; carries the exit code the CLI returns."""

    exit_code: int = EXIT_DAEMON

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
