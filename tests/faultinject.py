"""Run qosfs with a bug put into it: the stand-in for a fault in the QoS layer.

    python tests/faultinject.py --fault read=broken --fault sampler=/tmp/now -- \\
        mount --foreground SRC MNT --policy P

patches qosfs's classes in this process, then runs qosfs's own command line (``main``)
with the arguments after ``--``. The product has no hook for this: what a test breaks
here is the code a real bug would be in, reached the way a request reaches it.

Faults (repeat ``--fault``):

* ``read=CLASS``, ``write=CLASS``, ``meta=CLASS``: admission of a read, a write or a
  metadata operation (``PolicyFlow.admit_*``) raises ``ValueError`` for flows of CLASS
  (``meta`` needs a ``meta_iops`` cap somewhere, or metadata is not admitted at all);
* ``release=CLASS``: letting go of an open of CLASS (``OpenCharge.release``) raises
  ``KeyError``;
* ``register=ERRNO``: the kernel refuses every backing file registered for passthrough
  (``pyfuse3.passthrough_open`` raises ``OSError(ERRNO)``, e.g. ``ELOOP``, as for a
  backing file stacked deeper than negotiated);
* ``joins=RELEASE``: the kernel's release as the check of served joins reads it
  (``qosfs.passthrough.kernel.served_join_support``), e.g. ``6.8.0``: a kernel that does
  not take direct_io beside a backing id, where joins go uncapped;
* ``sampler=PATH``: the control service's rate sampler (a service on the daemon's event
  loop, once a second) raises ``RuntimeError`` while PATH exists;
* ``handover=hang``: a successor (``-- upgrade ...``) that took everything over and
  adopted the session hangs for ever instead of telling its predecessor it serves (the
  ``serving`` message of :mod:`qosfs.daemon.takeover.upgrade` is never sent), as a successor stuck
  in a system call or a deadlock would: its predecessor, which stopped reading
  /dev/fuse, must not wait for ever;
* ``handover=slow-ready``: a successor takes 2 s to say it is ready (building the
  operations for a large tree does), so that the policy can change under it (``ctl
  set`` on the old daemon, which serves on meanwhile).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # qosfs of this tree

import pyfuse3

from qosfs.control.snapshot import RateSampler
from qosfs.daemon.cli import main
from qosfs.daemon.takeover import fuse_session
from qosfs.passthrough import kernel
from qosfs.qos.charge import OpenCharge
from qosfs.qos.flow import PolicyFlow

_FLOW_FAULTS: dict[str, tuple[str, type[Exception]]] = {
    "read": ("admit_read", ValueError),
    "write": ("admit_write", ValueError),
    "meta": ("admit_meta", ValueError),
}


def _break_flow(kind: str, cls: str) -> None:
    name, error = _FLOW_FAULTS[kind]
    original: Callable[..., Any] = getattr(PolicyFlow, name)

    def broken(self: PolicyFlow, *args: Any) -> Any:
        if self.cls.rule.name == cls:
            raise error(f"injected {kind} fault in class {cls}")
        return original(self, *args)

    setattr(PolicyFlow, name, broken)


def _break_release(cls: str) -> None:
    original = OpenCharge.release

    def broken(self: OpenCharge) -> None:
        if self.flow.cls.rule.name == cls:  # type: ignore[attr-defined]
            raise KeyError(f"injected release fault in class {cls}")
        original(self)

    OpenCharge.release = broken  # type: ignore[method-assign]


def _break_sampler(trigger: str) -> None:
    original = RateSampler.sample

    def broken(self: RateSampler, snap: Any) -> None:
        if os.path.exists(trigger):
            raise RuntimeError("injected sampler fault")
        original(self, snap)

    RateSampler.sample = broken  # type: ignore[method-assign]


def _refuse_registration(name: str) -> None:
    code = getattr(errno, name)

    def refused(fd: int) -> int:
        raise OSError(code, os.strerror(code))

    pyfuse3.passthrough_open = refused  # what qosfs.passthrough.kernel calls


def _kernel_release(release: str) -> None:
    original = kernel.served_join_support

    def as_if(_release: str | None = None) -> kernel.Capability:
        return original(release)

    kernel.served_join_support = as_if  # what KernelPassthrough.served_joins calls


def _stall_before(message: str, seconds: float | None) -> None:
    """The successor waits *seconds* (None: for ever) before it sends *message*."""
    original = fuse_session.send_message

    def stalling(sock: Any, kind: str, *args: Any) -> None:
        if kind == message:
            threading.Event().wait(seconds)  # for ever: only SIGKILL ends this process
        original(sock, kind, *args)

    fuse_session.send_message = stalling  # what qosfs.daemon.takeover.upgrade calls


def run(argv: Sequence[str]) -> int:
    args = list(argv)
    split = args.index("--") if "--" in args else len(args)
    parser = argparse.ArgumentParser(prog="faultinject")
    parser.add_argument("--fault", action="append", default=[], metavar="KIND=WHAT")
    ours = parser.parse_args(args[:split])
    for fault in ours.fault:
        kind, _, what = fault.partition("=")
        if kind in _FLOW_FAULTS:
            _break_flow(kind, what)
        elif kind == "release":
            _break_release(what)
        elif kind == "register":
            _refuse_registration(what)
        elif kind == "joins":
            _kernel_release(what)
        elif kind == "sampler":
            _break_sampler(what)
        elif fault == "handover=hang":
            _stall_before("serving", None)
        elif fault == "handover=slow-ready":
            _stall_before("ready", 2.0)
        else:
            parser.error(f"unknown fault {fault!r}")
    return main(args[split + 1:])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
