"""Logging set-up: stderr in the foreground, journald/syslog or a file for a daemon.

When stderr is the journal (systemd's ``StandardError=journal``, the default for a unit:
``$JOURNAL_STREAM`` names stderr's device and inode) records go there with a ``<N>``
syslog priority prefix on every line, which the journal turns into the entry's priority
(``journalctl -p warning``). A daemonized mount (no ``--foreground``) loses its stderr, so
it logs to syslog instead, which the journal also collects with priorities.
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
        text = f"{record.name}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        # The journal reads stderr line by line: a traceback's lines each need the prefix.
        return "\n".join(f"<{prio}>{line}" for line in text.splitlines())


def under_systemd() -> bool:
    """Whether stderr is connected to the journal.

    ``$JOURNAL_STREAM`` (``DEVICE:INODE``) is inherited by children too, so it counts only
    when it names this process's stderr (systemd.exec(5)); ``$INVOCATION_ID`` alone says
    nothing about where stderr goes (``StandardError=file:...``, a redirected child).
    """
    stream = os.environ.get("JOURNAL_STREAM")
    if not stream:
        return False
    try:
        st = os.fstat(2)
    except OSError:
        return False
    return stream == f"{st.st_dev}:{st.st_ino}"


def setup_logging(debug: bool, daemon: bool = False, log_file: str | None = None) -> None:
    """Configure the root logger once per process."""
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    handler: logging.Handler
    if log_file:
        # Reopened when logrotate moves or removes the file (a stat per record; the data
        # path does not log): a rotated log must not swallow the daemon's messages.
        handler = logging.handlers.WatchedFileHandler(log_file)
        handler.setFormatter(logging.Formatter(_FORMAT))
    elif under_systemd() and not daemon:
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
