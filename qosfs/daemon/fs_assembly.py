"""The assembly of a mount's filesystem: :func:`build_filesystem` makes the parts the
FUSE operations (:class:`qosfs.passthrough.operations.PassthroughOperations`) are handed,
and returns them together as a :class:`qosfs.passthrough.filesystem.Filesystem`.

Kept apart from the operations so that they only answer FUSE: which inode table, which
descriptor budget and open quota, which I/O mode, ownership emulation and failure
counter a mount has is decided here, once, for the daemon (:mod:`qosfs.daemon.assembly`),
the in-process tests and the machinery benchmark alike.
"""

from __future__ import annotations

import os
import resource

from qosfs.core.failures import Failures
from qosfs.passthrough.backing_io import BackingIO, IoMode
from qosfs.passthrough.entries import Entries
from qosfs.passthrough.fdcache import DeferredClose, default_fd_budget
from qosfs.passthrough.filesystem import Filesystem
from qosfs.passthrough.handle_table import HandleTable
from qosfs.passthrough.handles import FileHandle, OpenQuota
from qosfs.passthrough.inodes import InodeTable
from qosfs.passthrough.intents import ExactlyOnce
from qosfs.passthrough.kernel_opens import KernelOpens
from qosfs.passthrough.meta_calls import MetaCalls
from qosfs.passthrough.namespace import Namespace
from qosfs.passthrough.operations import FsOptions, PassthroughOperations
from qosfs.passthrough.ownership import Ownership
from qosfs.passthrough.paths import PathBook
from qosfs.qos.interface import FilesystemQos


def build_filesystem(root_fd: int, io: IoMode | BackingIO, qos: FilesystemQos,
                     options: FsOptions, write_as_caller: bool = False,
                     failures: Failures | None = None) -> Filesystem:
    """The filesystem (its FUSE operations and their parts) over the backing root
    *root_fd*, with the syscalls of *io* (a mode, or a BackingIO made already) and the QoS
    engine *qos*.

    *write_as_caller*: non-root openers' writes run with their fsuid (root's reserve:
    :mod:`qosfs.daemon.privileges`). *failures*: where unexpected exceptions answered EIO
    are counted (the daemon's services count theirs in the same place: one figure in
    ``ctl status``).
    """
    # Evicted inode descriptors are closed only once no worker thread can still be using
    # them (network backing stores run metadata syscalls in threads): the inode table and
    # the I/O share one guard.
    if isinstance(io, BackingIO):
        backing = io
    else:
        backing = BackingIO(io, DeferredClose())
    budget = options.fd_budget or default_fd_budget()
    inodes = InodeTable(root_fd, budget, backing.fd_guard)
    # Each uid may hold half of the descriptors the inode cache leaves
    # (qosfs.passthrough.handles).
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    # Open files by fh; kernel passthrough (asked for at INIT by daemon/assembly.py, or why
    # not): which opens the kernel serves itself, counted by class.
    files: dict[int, FileHandle] = {}
    kernel_opens = KernelOpens(files)
    inodes.on_unlinked = kernel_opens.forget  # an idle backing id would keep the blocks
    handles = HandleTable(OpenQuota(max(64, (soft - budget) // 2)), qos, inodes,
                          kernel_opens, files)
    paths = PathBook(root_fd, inodes.root)
    # Renames, unlinks, mkdirs... recorded by request id, so that one the kernel sends
    # again after a crash is answered with what was done, not done twice.
    once = ExactlyOnce()
    calls = MetaCalls(backing, qos.meta_limiter, inodes)
    entries = Entries(inodes, paths, qos, calls, options.entry_timeout, options.attr_timeout)
    owners = Ownership(os.geteuid() == 0, write_as_caller)
    names = Namespace(inodes, paths, handles, qos, calls, entries, owners, once)
    failures = failures if failures is not None else Failures()
    ops = PassthroughOperations(inodes, handles, paths, backing, qos, options, kernel_opens,
                                calls, entries, names, owners, failures)
    return Filesystem(ops, inodes, handles, kernel_opens, once, backing, failures)
