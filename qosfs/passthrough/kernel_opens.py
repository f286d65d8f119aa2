"""Which opens of a mount the kernel serves itself: the kernel passthrough of one mount,
decided per open, counted per class, and said in ``ctl status``.

:mod:`qosfs.passthrough.kernel` is the interface to pyfuse3's passthrough API (backing ids
per inode); this module is the mount's use of it, held by the operations as
``kernel_opens``: whether passthrough was asked for at INIT and why not (``request``,
``off``, ``log``), what one open gets (``open``) and gives back (``release``), and the
counts of opens passed through, joined and served by the daemon, and joined uncapped, by
class (``status``).

Everything here runs once per open or release, never per read or write: a passed-through
open's requests never reach the daemon, and a daemon-served one pays nothing for
passthrough per request.
"""

from __future__ import annotations

import errno
import logging
import time
from typing import Any

import pyfuse3
import trio
from pyfuse3 import FUSEError

from qosfs.passthrough import kernel as binding
from qosfs.passthrough.handles import (
    JOINED,
    NOT_COUNTED,
    PASSED_THROUGH,
    SERVED,
    SHARES_BACKING_ID,
    FileHandle,
)
from qosfs.passthrough.kernel import KernelPassthrough
from qosfs.passthrough.read_counting import OFF, KernelReadCounting

log = logging.getLogger(__name__)

_monotonic = time.monotonic
#: Seconds between two closings of the idle backing ids that are due (`run`); a release
#: closes those due too, so this bounds how long one is kept on a mount gone quiet.
IDLE_SWEEP_EVERY = 5.0
#: Idle backing ids closed by one release at most, and by the sweep between two turns of
#: the event loop (~10 us each, their files' counting stopped with them).
EXPIRE_PER_RELEASE = 2
EXPIRE_BATCH = 128


class KernelOpens:
    """The kernel passthrough of one mount: its state, its opens' backing ids and counts.

    ``on`` says whether opens may be passed through (asked for at INIT and not turned off
    since): the operations test it before calling ``open``, one attribute per open.
    *files* is the operations' table of open files (fh -> handle), which ``recent_file``
    checks a remembered handle against.
    """

    __slots__ = ("_capped_uncapped", "_files", "_kernel", "_off_reason", "_opens",
                 "_recent", "_served_reads", "_served_writes", "_stack_depth",
                 "_uncapped_reads", "_uncapped_writes", "counting", "on")

    def __init__(self, files: dict[int, FileHandle],
                 kernel: KernelPassthrough | None = None) -> None:
        self._kernel = kernel if kernel is not None else KernelPassthrough()
        self._kernel.on_close = self._closed
        self.on = False
        self._files = files
        self._off_reason = "not requested"
        self._stack_depth = 0
        self._opens: dict[str, int] = {}  # opens passed through (joined uncapped too), by class
        self._served_reads: dict[str, int] = {}  # joined with direct_io (JOINED), by class
        self._served_writes: dict[str, int] = {}
        self._uncapped_reads: dict[str, int] = {}  # joined uncapped, by class
        self._uncapped_writes: dict[str, int] = {}
        self._capped_uncapped: dict[str, int] = {}  # of those, a cap bounded their flow
        self._recent: dict[str, FileHandle] = {}  # the last open passed through, by class
        # What the kernel reads for passed-through opens, counted (the daemon starts it:
        # qosfs.passthrough.read_counting); off until then.
        self.counting = KernelReadCounting(None, OFF)

    @property
    def kernel(self) -> KernelPassthrough:
        """The backing ids (:class:`~qosfs.passthrough.kernel.KernelPassthrough`)."""
        return self._kernel

    @kernel.setter
    def kernel(self, kernel: KernelPassthrough) -> None:
        self._kernel = kernel
        kernel.on_close = self._closed  # a closed id's file is no longer counted

    def __repr__(self) -> str:
        state = "on" if self.on else f"off ({self._off_reason})"
        return f"<KernelOpens {state} opens={self._opens}>"

    # ----------------------------------------------------------------- mount

    def request(self, ops: pyfuse3.Operations, stack_depth: int) -> None:
        """Ask the kernel for passthrough at INIT (before ``pyfuse3.init``) on the mount
        served by *ops*, for backing files stacked *stack_depth* deep
        (:func:`qosfs.passthrough.kernel.stack_depth`)."""
        self._stack_depth = stack_depth
        # What is known before INIT: not negotiating what cannot be used keeps the mount
        # exactly as before (passthrough also deepens the mount's own stack depth).
        cap = self.kernel.capability()
        if not cap.available and not self.kernel.negotiation_pending():
            self.off(cap.reason)
            return
        binding.request(ops, stack_depth)
        self.on = True

    def off(self, reason: str) -> None:
        """Passthrough is not asked for on this mount, because of *reason*."""
        self.on = False
        self._off_reason = reason

    def log(self) -> None:
        """One line at mount, once INIT is answered: whether opens may be passed through,
        and if they were asked for and cannot be, why not. An open of an inode served by
        nobody yet must not pay for the capability test again: it is cached here."""
        if not self.on:
            log.info("kernel passthrough off: %s", self._off_reason)
            return
        cap = self.kernel.capability()
        if cap.available:
            log.info("kernel passthrough active (backing stack depth %d)", self._stack_depth)
        else:
            # INFO, not WARNING: the mount works as it always did (ctl status says it too).
            log.info("kernel passthrough unavailable, reads are served by the daemon: %s",
                     cap.reason)
            self.off(cap.reason)

    def active(self) -> bool:
        """Whether this mount passes opens through to the kernel: asked for, and accepted
        at INIT (False before INIT is answered)."""
        return self.on and self.kernel.capability().available

    def status(self) -> dict[str, Any]:
        """The ``passthrough`` entry of ``ctl status`` (and its metrics)."""
        s = self.kernel.statistics()
        state = "active" if self.active() else "unavailable"
        reason = self.kernel.capability().reason if self.on else self._off_reason
        joins = self.kernel.served_joins()
        return {"state": state, "reason": reason, "stack_depth": self._stack_depth,
                "registered": s.registered, "refused": s.refused,
                "last_refusal": s.last_refusal, "declined": s.declined,
                "live_backing_ids": s.live, "idle_backing_ids": s.idle,
                "reused_backing_ids": s.reused, "opens": dict(self._opens),
                "joins": "served" if joins.available else "uncapped",
                "joins_reason": joins.reason, "joins_blocked_by": joins.by or None,
                "served_read_joins": dict(self._served_reads),
                "served_write_joins": dict(self._served_writes),
                "uncapped_read_opens": dict(self._uncapped_reads),
                "uncapped_write_opens": dict(self._uncapped_writes),
                "capped_uncapped_opens": dict(self._capped_uncapped),
                "read_counting": self.counting.status()}

    # ----------------------------------------------------------------- handover

    def export_state(self) -> dict[str, Any]:
        """What a successor process serving the same connection needs (plain data): on
        or off and why, the backing ids and counts, and the recent open of each class by
        its fh (:mod:`qosfs.passthrough.transfer`)."""
        return {"on": self.on, "off_reason": self._off_reason,
                "stack_depth": self._stack_depth, "opens": dict(self._opens),
                "served_reads": dict(self._served_reads),
                "served_writes": dict(self._served_writes),
                "uncapped_reads": dict(self._uncapped_reads),
                "uncapped_writes": dict(self._uncapped_writes),
                "capped_uncapped": dict(self._capped_uncapped),
                "recent": {name: handle.fh for name, handle in self._recent.items()},
                "kernel": self.kernel.export_state()}

    def import_state(self, state: dict[str, Any]) -> None:
        """Take over a predecessor's state (`export_state`), once the handle table's files
        table holds the handles it refers to by fh. A predecessor of the build before
        served no joins: it sent no counts of them (nor of capped uncapped opens)."""
        self.on = bool(state["on"])
        self._off_reason = str(state["off_reason"])
        self._stack_depth = int(state["stack_depth"])

        def counts(key: str) -> dict[str, int]:
            return {str(k): int(v) for k, v in state.get(key, {}).items()}

        self._opens = counts("opens")
        self._served_reads = counts("served_reads")
        self._served_writes = counts("served_writes")
        self._uncapped_reads = counts("uncapped_reads")
        self._uncapped_writes = counts("uncapped_writes")
        self._capped_uncapped = counts("capped_uncapped")
        self._recent = {str(name): self._files[int(fh)] for name, fh in state["recent"].items()
                        if int(fh) in self._files}
        self.kernel.import_state(state["kernel"])
        self.count_inherited()

    def count_inherited(self) -> None:
        """Count the reads of the passed-through opens a predecessor left (a handover's,
        or a crash's rebuilt from the journal): they are read by the kernel still."""
        for handle in self._files.values():
            if handle.kernel == PASSED_THROUGH:
                self.counting.watch(handle)

    # ----------------------------------------------------------------- opens

    def open(self, handle: FileHandle, read_only: bool) -> pyfuse3.FileInfo | None:
        """Pass the new open *handle* through to the kernel and return its reply, or count
        it as served by the daemon and return None. Once per open, never per request
        (called only while ``on``).

        A read-only open of a flow whose reads nothing caps now registers its descriptor
        (or shares the inode's backing id). Any other open is served by the daemon, plain
        (None) unless the inode is passed through now: the kernel fails an open of such an
        inode that does not carry its backing id (EIO), so it joins the id, with direct_io
        (JOINED): its reads and writes still come to the daemon, admitted and capped as
        any. Where this build or kernel cannot say direct_io beside a backing id
        (`KernelPassthrough.served_joins`), it joins uncapped as a passed-through open:
        counted per class (and apart, if a cap bounded its flow), the first of each class
        logged. POSIX lets anyone with the permission write a file others read; refusing
        the writer to keep a cap would break that.
        """
        kernel = self.kernel
        nodeid = handle.inode.nodeid
        flow = handle.charge.flow
        name = flow.class_name
        if read_only and flow.passes_reads_through():
            backing_id = kernel.register(nodeid, handle.fd)
            if backing_id is not None:
                return self._passed(handle, name, backing_id)
        if kernel.plain_open(nodeid):
            handle.kernel = SERVED
            return None
        backing_id = kernel.join(nodeid)  # shares the inode's id
        if backing_id is None:  # cannot happen: plain_open said it is passed through
            raise FUSEError(errno.EIO)
        if not read_only:  # its writes (by mmap at least) may miss the daemon: drop pages
            handle.inode.cache_stamp = None
        if kernel.served_joins().available:
            handle.kernel = JOINED
            served = self._served_reads if read_only else self._served_writes
            served[name] = served.get(name, 0) + 1
            info = pyfuse3.FileInfo(fh=handle.fh)
            binding.attach(info, backing_id, served=True)
            return info
        self._joined_uncapped(name, read_only,
                              flow.reads_capped() or (not read_only and flow.throttled_writes))
        return self._passed(handle, name, backing_id)

    def _passed(self, handle: FileHandle, name: str, backing_id: int) -> pyfuse3.FileInfo:
        """The reply to an open *handle* of class *name* passed through with *backing_id*."""
        handle.kernel = PASSED_THROUGH
        self.counting.watch(handle)
        self._opens[name] = self._opens.get(name, 0) + 1
        self._recent[name] = handle  # one dict store per open, for recent_file
        info = pyfuse3.FileInfo(fh=handle.fh)
        binding.attach(info, backing_id)
        return info

    def release(self, handle: FileHandle) -> None:
        """Give back what the open *handle* held: its share of the inode's backing id
        (passed through or joined), or its count as a daemon-served open (nothing for an
        open made while passthrough was not asked for). Must run at every release,
        whatever else failed: a backing id must not leak."""
        if handle.kernel == NOT_COUNTED:
            return
        if handle.kernel in SHARES_BACKING_ID:
            now = _monotonic()
            self.kernel.unregister(handle.inode.nodeid, now)
            if handle.kernel == PASSED_THROUGH:  # a JOINED open's reads are the daemon's
                self.counting.release(handle)
            # A few of those due (their files' counting stops: _closed): each release
            # makes at most one id idle, so two a release keep up with the limit; the
            # sweep closes the rest in batches.
            self.kernel.expire(now, EXPIRE_PER_RELEASE)
        else:
            self.kernel.plain_release(handle.inode.nodeid)

    # ----------------------------------------------------------------- idle backing ids

    def _closed(self, nodeid: int) -> None:
        """*nodeid*'s backing id was closed: its file's reads are no longer counted."""
        self.counting.forget(nodeid)

    def forget(self, nodeid: int) -> None:
        """The kernel forgot *nodeid*, or its last name was unlinked through the mount:
        its idle backing id, if any, must not keep the file (and its blocks) any longer.
        One dict test when it has none."""
        self.kernel.drop_idle(nodeid)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The daemon's service: close the idle backing ids that are due every
        :data:`IDLE_SWEEP_EVERY` seconds, even when no release comes to do it."""
        task_status.started()
        while True:
            await trio.sleep(IDLE_SWEEP_EVERY)
            # EXPIRE_BATCH at a time, letting the requests that came meanwhile through
            # in between (KernelPassthrough.expire says why).
            while len(self.kernel.expire(_monotonic(), EXPIRE_BATCH)) == EXPIRE_BATCH:
                await trio.sleep(0)

    def recent_file(self, class_name: str) -> int | None:
        """The backing descriptor of the last open of class *class_name* (its class at
        open) that was passed through to the kernel, joined uncapped ones included, if it
        is still open; None if there is none or it was released since (an older open of
        the class still open is not looked for). A daemon-served open (a JOINED one too)
        is never the answer.

        Still open means the operations' table still holds this very handle under its
        fh: the release takes it out before the descriptor is closed. O(1), and nothing
        per read."""
        handle = self._recent.get(class_name)
        if handle is None:
            return None
        if self._files.get(handle.fh) is not handle:
            del self._recent[class_name]  # released: do not keep its inode and charge alive
            return None
        if handle.fd >= 0:
            return handle.fd
        # Opened without a descriptor (handles.NO_DESCRIPTOR): its inode's, if cached, is
        # the same file (the probe reopens it through /proc and checks which file it is).
        cached = handle.inode.cached_fd
        return cached if cached >= 0 else None

    def _joined_uncapped(self, name: str, read_only: bool, capped: bool) -> None:
        """Count an open of class *name* that joined a passed-through inode uncapped
        (*capped*: a cap bounded its flow at open, which is alerted on)."""
        counts = self._uncapped_reads if read_only else self._uncapped_writes
        first = name not in counts
        counts[name] = counts.get(name, 0) + 1
        if capped:
            self._capped_uncapped[name] = self._capped_uncapped.get(name, 0) + 1
        if first:
            log.warning("class %s: %s open of a file passed through to the kernel joins it, "
                        "%s uncapped, because %s (counted in ctl status)", name,
                        "a read-only" if read_only else "a write",
                        "reading" if read_only else "writing",
                        self.kernel.served_joins().reason)
