"""``qosfs mount --metrics HOST:PORT``: serve ``/metrics`` over HTTP from the trio loop.

Why not prometheus_client's ``start_http_server``: it scrapes from its own thread, which
would iterate the engine's dicts while the loop changes them ("dictionary changed size
during iteration") or see half of a policy swap. Here the snapshot is taken on the loop
(consistent, a copy of plain numbers), and only the text formatting -- the expensive,
pure part -- runs in a worker thread (one at a time). The listening socket is bound
before mounting, so a busy port fails ``qosfs mount`` with one line.

The server speaks just enough HTTP/1.1 for Prometheus, curl and browsers: ``GET`` or
``HEAD`` of ``/metrics`` (any query string), one request per connection. It answers in
OpenMetrics when the ``Accept`` header asks for it and gzips the body when
``Accept-Encoding`` allows (expositions are repetitive text: a small mount's 25 kB
shrinks to 2.5 kB). Every read and write has a deadline and connections are
capped, so a slow scraper costs nothing.

Nobody can hold the endpoint shut with idle connections (a local user could, with 16 of
them, for as long as they kept reconnecting): the request head must arrive within
:data:`HEAD_TIMEOUT`, a remote address holds at most :data:`MAX_PER_ADDRESS` connections,
and when all :data:`MAX_CONNECTIONS` are taken a new connection evicts the oldest one
that has not sent its request yet -- a scraper sends it at once, so it is served.

A planned handover (``qosfs upgrade``) passes the listening socket to the successor
(SCM_RIGHTS), so the port never refuses a scrape: the old daemon stops accepting
(:meth:`MetricsServer.stop_accepting`; new connections wait in the backlog for the
successor), finishes the scrapes it holds, and closes its descriptor.
"""

from __future__ import annotations

import gzip
import logging
import socket
from collections.abc import Callable

import trio

from qosfs.control.accepting import AcceptLoop
from qosfs.control.metrics import render_for
from qosfs.control.snapshot import Snapshot
from qosfs.core.errors import EXIT_CONTROL, EXIT_USAGE, QosfsError

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
HEAD_LIMIT = 8192
HEAD_TIMEOUT = 2.0  # seconds from accept to a complete request head
TIMEOUT = 10.0  # seconds for the whole exchange
MAX_CONNECTIONS = 64
MAX_PER_ADDRESS = 8  # remote addresses; local users all connect from loopback


def parse_address(text: str) -> tuple[str, int]:
    """``"9567"`` or ``":9567"`` -> loopback; ``"0.0.0.0:9567"``, ``"[::]:9567"``."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    host = host.strip("[]") or DEFAULT_HOST
    if not port.isdigit() or not 0 <= int(port) < 65536:  # 0: any free port (tests)
        raise QosfsError(f"--metrics {text}: expected [HOST:]PORT, e.g. 9567 or "
                         "0.0.0.0:9567", EXIT_USAGE)
    return host, int(port)


class MetricsServer:
    """A bound HTTP listener; :meth:`serve` answers scrapes until cancelled."""

    def __init__(self, address: str, inherited: socket.socket | None = None) -> None:
        """Bind *address*, or serve *inherited*, the listening socket a predecessor bound
        for it."""
        self.host, self.port = parse_address(address)
        if inherited is not None and self.port not in (0, inherited.getsockname()[1]):
            raise ValueError(f"the inherited metrics listener is on port "
                             f"{inherited.getsockname()[1]}, not {self.port}")
        self._sock = _bind(self.host, self.port) if inherited is None else inherited
        self.port = self._sock.getsockname()[1]  # the real one when asked for port 0
        self._loop = AcceptLoop("metrics")
        self._open = 0
        self._render = trio.CapacityLimiter(1)
        # Connections still waiting for their request head, oldest first (evictable).
        self._waiting: dict[int, trio.CancelScope] = {}
        self._by_address: dict[str, int] = {}
        self._evicted: set[int] = set()
        self.evicted = 0

    def __repr__(self) -> str:
        return f"<MetricsServer {self.host}:{self.port}>"

    def close(self) -> None:
        self._sock.close()

    release = close  # (a TCP port has no path to leave behind: the same as close)

    def fileno(self) -> int:
        """The listening socket's descriptor (to pass to a successor)."""
        return self._sock.fileno()

    def connections(self) -> int:
        """Connections open now."""
        return self._open

    def stop_accepting(self) -> None:
        """A successor serves the port from now on: accept nothing more (connections
        wait in the backlog for it); the scrapes begun are finished. On the event loop."""
        self._loop.stop()

    async def stopped(self) -> None:
        """Wait until :meth:`serve` is over: after :meth:`stop_accepting`, until every
        scrape it accepted is answered (:mod:`qosfs.control.accepting`)."""
        await self._loop.stopped()

    async def serve(self, snapshot: Callable[[], Snapshot],
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Answer scrapes with *snapshot*'s until cancelled, or until the ones left after
        :meth:`stop_accepting` are done."""

        async def admit(stream: trio.SocketStream, nursery: trio.Nursery) -> None:
            address = _remote_address(stream)
            if address is not None and self._by_address.get(address, 0) >= MAX_PER_ADDRESS:
                await stream.aclose()
                return
            if self._open >= MAX_CONNECTIONS and not self._evict_oldest_waiting():
                await stream.aclose()
                return
            self._open += 1
            if address is not None:
                self._by_address[address] = self._by_address.get(address, 0) + 1
            nursery.start_soon(self._connection, stream, address, snapshot)

        await self._loop.run(self._sock, admit, task_status=task_status)

    def _evict_oldest_waiting(self) -> bool:
        """Free a slot by closing the oldest connection that sent no request yet."""
        for key, scope in self._waiting.items():
            del self._waiting[key]
            self._evicted.add(key)
            scope.cancel()
            self._open -= 1  # its slot is free now; its task only closes the stream
            self.evicted += 1
            return True
        return False

    async def _connection(self, stream: trio.SocketStream, address: str | None,
                          snapshot: Callable[[], Snapshot]) -> None:
        key = id(stream)
        try:
            async with stream:
                with trio.move_on_after(TIMEOUT):
                    head = None
                    with trio.move_on_after(HEAD_TIMEOUT) as waiting:
                        self._waiting[key] = waiting
                        head = await _read_head(stream)
                    self._waiting.pop(key, None)
                    if head is not None:
                        await self._exchange(stream, head, snapshot)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:
            log.exception("metrics request failed")
        finally:
            self._waiting.pop(key, None)
            if key in self._evicted:
                self._evicted.discard(key)
            else:
                self._open -= 1
            if address is not None:
                left = self._by_address[address] - 1
                if left:
                    self._by_address[address] = left
                else:
                    del self._by_address[address]

    async def _exchange(self, stream: trio.SocketStream, head: bytes,
                        snapshot: Callable[[], Snapshot]) -> None:
        if len(head) > HEAD_LIMIT:
            await _respond(stream, 431, b"request head too large\n")
            return
        method, _, rest = head.partition(b" ")
        path = rest.partition(b" ")[0].partition(b"?")[0]
        if method not in (b"GET", b"HEAD"):
            await _respond(stream, 405, b"only GET and HEAD\n")
        elif path == b"/metrics":
            headers = _headers(head)
            snap = snapshot()
            body, content_type = await trio.to_thread.run_sync(
                _encode, snap, headers.get("accept", ""),
                "gzip" in headers.get("accept-encoding", ""), limiter=self._render)
            await _respond(stream, 200, body, content_type, head_only=method == b"HEAD",
                           gzipped="gzip" in headers.get("accept-encoding", ""))
        elif path == b"/":
            await _respond(stream, 200, b"qosfs exporter: see /metrics\n")
        else:
            await _respond(stream, 404, b"not found; see /metrics\n")


async def _read_head(stream: trio.SocketStream) -> bytes | None:
    """The request head (up to just past HEAD_LIMIT), or None if the peer closed first."""
    head = bytearray()
    while b"\r\n\r\n" not in head and b"\n\n" not in head and len(head) <= HEAD_LIMIT:
        data = await stream.receive_some(4096)
        if not data:
            return None
        head += data
    return bytes(head)


def _headers(head: bytes) -> dict[str, str]:
    """The request's header fields, names lowercased (the last of repeated ones)."""
    fields = {}
    for line in head.decode("latin-1").split("\n")[1:]:
        name, sep, value = line.partition(":")
        if sep:
            fields[name.strip().lower()] = value.strip()
    return fields


def _encode(snap: Snapshot, accept: str, gzipped: bool) -> tuple[bytes, str]:
    """The exposition the scraper asked for, compressed if it accepts gzip (on a worker
    thread: both steps are pure and the larger cost of a scrape)."""
    body, content_type = render_for(snap, accept)
    return (gzip.compress(body, compresslevel=6) if gzipped else body), content_type


def _remote_address(stream: trio.SocketStream) -> str | None:
    """The peer's address if it is another host (loopback peers are all local users)."""
    try:
        host = stream.socket.getpeername()[0]
    except (OSError, IndexError):
        return None
    return None if host in ("127.0.0.1", "::1") or host.startswith("::ffff:127.") else host


_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large"}


async def _respond(stream: trio.SocketStream, status: int, body: bytes,
                   content_type: str = "text/plain; charset=utf-8",
                   head_only: bool = False, gzipped: bool = False) -> None:
    encoding = "Content-Encoding: gzip\r\n" if gzipped else ""
    header = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
              f"{encoding}Content-Length: {len(body)}\r\nVary: Accept, Accept-Encoding\r\n"
              "Connection: close\r\n\r\n").encode()
    await stream.send_all(header if head_only else header + body)


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise QosfsError(f"--metrics {host}:{port}: {exc.strerror}", EXIT_USAGE) from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind | socket.SOCK_CLOEXEC, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(64)
    except OSError as exc:
        sock.close()
        raise QosfsError(f"cannot serve metrics on {host}:{port}: {exc.strerror}",
                         EXIT_CONTROL) from None
    return sock
