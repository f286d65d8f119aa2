"""The mount's listening sockets, the control socket and the metrics listener: bound once
per mount, not per process, and handed from a daemon to its successor with the mount.

A ``qosfs ctl`` or a scrape during an upgrade must not find the mount deaf (issue 31
lists both among what travels). The old daemon sends the listening sockets themselves at
prepare (SCM_RIGHTS, :mod:`qosfs.daemon.takeover.offer`), stops accepting once the successor is
ready (:meth:`Listeners.wind_down`: the requests and scrapes it holds are answered, new
connections wait in the kernel's backlog), and closes its descriptors, leaving the
socket's path in place, once the successor serves (:meth:`Listeners.release`). The
successor serves the same sockets from its first loop on, so from the client's side there
is never a moment without a listener: a connection made meanwhile is answered late, never
refused. If the successor fails, the old daemon still holds them and serves on.

A control socket away from its derived path (``--socket PATH``) has a pointer there
(:mod:`qosfs.daemon.pointer`), which lives as long as the socket's path: left at bind and
by a successor, kept at release, removed at close.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import trio

from qosfs.control import exporter
from qosfs.control import server as control_server
from qosfs.control.exporter import MetricsServer
from qosfs.control.server import ControlSocket
from qosfs.daemon import pointer as socket_pointer

#: The most the old daemon waits, once a successor is ready, for its control requests and
#: scrapes in progress to be answered: as long as one exchange may take (the exporter's
#: TIMEOUT, a control request's REQUEST_TIMEOUT). They take milliseconds, but a bound of
#: 1 s could cut one on a loaded machine, and the process then ended with the connection
#: open. Waiting costs no caller anything: the old daemon reads /dev/fuse until this is
#: done, so a slow or hostile client can delay an upgrade by this much, never stall a job.
WIND_DOWN_LIMIT = max(exporter.TIMEOUT, control_server.REQUEST_TIMEOUT)


@dataclass
class Listeners:
    """The control socket and, with ``--metrics``, the metrics listener."""

    control: ControlSocket
    metrics: MetricsServer | None
    pointer: str | None = None  # the derived path that names the control socket

    @classmethod
    def bind(cls, control_path: str, admin_gid: int | None,
             metrics: str | None, pointer: str | None = None) -> Listeners:
        """Bind both (QosfsError, with one line, if either is taken), and leave the
        *pointer* to the control socket (`qosfs.daemon.pointer.pointer_path`)."""
        control = ControlSocket(control_path, admin_gid)
        try:
            bound = cls(control, MetricsServer(metrics) if metrics is not None else None,
                        pointer)
        except BaseException:
            control.close()
            raise
        bound.point()
        return bound

    @classmethod
    def inherit(cls, control_path: str, admin_gid: int | None, metrics: str | None,
                control_fd: int, metrics_fd: int | None,
                pointer: str | None = None) -> Listeners:
        """Serve the sockets a predecessor passed; ValueError if they are not the ones
        this mount's configuration names (the descriptors are then still the caller's to
        close). The *pointer* is left again: it names the same socket, and a predecessor
        of an older version may not have left one."""
        sockets = [socket.socket(fileno=control_fd)]
        if metrics_fd is not None:
            sockets.append(socket.socket(fileno=metrics_fd))
        try:
            if (metrics is None) != (metrics_fd is None):
                raise ValueError("the metrics listener does not match --metrics")
            control = ControlSocket(control_path, admin_gid, inherited=sockets[0])
            served = MetricsServer(metrics, inherited=sockets[1]) \
                if metrics is not None else None
        except BaseException:
            for sock in sockets:
                sock.detach()
            raise
        inherited = cls(control, served, pointer)
        inherited.point()
        return inherited

    def point(self) -> None:
        """Leave the pointer to the control socket, if it is away from its derived path."""
        if self.pointer is not None:
            socket_pointer.leave(self.pointer, self.control.path)

    def fds(self) -> dict[str, int]:
        """The descriptors to pass to a successor, by name."""
        fds = {"control": self.control.fileno()}
        if self.metrics is not None:
            fds["metrics"] = self.metrics.fileno()
        return fds

    async def wind_down(self, limit: float = WIND_DOWN_LIMIT) -> None:
        """Stop accepting and wait (at most *limit* seconds) until the connections in
        progress are done: the successor answers the next ones."""
        servers: list[ControlSocket | MetricsServer] = [self.control]
        if self.metrics is not None:
            servers.append(self.metrics)
        for server in servers:
            server.stop_accepting()
        # Not a count of the connections open now: an accept already woken when the
        # cancel came still returns its connection, a moment later. Counting at once saw
        # none, the process ended, and that connection was cut unanswered (an empty
        # /metrics answer in CI). Each server's serve() is over only once its accept loop
        # has ended and what it accepted is done.
        with trio.move_on_after(limit):
            for server in servers:
                await server.stopped()

    def release(self) -> None:
        """A successor serves them: close this process's descriptors, leave the path (and
        the pointer)."""
        self.control.release()
        if self.metrics is not None:
            self.metrics.release()

    def close(self) -> None:
        """The mount ends: close them and remove the control socket's path and pointer."""
        self.control.close()
        if self.pointer is not None:
            socket_pointer.remove(self.pointer, self.control.path)
        if self.metrics is not None:
            self.metrics.close()
