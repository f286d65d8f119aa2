"""The pass-through filesystem in-process, without a mount: its handlers called directly
under trio on a temporary backing tree, built the way ``qosfs.daemon.assembly`` builds it.

pyfuse3 lets Python build a :class:`pyfuse3.RequestContext` and a
:class:`pyfuse3.SetattrFields`, but not fill them (their fields are read-only and set
from C). The handlers only read those fields, so :class:`Caller` and :class:`Fields` are
subclasses that answer them from Python: real instances of pyfuse3's types, as the
handlers' signatures say, without a cast.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from qosfs.daemon.fs_assembly import build_filesystem
from qosfs.passthrough.backing_io import IoMode
from qosfs.passthrough.operations import FsOptions
from qosfs.policy.loading import parse_policy
from qosfs.qos.engine import PolicyQos
from qosfs.qos.interface import PassThroughQos, QosEngine

# A policy that classifies, counts and admits every request (metadata included), and
# limits nothing a test would notice: the handlers take the policy engine's path.
SMALL_POLICY = """
[classes.data]
paths = ["data/**"]
read_bandwidth = "100GiB/s"
meta_iops = 1000000000

[classes.default]
write_bandwidth = "100GiB/s"
meta_iops = 1000000000
"""

ENGINES: dict[str, Callable[[], QosEngine]] = {
    "no-qos": PassThroughQos,
    "policy": lambda: PolicyQos(parse_policy(SMALL_POLICY)),
}


class Caller(pyfuse3.RequestContext):
    """The caller of a request (pyfuse3 fills its own from the kernel's request)."""

    __slots__ = ("_gid", "_pid", "_uid", "_umask")

    def __init__(self, uid: int | None = None, gid: int | None = None,
                 pid: int | None = None, umask: int = 0o022) -> None:
        self._uid = os.getuid() if uid is None else uid
        self._gid = os.getgid() if gid is None else gid
        self._pid = os.getpid() if pid is None else pid
        self._umask = umask

    @property
    def uid(self) -> int:
        return self._uid

    @property
    def gid(self) -> int:
        return self._gid

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def umask(self) -> int:
        return self._umask


class Fields(pyfuse3.SetattrFields):
    """Which attributes a SETATTR changes (the keyword arguments set to True)."""

    __slots__ = ("_set",)

    def __init__(self, **updates: bool) -> None:
        unknown = set(updates) - {f"update_{x}" for x in
                                  ("size", "mode", "uid", "gid", "atime", "mtime", "ctime")}
        assert not unknown, unknown
        self._set = {name for name, on in updates.items() if on}

    def _has(self, name: str) -> bool:
        return name in self._set

    update_size = property(lambda self: self._has("update_size"))
    update_mode = property(lambda self: self._has("update_mode"))
    update_uid = property(lambda self: self._has("update_uid"))
    update_gid = property(lambda self: self._has("update_gid"))
    update_atime = property(lambda self: self._has("update_atime"))
    update_mtime = property(lambda self: self._has("update_mtime"))
    update_ctime = property(lambda self: self._has("update_ctime"))


def open_fds() -> int:
    """How many descriptors this process holds now."""
    return len(os.listdir("/proc/self/fd")) - 1  # less the one listing it


class InProcessFs:
    """A :class:`~qosfs.passthrough.filesystem.Filesystem` over *root* (``fs``, its operations
    ``ops``), and what tests ask of it.

    Built as ``qosfs.daemon.start.run_mount`` builds it: the backing root opened as a
    directory, a :class:`BackingIO` in *mode*, the engine, the mount's options.
    """

    def __init__(self, root: Path, qos: QosEngine, options: FsOptions | None = None,
                 mode: IoMode = IoMode.INLINE) -> None:
        self.root = root
        self.root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.fs = build_filesystem(self.root_fd, mode, qos, options or FsOptions())
        self.ops = self.fs.ops
        self.ctx = Caller()

    def run(self, main: Callable[[], Awaitable[Any]]) -> None:
        """Run *main* in a trio loop of its own, as pyfuse3 runs the handlers."""
        trio.run(main)

    async def lookup(self, path: str, ctx: Caller | None = None) -> pyfuse3.EntryAttributes:
        """Look *path* up one component at a time from the root, as the kernel does (each
        component counts one lookup); raises FUSEError(ENOENT) for a missing name."""
        parent = pyfuse3.ROOT_INODE
        entry = pyfuse3.EntryAttributes()
        for name in path.split("/"):
            entry = await self.ops.lookup(parent, os.fsencode(name), ctx or self.ctx)
            if entry.st_ino == 0:
                raise pyfuse3.FUSEError(2)
            parent = entry.st_ino
        return entry

    def close(self) -> None:
        """Close every descriptor, as the daemon does after the unmount."""
        self.fs.close_all()
        os.close(self.root_fd)
