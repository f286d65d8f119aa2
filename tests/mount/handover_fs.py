"""A minimal read-write pass-through filesystem that hands its live mount to a successor,
for the handover tests (qosfs.daemon.takeover.fuse_session): the files at the top of a source
directory, node ids handed out on lookup, one backing descriptor per open.

Deliberately not qosfs's own filesystem: it proves the native piece (a process serving a
connection another one initialised) through a real mount, with the two tables the kernel
holds ids of: node ids (and their lookup counts) and file handles (with their backing
descriptors). Both travel to the successor; node ids are handed out from a base that
differs per process, so a successor that numbered its own would serve the wrong files.

    python -m tests.mount.handover_fs SOURCE MOUNTPOINT --name A --listen SOCK
    python -m tests.mount.handover_fs SOURCE MOUNTPOINT --name B --listen SOCK2 --adopt SOCK

The handover, over the Unix socket the old process listens on (--listen):
1. prepare: the old process, still serving, sends the FUSE descriptor and the state
   negotiated at INIT; the successor checks them and answers ready (or refuse: the old
   process goes on serving, and listens again);
2. commit: the old process stops reading (pyfuse3.terminate: its tasks answer what they
   hold, then main() returns), sends its tables and every open's backing descriptor; the
   successor adopts the session, answers serving and serves; the old one exits without
   unmounting.

Each process prints one line when it serves ("serving NAME"), and the virtual file
`.whoami` reads "NAME PID" of the process that served the read. --refuse makes a
successor refuse at prepare (the refused-halfway case).
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import stat
import sys
import time
from typing import Any

import pyfuse3
import trio

from qosfs.daemon.takeover import fuse_session

WHOAMI = b".whoami"
WHOAMI_INODE = 2
WHOAMI_FH = 0
# .park: a read of it reads "NAME\n", except in a process started with --park, which
# holds it unanswered for ever (a request in flight when that process is killed).
PARK = b".park"
PARK_INODE = 3
PARK_FH = 1 << 62
OPTIONS = ("fsname=handoverfs", "default_permissions")


class HandoverFs(pyfuse3.Operations):
    def __init__(self, source: str, name: str, inode_base: int, park: bool = False) -> None:
        super().__init__()
        self.source = source
        self.name = name
        self.park = park
        self.inodes: dict[bytes, int] = {}  # file name -> node id
        self.names: dict[int, bytes] = {}  # node id -> file name
        self.lookups: dict[int, int] = {}  # node id -> the kernel's lookup count
        self.next_inode = inode_base
        self.opens: dict[int, int] = {}  # file handle -> backing descriptor
        self.next_fh = 1

    # What travels (the descriptors go as SCM_RIGHTS, in the order of "opens").
    def export_tables(self) -> tuple[dict[str, Any], list[int]]:
        opens = sorted(self.opens.items())
        tables = {
            "inodes": [[inode, name.hex(), self.lookups.get(inode, 0)]
                       for name, inode in self.inodes.items()],
            "next_inode": self.next_inode,
            "opens": [fh for fh, _fd in opens],
            "next_fh": self.next_fh,
        }
        return tables, [fd for _fh, fd in opens]

    def import_tables(self, tables: dict[str, Any], fds: list[int]) -> None:
        for inode, name_hex, lookups in tables["inodes"]:
            name = bytes.fromhex(name_hex)
            self.inodes[name] = inode
            self.names[inode] = name
            self.lookups[inode] = lookups
        self.next_inode = max(self.next_inode, tables["next_inode"])
        self.opens = dict(zip(tables["opens"], fds, strict=True))
        self.next_fh = tables["next_fh"]

    def path(self, inode: int) -> str:
        try:
            return os.path.join(self.source, os.fsdecode(self.names[inode]))
        except KeyError:
            # A node id this process does not know: the kernel's table and ours disagree.
            raise pyfuse3.FUSEError(errno.ESTALE) from None

    def whoami(self) -> bytes:
        return f"{self.name} {os.getpid()}\n".encode()

    def attrs(self, inode: int) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        if inode == pyfuse3.ROOT_INODE:
            st = os.stat(self.source)
            entry.st_mode, entry.st_nlink = st.st_mode, 2
        elif inode in (WHOAMI_INODE, PARK_INODE):
            entry.st_mode, entry.st_nlink, entry.st_size = stat.S_IFREG | 0o444, 1, 0
        else:
            try:
                st = os.stat(self.path(inode))
            except OSError as exc:
                raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
            entry.st_mode, entry.st_nlink, entry.st_size = st.st_mode, 1, st.st_size
            entry.st_mtime_ns = st.st_mtime_ns
        entry.st_ino = inode
        entry.attr_timeout = entry.entry_timeout = 0.2
        return entry

    async def lookup(self, parent_inode: int, name: bytes,
                     ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if name == WHOAMI:
            return self.attrs(WHOAMI_INODE)
        if name == PARK:
            return self.attrs(PARK_INODE)
        if parent_inode != pyfuse3.ROOT_INODE or b"/" in name:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if not os.path.isfile(os.path.join(self.source, os.fsdecode(name))):
            raise pyfuse3.FUSEError(errno.ENOENT)
        inode = self.inodes.get(name)
        if inode is None:
            inode = self.next_inode
            self.next_inode += 1
            self.inodes[name], self.names[inode] = inode, name
        entry = self.attrs(inode)
        self.lookups[inode] = self.lookups.get(inode, 0) + 1
        return entry

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for inode, count in inode_list:
            left = self.lookups.get(inode, 0) - count
            if left > 0:
                self.lookups[inode] = left
            elif inode in self.names:
                del self.lookups[inode]
                del self.inodes[self.names.pop(inode)]

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self.attrs(inode)

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        return 0

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        names = sorted(os.fsencode(n) for n in os.listdir(self.source))
        for i, name in enumerate(names[start_id:], start_id):
            entry = await self.lookup(pyfuse3.ROOT_INODE, name, pyfuse3.RequestContext())
            if not pyfuse3.readdir_reply(token, name, entry, i + 1):
                await self.forget([(entry.st_ino, 1)])
                break

    async def releasedir(self, fh: int) -> None:
        pass

    async def open(self, inode: int, flags: int,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if inode == WHOAMI_INODE:
            return pyfuse3.FileInfo(fh=WHOAMI_FH, direct_io=True)  # uncached: always current
        if inode == PARK_INODE:
            return pyfuse3.FileInfo(fh=PARK_FH, direct_io=True)
        try:
            fd = os.open(self.path(inode), flags & (os.O_ACCMODE | os.O_APPEND), 0)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        fh = self.next_fh
        self.next_fh += 1
        self.opens[fh] = fd
        # direct_io: every read and write reaches the daemon, none is served from the page
        # cache, so that I/O across a handover is I/O the successor served.
        return pyfuse3.FileInfo(fh=fh, direct_io=True)

    def backing(self, fh: int) -> int:
        try:
            return self.opens[fh]
        except KeyError:
            # An open this process never heard of (its predecessor died with the table):
            # a clear errno for the caller, never a hang.
            raise pyfuse3.FUSEError(errno.ESTALE) from None

    async def read(self, fh: int, off: int, size: int) -> bytes:
        if fh == WHOAMI_FH:
            return self.whoami()[off:off + size]
        if fh == PARK_FH:
            if self.park:
                await trio.sleep_forever()
            return f"{self.name}\n".encode()[off:off + size]
        try:
            return os.pread(self.backing(fh), size, off)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        fd = self.backing(fh)
        done = 0
        try:
            while done < len(buf):
                done += os.pwrite(fd, buf[done:], off + done)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        return done

    async def fsync(self, fh: int, datasync: bool) -> None:
        try:
            os.fsync(self.backing(fh))
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None

    async def flush(self, fh: int) -> None:
        pass

    async def release(self, fh: int) -> None:
        fd = self.opens.pop(fh, None)
        if fd is not None:
            os.close(fd)


class Offer:
    """The old process's side: listens for a successor and stops serving for one that is
    ready (`successor` is then its connected socket)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.successor: socket.socket | None = None
        self.refusals = 0
        self.stopped_at = 0.0  # time.monotonic() when this process stopped reading

    async def serve(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await listener.bind(self.path)
        listener.listen(1)
        task_status.started()
        with listener:
            while True:
                conn, _addr = await listener.accept()
                sock = socket.socket(fileno=conn.detach())
                sock.setblocking(True)  # used from a thread; trio made it non-blocking
                if await trio.to_thread.run_sync(self.prepare, sock):
                    self.successor = sock
                    os.unlink(self.path)
                    self.stopped_at = time.monotonic()
                    pyfuse3.terminate()  # the tasks answer what they hold; main() returns
                    return
                sock.close()

    def prepare(self, sock: socket.socket) -> bool:
        """Phase 1, while still serving: the descriptor and the state go; True if the
        successor is ready. A holder (hello "hold", what systemd's descriptor store does
        for a unit) gets them too, and the process serves on."""
        hello = fuse_session.receive_message(sock)
        session = fuse_session.export_session()
        fuse_session.send_message(sock, "prepare", {"state": session.state}, [session.fuse_fd])
        if hello.kind == "hold":
            return False
        try:
            reply = fuse_session.receive_message(sock)
        except fuse_session.HandoverError as exc:
            print(f"successor failed before commit: {exc}", file=sys.stderr, flush=True)
            self.refusals += 1
            return False
        if reply.kind != "ready":
            print(f"successor refused: {reply.payload.get('reason')}", file=sys.stderr,
                  flush=True)
            self.refusals += 1
            return False
        return True


def commit(fs: HandoverFs, sock: socket.socket, stopped_at: float) -> None:
    """Phase 2, once main() has returned (no request held): the tables and the backing
    descriptors go; returns when the successor serves."""
    tables, fds = fs.export_tables()
    tables["stopped_at"] = stopped_at  # CLOCK_MONOTONIC: the same clock in both processes
    fuse_session.send_message(sock, "commit", tables, fds)
    reply = fuse_session.receive_message(sock)
    if reply.kind != "serving":
        raise fuse_session.HandoverError(f"successor did not take over: {reply.kind}")


def adopt_from(path: str, fs: HandoverFs, mountpoint: str, refuse: bool) -> float:
    """The successor's side of both phases; returns when (time.monotonic()) the
    predecessor stopped reading requests."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    with sock:
        fuse_session.send_message(sock, "adopt", {})
        prepare = fuse_session.receive_message(sock)
        session = fuse_session.Session(prepare.fds[0],
                                       fuse_session.check_state(prepare.payload["state"]))
        fuse_session.check_fuse_fd(session.fuse_fd)
        if refuse:
            os.close(session.fuse_fd)
            fuse_session.send_message(sock, "refuse", {"reason": "--refuse"})
            raise SystemExit(3)
        fuse_session.send_message(sock, "ready", {})
        tables = fuse_session.receive_message(sock)
        fs.import_tables(tables.payload, tables.fds)
        fuse_session.adopt(fs, session, mountpoint, OPTIONS)
        if tables.payload.get("resend"):  # the predecessor died: what it held comes again
            fuse_session.resend()
        fuse_session.send_message(sock, "serving", {})
        return float(tables.payload["stopped_at"])


async def run(name: str, offer: Offer | None, stopped_at: float | None) -> None:
    async with trio.open_nursery() as nursery:
        if offer is not None:
            await nursery.start(offer.serve)  # listening: a successor may connect
        if stopped_at is not None:
            # The window in which nobody reads /dev/fuse: from the predecessor's last read
            # to this loop's first (requests queue in the kernel meanwhile).
            stall = time.monotonic() - stopped_at
            print(f"adopted after {stall * 1000:.1f} ms without a reader", flush=True)
        print(f"serving {name}", flush=True)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="handover_fs")
    parser.add_argument("source")
    parser.add_argument("mountpoint")
    parser.add_argument("--name", required=True)
    parser.add_argument("--listen", help="Unix socket a successor connects to")
    parser.add_argument("--adopt", help="the predecessor's --listen socket")
    parser.add_argument("--refuse", action="store_true")
    parser.add_argument("--park", action="store_true", help="never answer a read of .park")
    args = parser.parse_args(argv)
    # A node id base of its own per process (see the module's docstring).
    fs = HandoverFs(args.source, args.name, inode_base=1000 * (os.getpid() % 1000 + 1),
                    park=args.park)
    stopped_at = None
    if args.adopt:
        stopped_at = adopt_from(args.adopt, fs, args.mountpoint, args.refuse)
    else:
        reason = fuse_session.unavailable_reason()
        if reason is not None:
            print(f"handover unavailable: {reason}", file=sys.stderr, flush=True)
        pyfuse3.init(fs, args.mountpoint, set(OPTIONS))
    offer = Offer(args.listen) if args.listen else None
    try:
        trio.run(run, args.name, offer, stopped_at)
    except BaseException:
        pyfuse3.close(unmount=True)
        raise
    if offer is None or offer.successor is None:  # unmounted, or stopped by a signal
        pyfuse3.close(unmount=True)
        return 0
    with offer.successor:
        commit(fs, offer.successor, offer.stopped_at)
    pyfuse3.close(unmount=False)  # our copy of the descriptor only: the successor serves
    for fd in fs.opens.values():
        os.close(fd)
    print(f"handed over {args.name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
