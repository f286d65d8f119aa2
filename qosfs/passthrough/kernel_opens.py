"""Which opens of a mount the kernel serves itself: the kernel passthrough of one mount,
decided per open, counted per class, and said in ``ctl status``.

:mod:`qosfs.passthrough.kernel` is the interface to pyfuse3's passthrough API (backing ids
per inode); this module is the mount's use of it, held by the operations as
``kernel_opens``: whether passthrough was asked for at INIT and why not (``request``,
``off``, ``log``), what one open gets (``open``) and gives back (``release``), and the
counts of opens passed through and joined uncapped, by class (``status``).

Everything here runs once per open or release, never per read or write: a passed-through
open's requests never reach the daemon, and a daemon-served one pays nothing for
passthrough per request.
"""

from __future__ import annotations

import errno
import logging
from typing import Any

import pyfuse3
from pyfuse3 import FUSEError

from qosfs.passthrough import kernel as binding
from qosfs.passthrough.handles import NOT_COUNTED, PASSED_THROUGH, SERVED, FileHandle
from qosfs.passthrough.kernel import KernelPassthrough
from qosfs.passthrough.read_counting import OFF, KernelReadCounting

log = logging.getLogger(__name__)


class KernelOpens:
    """The kernel passthrough of one mount: its state, its opens' backing ids and counts.

    ``on`` says whether opens may be passed through (asked for at INIT and not turned off
    since): the operations test it before calling ``open``, one attribute per open.
    *files* is the operations' table of open files (fh -> handle), which ``recent_file``
    checks a remembered handle against.
    """

    __slots__ = ("_files", "_off_reason", "_opens", "_recent", "_stack_depth",
                 "_uncapped_reads", "_uncapped_writes", "counting", "kernel", "on")

    def __init__(self, files: dict[int, FileHandle],
                 kernel: KernelPassthrough | None = None) -> None:
        self.kernel = kernel if kernel is not None else KernelPassthrough()
        self.on = False
        self._files = files
        self._off_reason = "not requested"
        self._stack_depth = 0
        self._opens: dict[str, int] = {}  # opens passed through (joined ones too), by class
        self._uncapped_reads: dict[str, int] = {}  # joined uncapped, by class
        self._uncapped_writes: dict[str, int] = {}
        self._recent: dict[str, FileHandle] = {}  # the last open passed through, by class
        # What the kernel reads for passed-through opens, counted (the daemon starts it:
        # qosfs.passthrough.read_counting); off until then.
        self.counting = KernelReadCounting(None, OFF)

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
        return {"state": state, "reason": reason, "stack_depth": self._stack_depth,
                "registered": s.registered, "refused": s.refused,
                "last_refusal": s.last_refusal, "declined": s.declined,
                "live_backing_ids": s.live, "opens": dict(self._opens),
                "uncapped_read_opens": dict(self._uncapped_reads),
                "uncapped_write_opens": dict(self._uncapped_writes),
                "read_counting": self.counting.status()}

    # ----------------------------------------------------------------- handover

    def export_state(self) -> dict[str, Any]:
        """What a successor process serving the same connection needs (plain data): on
        or off and why, the backing ids and counts, and the recent open of each class by
        its fh (:mod:`qosfs.passthrough.transfer`)."""
        return {"on": self.on, "off_reason": self._off_reason,
                "stack_depth": self._stack_depth, "opens": dict(self._opens),
                "uncapped_reads": dict(self._uncapped_reads),
                "uncapped_writes": dict(self._uncapped_writes),
                "recent": {name: handle.fh for name, handle in self._recent.items()},
                "kernel": self.kernel.export_state()}

    def import_state(self, state: dict[str, Any]) -> None:
        """Take over a predecessor's state (`export_state`), once the handle table's files
        table holds the handles it refers to by fh."""
        self.on = bool(state["on"])
        self._off_reason = str(state["off_reason"])
        self._stack_depth = int(state["stack_depth"])
        self._opens = {str(k): int(v) for k, v in state["opens"].items()}
        self._uncapped_reads = {str(k): int(v) for k, v in state["uncapped_reads"].items()}
        self._uncapped_writes = {str(k): int(v) for k, v in state["uncapped_writes"].items()}
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
        (or shares the inode's backing id). Any other open is served by the daemon unless
        the inode is passed through now: the kernel fails a daemon-served open of such an
        inode (EIO), so it joins the backing id instead. A read-only one of a capped
        class then reads uncapped, a write one writes uncapped: counted per class, the
        first of each class logged. POSIX lets anyone with the permission write a file
        others read; refusing the writer to keep a cap would break that, and an open
        that joins is one of a file already read at native speed.
        """
        kernel = self.kernel
        nodeid = handle.inode.nodeid
        flow = handle.charge.flow
        backing_id = None
        if read_only and flow.passes_reads_through():
            backing_id = kernel.register(nodeid, handle.fd)
        joined = False
        if backing_id is None:
            if kernel.plain_open(nodeid):
                handle.kernel = SERVED
                return None
            backing_id = kernel.register(nodeid, handle.fd)  # shares the inode's id
            if backing_id is None:  # cannot happen: plain_open said it is passed through
                raise FUSEError(errno.EIO)
            joined = True
            if not read_only:  # writes the daemon will not see: the next open drops pages
                handle.inode.cache_stamp = None
        handle.kernel = PASSED_THROUGH
        self.counting.watch(handle)
        name = flow.class_name
        self._opens[name] = self._opens.get(name, 0) + 1
        self._recent[name] = handle  # one dict store per open, for recent_file
        if joined:
            self._joined(name, read_only)
        info = pyfuse3.FileInfo(fh=handle.fh)
        binding.attach(info, backing_id)
        return info

    def release(self, handle: FileHandle) -> None:
        """Give back what the open *handle* held: its share of the inode's backing id, or
        its count as a daemon-served open (nothing for an open made while passthrough was
        not asked for). Must run at every release, whatever else failed: a backing id
        must not leak."""
        if handle.kernel == NOT_COUNTED:
            return
        if handle.kernel == PASSED_THROUGH:
            self.kernel.unregister(handle.inode.nodeid)
            self.counting.release(handle)
        else:
            self.kernel.plain_release(handle.inode.nodeid)

    def recent_file(self, class_name: str) -> int | None:
        """The backing descriptor of the last open of class *class_name* (its class at
        open) that was passed through to the kernel, joined ones included, if it is still
        open; None if there is none or it was released since (an older open of the class
        still open is not looked for). A daemon-served open is never the answer.

        Still open means the operations' table still holds this very handle under its
        fh: the release takes it out before the descriptor is closed. O(1), and nothing
        per read."""
        handle = self._recent.get(class_name)
        if handle is None:
            return None
        if self._files.get(handle.fh) is not handle:
            del self._recent[class_name]  # released: do not keep its inode and charge alive
            return None
        return handle.fd

    def _joined(self, name: str, read_only: bool) -> None:
        """Count an open of class *name* that joined a passed-through inode uncapped."""
        counts = self._uncapped_reads if read_only else self._uncapped_writes
        first = name not in counts
        counts[name] = counts.get(name, 0) + 1
        if first:
            log.warning("class %s: %s open of a file passed through to the kernel joins it, "
                        "%s uncapped (the kernel serves an inode's opens all through "
                        "passthrough or none; counted in ctl status)", name,
                        "a read-only" if read_only else "a write",
                        "reading" if read_only else "writing")
