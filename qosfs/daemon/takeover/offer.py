"""The serving daemon's side of a planned handover (``qosfs upgrade``,
:mod:`qosfs.daemon.takeover.upgrade` is the successor's side and says what the protocol is): a
Unix socket next to the control socket (``/run/qosfs/NAME.handover`` for
``/run/qosfs/NAME.sock``, mode 0600; the peer must be root or the daemon's own user,
checked by SO_PEERCRED), on which this process prepares a successor while it serves,
stops reading /dev/fuse for one that is ready, commits its tables, or takes its session
back from a successor that failed after that.

Taking back: if the successor fails between ``ready`` and ``serving`` (it died, or said
something else), the kernel can have seen nothing of it but requests it read and never
answered. This process kills it (by the pidfd taken when it connected, so never another
process) and waits until it is gone, which makes the kernel requeue nothing and leaves no
second reader, then adopts its own session again with the tables it never changed
(:func:`qosfs.passthrough.transfer.export_state` changes nothing) and serves on.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import signal
import socket
import stat
import struct
import time
from contextlib import ExitStack
from typing import Any, Protocol

import pyfuse3
import trio

from qosfs import __version__
from qosfs.control.address import beside_socket
from qosfs.daemon.takeover import fuse_session
from qosfs.daemon.takeover.listeners import Listeners
from qosfs.passthrough.filesystem import Filesystem
from qosfs.passthrough.transfer import export_state
from qosfs.qos.interface import QosEngine
from qosfs.qos.latency.loop import LatencyLoop

log = logging.getLogger(__name__)

#: The handover protocol this daemon hands over in (messages and payloads): 2 since the
#: open files travel as their OpenRecords (:mod:`qosfs.passthrough.transfer`).
PROTOCOL = 2

#: The protocols a successor of this build takes a mount over in: also 1, the build
#: before's (the open files as dicts), so that ``qosfs upgrade`` from it works. Its
#: daemon wants the hello's ``protocol`` to be 1 and knows no other key; this build's
#: successor says ``protocol`` 1 and, in ``protocols``, all it speaks (`adopt_hello`).
PROTOCOLS = (1, 2)

#: An environment variable that overrides the version a daemon reports (tests show a
#: successor runs other code without building another package).
VERSION_ENV = "QOSFS_VERSION"

#: How long the old daemon waits for a successor's answer at prepare (building the
#: operations for a large tree takes a while), then serves on without it.
PREPARE_TIMEOUT = 60.0

#: How long the old daemon waits, once it stopped reading, for the successor to serve:
#: COMMIT_TIMEOUT, plus COMMIT_PER_ENTRY for each inode, open file and directory sent
#: (`commit_timeout`). Nobody reads /dev/fuse meanwhile, so every caller of the mount
#: stalls for as long as a hung successor is waited for: the wait must be as short as a
#: good commit allows. A good commit took 10-50 ms for a small table and 1.35-1.64 s for
#: 100,000 inodes and 5,000 open files (about 15 us an entry, on 2 busy cores); the
#: allowance is three times that per entry, and a base that covers a successor
#: descheduled for a while. (It was 30 s flat: half a minute of every caller stalled,
#: and yet too short for two million inodes.)
COMMIT_TIMEOUT = 3.0
COMMIT_PER_ENTRY = 45e-6

#: What a handover can come to, as ``qosfs_handovers_total{result}`` counts them: a
#: successor took over (``completed``, counted by ``handovers``), one failed before this
#: daemon stopped reading (``refused``: nobody noticed), or after it, so that this daemon
#: took the session back (``taken_back``: every caller stalled until then).
FAILURES = ("refused", "taken_back")

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def commit_timeout(entries: int) -> float:
    """How long to wait for a successor's ``serving`` after sending it *entries* inodes,
    open files and directories."""
    return COMMIT_TIMEOUT + entries * COMMIT_PER_ENTRY


def daemon_version() -> str:
    """The version this process reports: qosfs's, unless $QOSFS_VERSION says otherwise."""
    return os.environ.get(VERSION_ENV) or __version__


def adopt_hello() -> dict[str, Any]:
    """What a successor says first: ``protocols``, those it takes a mount over in, and
    ``protocol`` 1, which a daemon of the build before (protocol 1, equal or refused)
    accepts."""
    return {"protocol": PROTOCOLS[0], "protocols": list(PROTOCOLS),
            "version": daemon_version(), "pid": os.getpid()}


def chosen_protocol(hello: dict[str, Any]) -> int:
    """The protocol to hand over to the successor that said *hello* in: this daemon's, if
    it speaks it (a successor that names none in ``protocols`` speaks its ``protocol``
    alone). HandoverError, with the reason the successor is told, if it does not: a
    build before protocol 2 (a rollback) cannot take this mount over live."""
    spoken = hello.get("protocols", [hello.get("protocol")])
    if isinstance(spoken, list) and PROTOCOL in spoken:
        return PROTOCOL
    version = hello.get("version", "unknown")
    if spoken == [1]:
        raise fuse_session.HandoverError(
            f"the successor (qosfs {version}) speaks handover protocol 1 only: a build "
            f"from before protocol {PROTOCOL}, which this daemon hands over in, cannot take "
            f"the mount over live (unmount, then mount with that build)")
    raise fuse_session.HandoverError(f"handover protocol {spoken} (qosfs {version}) is not "
                                     f"this daemon's ({PROTOCOL})")


def handover_socket_path(control_path: str) -> str:
    """The handover socket beside the control socket *control_path*."""
    return beside_socket(control_path, ".handover")


def _peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of *sock*."""
    pid, uid, _gid = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid


class Served(Protocol):
    """What serves the mount (:class:`qosfs.daemon.assembly.Daemon`), as this module uses it."""

    mountpoint: str
    root_fd: int
    engine: QosEngine
    fs: Filesystem
    latency: LatencyLoop | None
    handovers: int
    handover_failures: dict[str, int]  # FAILURES -> how many, over the mount's processes
    listeners: Listeners | None

    @property
    def fuse_options(self) -> set[str]: ...

    @property
    def config(self) -> Any: ...  # the mount's configuration, a dataclass


def config_payload(config: Any) -> dict[str, Any]:
    """The mount's configuration (a dataclass) as plain data."""
    raw = dataclasses.asdict(config)
    return {key: list(value) if isinstance(value, tuple) else value
            for key, value in raw.items()}


def policy_payload(engine: QosEngine) -> dict[str, Any] | None:
    """The policy in force (``ctl set`` changes included), as text and its source."""
    policy = engine.policy
    return None if policy is None else {"text": policy.render(), "source": policy.source}


class HandoverOffer:
    """The old daemon's side: listens for a successor while serving, prepares it, stops
    reading for one that is ready, commits, or takes the session back."""

    def __init__(self, daemon: Served, path: str, listener: socket.socket) -> None:
        self.daemon = daemon
        self.path = path
        self._listener = listener
        self.successor: socket.socket | None = None
        self.successor_pid = 0
        self._pidfd = -1
        self._state: dict[str, int] = {}
        self.stopped_at = 0.0  # time.monotonic() when this process stopped reading
        self.to_monotonic = 0.0  # time.monotonic() - trio.current_time() in this run

    @classmethod
    def open(cls, daemon: Served, control_path: str,
             stack: ExitStack) -> HandoverOffer | None:
        """Bind the handover socket beside the control socket *control_path* (closed and
        removed when *stack* unwinds); None, with one line in the log, where this build
        cannot hand over or the socket cannot be bound."""
        reason = fuse_session.unavailable_reason()
        if reason is not None:
            log.info("handover unavailable: %s ('qosfs upgrade' will be refused)", reason)
            return None
        path = handover_socket_path(control_path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            _unlink_stale(path)
            old_umask = os.umask(0o177)  # 0600 from the start: never open to others
            try:
                listener.bind(path)
            finally:
                os.umask(old_umask)
            listener.listen(2)
        except OSError as exc:
            listener.close()
            log.warning("handover socket %s: %s ('qosfs upgrade' will not find this "
                        "daemon)", path, exc.strerror or exc)
            return None
        ino = os.lstat(path).st_ino
        offer = cls(daemon, path, listener)
        stack.callback(offer._close, ino)
        return offer

    def _close(self, ino: int) -> None:
        self._listener.close()
        try:
            if os.lstat(self.path).st_ino == ino:
                os.unlink(self.path)
        except OSError:
            pass

    def stopping(self) -> bool:
        """Whether this process stopped reading for a successor (not for an unmount)."""
        return self.successor is not None

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
                    ) -> None:
        """Answer successors one at a time until one is ready; then stop reading."""
        listener = trio.socket.from_stdlib_socket(self._listener.dup())
        task_status.started()
        with listener:
            while True:
                conn, _addr = await listener.accept()
                sock = socket.socket(fileno=conn.detach())
                sock.setblocking(True)  # used from a thread
                sock.settimeout(PREPARE_TIMEOUT)
                payload, fds = self._prepare_payload()
                if await trio.to_thread.run_sync(self._prepare, sock, payload, fds,
                                                 abandon_on_cancel=True):
                    break
                sock.close()
        listeners = self.daemon.listeners
        if listeners is not None:  # the successor answers from here on; ours finish
            await listeners.wind_down()
        latency = self.daemon.latency
        if latency is not None:  # its canary must not be left waiting on the mount
            await latency.stop_probe()
        self.stopped_at = time.monotonic()
        self.to_monotonic = self.stopped_at - trio.current_time()  # for the buckets' times
        self.successor = sock
        log.info("handing %s over to pid %d: no more requests read here",
                 self.daemon.mountpoint, self.successor_pid)
        pyfuse3.terminate()  # requests read are answered, then main() returns

    def _prepare_payload(self) -> tuple[dict[str, Any], list[int]]:
        """What prepare sends, taken on the event loop's thread (the policy in force),
        and the descriptors after the session's and the source's: the listening
        sockets, which the payload's ``listeners`` names by their index."""
        daemon = self.daemon
        listening = daemon.listeners.fds() if daemon.listeners is not None else {}
        return ({"protocol": PROTOCOL, "version": daemon_version(), "pid": os.getpid(),
                 "handovers": daemon.handovers,
                 "handover_failures": dict(daemon.handover_failures),
                 "mountpoint": daemon.mountpoint,
                 "config": config_payload(daemon.config),
                 "policy": policy_payload(daemon.engine),
                 "listeners": {name: 2 + i for i, name in enumerate(listening)}},
                list(listening.values()))

    def _prepare(self, sock: socket.socket, payload: dict[str, Any],
                 listening: list[int]) -> bool:
        """Phase 1, in a thread while the loop serves on; True if the successor is ready."""
        pid, pidfd = 0, -1
        try:
            pid, uid = _peer(sock)
            if uid not in (0, os.geteuid()):
                raise fuse_session.HandoverError(f"uid {uid} may not take the mount over")
            hello = fuse_session.receive_message(sock)
            if hello.kind != "adopt":
                raise fuse_session.HandoverError(f"expected adopt, not {hello.kind}")
            try:
                chosen_protocol(hello.payload)  # this daemon's, or refused
            except fuse_session.HandoverError as exc:
                fuse_session.send_message(sock, "refused", {"reason": str(exc)})
                raise
            pidfd = os.pidfd_open(pid)
            session = fuse_session.export_session()
            self._state = session.state
            fuse_session.send_message(sock, "prepare", {**payload, "state": session.state},
                                  [session.fuse_fd, self.daemon.root_fd, *listening])
            reply = fuse_session.receive_message(sock)
            if reply.kind != "ready":
                raise fuse_session.HandoverError(f"successor refused: "
                                             f"{reply.payload.get('reason', reply.kind)}")
        except (OSError, fuse_session.HandoverError, ValueError) as exc:
            if pidfd >= 0:
                os.close(pidfd)
            log.warning("handover to pid %d refused, serving on: %s", pid,
                        exc.strerror if isinstance(exc, OSError) and exc.strerror else exc)
            self.daemon.handover_failures["refused"] += 1
            return False
        self.successor_pid, self._pidfd = pid, pidfd
        return True

    def commit(self) -> bool:
        """Phase 2, after main() returned (no request is held here): the tables go; True
        once the successor serves."""
        sock = self.successor
        assert sock is not None
        daemon = self.daemon
        timeout = COMMIT_TIMEOUT
        try:
            daemon.fs.kernel_opens.counting.drain()  # the kernel's reads, into the totals
            daemon.fs.ops.forgets.flush()  # the FORGETs left queued: the tables whole
            tables, fds = export_state(daemon.fs)
            timeout = commit_timeout(
                len(tables["inodes"]["records"]) + len(tables["files"]) + len(tables["dirs"]))
            sock.settimeout(timeout)
            for at in range(0, len(fds), fuse_session.MAX_FDS):
                fuse_session.send_message(sock, "fds", {}, fds[at:at + fuse_session.MAX_FDS])
            fuse_session.send_message(sock, "commit", {
                "filesystem": tables, "fd_count": len(fds), "stopped_at": self.stopped_at,
                "policy": policy_payload(daemon.engine),
                "balances": daemon.engine.export_balances(self.to_monotonic),
                "accounts": daemon.engine.accounts.export_totals(),
                "latency": (daemon.latency.export_state(self.to_monotonic)
                            if daemon.latency is not None else None)})
            reply = fuse_session.receive_message(sock)
            if reply.kind != "serving":
                raise fuse_session.HandoverError(f"successor answered {reply.kind}")
        except TimeoutError:
            log.error("pid %d did not take %s over within %.1f s: taking the session back",
                      self.successor_pid, daemon.mountpoint, timeout)
            return False
        except (OSError, fuse_session.HandoverError) as exc:
            log.error("pid %d failed to take %s over (%s): taking the session back",
                      self.successor_pid, daemon.mountpoint,
                      exc.strerror if isinstance(exc, OSError) and exc.strerror else exc)
            return False
        finally:
            sock.close()
        os.close(self._pidfd)
        self._pidfd = -1
        return True

    def take_back(self) -> None:
        """The successor failed after this process stopped reading: make sure it is gone
        (it may have read nothing, never answered anything), then serve the session
        again with the tables it never changed."""
        self.daemon.handover_failures["taken_back"] += 1
        try:
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass  # gone already
        _wait_gone(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = -1
        session = fuse_session.export_session()
        fd = os.dup(session.fuse_fd)
        pyfuse3.close(unmount=False)  # pyfuse3's session and its copy of the descriptor
        fuse_session.adopt(self.daemon.fs.ops, fuse_session.Session(fd, self._state),
                       self.daemon.mountpoint, self.daemon.fuse_options)
        self.successor = None
        if self._state.get("proto_minor", 0) >= fuse_session.RESEND_MINOR:
            # What the successor may have read before it died comes again (this process
            # answered everything it read before it stopped).
            try:
                fuse_session.resend()
            except fuse_session.HandoverError as exc:
                log.warning("%s", exc)
        log.info("serving %s again", self.daemon.mountpoint)


def _wait_gone(pidfd: int, timeout: float = 10.0) -> None:
    """Until the process of *pidfd* has exited (its pidfd reads as readable)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.poll(timeout * 1000)


def _unlink_stale(path: str) -> None:
    """Remove a socket left at *path* by a daemon that died; refuse one that answers."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(17, f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: a dead daemon's
        return
    finally:
        probe.close()
    raise OSError(98, "another daemon listens on it")
