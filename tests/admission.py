"""Admission as the product runs it, for the tests of levels and of the backend.

A test states the levels a request passes as a policy (a class, a tenant, a backend),
opens a file in it, and charges requests through that file's flow:
:meth:`~qosfs.qos.flow.PolicyFlow.admit_read`, ``admit_write`` and ``admit_meta``, the
calls the filesystem makes per request. So a test of a level also runs the coroutine-free
fast path (``try_admit``), the parking bounds (:mod:`qosfs.qos.bounds`) and the
killed-caller scope (the engine's ``CallerWatch``) that every production request runs,
rather than a composition of its own that production never calls.

Run under :func:`tests.mock_clock.mock_clock`: time only moves when every task waits.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from qosfs.core.limit_kinds import Kind
from qosfs.policy.loading import parse_policy
from qosfs.qos import memo as memo_module
from qosfs.qos.bounds import ParkedCount, ParkingLimits
from qosfs.qos.engine import PolicyQos
from qosfs.qos.flow import PolicyFlow
from qosfs.qos.interface import NO_CALLER_WATCH, CallerWatch
from qosfs.qos.levels import RateLevel

MiB = 1 << 20
GiB = 1 << 30

# The CallerWatch the engines built by engine() get: the product's off-mount default,
# or a test's Callers (which puts itself here for the test's duration).
_watch: CallerWatch = NO_CALLER_WATCH


def table(header: str, **settings: object) -> str:
    """One TOML table of a policy: ``table("classes.c", write_bandwidth="1MiB/s")``."""
    lines = [f"[{header}]"] + [f"{key} = {json.dumps(value)}" for key, value in settings.items()]
    return "\n".join(lines) + "\n"


def klass(name: str = "c", **settings: object) -> str:
    """A class that every file under ``<name>/`` belongs to."""
    return table(f"classes.{name}", paths=[f"{name}/**"], **settings)


def engine(*tables: str, parking: ParkingLimits | None = None) -> PolicyQos:
    """The policy engine of the policy made of *tables*, with its parked count bounded by
    *parking* (default: the product's bounds)."""
    qos = PolicyQos(parse_policy("".join(tables)), callers=_watch)
    if parking is not None:
        qos.parking = ParkedCount(parking)  # flows opened from now on park here
    return qos


class _PathBook:
    """What the engine asks of the filesystem: the path of an inode, and the rename epoch."""

    epoch = 0

    def relpath_until(self, node: Any) -> tuple[str, float]:
        return str(node.path), memo_module._monotonic() + 3600.0


def open_flow(qos: PolicyQos, path: str = "c/f", uid: int = 0, writing: bool = True,
              ) -> PolicyFlow:
    """The flow a file at *path* opened by *uid* is charged to (as ``open`` binds it)."""
    node = SimpleNamespace(path=path, qos_memo=None)
    ctx = SimpleNamespace(uid=uid, gid=uid, pid=1)
    return qos.open_flow(_PathBook(), node, ctx, writing)  # type: ignore[arg-type]


def class_level(qos: PolicyQos, name: str = "c") -> RateLevel:
    """The level of class *name* (its parent level when the class is per-user)."""
    level = qos.classes[name].level
    assert isinstance(level, RateLevel)
    return level


def tenant_level(qos: PolicyQos, name: str = "t") -> RateLevel:
    level = qos.tenants[name]
    assert isinstance(level, RateLevel)
    return level


async def admit(flow: PolicyFlow, kind: Kind, nbytes: int = 0) -> float:
    """Charge one request of *kind* through *flow*, as the filesystem's handler does;
    returns the seconds it waited (a metadata request's, measured on the clock, since
    ``admit_meta`` returns nothing)."""
    if kind is Kind.READ:
        return await flow.admit_read(nbytes)
    if kind is Kind.WRITE:
        return await flow.admit_write(nbytes)
    start = trio.current_time()
    await flow.admit_meta()
    return trio.current_time() - start


@dataclass(frozen=True)
class _Caller:
    uid: int


class Callers:
    """Stands in for the FUSE request introspection (:mod:`qosfs.passthrough.interrupts`)
    that a mount gives the engine as its ``CallerWatch``; engines built by :func:`engine`
    while it is in place get it: every request that parks is sent by a caller of uid *uid*, and gets
    the cancel scope a FUSE INTERRUPT for a killed caller cancels; :meth:`kill` is that
    interrupt. The engine's side of it (EINTR, refunds, the parked count left) is then
    the product's; telling a killed caller from a signalled one needs a mount
    (tests/mount/test_flood.py).
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, uid: int = 0) -> None:
        self.uid = uid
        self.parked: list[trio.CancelScope] = []
        monkeypatch.setattr(sys.modules[__name__], "_watch", self)

    def current_caller(self, nbytes: int) -> _Caller:
        return _Caller(self.uid)

    @contextmanager
    def cancelled_if_killed(self, caller: object | None) -> Iterator[trio.CancelScope]:
        with trio.CancelScope() as scope:
            if caller is None:  # a metadata request: pyfuse3 tells nothing of its caller
                yield scope
                return
            self.parked.append(scope)
            try:
                yield scope
            finally:
                self.parked.remove(scope)

    def kill(self, index: int = 0) -> None:
        """The caller of the *index*-th request parked now was killed."""
        self.parked[index].cancel()
