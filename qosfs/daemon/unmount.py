"""``qosfs umount MOUNTPOINT``: unmount, and return only once nothing of the mount holds its
source any more.

``fusermount3 -u`` returns as soon as the kernel has detached the mount. The daemon learns
it only afterwards (its next read of ``/dev/fuse`` fails), then closes what it holds in
the source (its root, the backing files it had open) and exits; its keeper
(:mod:`qosfs.daemon.takeover.keeper`) closes its copy of the source's root when told. Until both
are gone the source's filesystem is busy: a script's ``umount`` of it right after
``fusermount3 -u`` failed with "target is busy" in 2 of 5 tries on a tmpfs here (issue
38). So this command:

1. learns which processes hold the source for this mount: the daemon (its control
   socket's ``status``) and the holder (its socket's ``status``), at the paths found from
   the mountpoint (:mod:`qosfs.daemon.pointer`: a mount made with ``--socket`` too), and
   takes a pidfd of each, so that a pid reused meanwhile cannot end the wait early;
2. runs ``fusermount3 -u``, and again every 50 ms while the mount is busy (a request in
   flight: the latency canary sends one every 2 ms for up to a second after a protected
   class's last request), up to ``--timeout``; a mount still busy then (a process has a
   file or directory open under it) stays mounted and served, and the command says so
   (exit 4);
3. waits, within the same ``--timeout``, until the daemon and the holder have exited, and
   then for a holder that answers although it was not found before (the daemon starts
   it once the kernel has initialised the mount, and waits until it listens).

Under systemd (``--keeper systemd``) stop the unit instead: ``systemctl stop`` returns
once its daemon has exited, and the daemon takes its descriptors out of systemd's store
before it exits. A daemon that cannot be asked (it does not answer its control socket) is
said on standard error, and then not waited for; a dead one's files (its sockets, its
journal, in memory under /run, and the pointer to them) are removed once the mount is
gone, as the daemon removes its own when it unmounts.

Standard library only, with no trio or pyfuse3: it runs as fast as ``ctl``.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import stat
import subprocess
import sys
import time
from typing import Any

from qosfs.control.address import answers, beside_socket
from qosfs.core.errors import EXIT_DAEMON, EXIT_FUSE, EXIT_MOUNTPOINT, QosfsError
from qosfs.core.mountinfo import QOSFS_FSTYPE, mount_type, resolve_without_touching
from qosfs.daemon.pointer import mount_socket_path, pointer_path
from qosfs.daemon.pointer import remove as remove_pointer
from qosfs.daemon.takeover import keeper

DEFAULT_TIMEOUT = 30.0
BUSY_RETRY = 0.05  # seconds between two tries of an unmount that found the mount busy


def add_parser(sub: Any) -> None:
    """Add ``qosfs umount`` to the main parser's subcommands."""
    u = sub.add_parser(
        "umount", help="unmount, and return once the daemon and its keeper have exited",
        description="Unmount a qosfs mount (fusermount3 -u, tried again while the mount "
        "is busy with a request in flight) and return only once its daemon and its "
        "keeper have exited, so that the source's filesystem can be unmounted next. A "
        "mount with files open under it stays mounted: exit 4, nothing changed. Under "
        "systemd, use systemctl stop instead.")
    u.add_argument("mountpoint")
    u.add_argument("--socket", metavar="PATH",
                   help="the mount's control socket (default: found from the mountpoint)")
    u.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                   help="how long to try while the mount is busy, and to wait for the "
                        f"daemon and keeper to exit (default: {DEFAULT_TIMEOUT:g})")
    u.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    mountpoint = resolve_without_touching(args.mountpoint)
    if mount_type(mountpoint) != QOSFS_FSTYPE:
        raise QosfsError(f"{args.mountpoint} is not a qosfs mount", EXIT_MOUNTPOINT)
    control = os.path.abspath(args.socket) if args.socket else mount_socket_path(mountpoint)
    keeper_path = keeper.keeper_socket_path(os.path.realpath(control))
    deadline = time.monotonic() + args.timeout
    waits: dict[int, tuple[str, int]] = {}  # pid -> (what it is, its pidfd)
    try:
        daemon = _daemon_pid(control)
        if daemon is None:
            print(f"qosfs: warning: the daemon of {mountpoint} does not answer at {control}: "
                  "not waiting for it", file=sys.stderr)
        for what, pid in (("daemon", daemon), ("keeper", keeper.holder_pid(keeper_path))):
            _watch(waits, what, pid)
        _unmount(mountpoint, deadline)
        _wait(waits, mountpoint, deadline)
        # A holder started after it was asked for (the daemon starts it once serving).
        _watch(waits, "keeper", keeper.holder_pid(keeper_path))
        _wait(waits, mountpoint, deadline)
        if daemon is None:
            _remove_leftovers(mountpoint, control)
    finally:
        for _, fd in waits.values():
            os.close(fd)
    return 0


def _daemon_pid(control: str) -> int | None:
    from qosfs.control.ctl import Client  # here: the parser is built without it

    try:
        with Client(control, timeout=5.0) as client:
            reply = client.request({"cmd": "status"})
    except QosfsError:
        return None
    pid = reply.get("pid")
    return pid if isinstance(pid, int) else None


def _remove_leftovers(mountpoint: str, control: str) -> None:
    """What a dead daemon of the mount, now unmounted, left: its control and handover
    sockets if nothing answers there, its journal, and the pointer to its socket."""
    for path in (control, beside_socket(control, ".handover")):
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode) and not answers(path):
                os.unlink(path)
        except OSError:
            pass
    try:
        os.unlink(keeper.journal_path(control))
    except OSError:
        pass
    pointer = pointer_path(mountpoint, control)
    if pointer is not None:
        remove_pointer(pointer, control)


def _watch(waits: dict[int, tuple[str, int]], what: str, pid: int | None) -> None:
    """Wait for *pid* too (*what* it is, for messages), unless it is gone or watched."""
    if pid is None or pid in waits:
        return
    try:
        waits[pid] = (what, os.pidfd_open(pid))
    except ProcessLookupError:
        pass  # exited already


def _unmount(mountpoint: str, deadline: float) -> None:
    fusermount = shutil.which("fusermount3")
    if fusermount is None:
        raise QosfsError("fusermount3 not found (install fuse3)", EXIT_FUSE)
    while True:
        done = subprocess.run([fusermount, "-u", mountpoint], capture_output=True, text=True)
        if done.returncode == 0:
            return
        said = done.stderr.strip()
        if "busy" not in said:
            raise QosfsError(f"cannot unmount {mountpoint}: {said}", EXIT_MOUNTPOINT)
        if time.monotonic() >= deadline:
            raise QosfsError(f"{mountpoint} is busy: a process has a file or directory open "
                             f"under it (fuser -vm {mountpoint}); it stays mounted",
                             EXIT_MOUNTPOINT)
        time.sleep(BUSY_RETRY)


def _wait(waits: dict[int, tuple[str, int]], mountpoint: str, deadline: float) -> None:
    """Until every watched process has exited; QosfsError naming those left at
    *deadline*."""
    poller = select.poll()
    left = {fd: (what, pid) for pid, (what, fd) in waits.items()}
    for fd in left:
        poller.register(fd, select.POLLIN)
    while left:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            running = ", ".join(f"{what} pid {pid}" for what, pid in left.values())
            raise QosfsError(f"{mountpoint} is unmounted, but its {running} still runs: "
                             "the source may still be busy", EXIT_DAEMON)
        for fd, _event in poller.poll(int(remaining * 1000) + 1):
            poller.unregister(fd)
            del left[fd]
