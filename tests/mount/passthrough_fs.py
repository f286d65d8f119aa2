"""A minimal pass-through filesystem for the kernel passthrough tests: the files at the top
of a source directory, read-only, each open registered with qosfs.passthrough.kernel.

Deliberately not qosfs's own filesystem: it tests the interface alone, and reports what
the daemon saw through a virtual file, `.stats` (JSON: read requests served by the
daemon, the interface's counters, the capability).

    python -m tests.mount.passthrough_fs mount --foreground SOURCE MOUNTPOINT
        [--no-passthrough] [--unpatched] [--stack-depth N] [--served-joins]

--no-passthrough: passthrough is not requested at INIT (an old kernel or libfuse looks the
same to the caller); --unpatched: the interface sees a pyfuse3 without the patch. An open
with O_NONBLOCK stands for one the daemon must serve itself (as a capped or writing open
will): it is passed through only if the inode already is, since the kernel would fail it.
--served-joins: such an open that joins a passed-through inode is answered with direct_io
too (`attach(..., served=True)`): its reads still reach the daemon.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import stat
import sys
import types
from typing import Any

import pyfuse3
import trio

from qosfs.passthrough.kernel import KernelPassthrough, attach, request

STATS = b".stats"
STATS_INODE = 2
FIRST_FILE_INODE = 3


class TinyPassthrough(pyfuse3.Operations):
    def __init__(self, source: str, passthrough: KernelPassthrough,
                 served_joins: bool = False) -> None:
        super().__init__()
        self.served_joins = served_joins
        self.source = source
        self.kernel = passthrough
        self.names = sorted(os.fsencode(n) for n in os.listdir(source)
                            if os.path.isfile(os.path.join(source, n)))
        self.inodes = {name: FIRST_FILE_INODE + i for i, name in enumerate(self.names)}
        self.reads = 0  # read requests for source files that reached the daemon
        self.opens: dict[int, tuple[int, bool]] = {}  # fh (the fd) -> (inode, passed through)

    def path(self, inode: int) -> str:
        return os.path.join(self.source, os.fsdecode(self.names[inode - FIRST_FILE_INODE]))

    def stats_bytes(self) -> bytes:
        s = self.kernel.statistics()
        cap = self.kernel.capability()
        return json.dumps({
            "reads": self.reads, "live": s.live, "registered": s.registered,
            "refused": s.refused, "last_refusal": s.last_refusal, "declined": s.declined,
            "open_files": len(self.opens),
            "available": cap.available, "reason": cap.reason, "pid": os.getpid(),
        }).encode() + b"\n"

    def attrs(self, inode: int) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        if inode == pyfuse3.ROOT_INODE:
            st = os.stat(self.source)
            entry.st_mode, entry.st_nlink = st.st_mode, 2
        elif inode == STATS_INODE:
            entry.st_mode, entry.st_nlink, entry.st_size = stat.S_IFREG | 0o444, 1, 0
        else:
            st = os.stat(self.path(inode))
            entry.st_mode, entry.st_nlink, entry.st_size = st.st_mode, 1, st.st_size
            entry.st_mtime_ns = st.st_mtime_ns
        entry.st_ino = inode
        entry.attr_timeout = entry.entry_timeout = 1.0
        return entry

    async def lookup(self, parent_inode: int, name: bytes,
                     ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if name == STATS:
            return self.attrs(STATS_INODE)
        if parent_inode != pyfuse3.ROOT_INODE or name not in self.inodes:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.attrs(self.inodes[name])

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self.attrs(inode)

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        return 0

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        for i, name in enumerate(self.names[start_id:], start_id):
            if not pyfuse3.readdir_reply(token, name, self.attrs(self.inodes[name]), i + 1):
                break

    async def releasedir(self, fh: int) -> None:
        pass

    async def open(self, inode: int, flags: int,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if inode == STATS_INODE:
            # Served by the daemon, uncached: every read sees the current counters.
            return pyfuse3.FileInfo(fh=0, direct_io=True)
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise pyfuse3.FUSEError(errno.EROFS)
        try:
            fd = os.open(self.path(inode), flags & (os.O_ACCMODE | os.O_DIRECT))
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        info = pyfuse3.FileInfo(fh=fd)
        backing_id = None
        served = bool(flags & os.O_NONBLOCK)  # the daemon must see its reads
        if not served or not self.kernel.plain_open(inode):
            backing_id = self.kernel.register(inode, fd)
            if backing_id is None:  # refused or declined: the daemon serves it
                self.kernel.plain_open(inode)
        if backing_id is not None:
            attach(info, backing_id, served=served and self.served_joins)
        self.opens[fd] = (inode, backing_id is not None)
        return info

    async def read(self, fh: int, off: int, size: int) -> bytes:
        if fh == 0:
            return self.stats_bytes()[off:off + size]
        self.reads += 1
        return os.pread(fh, size, off)

    async def release(self, fh: int) -> None:
        if fh == 0:
            return
        inode, registered = self.opens.pop(fh)
        os.close(fh)
        if registered:
            # Closed at the last release, as libfuse's examples do (qosfs keeps it idle).
            self.kernel.unregister(inode, 0.0)
            self.kernel.drop_idle(inode)
        else:
            self.kernel.plain_release(inode)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="passthrough_fs")
    parser.add_argument("command", choices=["mount"])
    parser.add_argument("--foreground", action="store_true")
    parser.add_argument("source")
    parser.add_argument("mountpoint")
    parser.add_argument("--no-passthrough", action="store_true")
    parser.add_argument("--unpatched", action="store_true")
    parser.add_argument("--stack-depth", type=int, default=0)
    parser.add_argument("--served-joins", action="store_true")
    args = parser.parse_args(argv)
    binding: Any = types.SimpleNamespace() if args.unpatched else pyfuse3
    fs = TinyPassthrough(args.source, KernelPassthrough(binding), args.served_joins)
    if not args.no_passthrough:
        request(fs, args.stack_depth)
    pyfuse3.init(fs, args.mountpoint, {"fsname=kpass", "default_permissions"})
    print("qosfs serving the test filesystem", flush=True)  # QosfsMount waits for it
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
