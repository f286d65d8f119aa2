"""Reads the kernel served from passed-through files, counted per class, tenant and uid.

A passed-through open's reads never reach the daemon. The BPF programs of
:mod:`qosfs.passthrough.read_probes` count them in the kernel, per watched backing file
(a *slot*) and reader uid; this module decides which files are watched and adds what was
counted, every :data:`DRAIN_EVERY` seconds (and before a handover hands the totals on),
to the very counters the daemon's own reads go to: the ``FlowStats`` of the opens'
flows (``qosfs_read_bytes_total`` and friends, ``ctl stats``, ``top``), never twice (the
programs skip the daemon's own reads). Those reads have no latency the daemon could
measure: their bytes and reads are counted, their latency histograms are not.

A file is watched from its first passed-through open for as long as its backing id is
registered (past its last release while the id is kept idle, for the next open:
:mod:`qosfs.passthrough.kernel`), so an open's reads are counted whichever of its inode's
opens made them; a read by a uid that has no
open of the file (a descriptor passed to another user) goes to the flow of the first
open. Per class, what cannot be counted is counted as such and said, with the reason
(``ctl status``, ``qosfs_passthrough_uncounted_opens_total``), never a silent 0:

- no programs (not root, no BPF, no BTF: :class:`~qosfs.passthrough.read_programs.ProbeError`);
- a backing filesystem whose reads the tracepoints do not see with the file's own device
  and inode (tmpfs reads through shmem, overlayfs and FUSE through another file, btrfs
  reports a subvolume's device): only :data:`COUNTED_FILESYSTEMS` are watched;
- the watched table full (:data:`MAX_WATCHED` files passed through at once).

Readers of a file mapped with mmap fault its pages in without a read call: those are
not counted (``ctl status`` says so).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import trio

from qosfs.core.keyring import join_mount_keyring
from qosfs.core.mountinfo import mounts
from qosfs.passthrough.handles import FileHandle
from qosfs.passthrough.read_probes import ReadProbes
from qosfs.passthrough.read_programs import ProbeError
from qosfs.qos.interface import Flow

log = logging.getLogger(__name__)

DRAIN_EVERY = 0.5  # seconds between two reads of the programs' counts
RETIRE_BATCH = 128  # retired slots freed between two turns of the event loop (<1 ms)
MAX_WATCHED = 65536
#: Filesystems whose buffered reads pass mm_filemap_get_pages (and O_DIRECT reads, for
#: the iomap ones, iomap_dio_rw_begin) with the device and inode stat() reports.
COUNTED_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "nfs", "nfs4", "f2fs"})
MMAP_NOT_COUNTED = "pages of a file mapped with mmap are not counted"
OTHER_MOUNTS_COUNTED = ("reads of its files through another mount of the same source are "
                        "counted here too")
TABLE_FULL = "the table of watched files is full"


class _Watch:
    """One passed-through file: its slot in the programs' tables (None: not counted, for
    the reason in ``why_not``), its open flows by uid, and what was already added per
    uid."""

    __slots__ = ("dev", "first", "flows", "ino", "opens", "seen", "slot", "why_not")

    def __init__(self, why_not: str | None, dev: int, ino: int, first: Flow) -> None:
        self.slot: int | None = None
        self.why_not = why_not
        self.dev, self.ino, self.first = dev, ino, first
        self.flows: dict[int, Flow] = {}
        self.seen: dict[int, tuple[int, int]] = {}
        self.opens = 0


class KernelReadCounting:
    """The counting of one mount; :meth:`start` loads the programs or says why not."""

    def __init__(self, probes: ReadProbes | None, off_reason: str = "",
                 other_mounts: str = "") -> None:
        self._probes = probes
        self.off_reason = off_reason
        # Why reads of this mount's files through another mount (of the same source, or
        # overlayfs over it) may be counted here too; "" when they are not.
        self.other_mounts = other_mounts
        self._watches: dict[int, _Watch] = {}  # by nodeid
        self._by_slot: dict[int, _Watch] = {}
        self._retired: list[_Watch] = []
        self._free: list[int] = []
        self._next_slot = 1
        self._filesystems: dict[int, str | None] = {}  # st_dev -> why not counted, or None
        self.read_bytes: dict[str, int] = {}  # by class, what the kernel read
        self.reads: dict[str, int] = {}
        self.uncounted: dict[str, dict[str, int]] = {}  # by class and reason, opens

    @classmethod
    def start(cls, tgid: int, mountpoint: str) -> KernelReadCounting:
        """Load the programs, counting reads of every process but *tgid* (the daemon)
        passed through this mount: those made with the credentials of its daemon, which
        hold the session keyring of *mountpoint* (joined here: call it on the thread
        that registers backing ids, before any is)."""
        keyring, why_not = join_mount_keyring(mountpoint)
        other_mounts = ""
        if keyring is None:
            other_mounts = f"{OTHER_MOUNTS_COUNTED} ({why_not})"
            log.warning("%s: %s", OTHER_MOUNTS_COUNTED, why_not)
        try:
            probes = ReadProbes.load(tgid, max_watched=MAX_WATCHED, keyring=keyring)
        except ProbeError as exc:
            log.warning("reads passed through to the kernel are not counted: %s", exc)
            return cls(None, str(exc))
        log.info("counting reads passed through to the kernel (BPF %s)", probes.mode)
        return cls(probes, other_mounts=other_mounts)

    @property
    def on(self) -> bool:
        return self._probes is not None

    # ------------------------------------------------------------- opens

    def watch(self, handle: FileHandle) -> None:
        """A passed-through open *handle*: count its file's reads (once per open)."""
        nodeid = handle.inode.nodeid
        flow = handle.charge.flow
        w = self._watches.get(nodeid)
        if w is None:
            w = self._watches[nodeid] = self._new_watch(handle, flow)
        w.opens += 1
        uid = flow.uid
        if uid is not None and uid not in w.flows:
            w.flows[uid] = flow
        if w.why_not is not None:
            per_class = self.uncounted.setdefault(flow.class_name, {})
            per_class[w.why_not] = per_class.get(w.why_not, 0) + 1

    def _new_watch(self, handle: FileHandle, flow: Flow) -> _Watch:
        """Watch *handle*'s file in a free slot, if its reads can be counted (one store
        into the index's mapping per file, at its first passed-through open). The file is
        its inode's backing object, whose (device, inode number) the inode holds from its
        lookup: an fstat of the open's descriptor would say the same."""
        probes = self._probes
        if probes is None:
            return _Watch(self.off_reason, 0, 0, flow)
        st_dev, st_ino = handle.inode.key
        w = _Watch(self._why_not(st_dev), st_dev, st_ino, flow)
        if w.why_not is not None:
            return w
        slot = self._free.pop() if self._free else self._next_slot
        if probes.watch(st_dev, st_ino, slot):
            w.slot = slot
            self._by_slot[slot] = w
            if slot == self._next_slot:
                self._next_slot += 1
        else:
            w.why_not = probes.attach_error or TABLE_FULL
            if slot != self._next_slot:
                self._free.append(slot)
        return w

    def _why_not(self, st_dev: int) -> str | None:
        """Why reads of files on device *st_dev* cannot be counted, or None if they can."""
        if st_dev in self._filesystems:
            return self._filesystems[st_dev]
        dev = f"{os.major(st_dev)}:{os.minor(st_dev)}"
        fstype = next((m.fstype for m in mounts() if m.dev == dev), None)
        reason = None
        if fstype not in COUNTED_FILESYSTEMS:
            reason = (f"{fstype or 'an unknown filesystem'} (device {dev}): its reads are "
                      "not seen by the tracepoints that count them")
        self._filesystems[st_dev] = reason
        return reason

    def release(self, handle: FileHandle) -> None:
        """A passed-through open *handle* is released. Its file stays watched after its
        last, as long as its backing id is kept idle (:meth:`forget` ends it): the next
        open of it writes no index entry, and what was read is added at the next drain."""
        w = self._watches.get(handle.inode.nodeid)
        if w is not None and w.opens > 0:
            w.opens -= 1

    def forget(self, nodeid: int) -> None:
        """*nodeid*'s backing id was closed: its file is no longer watched (what it read
        is added at the next drain, and its slot freed then)."""
        w = self._watches.get(nodeid)
        if w is None or w.opens > 0:
            return
        del self._watches[nodeid]
        if w.slot is not None and self._probes is not None:
            self._probes.unwatch(w.dev, w.ino)
            self._retired.append(w)

    # ------------------------------------------------------------- counts

    def drain(self) -> None:
        """Add what the programs counted since the last drain to the flows' counters,
        and free the slots of files no longer watched. Runs on the trio thread, like
        every reader and writer of the flows' counters."""
        self._retire(self._count_and_take_retired())

    def _count_and_take_retired(self) -> list[_Watch]:
        """:meth:`add_counts`, and the watches retired before that reading, to free
        (whatever they read is in it: they were unwatched before)."""
        retired, self._retired = self._retired, []
        self.add_counts()
        return retired

    def add_counts(self) -> None:
        """The counting half of :meth:`drain`, and all of it that a snapshot needs
        (``ctl stats``, ``/metrics``, the latency controller's samples): the slots of
        retired files are left for the drain service to free, a batch at a time."""
        probes = self._probes
        if probes is None:
            return
        for (slot, uid), (nbytes, nreads) in probes.changed_totals(self._by_slot).items():
            w = self._by_slot.get(slot)
            if w is None:  # left in the hash by a slot freed between two walks of it
                probes.forget(slot, (uid,))
                continue
            before = w.seen.get(uid, (0, 0))
            if (nbytes, nreads) == before:
                continue
            w.seen[uid] = (nbytes, nreads)
            flow = w.flows.get(uid, w.first)
            added_bytes, added_reads = nbytes - before[0], nreads - before[1]
            stats = flow.stats
            stats.read_bytes += added_bytes
            stats.read_ops += added_reads
            stats.kernel_reads += added_reads
            name = flow.class_name
            self.read_bytes[name] = self.read_bytes.get(name, 0) + added_bytes
            self.reads[name] = self.reads.get(name, 0) + added_reads

    def _retire(self, retired: list[_Watch]) -> None:
        """Free the slots of *retired* watches, for the next files."""
        probes = self._probes
        for w in retired:
            assert w.slot is not None and probes is not None
            if w.seen:  # a file never read left nothing to clear
                probes.forget(w.slot, w.seen)
            del self._by_slot[w.slot]
            self._free.append(w.slot)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The daemon's service: drain every :data:`DRAIN_EVERY` seconds. The slots of
        the files retired meanwhile are freed :data:`RETIRE_BATCH` at a time, letting
        the requests that came meanwhile through in between: a loader's pass over
        thousands of files retires them all within seconds, 60 s later (their idle
        backing ids expire together), and freeing them in one go stalled the loop."""
        task_status.started()
        while True:
            await trio.sleep(DRAIN_EVERY)
            retired = self._count_and_take_retired()
            for start in range(0, len(retired), RETIRE_BATCH):
                if start:
                    await trio.sleep(0)
                self._retire(retired[start:start + RETIRE_BATCH])

    def status(self) -> dict[str, Any]:
        """The ``read_counting`` entry of ``ctl status``'s ``passthrough``."""
        lost = self._probes.lost_totals() if self._probes is not None else (0, 0)
        return {"state": "on" if self.on else "off",
                "reason": (f"BPF ({self._probes.mode}); {MMAP_NOT_COUNTED}"
                           + (f"; {self.other_mounts}" if self.other_mounts else "")
                           if self._probes is not None else self.off_reason),
                "watched": len(self._by_slot),
                # The programs cost every buffered read on the machine while attached:
                # only while a file is watched (qosfs.passthrough.read_probes).
                "attached": self._probes is not None and self._probes.attached,
                "read_bytes": dict(self.read_bytes),
                "reads": dict(self.reads),
                "uncounted_opens": {c: dict(r) for c, r in self.uncounted.items()},
                "lost_bytes": lost[0], "lost_reads": lost[1]}

    def close(self) -> None:
        if self._probes is not None:
            self.drain()
            self._probes.close()
            self._probes = None
            self.off_reason = "closed"


OFF = "not started (no daemon: counting is loaded when a mount asks for passthrough)"
