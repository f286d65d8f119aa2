"""Keeping a mount's kernel connection alive while its daemon is dead: the keeper.

A FUSE connection lives as long as some process holds its ``/dev/fuse`` descriptor. If
only the daemon holds it, a ``kill -9`` ends the connection and every descriptor any job
has open under the mount fails (ENOTCONN). So something outside the daemon holds a copy:

* under systemd, its file descriptor store (``FileDescriptorStoreMax=`` in the unit;
  :mod:`qosfs.daemon.notify`), which hands the descriptors to the restarted service;
* elsewhere, the holder below: a small process the daemon starts at mount, which holds the
  FUSE descriptor and the source's root (an in-place mount covers the source, and a new
  daemon could not open it through the dead mount), and gives them to a new daemon that
  asks.

What the holder must never do, and does not: read or write ``/dev/fuse`` (it would steal
requests from the daemon), touch the mountpoint or anything under it (it would wait on
the mount it keeps), hold any other descriptor, or outlive its purpose. Its protocol, one
line per request on a Unix socket beside the control socket (mode 0600, peers must be
root or its own user):

* ``serve``: the connection is the lease of the daemon serving the mount; it ends with
  ``bye`` (the daemon unmounts: the holder closes its copies and exits) or with the
  daemon's death (EOF);
* ``adopt``: a new daemon asks for the descriptors; given (SCM_RIGHTS) only while no
  daemon holds a lease, else ``busy``;
* ``drop``: the descriptors cannot be used (the journal is unreadable): close them, so the
  connection ends and callers get ENOTCONN instead of waiting;
* ``status``: one line of JSON.

A dead daemon's callers wait while the holder holds on; if no daemon takes over within
the grace period (``--recover-within``, 30 s by default), the holder closes its copies:
the connection is aborted and every waiting caller gets ENOTCONN. So no caller waits
longer than that bound for a daemon that does not come back.
"""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

from qosfs.control.address import beside_socket
from qosfs.core.errors import QosfsError

GRACE_DEFAULT = 30.0
_FUSE, _ROOT = 0, 1


def keeper_socket_path(control_path: str) -> str:
    """The holder's socket for the mount whose control socket is *control_path*."""
    return beside_socket(control_path, ".keeper")


def journal_path(control_path: str) -> str:
    """The session journal (qosfs.passthrough.journal) of that mount."""
    return beside_socket(control_path, ".journal")


# ----------------------------------------------------------------------- the holder


def _peer_allowed(conn: socket.socket) -> bool:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    uid = int.from_bytes(creds[4:8], sys.byteorder)
    return uid in (0, os.geteuid())


def hold(path: str, fds: list[int], grace: float, ready_fd: int | None = None) -> int:
    """Serve the holder's protocol on *path* for the descriptors *fds* (FUSE, root) until
    the mount is unmounted, the daemon says ``bye`` or nobody takes over within *grace*
    seconds of the last daemon's death. Once it listens, it writes a byte to *ready_fd*
    (the daemon's pipe) and closes it; its end without that byte tells the daemon at once
    that no keeper will listen."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old_umask = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old_umask)
    listener.listen(16)
    if ready_fd is not None:
        os.write(ready_fd, b"L")
        os.close(ready_fd)
    poller = select.poll()
    # No events asked of /dev/fuse: poll still reports POLLERR once the connection is gone
    # (unmounted or aborted), and never POLLIN, so nothing is read from it. Watched only
    # while no daemon serves: a poller of /dev/fuse is woken by every request the kernel
    # queues, whatever events it asked for, and the holder then cost a context switch per
    # request (measured: 6.5 us of its CPU per open, and the daemon's CPU per open 77 ->
    # 87 us on 2 cores). A serving daemon says ``bye`` when the mount ends instead.
    poller.register(fds[_FUSE], 0)
    poller.register(listener, select.POLLIN)
    leases: dict[int, socket.socket] = {}
    deadline: float | None = time.monotonic() + grace  # the daemon connects in a moment
    started = time.time()

    def finish() -> int:
        for fd in fds:
            os.close(fd)
        for conn in leases.values():
            conn.close()
        listener.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return 0

    while True:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        events = poller.poll(None if timeout is None else int(timeout * 1000) + 1)
        if deadline is not None and not leases and time.monotonic() >= deadline:
            return finish()  # nobody came back: let the connection end (ENOTCONN)
        # A lease's end before any new request: a successor that asks in the wakeup that
        # also brings its predecessor's death must get the descriptors, not "busy".
        for fd, _event in sorted(events, key=lambda event: event[0] == listener.fileno()):
            if fd == fds[_FUSE]:
                return finish()  # unmounted, or aborted through fusectl
            if fd == listener.fileno():
                conn, _ = listener.accept()
                conn.settimeout(5.0)
                request = _request(conn)
                if request == "serve":
                    conn.sendall(b"ok\n")
                    conn.setblocking(False)
                    if not leases:
                        poller.unregister(fds[_FUSE])
                    leases[conn.fileno()] = conn
                    poller.register(conn, select.POLLIN)
                    deadline = None
                elif request == "adopt" and not leases:
                    conn.sendmsg([b"fd\n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                              array.array("i", fds).tobytes())])
                    conn.close()
                elif request == "adopt":
                    conn.sendall(b"busy\n")
                    conn.close()
                elif request == "drop":
                    conn.sendall(b"ok\n")
                    conn.close()
                    return finish()
                elif request == "status":
                    conn.sendall(json.dumps({"pid": os.getpid(), "leases": len(leases),
                                             "since": started}).encode() + b"\n")
                    conn.close()
                else:
                    conn.close()
                continue
            conn = leases[fd]
            try:
                data = conn.recv(64)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data.startswith(b"bye"):
                return finish()  # unmounting: nothing to keep
            if not data:  # the daemon is gone
                poller.unregister(fd)
                del leases[fd]
                conn.close()
                if not leases:
                    deadline = time.monotonic() + grace
                    poller.register(fds[_FUSE], 0)  # unmounted meanwhile: POLLERR at once


def _request(conn: socket.socket) -> str:
    try:
        if not _peer_allowed(conn):
            return ""
        data = b""
        while not data.endswith(b"\n") and len(data) < 64:
            chunk = conn.recv(64)
            if not chunk:
                break
            data += chunk
        return data.decode(errors="replace").strip()
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    """``python -m qosfs.daemon.takeover.keeper SOCKET GRACE FUSE_FD ROOT_FD [READY_FD]`` (started
    by the daemon, which passes the descriptors)."""
    args = sys.argv[1:] if argv is None else argv
    path, grace, fuse_fd, root_fd = args[0], float(args[1]), int(args[2]), int(args[3])
    ready_fd = int(args[4]) if len(args) > 4 else None
    if os.fork() > 0:
        os._exit(0)  # the daemon reaps this at once; the holder is nobody's child to wait on
    for fd in (fuse_fd, root_fd, ready_fd):
        if fd is not None:
            os.set_inheritable(fd, False)
    return hold(path, [fuse_fd, root_fd], grace, ready_fd)


# ----------------------------------------------------------------------- the daemon's side


def _connect(path: str, timeout: float = 5.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return sock


def start_holder(path: str, fuse_fd: int, root_fd: int, grace: float) -> None:
    """Start a holder for this mount's descriptors and wait until it listens.

    The holder says so on a pipe, and a holder that ends first (the mount was unmounted
    while it started: it saw the connection gone) closes the pipe unsaid, so this returns
    or fails at once instead of polling its socket until a deadline (an unmount in the
    first moments of a mount kept the daemon 10 s in that loop).
    """
    ready_r, ready_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "qosfs.daemon.takeover.keeper", path, str(grace), str(fuse_fd),
             str(root_fd), str(ready_w)],
            pass_fds=(fuse_fd, root_fd, ready_w), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            close_fds=True, cwd="/")
        os.close(ready_w)
        ready_w = -1
        if proc.wait(10.0) != 0:  # it forks the holder and exits
            raise QosfsError(f"the keeper could not start ({proc.returncode})")
        readable, _, _ = select.select([ready_r], [], [], 10.0)
        if not readable:
            raise QosfsError(f"the keeper did not listen on {path} within 10 s")
        if os.read(ready_r, 1) != b"L":
            raise QosfsError("the keeper ended before it listened (the mount is gone)")
    except subprocess.TimeoutExpired:
        raise QosfsError("the keeper could not start within 10 s") from None
    finally:
        os.close(ready_r)
        if ready_w >= 0:
            os.close(ready_w)


class Lease:
    """The serving daemon's connection to its holder (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.sock = _connect(path)
        self.sock.sendall(b"serve\n")
        if self.sock.recv(16) != b"ok\n":
            self.sock.close()
            raise OSError("the keeper refused the lease")
        self.sock.setblocking(True)

    def end(self, unmounting: bool) -> None:
        """Give the lease up: *unmounting* tells the holder to let go too."""
        try:
            if unmounting:
                self.sock.sendall(b"bye\n")
        except OSError:
            pass
        self.sock.close()


def claim(path: str) -> tuple[int, int] | None:
    """The (FUSE, root) descriptors a holder at *path* keeps for a dead daemon; None if
    there is no holder or a daemon serves the mount."""
    try:
        sock = _connect(path)
    except OSError:
        return None
    with sock:
        sock.sendall(b"adopt\n")
        data, ancdata, _flags, _addr = sock.recvmsg(16, socket.CMSG_SPACE(8),
                                                    socket.MSG_CMSG_CLOEXEC)
        fds: list[int] = []
        for level, kind, cdata in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", cdata[:len(cdata) - len(cdata) % 4]))
        if data == b"fd\n" and len(fds) == 2:
            return fds[0], fds[1]
        for fd in fds:
            os.close(fd)
        return None  # "busy": a daemon serves it (the usual checks say so)


def holder_pid(path: str) -> int | None:
    """The pid of the holder listening at *path* (its ``status``); None if none answers."""
    try:
        with _connect(path, 2.0) as sock:
            sock.sendall(b"status\n")
            data = b""
            while chunk := sock.recv(4096):
                data += chunk
        return int(json.loads(data)["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def drop(path: str) -> None:
    """Tell the holder at *path* to let its descriptors go (the connection ends)."""
    try:
        with _connect(path) as sock:
            sock.sendall(b"drop\n")
            sock.recv(16)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
