"""The one mock clock every engine test runs under (trio's ``MockClock``): timing tests
are exact and instant, because time only moves when every task is blocked."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

import trio
import trio.testing


def mock_clock(fn: Callable[[], Awaitable[None]]) -> Callable[[], None]:
    """Run an async test under a mock clock that jumps as soon as every task is blocked."""

    @functools.wraps(fn)
    def wrapper() -> None:
        trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))

    return wrapper
