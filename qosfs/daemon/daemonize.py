"""Without ``--foreground``, ``qosfs mount`` and ``qosfs upgrade`` return once the mount is
served: the process forks as soon as the command line is checked and the path is chosen
(:mod:`qosfs.daemon.start`), before anything is mounted; the child does the rest and
serves, and the parent waits on a pipe and exits 0 only once the child's mount answers a
``stat`` (or prints the child's one-line error and exits with its code). Under systemd
the parent also tells it the child's pid (``MAINPID=``).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

from qosfs.core.errors import EXIT_FUSE, QosfsError
from qosfs.daemon.notify import notify

log = logging.getLogger(__name__)


def daemonize(serve: Callable[[Callable[[], None]], int]) -> int:
    """Fork; the child runs ``serve(on_ready)``, the parent returns 0 once the child
    called on_ready (its mount answers), or the child's error."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            report = pipe.read().decode(errors="replace")
        if report.startswith("OK"):
            # Under Type=notify without --foreground: the daemon is the child, not us.
            notify(f"MAINPID={pid}\nREADY=1")
            return 0
        _, waited = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(waited)
        message = report.partition(" ")[2].strip() or f"the daemon exited with code {code}"
        raise QosfsError(message, code if code > 0 else EXIT_FUSE)
    # Child: detach from the terminal, report success or failure through the pipe.
    os.close(read_end)
    os.setsid()
    to_parent = os.fdopen(write_end, "wb", buffering=0)

    def ready() -> None:
        to_parent.write(b"OK\n")
        to_parent.close()
        _detach_stdio()

    try:
        code = serve(ready)
    except QosfsError as exc:
        if not to_parent.closed:
            to_parent.write(f"ERR {exc}\n".encode())
        os._exit(exc.exit_code)
    except BaseException as exc:
        log.exception("daemon failed")
        if not to_parent.closed:
            to_parent.write(f"ERR daemon failed: {exc}\n".encode())
        os._exit(8)
    os._exit(code)


def _detach_stdio() -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115
