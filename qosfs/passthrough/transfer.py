"""What a running filesystem hands to the process that takes its mount over: the kernel's
ids of it, as plain data and descriptors.

The kernel keeps using the node ids, lookup counts and file handles the old process gave
it, so the successor (``qosfs upgrade``) must answer each of them with the same
backing object, the same open and the same QoS charge:

- the inode table (:meth:`qosfs.passthrough.inodes.InodeTable.export_state`): node ids,
  lookup counts, what reopens each inode (file handle or parent and name) and its cached
  ``O_PATH`` descriptor;
- every open file: its ``fh`` as the kernel knows it, its backing descriptor (and its
  buffered twin, if an O_DIRECT open has one), flags, owner, and its charge: the flow by
  the engine's ``flow_key`` (class, tenant, uid) and where its streaming detection stands;
  an open passed through to the kernel keeps its backing id, which belongs to the
  connection (:meth:`qosfs.passthrough.kernel_opens.KernelOpens.export_state`);
- every open directory, with the snapshot its offsets refer to.

``export_state`` changes nothing (a refused handover leaves the old process serving as it
was); ``import_state`` is called on a new, idle operations object. The descriptors travel
by SCM_RIGHTS in the order of the returned list, which the payload refers to by index.
What does not travel: the QoS engine's memo of each inode's classification (made again at
the next request) and the bytes a watched open wrote under a temporary name (a rename
after the handover charges nothing more for them).
"""

from __future__ import annotations

from typing import Any

from qosfs.passthrough.handles import DirHandle, FileHandle
from qosfs.passthrough.operations import PassthroughOperations
from qosfs.qos.charge import OpenCharge


def export_state(ops: PassthroughOperations) -> tuple[dict[str, Any], list[int]]:
    """The filesystem's state as a JSON-able payload and the descriptors it names."""
    fds: list[int] = []
    files = list(ops.files.values())
    dirs = list(ops.dirs.values())
    inodes, index = ops.inodes.export_state(
        fds, [h.inode for h in files] + [d.inode for d in dirs])

    def add(fd: int) -> int:
        if fd < 0:
            return -1
        fds.append(fd)
        return len(fds) - 1

    file_records = [{
        "fh": h.fh, "fd": add(h.fd), "buffered": add(h.buffered), "direct": h.direct,
        "inode": index[id(h.inode)], "kill_priv": h.kill_priv, "fsuid": h.fsuid,
        "owner": h.owner, "dio_mask": h.dio_mask, "kernel": h.kernel,
        "flow": ops.qos.flow_key(h.charge.flow), "charge": h.charge.export_state(),
    } for h in files]
    dir_records = [{
        "fh": d.fh, "fd": add(d.fd), "inode": index[id(d.inode)],
        "names": [name.hex() for name in d.names], "listed": d.listed, "owner": d.owner,
    } for d in dirs]
    payload = {"inodes": inodes, "files": file_records, "dirs": dir_records,
               "next_fh": ops.next_fh, "open_refused": ops.open_quota.refused,
               "passthrough": ops.kernel_opens.export_state()}
    return payload, fds


def import_state(ops: PassthroughOperations, payload: dict[str, Any],
                 fds: list[int]) -> None:
    """Take over a predecessor's state: *ops* must not have served a request yet, and
    owns *fds* (as `export_state` listed them) from here on."""
    nodes = ops.inodes.import_state(payload["inodes"], fds)
    for rec in payload["files"]:
        node = nodes[rec["inode"]]
        flow = ops.qos.flow_from_key(rec["flow"])
        charge = OpenCharge.restore(ops.qos, flow, node, rec["charge"])
        node.opens += 1
        ops.open_quota.adopt(int(rec["owner"]))
        fh = int(rec["fh"])
        ops.files[fh] = FileHandle(
            fds[rec["fd"]], bool(rec["direct"]), charge, node, bool(rec["kill_priv"]),
            int(rec["fsuid"]), int(rec["owner"]), int(rec["dio_mask"]),
            fds[rec["buffered"]] if rec["buffered"] >= 0 else -1, int(rec["kernel"]), fh)
    for rec in payload["dirs"]:
        fh = int(rec["fh"])
        ops.open_quota.adopt(int(rec["owner"]))
        ops.dirs[fh] = DirHandle(fds[rec["fd"]], nodes[rec["inode"]],
                                 [bytes.fromhex(n) for n in rec["names"]],
                                 bool(rec["listed"]), int(rec["owner"]), fh)
    # fh numbers are never reused: the kernel may hold any of the predecessor's.
    ops.next_fh = max(ops.next_fh, int(payload["next_fh"]))
    ops.open_quota.refused += int(payload["open_refused"])
    ops.kernel_opens.import_state(payload["passthrough"])
