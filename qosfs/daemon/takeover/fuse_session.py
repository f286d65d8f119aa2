"""Live handover, the native piece: a successor process serves the mount of a running one.

The FUSE connection lives as long as one process holds its ``/dev/fuse`` descriptor, and a
descriptor passes between processes over a Unix socket (SCM_RIGHTS). But the kernel sends
INIT once per connection, and libfuse (3.18) refuses every request of a session that has
not seen INIT. deploy/libfuse's two patches add what is missing:
``fuse_session_get_conn``/``fuse_session_adopt`` in libfuse, and in pyfuse3
``session_state()``, ``get_session_fd()``, ``init_adopted()`` and ``notify_resend()``.
This module is qosfs's one interface over them:

- `unavailable_reason` says why a handover cannot be done here (pyfuse3 without the patch,
  or built against the system's libfuse), before anything is stopped;
- `export_session` (the old process) returns what travels with the descriptor: the state
  negotiated at INIT, as plain integers (`STATE_KEYS`);
- `adopt` (the new process) starts pyfuse3 on that descriptor and state, without INIT;
- `resend` has the kernel send again the requests a dead predecessor had read and not
  answered (FUSE_NOTIFY_RESEND, Linux 6.9): the crash path;
- `send_message`/`receive_message` carry a JSON payload and descriptors (SCM_RIGHTS) over
  a connected Unix stream socket, and `check_fuse_fd` checks a received descriptor.

What must travel besides (node ids and their lookup counts, open files with their backing
descriptors, buckets) is the file system's business: the kernel keeps using the node ids
and file handles the old process gave it, so the new one must map them to the same files.
"""

from __future__ import annotations

import array
import json
import os
import socket
import stat
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pyfuse3

#: The connection parameters pyfuse3's ``session_state()`` returns (struct fuse_conn_info);
#: a state missing one is refused before the kernel gets a reply shaped for another protocol.
STATE_KEYS = frozenset({
    "proto_major", "proto_minor", "max_write", "max_read", "max_readahead", "capable",
    "want", "max_background", "congestion_threshold", "time_gran",
    "max_backing_stack_depth", "no_interrupt", "capable_ext", "want_ext", "request_timeout",
})

#: The kernel passes at most SCM_MAX_FD (253) descriptors in one message.
MAX_FDS = 253

#: /dev/fuse is the misc device 10:229.
_FUSE_DEVICE = os.makedev(10, 229)

#: A message's header: the payload's length in bytes, then its descriptor count.
_HEADER = struct.Struct("!II")

#: Protocol minor that brought FUSE_NOTIFY_RESEND (Linux 6.9).
RESEND_MINOR = 40


class HandoverError(Exception):
    """A handover cannot go on; the message is one line for the log and the caller."""


@dataclass(frozen=True, slots=True)
class Session:
    """What the successor needs to serve the connection: its descriptor and the state
    negotiated at INIT (the keys of `STATE_KEYS`, plain integers, so it can travel as JSON)."""

    fuse_fd: int
    state: dict[str, int]


@dataclass(frozen=True, slots=True)
class Message:
    """One message: its kind, its JSON payload and the descriptors that came with it (the
    receiver owns them)."""

    kind: str
    payload: dict[str, Any]
    fds: list[int]


def unavailable_reason(binding: ModuleType | Any = pyfuse3) -> str | None:
    """Why this pyfuse3 cannot hand its mount over or adopt one, or None if it can."""
    if getattr(binding, "init_adopted", None) is None:
        return "pyfuse3 lacks the adopt patch (make deps builds it: deploy/libfuse)"
    if not getattr(binding, "ADOPT_SUPPORTED", False):
        return ("pyfuse3 was built against a libfuse without fuse_session_adopt "
                "(the system's; deploy/libfuse builds one with it)")
    return None


def _require(binding: ModuleType | Any) -> None:
    reason = unavailable_reason(binding)
    if reason is not None:
        raise HandoverError(f"handover unavailable: {reason}")


def export_session(binding: ModuleType | Any = pyfuse3) -> Session:
    """The running session's descriptor and negotiated state (after INIT).

    The descriptor stays pyfuse3's: once the successor serves, the old process calls
    ``pyfuse3.close(unmount=False)``, which closes its copy and leaves the mount alone.
    """
    _require(binding)
    try:
        state = dict(binding.session_state())
        fd = int(binding.get_session_fd())
    except OSError as exc:
        raise HandoverError(f"handover unavailable: {exc.strerror or exc}") from None
    return Session(fd, {key: int(value) for key, value in state.items()})


def check_state(state: Mapping[str, Any]) -> dict[str, int]:
    """*state* as integers, or HandoverError naming what is missing or wrong."""
    missing = STATE_KEYS - state.keys()
    if missing:
        raise HandoverError(f"session state lacks {', '.join(sorted(missing))}")
    values: dict[str, int] = {}
    for key in STATE_KEYS:
        value = state[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise HandoverError(f"session state: {key} is not a count ({value!r})")
        values[key] = value
    return values


def check_fuse_fd(fd: int) -> None:
    """HandoverError unless *fd* is an open /dev/fuse descriptor."""
    try:
        st = os.fstat(fd)
    except OSError as exc:
        raise HandoverError(f"received descriptor {fd}: {exc.strerror}") from None
    if not stat.S_ISCHR(st.st_mode) or st.st_rdev != _FUSE_DEVICE:
        raise HandoverError(f"received descriptor {fd} is not /dev/fuse")


def adopt(ops: pyfuse3.Operations, session: Session, mountpoint: str | None,
          options: Iterable[str], binding: ModuleType | Any = pyfuse3) -> None:
    """Start pyfuse3 on an adopted connection, in place of ``pyfuse3.init``.

    Then ``pyfuse3.main()`` serves it from the first request read; ``ops.init()`` has been
    called. *mountpoint* is what ``pyfuse3.close(unmount=True)`` unmounts (None: never).
    The predecessor must have stopped reading requests (it may still answer those it
    holds). The descriptor belongs to pyfuse3 from here on.
    """
    _require(binding)
    state = check_state(session.state)
    check_fuse_fd(session.fuse_fd)
    try:
        binding.init_adopted(ops, session.fuse_fd, state, mountpoint, set(options))
    except OSError as exc:
        raise HandoverError(f"adopting the FUSE session failed: {exc.strerror or exc}") from None


def resend(binding: ModuleType | Any = pyfuse3) -> None:
    """Have the kernel send again every request it sent and that is unanswered.

    For a successor of a process that died: what it had read comes again (with the high
    bit of the unique id set) and is executed a second time, so the requests had better be
    idempotent (reads, writes at an offset, getattr are; a create or a rename is not).
    HandoverError on a kernel older than 6.9 (ENOSYS) or without a session.
    """
    _require(binding)
    try:
        binding.notify_resend()
    except OSError as exc:
        raise HandoverError(f"FUSE_NOTIFY_RESEND refused: {exc.strerror or exc}") from None


def send_message(sock: socket.socket, kind: str, payload: Mapping[str, Any],
                 fds: Sequence[int] = ()) -> None:
    """Send one message over a connected Unix stream socket: the header and the start of
    the payload carry the descriptors (SCM_RIGHTS), the rest of the payload follows."""
    if len(fds) > MAX_FDS:
        raise HandoverError(f"{len(fds)} descriptors in one message (at most {MAX_FDS})")
    body = json.dumps({"kind": kind, "payload": dict(payload)}).encode()
    data = _HEADER.pack(len(body), len(fds)) + body
    first = 65536
    if fds:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        sent = sock.sendmsg([data[:first]], ancillary)
    else:
        sent = sock.send(data[:first])
    if sent < len(data):  # (an empty send to a peer that has closed fails with EPIPE)
        sock.sendall(data[sent:])


def receive_message(sock: socket.socket) -> Message:
    """Receive one message of `send_message`; HandoverError if the peer closed first or
    sent fewer descriptors than announced (those received are closed then)."""
    fds: list[int] = []
    header = b""
    try:
        while len(header) < _HEADER.size:
            data, ancdata, _flags, _addr = sock.recvmsg(  # close-on-exec, as all of ours
                _HEADER.size - len(header), socket.CMSG_SPACE(MAX_FDS * 4),
                socket.MSG_CMSG_CLOEXEC)
            for level, kind, cdata in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    usable = len(cdata) - len(cdata) % 4
                    fds.extend(array.array("i", cdata[:usable]))
            if not data:
                raise HandoverError("the peer closed the handover socket")
            header += data
        length, count = _HEADER.unpack(header)
        body = bytearray()
        while len(body) < length:
            chunk = sock.recv(min(length - len(body), 1 << 20))
            if not chunk:
                raise HandoverError("the peer closed the handover socket mid-message")
            body += chunk
        if len(fds) != count:
            raise HandoverError(f"expected {count} descriptors, received {len(fds)}")
        message = json.loads(body)
        return Message(str(message["kind"]), dict(message["payload"]), fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
