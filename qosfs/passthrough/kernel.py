"""Kernel FUSE passthrough: the kernel reads an open file straight from its backing file,
without a round trip through the daemon.

One interface over pyfuse3's passthrough API (which `make deps` adds with
deploy/libfuse/pyfuse3-passthrough.patch): ask for it at INIT (`request`), learn whether
it is usable (`KernelPassthrough.capability`), and register or release a backing file per
inode (`register`, `unregister`). Whatever is missing (pyfuse3 without the patch, libfuse
older than 3.17, a kernel without passthrough, a daemon without CAP_SYS_ADMIN, a backing
file the kernel refuses) makes `register` return None: the open is then served by the
daemon as before, and no exception reaches the caller.

The kernel's rules this follows:
- passthrough excludes the writeback cache (`request` turns it off);
- the backing file system may be stacked at most as deep as negotiated (a qosfs over
  overlayfs or another FUSE mount needs `stack_depth=1`; deeper is refused with ELOOP);
- registering needs CAP_SYS_ADMIN;
- a passthrough open must not keep the page cache (FOPEN_KEEP_CACHE: the kernel fails
  the open with EIO), so `attach` clears keep_cache;
- one backing id per inode: opens of one inode share it (counted here), whatever their
  flags: the id names the file the daemon registered, and each open the kernel passes
  through gets a backing file of its own, opened on that file's path with the open's
  own flags (fs/fuse/passthrough.c, ``backing_file_open``), so an O_DIRECT open and a
  buffered one of the same inode each keep their semantics;
- a backing id outlives the opens that used it: the kernel holds a reference to the file
  until the id is closed, and the inode's passthrough state is its open files' (fi->fb
  goes with the last of them, fs/fuse/iomode.c). So an id whose last open is released is
  kept *idle* (`IDLE_LIMIT` of them, for `IDLE_SECONDS`) and the inode's next open reuses
  it: no registration and no release per open of a file read again (a loader's next
  pass). An idle id pins its file as an open descriptor would: it is closed when the
  kernel forgets the inode, when its last name is unlinked through the mount
  (`drop_idle`), and after `IDLE_SECONDS` in any case (`expire`);
- an open may carry the backing id and direct_io together (FOPEN_PASSTHROUGH |
  FOPEN_DIRECT_IO, fs/fuse/passthrough.c's FOPEN_PASSTHROUGH_MASK, since 6.9): its reads
  and writes come to the daemon, its mmap maps the backing file (`attach`'s *served*,
  `KernelPassthrough.served_joins` says whether this build and kernel allow it);
- an inode's opens all carry its backing id or none do (observed on 6.18): while one open
  is passed through, the kernel fails any other open of the inode that does not carry the
  id (cached or direct_io alike) with EIO, and while a cached open exists it fails a
  passed-through one. So the daemon's own opens are counted too (`plain_open`,
  `plain_release`): `register` declines while an inode has them, and `plain_open` tells
  when the inode is passed through, where the caller must share its id (`register`, with
  direct_io if the daemon must still serve the open) or refuse the open.
"""

from __future__ import annotations

import errno
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, cast

import pyfuse3

from qosfs.passthrough.inodes import OPENED_LIMIT

_monotonic = time.monotonic

#: CAP_SYS_ADMIN's bit in /proc/self/status CapEff (linux/capability.h).
_CAP_SYS_ADMIN = 21

#: Backing ids kept registered after their inode's last open is released, at most (the
#: oldest is closed first). Each pins its file in the kernel as an open descriptor would
#: (a struct file, ~0.3 KiB, and the inode and dentry it holds in the caches) and costs
#: the daemon one dict entry; a warm open that reuses one saves two ioctls and, with
#: read counting, its BPF map updates (bench/opcost.py). As many as the inode table keeps
#: opened files as objects, the same working set: at 8,192, a loader's set past that
#: registered and closed an id per open (12,000 files of 16 KiB on tmpfs, 4 readers:
#: 6,900 files/s and 134-142 us of daemon CPU per file, against 8,500-9,300 and 109-111
#: us at 32,768). At most ~10 MiB of kernel memory, the caches' pins aside.
IDLE_LIMIT = OPENED_LIMIT
#: How long an idle backing id is kept at most. Bounds how long a file deleted on the
#: backing store directly (not through the mount) keeps its blocks.
IDLE_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class Capability:
    """Whether opens can be passed through, and if not, why not (one line for the log
    and `ctl status`)."""

    available: bool
    reason: str
    by: str = ""  # what stands in the way, as a metric label ("kernel", "pyfuse3")


@dataclass(frozen=True, slots=True)
class PassthroughStats:
    """A snapshot of the backing ids: how many inodes hold one now, how many were
    registered and refused since the mount, and the last refusal's errno name."""

    live: int
    registered: int
    refused: int
    last_refusal: str | None
    declined: int = 0  # opens not passed through because the daemon served the inode
    idle: int = 0  # ids kept registered that no open uses now
    reused: int = 0  # opens that took an idle id instead of registering


class _WithBackingId(Protocol):
    backing_id: int


class BackingJournal(Protocol):
    """Where the registered ids are written down for a successor after a crash
    (:class:`qosfs.passthrough.journal.SessionJournal`)."""

    def put_backing(self, nodeid: int, backing_id: int) -> int: ...

    def free(self, slot: int) -> None: ...


def build_support(binding: ModuleType | Any = pyfuse3) -> str | None:
    """Why this pyfuse3 cannot pass opens through, or None if it can (it was patched and
    built against libfuse >= 3.17). Known before the mount."""
    if getattr(binding, "passthrough_open", None) is None:
        return "pyfuse3 lacks the passthrough patch (make deps builds it: deploy/libfuse)"
    if not getattr(binding, "PASSTHROUGH_SUPPORTED", False):
        return "pyfuse3 was built against libfuse older than 3.17"
    return None


#: Filesystems that put a backing file one level deeper (their own files live on another
#: filesystem): FUSE mounts (with passthrough of their own, one level below already),
#: overlayfs, eCryptfs.
STACKED_FSTYPES = ("fuse", "overlay", "ecryptfs")


def stack_depth(fstype: str | None) -> int:
    """The stack depth to negotiate for backing files on a filesystem of type *fstype*
    (``/proc/self/mountinfo``'s, e.g. "ext4", "overlay", "fuse.sshfs"): 1 for a stacking
    filesystem, 0 otherwise. One level more than that (qosfs over a passthrough FUSE
    mount over overlayfs) the kernel refuses at registration: counted, and served by the
    daemon (`KernelPassthrough.register`)."""
    if fstype is None:
        return 0
    base = fstype.split(".", 1)[0]
    return 1 if base in STACKED_FSTYPES or base == "fuseblk" else 0


#: The first Linux with FUSE passthrough; it took FOPEN_DIRECT_IO beside FOPEN_PASSTHROUGH
#: from the start (FOPEN_PASSTHROUGH_MASK).
SERVED_JOINS_SINCE = (6, 9)


def served_join_support(release: str | None = None) -> Capability:
    """Whether an open that must join a passed-through inode cannot be answered with its
    backing id and direct_io (its reads and writes served, and capped, by the daemon),
    and if not, why not: pyfuse3's FileInfo must carry a backing id (the patch puts it and
    direct_io into the same reply, and libfuse's fill_open sets both flags), and the
    kernel (*release*: ``uname -r``, this one's by default) must be 6.9 or later. Asked
    once per mount, at the first such open (`KernelPassthrough.served_joins`)."""
    if "backing_id" not in dir(pyfuse3.FileInfo):
        return Capability(False, "pyfuse3's FileInfo carries no backing id (the "
                          "passthrough patch is missing)", "pyfuse3")
    release = os.uname().release if release is None else release
    found = re.match(r"(\d+)\.(\d+)", release)
    if found is None or (int(found[1]), int(found[2])) < SERVED_JOINS_SINCE:
        return Capability(False, f"Linux {release} does not take direct_io beside a "
                          f"backing id (needs {SERVED_JOINS_SINCE[0]}."
                          f"{SERVED_JOINS_SINCE[1]} or later)", "kernel")
    return Capability(True, "joins get direct_io: served by the daemon")


def has_cap_sys_admin() -> bool:
    """Whether this process may register backing files (CAP_SYS_ADMIN, effective)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    except OSError:
        pass
    return os.geteuid() == 0


def request(operations: pyfuse3.Operations, stack_depth: int = 0) -> None:
    """Ask for passthrough at INIT, for backing files stacked at most *stack_depth* deep
    (0: ext4, xfs, tmpfs...; 1: also one overlayfs or FUSE layer below; the kernel
    refuses passthrough altogether beyond that). Turns the writeback cache off, which the
    kernel does not combine with passthrough. Harmless on a pyfuse3 without the patch
    (the attributes are then never read)."""
    if not 0 <= stack_depth <= 1:
        raise ValueError(f"stack_depth must be 0 or 1, not {stack_depth}")
    operations.enable_writeback_cache = False
    vars(operations).update(enable_passthrough=True, max_backing_stack_depth=stack_depth)


def attach(info: pyfuse3.FileInfo, backing_id: int, served: bool = False) -> None:
    """Put *backing_id* (from `KernelPassthrough.register`) into an open/create reply.
    The page cache is the backing file's then: keep_cache would make the kernel fail the
    open (EIO).

    *served*: the open joins the inode's backing id only because the kernel wants every
    open of a passed-through inode to carry it, and its reads and writes must still come
    to the daemon (a writer, a capped reader): the reply says direct_io too
    (FOPEN_PASSTHROUGH | FOPEN_DIRECT_IO, which the kernel accepts since passthrough
    came, Linux 6.9: "direct_io overrides passthrough" for read and write, mmap maps the
    backing file). Otherwise direct_io is the backing file's business: cleared."""
    info.keep_cache = False
    info.direct_io = served
    cast(_WithBackingId, info).backing_id = backing_id


def _nothing(inode: int) -> None:
    pass


class KernelPassthrough:
    """The backing ids of one mount, one per inode, counted by open.

    Call `register` in open/create with the open's descriptor and `unregister` at that
    open's release; both happen once per open, never on the read path. An id no open uses
    stays registered, idle, until `expire`, `drop_idle` or the inode's next open.
    """

    def __init__(self, binding: ModuleType | Any = pyfuse3) -> None:
        self._binding = binding
        # Told the inode of every id closed (the read counting stops watching its file).
        self.on_close: Callable[[int], None] = _nothing
        # inode -> [backing id, opens using it, its journal slot or -1]
        self._ids: dict[int, list[int]] = {}
        self._journal: BackingJournal | None = None
        self._idle: OrderedDict[int, float] = OrderedDict()  # inode -> idle since, oldest first
        self._plain: dict[int, int] = {}  # inode -> opens the daemon serves
        self._declined = 0
        self._capability: Capability | None = None
        self._served_joins: Capability | None = None
        self._registered = 0
        self._reused = 0
        self._refused = 0
        self._last_refusal: str | None = None

    def capability(self) -> Capability:
        """Available, or the reason not. Final once the mount is initialized (the kernel's
        answer to `request` is known from then on); cached from the first call after."""
        if self._capability is not None:
            return self._capability
        reason = build_support(self._binding)
        if reason is not None:
            return self._remember(Capability(False, reason))
        if not has_cap_sys_admin():
            return self._remember(Capability(
                False, "the daemon lacks CAP_SYS_ADMIN, which registering backing files needs"))
        if not self._binding.passthrough_negotiated():
            # Not cached: before INIT nothing is negotiated yet.
            return Capability(False, "the kernel did not accept passthrough (Linux >= 6.9 "
                              "with CONFIG_FUSE_PASSTHROUGH), or it was not requested")
        return self._remember(Capability(True, "kernel passthrough negotiated"))

    def served_joins(self) -> Capability:
        """Whether an open that must share an inode's backing id without being passed
        through (a writer, a capped reader) can be served by the daemon all the same
        (`attach` with *served*), or why not: then it joins uncapped. Found out at the
        first call (`served_join_support`) and remembered for the mount."""
        if self._served_joins is None:
            self._served_joins = served_join_support()
        return self._served_joins

    def negotiation_pending(self) -> bool:
        """Whether only the kernel's answer at INIT is missing: the build and the daemon's
        privileges allow passthrough (before INIT, `capability` cannot tell more)."""
        return self._capability is None

    def _remember(self, capability: Capability) -> Capability:
        self._capability = capability
        return capability

    def register(self, inode: int, fd: int) -> int | None:
        """The backing id for an open of *inode* whose descriptor is *fd*, or None: the
        open is then served by the daemon. The first open of an inode registers *fd*'s
        file (the kernel keeps its own reference); later ones share its id, or take it
        back idle."""
        entry = self._ids.get(inode)
        if entry is not None:
            if entry[1] > 0:
                entry[1] += 1
                return entry[0]
            if inode not in self._plain:  # idle, and no served open stands in the way
                del self._idle[inode]
                entry[1] = 1
                self._reused += 1
                return entry[0]
        if not self.capability().available:
            return None
        if inode in self._plain:
            self._declined += 1
            return None
        try:
            backing_id = int(self._binding.passthrough_open(fd))
        except OSError as exc:
            # EPERM: no CAP_SYS_ADMIN; ELOOP: the backing file system is stacked deeper
            # than negotiated; EOPNOTSUPP: passthrough not enabled on this connection.
            self._refused += 1
            self._last_refusal = errno.errorcode.get(exc.errno or 0, str(exc.errno))
            return None
        self._ids[inode] = [backing_id, 1, self._write_down(inode, backing_id)]
        self._registered += 1
        return backing_id

    def shares(self, inode: int) -> bool:
        """Whether `register` would answer an open of *inode* with an id it holds, live
        or idle, without registering a descriptor (the open then needs none)."""
        entry = self._ids.get(inode)
        return entry is not None and (entry[1] > 0 or inode not in self._plain)

    def _write_down(self, inode: int, backing_id: int) -> int:
        return -1 if self._journal is None else self._journal.put_backing(inode, backing_id)

    def attach_journal(self, journal: BackingJournal) -> None:
        """Write every registered id down in *journal*, and each one registered later
        (a successor closes those no open of its own takes back: `restore_idle`)."""
        self._journal = journal
        for inode, entry in self._ids.items():
            entry[2] = journal.put_backing(inode, entry[0])

    def join(self, inode: int) -> int | None:
        """The id of passed-through *inode* for an open that must carry it although its
        requests are served by the daemon (direct_io). None if *inode* is not passed
        through now (an idle id is not: no open of the inode carries it)."""
        entry = self._ids.get(inode)
        if entry is None or entry[1] <= 0:
            return None
        entry[1] += 1
        return entry[0]

    def unregister(self, inode: int, now: float) -> None:
        """One open of *inode* that `register` or `join` gave an id to was released
        (*now*: ``time.monotonic()``); after the last one the id stays registered, idle
        (`expire` closes it)."""
        entry = self._ids.get(inode)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            entry[1] = 0
            self._idle[inode] = now

    def expire(self, now: float, at_most: int | None = None) -> list[int]:
        """Close the idle ids kept past `IDLE_SECONDS` at *now* (``time.monotonic()``) or
        beyond `IDLE_LIMIT`, oldest first, *at_most* of them (None: all); return their
        inodes. O(1) when none is due.

        A loader's pass over thousands of files leaves as many ids idle within seconds,
        so they fall due together a minute later; each close is a system call and its
        file's counting stopped (~10 us), and closing 16,000 at once stalled the loop
        for ~0.2 s. The daemon's callers close a few per release and the rest in batches
        (:class:`qosfs.passthrough.kernel_opens.KernelOpens`)."""
        closed: list[int] = []
        idle = self._idle
        while idle and (at_most is None or len(closed) < at_most):
            inode = next(iter(idle))
            if len(idle) <= IDLE_LIMIT and idle[inode] > now - IDLE_SECONDS:
                break
            del idle[inode]
            self._close(inode)
            closed.append(inode)
        return closed

    def drop_idle(self, inode: int) -> bool:
        """Close *inode*'s idle id now (its file is gone: the kernel forgot the inode, or
        its last name was unlinked); whether it had one."""
        if self._idle.pop(inode, None) is None:
            return False
        self._close(inode)
        return True

    def _close(self, inode: int) -> None:
        entry = self._ids.pop(inode)
        if entry[2] >= 0 and self._journal is not None:
            self._journal.free(entry[2])
        try:
            self._binding.passthrough_close(entry[0])
        except OSError:
            # The kernel dropped it already (e.g. the connection is going away): the id
            # is gone either way.
            pass
        self.on_close(inode)

    def restore_open(self, inode: int, backing_id: int) -> None:
        """Count an open of *inode* that a dead predecessor passed through with
        *backing_id* (still registered: ids belong to the connection, which lived on)."""
        entry = self._ids.get(inode)
        if entry is None:
            self._ids[inode] = [backing_id, 1, -1]
        else:
            entry[1] += 1

    def restore_idle(self, inode: int, backing_id: int) -> None:
        """Keep idle an id a dead predecessor had registered for *inode* that none of its
        open files uses (ids belong to the connection, which lived on): the next open of
        the inode takes it back, and `expire` closes it if none does."""
        if inode in self._ids:
            return  # taken by a restored open
        self._ids[inode] = [backing_id, 0, -1]
        self._idle[inode] = _monotonic()

    def plain_open(self, inode: int) -> bool:
        """Count an open of *inode* that the daemon serves; False (and nothing counted) if
        *inode* is passed through now: the kernel would fail that open, so the caller
        shares the id (`register`) or refuses the open."""
        entry = self._ids.get(inode)
        if entry is not None and entry[1] > 0:
            return False
        self._plain[inode] = self._plain.get(inode, 0) + 1
        return True

    def plain_release(self, inode: int) -> None:
        """One open of *inode* that `plain_open` counted was released."""
        left = self._plain.get(inode, 0) - 1
        if left > 0:
            self._plain[inode] = left
        else:
            self._plain.pop(inode, None)

    def backing_id(self, inode: int) -> int | None:
        """The id *inode*'s opens share now, if any (an idle one is not shared)."""
        entry = self._ids.get(inode)
        return None if entry is None or entry[1] <= 0 else entry[0]

    def export_state(self) -> dict[str, Any]:
        """The backing ids and counts as plain data, for a successor process serving the
        same connection: the kernel keeps backing ids per connection, not per
        descriptor, so they stay valid there (and are released there, by the last open).
        Idle ids are among ``ids`` with no opens; ``idle`` lists them oldest first, with
        their seconds idle (a build before reads ``ids`` alone, and closes an idle id at
        the next release of its inode)."""
        return {"ids": [[inode, entry[0], entry[1]] for inode, entry in self._ids.items()],
                "idle": [[inode, _monotonic() - since] for inode, since in self._idle.items()],
                "plain": [[inode, n] for inode, n in self._plain.items()],
                "declined": self._declined, "registered": self._registered,
                "reused": self._reused, "refused": self._refused,
                "last_refusal": self._last_refusal}

    def import_state(self, state: dict[str, Any]) -> None:
        """Take over a predecessor's backing ids and counts (`export_state`); a build
        before this one kept no idle ids."""
        self._ids = {int(i): [int(b), int(n), -1] for i, b, n in state["ids"]}
        now = _monotonic()
        self._idle = OrderedDict((int(i), now - float(age)) for i, age in state.get("idle", ()))
        self._plain = {int(i): int(n) for i, n in state["plain"]}
        self._declined = int(state["declined"])
        self._registered = int(state["registered"])
        self._reused = int(state.get("reused", 0))
        self._refused = int(state["refused"])
        self._last_refusal = state["last_refusal"]

    def statistics(self) -> PassthroughStats:
        return PassthroughStats(live=len(self._ids) - len(self._idle),
                                registered=self._registered, refused=self._refused,
                                last_refusal=self._last_refusal, declined=self._declined,
                                idle=len(self._idle), reused=self._reused)

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<KernelPassthrough live={s.live} registered={s.registered} "
                f"refused={s.refused}>")
