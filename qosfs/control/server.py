"""The control socket: a Unix socket served on the daemon's trio loop.

The socket is bound before the filesystem is mounted, so a path held by another live
daemon fails ``qosfs mount`` with one line instead of a half-started mount, and "mounted"
implies "controllable". A stale socket left by a killed daemon is replaced.

Nothing a client does may block the loop or another client, because every FUSE request
shares that loop:

* each connection is its own task; every receive and send has a deadline: a request must
  arrive whole within :data:`REQUEST_TIMEOUT` of its first byte (a client trickling one
  byte at a time does not restart the clock), a connection with no request for
  :data:`IDLE_TIMEOUT` is dropped, and one that does not read its replies after
  :data:`SEND_TIMEOUT`;
* a line longer than :data:`~qosfs.control.protocol.MAX_REQUEST_BYTES` is refused and the
  connection closed; garbage gets an error reply and the connection goes on;
* requests of a non-root uid are paced (:data:`REQUESTS_PER_SECOND` per uid, over all of
  its connections), a non-root uid holds at most :data:`MAX_CONNECTIONS_PER_UID`
  connections and all of them together :data:`MAX_CONNECTIONS`; root and the admin
  group have :data:`RESERVED_CONNECTIONS` more of their own, so users with a 0666 socket
  can never lock the administrator out; root is never paced;
* a failure while answering is logged and answered with an ``internal`` error: an
  exception must never reach the nursery that also runs ``pyfuse3.main``.

File mode 0600 (root only), or 0660 with the policy's ``[control] admin_group`` as group,
set at bind. The mode is a first gate only: every change is checked against
``SO_PEERCRED`` by :class:`qosfs.control.service.ControlService`. To let every user read status
(``qosfs top``), ``chmod 0666`` the socket; changes stay limited to root and the admin
group, and the daemon keeps the mode the administrator chose (a policy change only
adjusts the group, and the group bits, when ``admin_group`` itself changes). It never acts
on the path by name: a symlink put in its place is not followed.

A planned handover (``qosfs upgrade``) passes the listening socket itself to the
successor (SCM_RIGHTS), so the path never stops answering: the old daemon stops
accepting (:meth:`ControlSocket.stop_accepting`; new connections wait in the backlog for
the successor), answers the requests it holds and the first request of a connection
it accepted, lets connections idle between requests go after :data:`LINGER`, and
closes its descriptor without removing the path (:meth:`ControlSocket.release`). The
successor serves the same socket (``ControlSocket(path, inherited=sock)``).
"""

from __future__ import annotations

import array
import errno
import logging
import math
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from qosfs.control.accepting import AcceptLoop
from qosfs.control.address import answers
from qosfs.control.protocol import (
    MAX_REQUEST_BYTES,
    Peer,
    ProtocolError,
    Request,
    encode,
    error_reply,
    parse_request,
)
from qosfs.core import syscalls
from qosfs.core.errors import EXIT_CONTROL, QosfsError
from qosfs.qos.bucket import TokenBucket

log = logging.getLogger(__name__)

IDLE_TIMEOUT = 60.0  # seconds a connection may stay without starting a request
REQUEST_TIMEOUT = 10.0  # seconds from a request's first byte to its newline
SEND_TIMEOUT = 5.0  # seconds a reply may take to be accepted by the peer
MAX_CONNECTIONS = 256  # unprivileged peers, all together
MAX_CONNECTIONS_PER_UID = 8  # non-root
RESERVED_CONNECTIONS = 512  # root and the admin group, apart from MAX_CONNECTIONS
REQUESTS_PER_SECOND = 50.0  # non-root, per uid
REQUEST_BURST = 50.0
# Seconds an idle connection that was answered before is still served once a successor
# takes the socket over (a request may be on its way; ``qosfs top`` reconnects).
LINGER = 0.05
# ... and one that was accepted but has not sent its first request yet: that client
# connected to send one, and on a loaded machine the gap from connect() to send() can
# pass 50 ms. Closing it would fail a request nobody refused: the old daemon waits for
# it (Listeners.wind_down).
FIRST_REQUEST_LINGER = 1.0
_RECV = 65536
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13; not in Python's list
_PEERGROUPS_BYTES = 1024
_UNIX_PATH_MAX = 107

Handler = Callable[[Request, Peer], Awaitable[dict[str, Any]]]


class ControlSocket:
    """A bound, listening control socket; :meth:`serve` answers on it until cancelled."""

    def __init__(self, path: str, admin_gid: int | None = None,
                 inherited: socket.socket | None = None) -> None:
        """Bind *path*, or serve *inherited*, the listening socket a predecessor bound at
        *path* (its mode and group are left as they are: an administrator's chmod stays)."""
        self.path = os.path.abspath(path)
        if inherited is not None and inherited.getsockname() != self.path:
            raise ValueError(f"the inherited control socket is bound to "
                             f"{inherited.getsockname()!r}, not {self.path}")
        self._sock = _bind(self.path) if inherited is None else inherited
        self._ino = os.lstat(self.path).st_ino
        self._admin_gid: int | None = None
        self._connections: dict[int, int] = {}  # uid -> open connections
        self._pacing: dict[int, TokenBucket] = {}
        self._total = 0  # unprivileged connections
        self._privileged = 0  # root's and the admin group's
        self._loop = AcceptLoop("control socket")
        self._closing_at = math.inf  # trio time at which stop_accepting was called
        # Connections waiting for a request -> how long they linger after stop_accepting.
        self._idle: dict[trio.CancelScope, float] = {}
        if inherited is None:
            self._apply_group(admin_gid, 0o600 if admin_gid is None else 0o660)
        else:
            self._admin_gid = admin_gid

    def __repr__(self) -> str:
        return f"<ControlSocket {self.path} connections={self._total}>"

    def set_admin_group(self, gid: int | None) -> None:
        """The policy's admin group changed (or not): give the socket to that group with
        group read/write, or back to root's group without them. Other bits (an
        administrator's ``chmod 0666`` for ``top``) are kept; nothing happens if the group
        is the same as before, so ``ctl set`` and ``reload`` leave the mode alone."""
        if gid == self._admin_gid:
            return
        try:
            mode = stat.S_IMODE(os.lstat(self.path).st_mode)
        except OSError:
            return
        mode = mode | 0o060 if gid is not None else mode & ~0o070
        self._apply_group(gid, mode)

    def _apply_group(self, gid: int | None, mode: int) -> None:
        """chown/chmod the socket itself: opened O_PATH|O_NOFOLLOW and checked to be the
        socket we bound, so a symlink or another file put at the path is never touched."""
        self._admin_gid = gid
        try:
            fd = os.open(self.path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("control socket %s: cannot open it to set its mode: %s",
                        self.path, exc.strerror)
            return
        try:
            st = os.fstat(fd)
            if not stat.S_ISSOCK(st.st_mode) or st.st_ino != self._ino:
                log.warning("control socket %s was replaced by something else: leaving "
                            "its mode alone", self.path)
                return
            syscalls.chown_fd(fd, -1, 0 if gid is None else gid)
            os.chmod(f"/proc/self/fd/{fd}", mode)  # the magic link is this very inode
        except OSError as exc:  # not root: the socket stays the daemon user's, 0600
            log.debug("control socket %s: cannot set group %s: %s", self.path, gid, exc)
        finally:
            os.close(fd)

    def fileno(self) -> int:
        """The listening socket's descriptor (to pass to a successor)."""
        return self._sock.fileno()

    def connections(self) -> int:
        """Connections open now."""
        return self._total + self._privileged

    def stop_accepting(self) -> None:
        """A successor serves the socket from now on: accept nothing more (connections
        wait in the backlog for it), finish the requests begun, let idle connections go
        once :data:`LINGER` has passed (:data:`FIRST_REQUEST_LINGER` for one that has not
        sent its first request yet). Called on the event loop."""
        self._closing_at = trio.current_time()
        self._loop.stop()
        for wait, linger in self._idle.items():
            wait.deadline = min(wait.deadline, self._closing_at + linger)

    async def stopped(self) -> None:
        """Wait until :meth:`serve` is over: after :meth:`stop_accepting`, until every
        connection it accepted is done (:mod:`qosfs.control.accepting`)."""
        await self._loop.stopped()

    def release(self) -> None:
        """Close this process's descriptor and leave the path: a successor serves it."""
        self._sock.close()

    def close(self) -> None:
        """Close, and remove the path if it is still ours (not replaced meanwhile)."""
        self._sock.close()
        try:
            if os.stat(self.path).st_ino == self._ino:
                os.unlink(self.path)
        except OSError:
            pass

    async def serve(self, handler: Handler,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Accept and answer connections until cancelled (the socket stays open), or
        until the connections left after :meth:`stop_accepting` are done."""
        self._closing_at = math.inf

        async def admit(stream: trio.SocketStream, nursery: trio.Nursery) -> None:
            nursery.start_soon(self._connection, stream, handler)

        await self._loop.run(self._sock, admit, task_status=task_status)

    # ------------------------------------------------------------------ one connection

    async def _connection(self, stream: trio.SocketStream, handler: Handler) -> None:
        async with stream:
            try:
                peer = peer_credentials(stream.socket)
            except OSError:
                return
            refusal = self._admit(peer)
            if refusal is not None:
                with trio.move_on_after(1.0):
                    try:
                        await stream.send_all(encode(error_reply(refusal, "busy")))
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass  # gone already: an exception here would end the daemon
                return
            try:
                await self._converse(stream, peer, handler)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client went away
            except Exception:
                log.exception("control connection from uid %d failed", peer.uid)
            finally:
                self._leave(peer)

    def _privileged_peer(self, peer: Peer) -> bool:
        gid = self._admin_gid
        return peer.uid == 0 or (gid is not None and (peer.gid == gid or gid in peer.groups))

    def _admit(self, peer: Peer) -> str | None:
        held = self._connections.get(peer.uid, 0)
        if self._privileged_peer(peer):
            if self._privileged >= RESERVED_CONNECTIONS:
                return f"too many administrator control connections ({RESERVED_CONNECTIONS})"
            self._privileged += 1
        else:
            if held >= MAX_CONNECTIONS_PER_UID:
                return f"too many control connections for uid {peer.uid} ({held})"
            if self._total >= MAX_CONNECTIONS:
                return f"too many control connections ({MAX_CONNECTIONS})"
            self._total += 1
        self._connections[peer.uid] = held + 1
        return None

    def _leave(self, peer: Peer) -> None:
        if self._privileged_peer(peer):
            self._privileged -= 1
        else:
            self._total -= 1
        left = self._connections[peer.uid] - 1
        if left:
            self._connections[peer.uid] = left
        else:
            del self._connections[peer.uid]
            self._pacing.pop(peer.uid, None)

    async def _converse(self, stream: trio.SocketStream, peer: Peer, handler: Handler) -> None:
        buf = bytearray()
        scanned = 0  # bytes of buf known to hold no newline
        # Deadlines are absolute: bytes trickling in do not push them back.
        idle_until = trio.current_time() + IDLE_TIMEOUT
        request_until = math.inf  # set by a request's first byte
        linger = FIRST_REQUEST_LINGER  # LINGER once a request was answered
        while True:
            newline = buf.find(b"\n", scanned)
            if newline < 0:
                if len(buf) > MAX_REQUEST_BYTES:
                    await _send(stream, error_reply(
                        f"request longer than {MAX_REQUEST_BYTES} bytes", "protocol"))
                    return
                scanned = len(buf)
                if buf.strip() and request_until == math.inf:
                    request_until = trio.current_time() + REQUEST_TIMEOUT
                # Handed over: an idle connection goes (the successor answers its next
                # connection), but not before a request on its way has come.
                lingering = self._closing_at + linger if request_until == math.inf \
                    else math.inf
                with trio.move_on_at(min(idle_until, request_until, lingering)) as wait:
                    if request_until == math.inf:
                        self._idle[wait] = linger
                    try:
                        data = await stream.receive_some(_RECV)
                    finally:
                        self._idle.pop(wait, None)
                    if not data:
                        return  # the client closed its end
                    buf += data
                    continue
                if request_until != math.inf:
                    await _send(stream, error_reply(
                        f"request not complete within {REQUEST_TIMEOUT:g} s", "protocol"))
                return  # silent, or too slow, for too long
            line = bytes(buf[:newline]).rstrip(b"\r")
            del buf[:newline + 1]
            scanned = 0
            if len(line) > MAX_REQUEST_BYTES:
                await _send(stream, error_reply(
                    f"request longer than {MAX_REQUEST_BYTES} bytes", "protocol"))
                return
            if not line.strip():
                continue
            await self._pace(peer)
            if not await _send(stream, await _answer(line, peer, handler)):
                return
            linger = LINGER
            idle_until = trio.current_time() + IDLE_TIMEOUT
            request_until = math.inf if not buf.strip() else \
                trio.current_time() + REQUEST_TIMEOUT

    async def _pace(self, peer: Peer) -> None:
        if peer.uid == 0:
            return
        bucket = self._pacing.get(peer.uid)
        if bucket is None:
            bucket = self._pacing[peer.uid] = TokenBucket(REQUESTS_PER_SECOND, REQUEST_BURST)
        delay = bucket.take(1.0, trio.current_time())
        if delay > 0.0:
            await trio.sleep(delay)


async def _answer(line: bytes, peer: Peer, handler: Handler) -> dict[str, Any]:
    try:
        request = parse_request(line)
    except ProtocolError as exc:
        return error_reply(str(exc), exc.code)
    try:
        return await handler(request, peer)
    except Exception:
        log.exception("control request %s failed", request.cmd)
        return error_reply("internal error (see the daemon's log)", "internal")


async def _send(stream: trio.SocketStream, reply: dict[str, Any]) -> bool:
    """Send one reply line; False if the peer did not take it within SEND_TIMEOUT."""
    with trio.move_on_after(SEND_TIMEOUT):
        await stream.send_all(encode(reply))
        return True
    return False


def peer_credentials(sock: Any) -> Peer:
    """pid, uid, gid and supplementary groups of a connected Unix socket's peer."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        struct.calcsize("3i")))
    groups: tuple[int, ...] = ()
    try:
        # 1024 bytes (256 groups) is the most Python's getsockopt() accepts; a larger
        # buflen raised OSError every time, so supplementary groups never counted.
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, _PEERGROUPS_BYTES)
        groups = tuple(array.array("I", raw[:len(raw) - len(raw) % 4]))
    except OSError:  # old kernel, or more than 256 groups: the primary gid still counts
        pass
    return Peer(pid, uid, gid, groups)


def _bind(path: str) -> socket.socket:
    """A listening Unix socket at ``path``, mode 0600 from the start (no window)."""
    if len(os.fsencode(path)) > _UNIX_PATH_MAX:
        raise QosfsError(f"control socket path {path} is too long for a Unix socket "
                         f"(at most {_UNIX_PATH_MAX} bytes); pass a shorter --socket",
                         EXIT_CONTROL)
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
    except OSError as exc:
        raise QosfsError(f"cannot create {directory} for the control socket: "
                         f"{exc.strerror} (pass --socket PATH)", EXIT_CONTROL) from None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        _bind_replacing_stale(sock, path)
        sock.listen(64)
    except BaseException:
        sock.close()
        raise
    return sock


def _bind_replacing_stale(sock: socket.socket, path: str) -> None:
    old_umask = os.umask(0o177)
    try:
        try:
            sock.bind(path)
            return
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise QosfsError(f"cannot create control socket {path}: {exc.strerror}",
                                 EXIT_CONTROL) from None
        # A symbolic link: the pointer a mount made with --socket left here
        # (qosfs.daemon.pointer), stale unless the socket it leads to answers.
        mode = os.lstat(path).st_mode
        if not (stat.S_ISSOCK(mode) or stat.S_ISLNK(mode)):
            raise QosfsError(f"{path} exists and is not a socket; pass another --socket",
                             EXIT_CONTROL)
        if answers(path):
            raise QosfsError(f"control socket {path} is in use by a running qosfs daemon; "
                             "pass another --socket", EXIT_CONTROL)
        log.info("replacing stale control socket %s", path)
        os.unlink(path)
        try:
            sock.bind(path)
        except OSError as exc:
            raise QosfsError(f"cannot create control socket {path}: {exc.strerror}",
                             EXIT_CONTROL) from None
    finally:
        os.umask(old_umask)


