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
  one); an open passed through to the kernel keeps its backing id, which belongs to the
  connection (:meth:`qosfs.passthrough.kernel_opens.KernelOpens.export_state`);
- every open directory, with the snapshot its offsets refer to.

``export_state`` changes nothing (a refused handover leaves the old process serving as it
was); ``import_state`` is called on a new, idle filesystem (its :class:`~qosfs.passthrough.
handle_table.Tables`). The descriptors travel
by SCM_RIGHTS in the order of the returned list, which the payload refers to by index.
What does not travel: the QoS engine's memo of each inode's classification (made again at
the next request) and the bytes a watched open wrote under a temporary name (a rename
after the handover charges nothing more for them).
"""

from __future__ import annotations

import fcntl
from typing import Any

from qosfs.passthrough.handle_table import OpenRecord, Tables
from qosfs.passthrough.inode_takeover import export_inodes, import_inodes


def export_state(fs: Tables) -> tuple[dict[str, Any], list[int]]:
    """The filesystem's state as a JSON-able payload and the descriptors it names."""
    fds: list[int] = []
    handles = fs.handles
    files = list(handles.files.values())
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
        "open": handles.record(h, fcntl.fcntl(h.fd, fcntl.F_GETFL),
                               index[id(h.inode)]).save(),
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


def import_state(fs: Tables, payload: dict[str, Any], fds: list[int]) -> None:
    """Take over a predecessor's state: *fs* must not have served a request yet, and
    owns *fds* (as `export_state` listed them) from here on."""
    nodes = import_inodes(fs.inodes, payload["inodes"], fds)
    handles = fs.handles
    for rec in payload["files"]:
        record = OpenRecord.load(rec["open"])
        handles.restore_file(record, nodes[record.inode], fds[rec["fd"]],
                             fds[rec["buffered"]] if rec["buffered"] >= 0 else -1)
    for rec in payload["dirs"]:
        handles.restore_dir(int(rec["fh"]), fds[rec["fd"]], nodes[rec["inode"]],
                            int(rec["owner"]), [bytes.fromhex(n) for n in rec["names"]],
                            bool(rec["listed"]))
    # fh numbers are never reused: the kernel may hold any of the predecessor's.
    handles.number_after(int(payload["next_fh"]))
    handles.quota.refused += int(payload["open_refused"])
    fs.kernel_opens.import_state(payload["passthrough"])
