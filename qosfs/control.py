"""The control socket: a Unix socket served on the daemon's trio loop.

The socket is bound before the filesystem is mounted, so a path held by another live
daemon fails ``qosfs mount`` with one line instead of a half-started mount, and "mounted"
implies "controllable". A stale socket left by a killed daemon is replaced.

Nothing a client does may block the loop or another client, because every FUSE request
shares that loop:

* each connection is its own task; every receive and send has a deadline (a silent client
  is dropped after :data:`IDLE_TIMEOUT`, one that does not read its replies after
  :data:`SEND_TIMEOUT`);
* a line longer than :data:`~qosfs.protocol.MAX_REQUEST_BYTES` is refused and the
  connection closed; garbage gets an error reply and the connection goes on;
* requests of a non-root uid are paced (:data:`REQUESTS_PER_SECOND` per uid, over all of
  its connections), and a non-root uid holds at most :data:`MAX_CONNECTIONS_PER_UID`
  connections, so nobody can hog the loop or the connection slots; root is never paced;
* a failure while answering is logged and answered with an ``internal`` error: an
  exception must never reach the nursery that also runs ``pyfuse3.main``.

File mode 0600 (root only), or 0660 with the policy's ``[control] admin_group`` as group.
The mode is a first gate only: every change is checked against ``SO_PEERCRED`` by
:class:`qosfs.controller.Controller`. To let every user read status (``qosfs top``),
``chmod 0666`` the socket; changes stay limited to root and the admin group.
"""

from __future__ import annotations

import array
import errno
import logging
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from qosfs.bucket import TokenBucket
from qosfs.errors import EXIT_CONTROL, QosfsError
from qosfs.protocol import (
    MAX_REQUEST_BYTES,
    Peer,
    ProtocolError,
    Request,
    encode,
    error_reply,
    parse_request,
)

log = logging.getLogger(__name__)

IDLE_TIMEOUT = 60.0  # seconds a connection may stay without completing a request
SEND_TIMEOUT = 5.0  # seconds a reply may take to be accepted by the peer
MAX_CONNECTIONS = 256
MAX_CONNECTIONS_PER_UID = 16  # non-root
REQUESTS_PER_SECOND = 50.0  # non-root, per uid
REQUEST_BURST = 50.0
_RECV = 65536
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13; not in Python's list
_PEERGROUPS_BYTES = 1024
_UNIX_PATH_MAX = 107

Handler = Callable[[Request, Peer], Awaitable[dict[str, Any]]]


class ControlSocket:
    """A bound, listening control socket; :meth:`serve` answers on it until cancelled."""

    def __init__(self, path: str, admin_gid: int | None = None) -> None:
        self.path = os.path.abspath(path)
        self._sock = _bind(self.path)
        self._ino = os.stat(self.path).st_ino
        self.set_admin_group(admin_gid)
        self._connections: dict[int, int] = {}  # uid -> open connections
        self._pacing: dict[int, TokenBucket] = {}
        self._total = 0

    def __repr__(self) -> str:
        return f"<ControlSocket {self.path} connections={self._total}>"

    def set_admin_group(self, gid: int | None) -> None:
        """0660 with group ``gid`` (members may connect), or 0600 root only."""
        try:
            os.chown(self.path, -1, 0 if gid is None else gid)
            os.chmod(self.path, 0o600 if gid is None else 0o660)
        except OSError as exc:  # not root: the socket stays the daemon user's, 0600
            log.debug("control socket %s: cannot set group %s: %s", self.path, gid, exc)

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
        """Accept and answer connections until cancelled (the socket stays open)."""
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(self._sock.dup()))
        async with listener, trio.open_nursery() as nursery:
            task_status.started()
            while True:
                try:
                    stream = await listener.accept()
                except OSError as exc:  # EMFILE and friends: back off, keep serving
                    log.warning("control socket accept failed: %s", exc)
                    await trio.sleep(0.1)
                    continue
                nursery.start_soon(self._connection, stream, handler)

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
                    await stream.send_all(encode(error_reply(refusal, "busy")))
                return
            try:
                await self._converse(stream, peer, handler)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client went away
            except Exception:
                log.exception("control connection from uid %d failed", peer.uid)
            finally:
                self._leave(peer)

    def _admit(self, peer: Peer) -> str | None:
        if self._total >= MAX_CONNECTIONS:
            return f"too many control connections ({MAX_CONNECTIONS})"
        held = self._connections.get(peer.uid, 0)
        if peer.uid != 0 and held >= MAX_CONNECTIONS_PER_UID:
            return f"too many control connections for uid {peer.uid} ({held})"
        self._connections[peer.uid] = held + 1
        self._total += 1
        return None

    def _leave(self, peer: Peer) -> None:
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
        while True:
            newline = buf.find(b"\n", scanned)
            if newline < 0:
                if len(buf) > MAX_REQUEST_BYTES:
                    await _send(stream, error_reply(
                        f"request longer than {MAX_REQUEST_BYTES} bytes", "protocol"))
                    return
                scanned = len(buf)
                with trio.move_on_after(IDLE_TIMEOUT):
                    data = await stream.receive_some(_RECV)
                    if not data:
                        return  # the client closed its end
                    buf += data
                    continue
                return  # silent for too long
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
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise QosfsError(f"{path} exists and is not a socket; pass another --socket",
                             EXIT_CONTROL)
        if _answers(path):
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


def _answers(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError:
        return False  # ECONNREFUSED: nobody listens, it is stale
    finally:
        probe.close()
    return True
