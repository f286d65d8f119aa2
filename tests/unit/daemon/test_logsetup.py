"""Logging under systemd: the journal only when stderr is the journal, priorities on
every line."""

from __future__ import annotations

import logging
import os
import sys
import uuid
from pathlib import Path

import pytest

from qosfs.daemon import logsetup


def test_journal_detected_only_when_journal_stream_is_our_stderr(
        monkeypatch: pytest.MonkeyPatch) -> None:
    st = os.fstat(2)
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    monkeypatch.setenv("INVOCATION_ID", uuid.uuid4().hex)  # run by systemd says nothing
    assert not logsetup.under_systemd()
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    assert logsetup.under_systemd()
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino + 1}")  # inherited, redirected
    assert not logsetup.under_systemd()


def test_journal_lines_carry_priorities_even_in_tracebacks() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        exc_info = sys.exc_info()
    record = logging.LogRecord("qosfs.daemon.serve", logging.ERROR, __file__, 1, "failed %s",
                               ("x",), exc_info)
    lines = logsetup._JournalFormatter().format(record).split("\n")
    assert lines[0] == "<3>qosfs.daemon.serve: failed x"
    assert len(lines) > 3 and all(line.startswith("<3>") for line in lines)
    assert lines[-1] == "<3>ValueError: boom"
    warning = logging.LogRecord("qosfs", logging.WARNING, __file__, 1, "careful", (), None)
    assert logsetup._JournalFormatter().format(warning) == "<4>qosfs: careful"


def test_a_daemonized_mount_does_not_log_to_the_journal_stderr_it_will_close(
        monkeypatch: pytest.MonkeyPatch) -> None:
    st = os.fstat(2)
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    try:
        logsetup.setup_logging(False, daemon=False)
        assert isinstance(root.handlers[0].formatter, logsetup._JournalFormatter)
        logsetup.setup_logging(False, daemon=True)
        assert not isinstance(root.handlers[0].formatter, logsetup._JournalFormatter)
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
            handler.close()
        for handler in saved:
            root.addHandler(handler)
        root.setLevel(level)
        logging.getLogger("pyfuse3").setLevel(logging.NOTSET)


def test_a_log_file_moved_away_by_logrotate_is_reopened(tmp_path: Path) -> None:
    path = tmp_path / "qosfs.log"
    root = logging.getLogger()
    saved = list(root.handlers), root.level
    try:
        logsetup.setup_logging(debug=False, log_file=str(path))
        logging.getLogger("qosfs.daemon.serve").info("before rotation")
        path.rename(tmp_path / "qosfs.log.1")  # logrotate without copytruncate
        logging.getLogger("qosfs.daemon.serve").info("after rotation")
        assert "before rotation" in (tmp_path / "qosfs.log.1").read_text()
        assert "after rotation" in path.read_text()
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
            handler.close()
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
