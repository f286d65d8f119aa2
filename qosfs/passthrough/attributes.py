"""What a SETATTR changes on the backing object (size, mode, owner, times), through the
open's descriptor when the kernel names one."""

from __future__ import annotations

import os
import stat

import pyfuse3

from qosfs.core import syscalls
from qosfs.passthrough.handles import FileHandle
from qosfs.passthrough.inode import Inode
from qosfs.passthrough.ownership import kill_priv


def apply_setattr(node: Inode, handle: FileHandle | None,
                  attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                  caller_uid: int) -> None:
    if not (fields.update_size or fields.update_mode or fields.update_uid
            or fields.update_gid or fields.update_atime or fields.update_mtime):
        # chown(-1, -1) (and lchown, fchown): the kernel sends a setattr with nothing
        # to change, yet natively the call updates ctime. The same no-op chown on the
        # backing object does exactly what it does there. (update_ctime alone comes
        # only with the writeback cache, which is off.)
        syscalls.chown_fd(node.fd, -1, -1)
        return
    if fields.update_size:
        node.cache_stamp = None  # cached pages past the new size are gone: re-read
        if handle is not None:
            os.ftruncate(handle.fd, attr.st_size)
        else:
            os.truncate(node.proc_path, attr.st_size)
        if caller_uid != 0:
            kill_priv(node.fd)
    if fields.update_mode:
        mode = stat.S_IMODE(attr.st_mode)
        if handle is not None:
            os.fchmod(handle.fd, mode)
        else:
            os.chmod(node.proc_path, mode)
    if fields.update_uid or fields.update_gid:
        uid = attr.st_uid if fields.update_uid else -1
        gid = attr.st_gid if fields.update_gid else -1
        syscalls.chown_fd(node.fd, uid, gid)
    if fields.update_atime or fields.update_mtime:
        syscalls.utimens_fd(
            node.fd,
            attr.st_atime_ns if fields.update_atime else None,
            attr.st_mtime_ns if fields.update_mtime else None,
        )
