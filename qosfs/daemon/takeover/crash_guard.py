"""The serving side of crash recovery: the session journal and the keeper's copies.

While a mount is served, :class:`CrashGuard` keeps two things outside the process, so
that a daemon started after this one dies can take the mount over
(:mod:`qosfs.daemon.takeover.recover` says how, and what holds then):

* the session journal (:mod:`qosfs.passthrough.journal`), written as the tables change;
* a copy of the FUSE descriptor and of the source's root, in the keeper
  (:mod:`qosfs.daemon.takeover.keeper`: systemd's descriptor store, or the project's holder).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol

from qosfs.core.errors import QosfsError
from qosfs.daemon import notify
from qosfs.daemon.takeover import fuse_session, keeper
from qosfs.passthrough.filesystem import Filesystem
from qosfs.passthrough.journal import SessionJournal


class Daemon(Protocol):
    """What the guard needs of the daemon it serves (qosfs.daemon.assembly.Daemon)."""

    fs: Filesystem
    root_fd: int
    mountpoint: str


log = logging.getLogger(__name__)

# Names of the descriptors in systemd's store.
FUSE_NAME, ROOT_NAME = notify.FUSE_FD_NAME, "qosfs-root"


def release_store() -> None:
    """Take both descriptors out of systemd's store (the mount is gone, or cannot be
    taken over): a kept connection nobody serves would leave callers waiting."""
    notify.remove_fd(FUSE_NAME)
    notify.remove_fd(ROOT_NAME)


class CrashGuard:
    """The serving side: the journal and the keeper of one mount in this process."""

    def __init__(self, kind: str, control_path: str, grace: float) -> None:
        self.kind = kind  # "holder", "systemd" or "none"
        self.keeper_path = keeper.keeper_socket_path(control_path)
        self.journal_path = keeper.journal_path(control_path)
        self.grace = grace
        self.journal: SessionJournal | None = None
        self.lease: keeper.Lease | None = None
        self.kept = False  # whether the keeper holds the connection now
        self.state: dict[str, int] | None = None  # INIT's, once known

    @property
    def on(self) -> bool:
        return self.kind != "none" and fuse_session.unavailable_reason() is None

    def attach(self, daemon: Daemon, state: dict[str, int] | None = None) -> None:
        """Write *daemon*'s tables down from now on (before it reads a request); *state*:
        the INIT state, if the session was adopted (else `keep` learns it)."""
        if not self.on:
            if self.kind != "none":
                log.warning("crash protection off: %s", fuse_session.unavailable_reason())
            return
        self.journal = SessionJournal(self.journal_path)
        daemon.fs.attach_journal(self.journal)
        if state is not None:
            self._describe(daemon, state)

    def _describe(self, daemon: Daemon, state: dict[str, int]) -> None:
        assert self.journal is not None
        st = os.fstat(daemon.root_fd)
        self.state = state
        self.journal.session({"state": state, "root": [st.st_dev, st.st_ino],
                              "mountpoint": daemon.mountpoint, "pid": os.getpid()})

    def keep(self, daemon: Daemon) -> None:
        """The session serves (INIT answered): give the keeper its copies, take a lease."""
        if self.journal is None:
            return
        try:
            session = fuse_session.export_session()
            if self.state is None:
                self._describe(daemon, session.state)
            if self.kind == "systemd":
                self.kept = (notify.store_fd(session.fuse_fd, FUSE_NAME)
                             and notify.store_fd(daemon.root_fd, ROOT_NAME))
                if not self.kept:
                    log.error("crash protection off: systemd's descriptor store was not "
                              "reached ($NOTIFY_SOCKET)")
                return
            try:
                self.lease = keeper.Lease(self.keeper_path)
            except OSError:
                keeper.start_holder(self.keeper_path, session.fuse_fd, daemon.root_fd,
                                    self.grace)
                self.lease = keeper.Lease(self.keeper_path)
            self.kept = True
        except (OSError, QosfsError, fuse_session.HandoverError) as exc:
            log.error("crash protection off: the keeper failed: %s", exc)

    def status(self) -> dict[str, Any]:
        """For ``ctl status``: who keeps the connection, and whether it is kept now."""
        kept = self.journal is not None and self.kept
        reason = None
        if not kept:
            reason = ("--keeper none" if self.kind == "none"
                      else fuse_session.unavailable_reason() or "the keeper failed (see the log)")
        return {"keeper": self.kind, "kept": kept, "reason": reason,
                "recover_within": self.grace if self.kind == "holder" else None,
                "journal_records": 0 if self.journal is None else self.journal.used}

    def end(self, unmounted: bool) -> None:
        """This process stops serving: *unmounted* (the mount is gone: the keeper lets go,
        the journal is removed) or handed over (the successor's journal and lease stand)."""
        if self.lease is not None:
            self.lease.end(unmounting=unmounted)
            self.lease = None
        if unmounted and self.kind == "systemd" and self.kept:
            release_store()
        self.kept = False
        if self.journal is not None:
            self.journal.close(remove=unmounted)
            self.journal = None
