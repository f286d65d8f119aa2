"""The filesystem as a whole: the FUSE operations and the parts they were handed, held
together for what concerns all of them at once and no FUSE request.

:func:`qosfs.daemon.fs_assembly.build_filesystem` makes one :class:`Filesystem` per mount
(and per in-process test or benchmark); the daemon holds it and gives ``pyfuse3`` its
``ops``. Here, not on the operations: what the filesystem holds for ``ctl status``
(`Filesystem.resources`), writing its tables down in a crash journal
(`Filesystem.attach_journal`) and closing every backing descriptor at unmount
(`Filesystem.close_all`). It is the :class:`~qosfs.passthrough.handle_table.Tables` that a
handover (:mod:`qosfs.passthrough.transfer`) and crash recovery
(:mod:`qosfs.passthrough.recovery`) fill or export.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyfuse3

from qosfs.core.failures import Failures
from qosfs.passthrough import interrupts
from qosfs.passthrough.backing_io import BackingIO
from qosfs.passthrough.handle_table import HandleTable
from qosfs.passthrough.inodes import InodeTable
from qosfs.passthrough.intents import ExactlyOnce
from qosfs.passthrough.journal import SessionJournal
from qosfs.passthrough.kernel_opens import KernelOpens
from qosfs.passthrough.operations import PassthroughOperations


@dataclass(frozen=True, slots=True)
class Filesystem:
    """One mount's filesystem: *ops* answers FUSE over the other parts (*inodes*, held by
    O_PATH descriptors; *handles*, open files and directories by fh; *kernel_opens*, the
    opens the kernel serves itself; *once*, requests done exactly once across a crash;
    *io*, the data path's syscalls; *failures*, unexpected exceptions answered EIO)."""

    ops: PassthroughOperations
    inodes: InodeTable
    handles: HandleTable
    kernel_opens: KernelOpens
    once: ExactlyOnce
    io: BackingIO
    failures: Failures

    def resources(self) -> dict[str, Any]:
        """What the filesystem holds now, for ``ctl status`` (inodes, descriptors, handles,
        the open quota, failures). The engine's figures come from the engine itself
        (:meth:`qosfs.qos.interface.QosControl.counters`)."""
        inodes, handles = self.inodes, self.handles
        return {
            "inodes": len(inodes), "inode_fds": inodes.fds_held,
            "inode_fd_budget": inodes.cache.capacity, "inode_fd_reopens": inodes.reopens,
            "inode_objects": len(inodes.by_id), "inode_thaws": inodes.thaws,
            "file_handles": len(handles.files), "dir_handles": len(handles.dirs),
            "open_per_uid_limit": handles.quota.per_uid,
            "open_refused": handles.quota.refused,
            "killed_callers": interrupts.killed_callers,
            "backing_thread_hops": self.io.thread_hops,
            "backing_prefetches": self.io.prefetches,
            "internal_errors": self.failures.counts(),
            "passthrough": self.kernel_opens.status(),
            **busy_polling(),
        }

    def attach_journal(self, journal: SessionJournal) -> None:
        """Write the filesystem's state down in *journal* and keep it written: the inode
        table, every open file and directory, the backing ids, the exactly-once ring (a
        new mount's, a successor's, a recovered one's: each process writes a journal of
        its own)."""
        self.once.attach(journal.intents)
        self.inodes.attach_journal(journal, self.handles.inodes_held())
        self.handles.attach_journal(journal)
        self.kernel_opens.kernel.attach_journal(journal)

    def close_all(self) -> None:
        """Close every backing descriptor once the kernel connection is gone."""
        self.kernel_opens.counting.close()
        self.handles.close_all()
        self.inodes.close_all()
        self.io.fd_guard.close_all()


def busy_polling() -> dict[str, int]:
    """Requests the session read by busy polling and polls that found none
    (``--busy-poll-us``; deploy/libfuse/pyfuse3-busy-poll.patch), where pyfuse3 counts
    them: a caller that waits on one request at a time should see most of its requests
    polled, an idle mount few polls at all."""
    counts = getattr(pyfuse3, "busy_poll_counts", None)
    if counts is None:
        return {}
    polled, missed = counts()
    return {"busy_polled": int(polled), "busy_poll_misses": int(missed)}
