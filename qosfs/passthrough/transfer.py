"""What a running filesystem hands to the process that takes its mount over: the kernel's
ids of it, as plain data and descriptors.

The kernel keeps using the node ids, lookup counts and file handles the old process gave
it, so the successor (``qosfs upgrade``) must answer each of them with the same
backing object, the same open and the same QoS charge:

- the inode table (:func:`qosfs.passthrough.inode_takeover.export_inodes`): node ids,
  lookup counts, what reopens each inode (file handle or parent and name) and its cached
  ``O_PATH`` descriptor;
- every open file, as the crash journal writes it (:class:`qosfs.passthrough.handle_table.
  OpenRecord`: its ``fh`` as the kernel knows it, flags, owner, and its charge: the flow
  by the engine's ``flow_key`` (class, tenant, uid) and where its streaming detection
  stands), with its backing descriptor (and its buffered twin, if an O_DIRECT open has
  one); an open passed through to the kernel (or that joined one with direct_io) keeps
  its backing id, which belongs to the connection
  (:meth:`qosfs.passthrough.kernel_opens.KernelOpens.export_state`);
- every open directory, with the snapshot its offsets refer to.

``export_state`` changes nothing (a refused handover leaves the old process serving as it
was); ``import_state`` is called on a new, idle filesystem (a :class:`~qosfs.passthrough.filesystem.
Filesystem`, as its :class:`~qosfs.passthrough.handle_table.Tables`). The descriptors travel
by SCM_RIGHTS in the order of the returned list, which the payload refers to by index.
What does not travel: the QoS engine's memo of each inode's classification (made again at
the next request) and the bytes a watched open wrote under a temporary name (a rename
after the handover charges nothing more for them).

The open files' format is the handover protocol's (:data:`qosfs.daemon.takeover.offer.
PROTOCOL`): in protocol 2 each is its OpenRecord's tuple. The build before wrote protocol
1, each open a dict of its fields; ``import_state`` still reads it (`open_record_v1`), so
that ``qosfs upgrade`` from that build works. Nothing writes protocol 1.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from typing import Any

from qosfs.passthrough.handle_table import OPEN_DROP, OpenRecord, Tables
from qosfs.passthrough.handles import SHARES_BACKING_ID
from qosfs.passthrough.inode_takeover import export_inodes, import_inodes
from qosfs.qos.charge import OpenCharge


def export_state(fs: Tables) -> tuple[dict[str, Any], list[int]]:
    """The filesystem's state as a JSON-able payload and the descriptors it names."""
    fds: list[int] = []
    handles = fs.handles
    files = list(handles.files.values())
    for h in files:  # a successor is sent a descriptor for every open
        try:
            handles.descriptor(h)
        except OSError:
            pass  # gone underneath: sent as lost (-1), as a crash's successor would find it
    dirs = list(handles.dirs.values())
    inodes, index = export_inodes(
        fs.inodes, fds, [h.inode for h in files] + [d.inode for d in dirs])

    def add(fd: int) -> int:
        if fd < 0:
            return -1
        fds.append(fd)
        return len(fds) - 1

    # Each open as its OpenRecord (the crash journal's), and its descriptors by index.
    file_records = [{
        "open": handles.record(h, fcntl.fcntl(h.fd, fcntl.F_GETFL) if h.fd >= 0
                               else h.open_flags, index[id(h.inode)]).save(),
        "fd": add(h.fd), "buffered": add(h.buffered),
    } for h in files]
    dir_records = [{
        "fh": d.fh, "fd": add(d.fd), "inode": index[id(d.inode)],
        "names": [name.hex() for name in d.names], "listed": d.listed, "owner": d.owner,
    } for d in dirs]
    payload = {"inodes": inodes, "files": file_records, "dirs": dir_records,
               "next_fh": handles.next_fh, "open_refused": handles.quota.refused,
               "passthrough": fs.kernel_opens.export_state()}
    return payload, fds


def import_state(fs: Tables, payload: dict[str, Any], fds: list[int], protocol: int) -> None:
    """Take over a predecessor's state: *fs* must not have served a request yet, and
    owns *fds* (as `export_state` listed them) from here on. *protocol*: the handover
    protocol *payload* was written in (2, or the build before's 1: see the module
    docstring)."""
    nodes = import_inodes(fs.inodes, payload["inodes"], fds)
    handles = fs.handles
    read = _files_reader(payload, fds, protocol)
    for rec in payload["files"]:
        record = read(rec)
        handles.restore_file(record, nodes[record.inode],
                             fds[rec["fd"]] if rec["fd"] >= 0 else -1,
                             fds[rec["buffered"]] if rec["buffered"] >= 0 else -1)
    for rec in payload["dirs"]:
        handles.restore_dir(int(rec["fh"]), fds[rec["fd"]], nodes[rec["inode"]],
                            int(rec["owner"]), [bytes.fromhex(n) for n in rec["names"]],
                            bool(rec["listed"]))
    # fh numbers are never reused: the kernel may hold any of the predecessor's.
    handles.number_after(int(payload["next_fh"]))
    handles.quota.refused += int(payload["open_refused"])
    fs.kernel_opens.import_state(payload["passthrough"])


def _files_reader(payload: dict[str, Any], fds: list[int],
                  protocol: int) -> Callable[[dict[str, Any]], OpenRecord]:
    """What reads an open file's record of *payload*, written in *protocol*."""
    if protocol != 1:
        return lambda rec: OpenRecord.load(rec["open"])
    records = payload["inodes"]["records"]
    backing_ids = {int(nodeid): int(backing_id)
                   for nodeid, backing_id, _opens in payload["passthrough"]["kernel"]["ids"]}
    return lambda rec: open_record_v1(
        rec, fds[rec["fd"]], backing_ids.get(int(records[rec["inode"]]["nodeid"])))


def open_record_v1(rec: dict[str, Any], fd: int, backing_id: int | None) -> OpenRecord:
    """An open file of a protocol-1 payload (the build before's: ``{"fh", "fd",
    "buffered", "direct", "inode", "kill_priv", "fsuid", "owner", "dio_mask", "kernel",
    "flow", "charge"}``, the charge as ``OpenCharge.export_state``'s dict) as the
    OpenRecord this build's export writes of the same open: its flags are its descriptor's
    *fd* (the predecessor's open file description, received), less what
    :meth:`~qosfs.passthrough.handle_table.HandleTable.record` drops, with O_DIRECT as
    ``direct`` says; *backing_id*: its inode's kernel passthrough id (the payload's
    ``passthrough`` state), kept if the open is passed through. ``dio_mask`` is not
    read: the restore works it out from the descriptor, as the predecessor did at open
    (:func:`qosfs.passthrough.odirect.dio_mask_of`)."""
    direct = bool(rec["direct"])
    flags = (fcntl.fcntl(fd, fcntl.F_GETFL) & ~(OPEN_DROP | os.O_TRUNC | os.O_DIRECT)
             | os.O_CLOEXEC | (os.O_DIRECT if direct else 0))
    kernel = int(rec["kernel"])
    return OpenRecord(
        int(rec["fh"]), int(rec["inode"]), flags, list(rec["flow"]),
        OpenCharge.values_from_state(rec["charge"]), int(rec["owner"]), int(rec["fsuid"]),
        bool(rec["kill_priv"]), kernel, backing_id if kernel in SHARES_BACKING_ID else None)
