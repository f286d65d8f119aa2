"""Unexpected failures: counted by (where, type), logged once per kind."""

from __future__ import annotations

import logging

import pytest

from qosfs.core.failures import Failures


def _expected(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    for r in caplog.records:
        r.expected = True  # type: ignore[attr-defined]
    return caplog.records


def test_each_kind_is_logged_once_with_its_traceback_and_counted_always(
        caplog: pytest.LogCaptureFixture) -> None:
    failures = Failures()
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            failures.record("read", ValueError("bug"), "answered EIO")
        failures.record("read", KeyError("k"), "answered EIO")
        failures.record("write", ValueError("bug"), "answered EIO")
    records = _expected(caplog)
    assert [r.getMessage().split(";")[0] for r in records] == [
        "unexpected failure in read: ValueError: bug",
        "unexpected failure in read: KeyError: 'k'",
        "unexpected failure in write: ValueError: bug"]
    assert "answered EIO. Further ValueError in read are counted" in records[0].getMessage()
    assert all(r.exc_info for r in records)
    assert failures.counts() == {"read": {"KeyError": 1, "ValueError": 3},
                                 "write": {"ValueError": 1}}
    assert failures.total == 5
    assert repr(failures) == "<Failures 5 in 3 kinds>"


def test_a_nursery_group_of_one_counts_as_what_it_holds(
        caplog: pytest.LogCaptureFixture) -> None:
    failures = Failures()
    with caplog.at_level(logging.ERROR):
        failures.record("cluster", ExceptionGroup("nursery", [ValueError("x")]), "restarting")
        failures.record("cluster", ExceptionGroup("nursery", [ValueError("y"), KeyError()]),
                        "restarting")
    _expected(caplog)
    assert failures.counts() == {"cluster": {"ExceptionGroup": 1, "ValueError": 1}}
