"""Logging set-up: stderr in the foreground, journald/syslog or a file for a daemon.

Under systemd (``$JOURNAL_STREAM`` or ``$INVOCATION_ID`` set) stderr goes to the journal,
so records carry a ``<N>`` syslog priority prefix the journal understands.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_PRIORITY = {"DEBUG": 7, "INFO": 6, "WARNING": 4, "ERROR": 3, "CRITICAL": 2}


class _JournalFormatter(logging.Formatter):
    """Prefix each line with its syslog priority, as sd-daemon(3) describes."""

    def format(self, record: logging.LogRecord) -> str:
        prio = _PRIORITY.get(record.levelname, 6)
        return f"<{prio}>{record.name}: {record.getMessage()}" + (
            "\n" + self.formatException(record.exc_info) if record.exc_info else "")


def under_systemd() -> bool:
    return bool(os.environ.get("JOURNAL_STREAM") or os.environ.get("INVOCATION_ID"))


def setup_logging(debug: bool, daemon: bool = False, log_file: str | None = None) -> None:
    """Configure the root logger once per process."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    handler: logging.Handler
    if log_file:
        handler = logging.FileHandler(log_file)
        handler.setFormatter(logging.Formatter(_FORMAT))
    elif under_systemd():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_JournalFormatter())
    elif daemon and os.path.exists("/dev/log"):
        handler = logging.handlers.SysLogHandler(address="/dev/log")
        handler.setFormatter(logging.Formatter("qosfs[%(process)d]: %(name)s: %(message)s"))
    elif daemon:
        handler = logging.NullHandler()
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT))
    root.addHandler(handler)
    # pyfuse3 logs every worker start/stop at DEBUG: too chatty even for --debug.
    logging.getLogger("pyfuse3").setLevel(logging.INFO)
