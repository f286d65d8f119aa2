"""Waiting for a state in tests: poll until it holds, or fail saying what was awaited and
what was seen last (a timeout alone says nothing about why).

Example::

    status = wait_for("the writers to park", lambda: request({"cmd": "status"}),
                      until=lambda s: s["parked_requests"] >= 8, timeout=30)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T], *, until: Callable[[T], object] = bool,
             timeout: float = 10.0, interval: float = 0.02) -> T:
    """Call *probe* every *interval* seconds until ``until(value)`` holds (by default:
    until the value is true) and return that value. After *timeout* seconds, fail the
    test with *what* and the last value seen."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if until(value):
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout:g} s for {what}; last saw: {value!r}")
        time.sleep(interval)
