"""The FUSE pass-through: the pyfuse3 operations, inodes held by file handle, open
files, paths for classification, and the backing I/O (descriptors opened before the
mount, reads and writes on the loop or on worker threads)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qosfs.core.faces import lazy_face

if TYPE_CHECKING:
    from qosfs.passthrough.backing_io import BackingIO, IoMode, backing_mount, choose_io_mode
    from qosfs.passthrough.fdcache import DeferredClose, FdCache
    from qosfs.passthrough.handles import DirHandle, FileHandle, OpenQuota
    from qosfs.passthrough.inodes import Inode, InodeTable
    from qosfs.passthrough.operations import FsOptions, PassthroughOperations
    from qosfs.passthrough.paths import PathBook

_EXPORTS = {
    "operations": ("FsOptions", "PassthroughOperations"),
    "backing_io": ("BackingIO", "IoMode", "backing_mount", "choose_io_mode"),
    "inodes": ("Inode", "InodeTable"),
    "handles": ("DirHandle", "FileHandle", "OpenQuota"),
    "paths": ("PathBook",),
    "fdcache": ("DeferredClose", "FdCache"),
}
__all__ = [
    "BackingIO", "DeferredClose", "DirHandle", "FdCache", "FileHandle", "FsOptions", "Inode",
    "InodeTable", "IoMode", "OpenQuota", "PassthroughOperations", "PathBook", "backing_mount",
    "choose_io_mode",
]

if not TYPE_CHECKING:  # type checkers read the imports above
    __getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
