"""Taking a mount over from a daemon that died: the tables rebuilt from its journal.

The kernel connection outlived the daemon (:mod:`qosfs.daemon.takeover.keeper`); its node ids and
file handles are still in the kernel and in use. :func:`rebuild` gives a new, idle
operations object the same meaning for each of them, from the dead process's session
journal (:mod:`qosfs.passthrough.journal`):

- inodes: the same node ids and lookup counts, reopened from their file handles or their
  (parent, name) when first used (:meth:`qosfs.passthrough.inodes.InodeTable.rebuild`);
- open files: the same ``fh``, a new backing descriptor opened with the open's flags (less
  those that made or emptied the file), the same class, tenant and owner, and an open the
  kernel passes through keeps its backing id (it belongs to the connection, which lived
  on). An open that cannot be reopened (its file was unlinked while open: its blocks went
  with the dead process's descriptor) stays in the table with no descriptor, and every
  request on it answers ESTALE, never a hang and never another file's data;
- open directories: the same ``fh``; the listing is taken again at the next READDIR;
- the outcomes of its non-idempotent requests by request id, so that those the kernel
  sends again are answered with them instead of being done twice, and its intent ring,
  carried into the successor's journal (:mod:`qosfs.passthrough.intents`).

What is not carried: the buckets' balances (a cap starts again from one burst) and a
streaming open's progress since it was opened.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from qosfs.passthrough.handles import PASSED_THROUGH, SERVED, DirHandle, FileHandle
from qosfs.passthrough.journal import DIR, FILE, INODE, Journal
from qosfs.passthrough.operations import PassthroughOperations, dio_mask_of
from qosfs.qos.charge import OpenCharge

log = logging.getLogger(__name__)

_SIGNED = 1 << 63


@dataclass(frozen=True, slots=True)
class Rebuilt:
    """What was taken over, for the log and ``ctl status``."""

    inodes: int
    open_files: int
    lost_files: int
    open_dirs: int
    intents: int  # requests the dead process had begun or done, by id (recent ones)


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= _SIGNED else value


def rebuild(ops: PassthroughOperations, journal: Journal) -> Rebuilt:
    """Give *ops* (new, idle) the dead predecessor's tables from *journal*."""
    nodes = ops.inodes.rebuild(list(journal.of_kind(INODE)))
    root = ops.inodes.root
    files = lost = dirs = 0
    for rec in journal.of_kind(FILE):
        node = nodes.get(rec.entry_slot)
        if node is None:
            log.warning("open fh %d names no inode in the journal: dropped", rec.nodeid)
            continue
        # What operations._write_down_file wrote, in this order.
        flow_key, charge_values, owner, fsuid, kill_priv, kernel, backing_id = rec.extra
        fh = rec.nodeid
        try:
            fd = os.open(f"/proc/self/fd/{node.fd}", rec.aux | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("open fh %d (node %d) cannot be reopened (%s): its requests "
                        "answer ESTALE", fh, node.nodeid, exc.strerror)
            fd = -1
            lost += 1
        flow = ops.qos.flow_from_key(flow_key)
        charge = OpenCharge.restore(ops.qos, flow, node,
                                    OpenCharge.state_from_values(charge_values))
        node.opens += 1
        ops.open_quota.adopt(int(owner))
        direct = bool(rec.aux & os.O_DIRECT)
        dio_mask = 0
        if direct and fd >= 0:
            dio_mask = dio_mask_of(fd)
        handle = FileHandle(fd, direct, charge, node, bool(kill_priv), int(fsuid),
                            int(owner), dio_mask, -1, int(kernel), fh)
        if fd >= 0:
            ops.files[fh] = handle
        else:
            ops.lost[fh] = handle
        if kernel == PASSED_THROUGH and backing_id is not None:
            ops.kernel_opens.kernel.restore_open(node.nodeid, int(backing_id))
        elif kernel == SERVED:
            ops.kernel_opens.kernel.plain_open(node.nodeid)
        files += 1
    for rec in journal.of_kind(DIR):
        node = root if rec.entry_slot == -2 else nodes.get(rec.entry_slot)
        if node is None:
            continue
        try:
            fd = os.open(f"/proc/self/fd/{node.fd}",
                         os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue  # gone: its READDIR answers EIO (no handle of that number)
        owner = _signed(rec.aux)
        ops.open_quota.adopt(owner)
        ops.dirs[rec.nodeid] = DirHandle(fd, node, owner=owner, fh=rec.nodeid)
        dirs += 1
    ops.once.past = journal.outcomes
    ops.once.carried = journal.ring
    highest = max([*ops.files, *ops.dirs, 0])
    ops.next_fh = max(ops.next_fh, journal.next_fh, highest + 1)
    return Rebuilt(len(nodes), files, lost, dirs, len(journal.outcomes))
