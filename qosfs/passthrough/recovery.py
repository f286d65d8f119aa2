"""Taking a mount over from a daemon that died: the tables rebuilt from its journal.

The kernel connection outlived the daemon (:mod:`qosfs.daemon.takeover.keeper`); its node ids and
file handles are still in the kernel and in use. :func:`rebuild` gives a new, idle
filesystem (a :class:`~qosfs.passthrough.filesystem.Filesystem`, as its
:class:`~qosfs.passthrough.handle_table.Tables`) the same meaning for
each of them, from the dead process's session journal (:mod:`qosfs.passthrough.journal`):

- inodes: the same node ids and lookup counts, reopened from their file handles or their
  (parent, name) when first used (:func:`qosfs.passthrough.inode_takeover.rebuild_inodes`);
- open files: the same ``fh``, a new backing descriptor opened with the open's flags (less
  those that made or emptied the file), the same class, tenant and owner, and an open the
  kernel passes through keeps its backing id (it belongs to the connection, which lived
  on), as does one that joined a passed-through inode with direct_io (``JOINED``: still
  served by the new daemon, and capped); a backing id no open used (kept idle) is kept
  idle again, to be taken back or closed in its time. An open that cannot be reopened (its file was
  unlinked while open: its blocks went with the dead process's descriptor) stays in the
  table with no descriptor, and every request on it answers ESTALE, never a hang and
  never another file's data;
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

from qosfs.passthrough.handle_table import OpenRecord, Tables
from qosfs.passthrough.handles import SERVED, SHARES_BACKING_ID
from qosfs.passthrough.inode_takeover import rebuild_inodes
from qosfs.passthrough.journal import BACKING, DIR, FILE, INODE, Journal

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


def rebuild(fs: Tables, journal: Journal) -> Rebuilt:
    """Give *fs* (new, idle) the dead predecessor's tables from *journal*."""
    nodes = rebuild_inodes(fs.inodes, list(journal.of_kind(INODE)))
    root = fs.inodes.root
    handles = fs.handles
    kernel = fs.kernel_opens.kernel
    files = lost = dirs = 0
    for rec in journal.of_kind(FILE):
        node = nodes.get(rec.entry_slot)
        if node is None:
            log.warning("open fh %d names no inode in the journal: dropped", rec.nodeid)
            continue
        record = OpenRecord.load(rec.saved())
        try:
            fd = os.open(f"/proc/self/fd/{node.fd}", record.flags | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("open fh %d (node %d) cannot be reopened (%s): its requests "
                        "answer ESTALE", record.fh, node.nodeid, exc.strerror)
            fd = -1
            lost += 1
        handles.restore_file(record, node, fd)
        if record.kernel in SHARES_BACKING_ID and record.backing_id is not None:
            kernel.restore_open(node.nodeid, record.backing_id)
        elif record.kernel == SERVED:
            kernel.plain_open(node.nodeid)
        files += 1
    fs.kernel_opens.count_inherited()
    for rec in journal.of_kind(BACKING):  # ids no open of the dead process used: idle
        kernel.restore_idle(rec.nodeid, rec.aux)
    for rec in journal.of_kind(DIR):
        node = root if rec.entry_slot == -2 else nodes.get(rec.entry_slot)
        if node is None:
            continue
        try:
            fd = os.open(f"/proc/self/fd/{node.fd}",
                         os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue  # gone: its READDIR answers EIO (no handle of that number)
        handles.restore_dir(rec.nodeid, fd, node, _signed(rec.aux))
        dirs += 1
    fs.once.past = journal.outcomes
    fs.once.carried = journal.ring
    handles.number_after(journal.next_fh)
    return Rebuilt(len(nodes), files, lost, dirs, len(journal.outcomes))
