"""Taking an inode table over: a predecessor's, for a process that serves the same
kernel connection. A planned handover exports the table as plain data and descriptors
(:func:`export_inodes`, :func:`import_inodes`, for :mod:`qosfs.passthrough.transfer`);
after a crash it is rebuilt from the dead process's journal (:func:`rebuild_inodes`, for
:mod:`qosfs.passthrough.recovery`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from qosfs.passthrough.inode import Inode
from qosfs.passthrough.inodes import InodeTable
from qosfs.passthrough.journal import ROOT_SLOT, STALE, Record


def export_inodes(table: InodeTable, fds: list[int],
                  also: Iterable[Inode] = ()) -> tuple[dict[str, Any], dict[int, int]]:
    """The table as plain data, for a successor process that serves the same kernel
    connection (:mod:`qosfs.passthrough.transfer`): every inode the kernel holds a
    node id of, every inode those name as their parent or entry (a directory the kernel
    forgot included) and the inodes of *also* (open files' and directories'), each
    with its lookup count and what reopens it: its file handle, or its (parent, name).
    A cached descriptor is appended to *fds* (they travel by SCM_RIGHTS) and its
    record names its index. Returns the payload and, by ``id(inode)``, each inode's
    record index. Nothing is closed or changed here: refused, the handover leaves the
    table serving as it was."""
    table.thaw_all()  # cold inodes travel as objects (the successor folds them again)
    index: dict[int, int] = {}
    order: list[Inode] = []

    def ref(inode: Inode | None) -> int:
        if inode is None:
            return -1
        at = index.get(id(inode))
        if at is None:
            at = index[id(inode)] = len(order)
            order.append(inode)
        return at

    ref(table.root)  # record 0: the successor's own root (the root descriptor travels apart)
    for inode in (*table.by_id.values(), *table.by_key.values(), *also):
        ref(inode)
    records: list[dict[str, Any]] = []
    at = 0
    while at < len(order):  # ref() appends the parents and entries it meets
        inode = order[at]
        at += 1
        entry = inode.entry
        fd, pinned = -1, False
        if inode is not table.root and inode.cached_fd >= 0:
            fd, pinned = len(fds), inode.slot < 0
            fds.append(inode.cached_fd)
        records.append({
            "nodeid": inode.nodeid, "key": list(inode.key), "lookups": inode.lookups,
            "handle": None if inode.handle is None else inode.handle.hex(),
            "handle_due": inode.handle_due,
            "entry": None if entry is None else [ref(entry[0]), entry[1].hex()],
            "parent": ref(inode.parent), "stale": inode.stale,
            "known": table.by_id.get(inode.nodeid) is inode,
            "keyed": table.by_key.get(inode.key) is inode,
            "cache_stamp": None if inode.cache_stamp is None else list(inode.cache_stamp),
            "fd": fd, "pinned": pinned,
        })
    return {"records": records, "next_synthetic": table.next_synthetic,
            "reopens": table.reopens}, index

def import_inodes(table: InodeTable, state: dict[str, Any],
                  fds: Sequence[int]) -> list[Inode]:
    """Take over a predecessor's table (`export_state`'s payload, the descriptors it
    names received as *fds*, owned from here on); returns the inodes by record index.
    The table must be new: record 0 is its root."""
    records = state["records"]
    nodes: list[Inode] = [table.root]
    for rec in records[1:]:
        handle = rec["handle"]
        nodes.append(Inode(table, int(rec["nodeid"]), (int(rec["key"][0]),
                           int(rec["key"][1])), int(rec["lookups"]),
                           None if handle is None else bytes.fromhex(handle), -1))
    for inode, rec in zip(nodes, records, strict=True):
        if inode is not table.root:
            inode.handle_due = bool(rec["handle_due"])
            inode.stale = bool(rec["stale"])
            entry = rec["entry"]
            inode.entry = None if entry is None else (nodes[entry[0]],
                                                      bytes.fromhex(entry[1]))
            stamp = rec["cache_stamp"]
            inode.cache_stamp = None if stamp is None else (int(stamp[0]), int(stamp[1]),
                                                            int(stamp[2]))
            if rec["known"]:
                table.by_id[inode.nodeid] = inode
            if rec["keyed"]:
                table.by_key[inode.key] = inode
        parent = rec["parent"]
        inode.parent = None if parent < 0 else nodes[parent]
        inode.lookups = int(rec["lookups"])
        if rec["fd"] >= 0:
            fd = fds[rec["fd"]]
            if rec["pinned"]:
                inode.cached_fd = fd
                table.pinned += 1
            else:
                table.cache.put(inode, fd)
    table.next_synthetic = max(table.next_synthetic, int(state["next_synthetic"]))
    table.reopens += int(state["reopens"])
    return nodes

def rebuild_inodes(table: InodeTable, records: Sequence[Record]) -> dict[int, Inode]:
    """Take over a dead predecessor's table from its journal's inode records (the
    table must be new); returns the inodes by their old slot.

    No descriptor is opened here: an inode is reopened from its handle, or by its
    (parent, name) with its (device, inode number) checked, when first used, as after
    an eviction. One that can be reopened neither way (the predecessor held its only
    descriptor: a source without handles) answers ESTALE, as does one the predecessor
    had let go (unlinked, or replaced underneath). Lookup counts are the
    kernel's as the predecessor last wrote them; a lookup it counted but never answered
    leaves one reference too many (the inode is then kept until unmount), never one
    too few."""
    nodes: dict[int, Inode] = {}
    for rec in records:
        nodes[rec.slot] = Inode(table, rec.nodeid, (rec.dev, rec.ino), rec.lookups,
                                rec.handle or None, -1)

    def ref(slot: int) -> Inode | None:
        return table.root if slot == ROOT_SLOT else nodes.get(slot)

    for rec in records:
        inode = nodes[rec.slot]
        named = ref(rec.entry_slot)
        if inode.handle is None and named is not None:
            inode.entry = (named, rec.name)
            inode.handle_due = table.handles and inode.key[0] == table.root_dev
        inode.parent = ref(rec.parent_slot)
        inode.stale = bool(rec.flags & STALE)
        if rec.lookups > 0 and rec.nodeid not in table.by_id:
            table.by_id[rec.nodeid] = inode
            if not inode.stale:  # the key is the live object's, if one is known
                table.by_key.setdefault(inode.key, inode)
        if rec.nodeid >= table.next_synthetic:
            table.next_synthetic = rec.nodeid + 1
    return nodes
