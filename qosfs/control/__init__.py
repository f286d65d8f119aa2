"""Control and observability: the control socket and its line protocol, the service
that answers it (status, stats, set, reload), the ``ctl`` and ``top`` clients, snapshots
of the engine, and Prometheus metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qosfs.core.faces import lazy_face

if TYPE_CHECKING:
    from qosfs.control.ctl import Client, call, checked
    from qosfs.control.exporter import MetricsServer
    from qosfs.control.metrics import render
    from qosfs.control.protocol import (
        Peer,
        ProtocolError,
        Request,
        default_socket_path,
        encode,
        error_reply,
        parse_request,
    )
    from qosfs.control.server import ControlSocket
    from qosfs.control.service import ControlService
    from qosfs.control.snapshot import RateSampler, Snapshot, take_snapshot, to_json

_EXPORTS = {
    "server": ("ControlSocket",),
    "service": ("ControlService",),
    "protocol": (
        "Peer", "ProtocolError", "Request", "default_socket_path", "encode", "error_reply",
        "parse_request"
    ),
    "ctl": ("Client", "call", "checked"),
    "snapshot": ("RateSampler", "Snapshot", "take_snapshot", "to_json"),
    "metrics": ("render",),
    "exporter": ("MetricsServer",),
}
__all__ = [
    "Client", "ControlService", "ControlSocket", "MetricsServer", "Peer", "ProtocolError",
    "RateSampler", "Request", "Snapshot", "call", "checked", "default_socket_path", "encode",
    "error_reply", "parse_request", "render", "take_snapshot", "to_json",
]

if not TYPE_CHECKING:  # type checkers read the imports above
    __getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
