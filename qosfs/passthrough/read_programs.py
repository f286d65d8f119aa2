"""Two BPF programs that count what the kernel reads from passed-through backing files.

A passed-through read never reaches the daemon: the kernel reads the backing file in the
reader's own context (fs/fuse/passthrough.c keeps no count). Two raw tracepoints on the
read path see it there:

- ``mm_filemap_get_pages`` (mm/filemap.c), for buffered reads of a filesystem that reads
  through the page cache (ext4, XFS, NFS...). Its arguments are the file's mapping and
  the range of pages the read asks for, from the read position to the end of the *whole*
  request, and ``filemap_read`` calls it again for each batch of pages of a large read.
  So a read is counted at its first call, clamped to the file's size (a 1 MiB read of a
  112 KiB file moves 112 KiB), and a later call by the same thread on the same file with
  the same end and a further start is the same read, counted nothing (the ``recent``
  map: each CPU's last counted read). Bytes are exact for reads that start on a page
  boundary (any read of fio, of a loader reading whole files); an unaligned read is
  counted from the start of its first page.
- ``iomap_dio_rw_begin`` (fs/iomap/direct-io.c), for O_DIRECT reads (ext4, XFS): the
  request's size, clamped to the file's size; a resumed request (``done_before``) is not
  counted twice; writes are skipped (the iterator is a source).

Both look up the backing file's (device, inode) among the files the daemon watches
(:mod:`qosfs.passthrough.read_counting`): first in ``index``, an array indexed by the
inode number's low bits, then, only where the entry says another watched file shares
them, in the ``watched`` hash (a hash lookup was ~45 ns of the ~125 a counted read paid
inside the programs, the array's a few: ``python -m bench.probecost --timing``). They add
(bytes, reads) to ``counts`` under (slot, real uid of the reader). The daemon's own reads
(its threads share its tgid) are skipped: it counts those itself. So is a read of a
watched file by a process that opened the backing file itself, not through the mount (a
backup job reading the source directory, a test digesting the tree underneath): a
passed-through read runs with the credentials the backing file was opened with in force
(fs/backing-file.c overrides ``current->cred``), a direct read with the reader's own
(``cred == real_cred``); only the first kind is the mount's, and of those only the
reads made with the credentials of this mount's daemon (they hold its session keyring:
:mod:`qosfs.core.keyring`), not another mount's of the same files. A read whose count
finds ``counts`` full is added to ``lost`` instead, which ``ctl status`` shows.

Field offsets come from the running kernel's BTF (:mod:`qosfs.core.bpf.btf`), so the
programs need no compiler and no headers; raw tracepoints need no tracefs either.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from qosfs.core.bpf import syscall as bpf
from qosfs.core.bpf.asm import (
    GET_CURRENT_PID_TGID,
    GET_CURRENT_TASK,
    GET_CURRENT_TASK_BTF,
    GET_SMP_PROCESSOR_ID,
    MAP_LOOKUP_ELEM,
    MAP_UPDATE_ELEM,
    PROBE_READ_KERNEL,
    Program,
)
from qosfs.core.bpf.btf import VMLINUX, BtfError, KernelTypes

FILEMAP_TRACEPOINT = "mm_filemap_get_pages"
DIRECT_TRACEPOINT = "iomap_dio_rw_begin"

_PAGE_SHIFT = (os.sysconf("SC_PAGESIZE")).bit_length() - 1
LAYOUT_CACHE = Path("/run/qosfs/kernel-layout.json")

# Stack slots below the frame pointer (r10), shared by both programs.
_TMP = -8        # u64 scratch for probe reads
_INO = -16       # u64 \ the watched key: (u32 dev, u32 pad, u64 ino)
_DEV = -24       # u32 /
_ISIZE = -32
_BYTES = -40
_INDEX = -48     # filemap: first page; direct: the read position
_LAST = -56      # filemap: last page;  direct: the request's size
_TID = -64       # u32 0, the recent map's key
# recent's value, per CPU: u64 ino, u64 last, u64 index, u32 dev, u32 thread id
_COUNT_KEY = -104  # u32 slot, u32 uid
_COUNT_VALUE = -120  # u64 bytes, u64 reads
_ZERO = -124     # u32 0, the lost map's key
_FAST_KEY = -128  # u32, counts_fast's key: this CPU's region, then the slot
_SLOT_INDEX = -72  # u32, the index's key: the inode number's low bits

#: Entries of the ``index`` array (a power of two): 24 bytes each, 1.5 MiB in all. Its
#: entry for an inode number's low bits holds one watched file (u64 ino, u32 dev, u32
#: slot) and how many more with the same bits are in the ``watched`` hash (u32).
INDEX_SIZE = 1 << 16
INDEX_VALUE = struct.Struct("<QIII4x")


class ProbeError(Exception):
    """The programs cannot be loaded here; the message says why, for ``ctl status``."""


@dataclass(frozen=True, slots=True)
class Offsets:
    """The kernel struct fields the programs follow."""

    host: int
    i_ino: int
    i_sb: int
    i_size: int
    s_dev: int
    ki_filp: int
    ki_pos: int
    f_inode: int
    iter_count: int
    iter_source: int
    real_cred: int
    cred: int
    cred_uid: int
    session_keyring: int
    key_serial: int

    @classmethod
    def of(cls, types: KernelTypes) -> Offsets:
        return cls(types.offset("address_space", "host"), types.offset("inode", "i_ino"),
                   types.offset("inode", "i_sb"), types.offset("inode", "i_size"),
                   types.offset("super_block", "s_dev"), types.offset("kiocb", "ki_filp"),
                   types.offset("kiocb", "ki_pos"), types.offset("file", "f_inode"),
                   types.offset("iov_iter", "count"), types.offset("iov_iter", "data_source"),
                   types.offset("task_struct", "real_cred"),
                   types.offset("task_struct", "cred"), types.offset("cred", "uid"),
                   types.offset("cred", "session_keyring"), types.offset("key", "serial"))


class _Fields:
    """How a program follows a kernel pointer: with a plain load where the program is
    BTF-typed (``tp_btf``: the verifier knows each pointer's type and turns the load into
    one that cannot fault, a few ns), else with ``bpf_probe_read_kernel`` through the
    stack (a plain raw tracepoint; a helper call each, ~30 ns)."""

    def __init__(self, p: Program, typed: bool) -> None:
        self.p, self.typed = p, typed

    def read(self, dst: int, base: int, off: int, size: int = 8) -> None:
        """``dst = *(size *)(base + off)``; on a fault, go to ``out``. Clobbers r1-r5
        (and r0) when untyped, so *base* must then be r6-r9 and *dst* r0 or r6-r9."""
        p = self.p
        if self.typed:
            p.load(size, dst, base, off)
            return
        p.store_imm(8, 10, _TMP, 0)
        p.alu_reg("mov", 1, 10)
        p.alu("add", 1, _TMP)
        p.alu("mov", 2, size)
        p.alu_reg("mov", 3, base)
        p.alu("add", 3, off)
        p.call(PROBE_READ_KERNEL)
        p.jump("jne", 0, 0, "out")
        p.load(size, dst, 10, _TMP)


def _lookup(p: Program, map_fd: int, key: int) -> None:
    """``r0 = bpf_map_lookup_elem(map, r10 + key)``: the value's address, or 0."""
    p.map_fd(1, map_fd)
    p.alu_reg("mov", 2, 10)
    p.alu("add", 2, key)
    p.call(MAP_LOOKUP_ELEM)


def _update(p: Program, map_fd: int, key: int, value: int, flags: int) -> None:
    """``r0 = bpf_map_update_elem(map, r10 + key, r10 + value, flags)``: 0 or an error."""
    p.map_fd(1, map_fd)
    p.alu_reg("mov", 2, 10)
    p.alu("add", 2, key)
    p.alu_reg("mov", 3, 10)
    p.alu("add", 3, value)
    p.alu("mov", 4, flags)
    p.call(MAP_UPDATE_ELEM)


def _skip_own_reads(p: Program, tgid: int) -> None:
    """Go to ``out`` for a read of the daemon's own threads; r7 = the thread id."""
    p.call(GET_CURRENT_PID_TGID)
    p.alu_reg("mov", 7, 0)
    p.alu("rsh", 0, 32)
    p.jump("jeq", 0, tgid, "out")


def _reader(f: _Fields, o: Offsets, passthrough_only: bool, keyring: int | None) -> None:
    """Store the reader's *real* uid at ``_COUNT_KEY + 4``, first of all; with
    *passthrough_only*, go to ``out`` for a read made with the reader's own credentials,
    and, given the mount's *keyring* serial, for one made with credentials that do not
    hold it.

    The uid is the real one (``current->real_cred``): a passed-through read runs with the
    daemon's credentials in force (fs/backing-file.c overrides ``current->cred`` with
    those the backing id was registered with), so ``bpf_get_current_uid_gid`` would say
    root for every reader. That override is also what tells a passed-through read from
    a read of the backing file by a process that opened it itself, outside the mount
    (``cred == real_cred``): that one is left out, and before the watched lookup, so
    every other read on the machine pays two loads and a compare, not a hash lookup.
    The credentials in force also say *which* mount: those of this mount's daemon hold
    its session keyring (:mod:`qosfs.core.keyring`), those of another mount of the same
    source, or of overlayfs, do not; without the check each mount counted the others'
    reads of a file it has open too. Clobbers r0-r5, r7 and r8."""
    p = f.p
    p.call(GET_CURRENT_TASK_BTF if f.typed else GET_CURRENT_TASK)
    p.alu_reg("mov", 7, 0)
    if passthrough_only:
        f.read(8, 7, o.cred)
    f.read(7, 7, o.real_cred)
    if passthrough_only:
        p.jump_reg("jeq", 7, 8, "out")
        if keyring is not None:
            f.read(8, 8, o.session_keyring)
            p.jump("jeq", 8, 0, "out")
            f.read(8, 8, o.key_serial, 4)
            p.jump("jne", 8, keyring, "out")
    f.read(7, 7, o.cred_uid, 4)
    p.store(4, 10, _COUNT_KEY + 4, 7)


def _watched_slot(f: _Fields, o: Offsets, index: int, watched: int) -> None:
    """With r8 = the inode: fill the key (dev, ino) and _ISIZE; r9 = the watched slot, or
    go to ``out`` if the inode is not watched.

    The ``index`` entry of the inode number's low bits answers for most files: its file,
    or no watched file there (most inodes on a machine). Only where it counts other
    watched files with the same bits (``overflow``) is the ``watched`` hash looked up.
    The daemon rewrites an entry while no read of its old or new file can be in flight
    (at a file's first open, before any read; after its last release), so a read never
    sees half of an entry that concerns it."""
    p = f.p
    f.read(6, 8, o.i_ino)
    p.store(8, 10, _INO, 6)
    p.alu("and", 6, INDEX_SIZE - 1)
    p.store(4, 10, _SLOT_INDEX, 6)
    f.read(6, 8, o.i_sb)
    f.read(6, 6, o.s_dev, 4)
    p.store_imm(8, 10, _DEV, 0)  # the hash key's padding must be zero
    p.store(4, 10, _DEV, 6)
    _lookup(p, index, _SLOT_INDEX)
    p.jump("jeq", 0, 0, "out")  # never (the index is in range); the verifier asks
    p.load(8, 1, 0, 0)
    p.load(8, 2, 10, _INO)
    p.jump_reg("jne", 1, 2, "overflow")
    p.load(4, 1, 0, 8)
    p.jump_reg("jne", 1, 6, "overflow")
    p.load(4, 9, 0, 12)
    p.goto("watched")
    p.label("overflow")
    p.load(4, 1, 0, 16)
    p.jump("jeq", 1, 0, "out")
    _lookup(p, watched, _DEV)
    p.jump("jeq", 0, 0, "out")
    p.load(4, 9, 0, 0)
    p.label("watched")
    f.read(6, 8, o.i_size)
    p.store(8, 10, _ISIZE, 6)


def _count(f: _Fields, counts_fast: int, fast_slots: int, counts: int, lost: int) -> None:
    """Add (the bytes at _BYTES, one read) to the slot's (r9) count for the reader's uid
    (at _COUNT_KEY + 4): in ``counts_fast`` if this CPU's entry for the slot is the
    uid's or nobody's yet, else in ``counts`` under (slot, uid), else in ``lost``.

    Most files are read by one uid at a time, so the common case is an array element
    (a lookup the verifier inlines to a few instructions) and two plain adds: the entry
    is this CPU's alone and a tracepoint's program runs with preemption off, so no other
    run can come between the load and the store. The hash and its atomic adds, which
    were the common case before, cost ~35 ns more per read (``python -m
    bench.probecost --timing``).

    ``counts_fast`` is one plain array holding a region of *fast_slots* entries per CPU
    (CPU-major: a CPU's entries share cache lines with no other CPU's), not a per-CPU
    array: that one allocates each entry apart, and 65,537 of them took ~75 ms to create,
    at every mount's start."""
    p = f.p
    p.store(4, 10, _COUNT_KEY, 9)
    p.jump("jge", 9, fast_slots, "shared")  # a slot past the array (retired, not yet freed)
    p.call(GET_SMP_PROCESSOR_ID)
    p.alu("mul", 0, fast_slots)
    p.alu_reg("add", 0, 9)
    p.store(4, 10, _FAST_KEY, 0)
    _lookup(p, counts_fast, _FAST_KEY)
    p.jump("jeq", 0, 0, "shared")  # never (the key is in range); the verifier asks
    p.load(4, 2, 10, _COUNT_KEY + 4)
    p.alu("add", 2, 1)  # the entry's owner: uid + 1, 0 while nobody's
    p.load(8, 1, 0, 0)
    p.jump_reg("jeq", 1, 2, "own")
    p.jump("jne", 1, 0, "shared")  # another uid read the file on this CPU first
    p.store(8, 0, 0, 2)
    p.label("own")
    p.load(8, 1, 0, 8)
    p.load(8, 2, 10, _BYTES)
    p.alu_reg("add", 1, 2)
    p.store(8, 0, 8, 1)
    p.load(8, 1, 0, 16)
    p.alu("add", 1, 1)
    p.store(8, 0, 16, 1)
    p.goto("out")
    p.label("shared")
    _lookup(p, counts, _COUNT_KEY)
    p.jump("jne", 0, 0, "add")
    p.load(8, 1, 10, _BYTES)
    p.store(8, 10, _COUNT_VALUE, 1)
    p.store_imm(8, 10, _COUNT_VALUE + 8, 1)
    _update(p, counts, _COUNT_KEY, _COUNT_VALUE, bpf.NOEXIST)
    p.jump("jeq", 0, 0, "out")
    # Another CPU added the key meanwhile (add to it), or the map is full (count as lost).
    _lookup(p, counts, _COUNT_KEY)
    p.jump("jne", 0, 0, "add")
    p.store_imm(4, 10, _ZERO, 0)
    _lookup(p, lost, _ZERO)
    p.jump("jeq", 0, 0, "out")
    p.label("add")
    p.load(8, 1, 10, _BYTES)
    p.atomic_add(0, 0, 1)
    p.alu("mov", 1, 1)
    p.atomic_add(0, 8, 1)
    p.label("out")
    p.alu("mov", 0, 0)
    p.exit()


def filemap_program(o: Offsets, typed: bool, tgid: int, index: int, watched: int,
                    recent: int, counts_fast: int, counts: int, lost: int, *,
                    fast_slots: int, passthrough_only: bool = True,
                    keyring: int | None = None) -> bytes:
    """The buffered-read counter; its context is (mapping, first page, last page).
    *passthrough_only* False counts direct reads of a watched file too (the unit tests,
    which read the file themselves, with no mount). *keyring*: the serial of the mount's
    session keyring, which the credentials of its passed-through reads hold (None: any
    passed-through read of a watched file counts, whichever mount it came through)."""
    p = Program()
    f = _Fields(p, typed)
    p.alu_reg("mov", 6, 1)
    _reader(f, o, passthrough_only, keyring)
    p.load(8, 1, 6, 8)
    p.store(8, 10, _INDEX, 1)
    p.load(8, 1, 6, 16)
    p.store(8, 10, _LAST, 1)
    p.load(8, 8, 6, 0)  # the mapping
    f.read(8, 8, o.host)  # r8 = the inode
    _watched_slot(f, o, index, watched)
    _skip_own_reads(p, tgid)  # after the lookup: most reads on a machine are not watched
    # bytes = min((last + 1) << PAGE_SHIFT, size) - (first << PAGE_SHIFT), if positive
    p.load(8, 3, 10, _ISIZE)
    p.jump("jsle", 3, 0, "out")
    p.load(8, 4, 10, _LAST)
    p.alu("add", 4, 1)
    p.alu("lsh", 4, _PAGE_SHIFT)
    p.jump_reg("jle", 4, 3, "clamped")
    p.alu_reg("mov", 4, 3)
    p.label("clamped")
    p.load(8, 5, 10, _INDEX)
    p.alu("lsh", 5, _PAGE_SHIFT)
    p.jump_reg("jge", 5, 4, "out")
    p.alu_reg("sub", 4, 5)
    p.store(8, 10, _BYTES, 4)
    # The same read's next batch: same thread, same file and end, a further start. Each
    # CPU remembers the last read it counted (a per-CPU array: no hashing, no insert); a
    # thread that moves to another CPU between two batches of one read has that read's
    # rest counted again, which is rare and at most the rest of one read.
    p.store_imm(4, 10, _TID, 0)
    _lookup(p, recent, _TID)
    p.jump("jeq", 0, 0, "count")  # an array's element is always there; the verifier asks
    p.alu_reg("mov", 3, 7)
    p.alu("lsh", 3, 32)
    p.alu("rsh", 3, 32)  # r3 = the thread id
    p.load(4, 1, 0, 28)
    p.jump_reg("jne", 1, 3, "new_read")
    for state_off, slot, size in ((0, _INO, 8), (24, _DEV, 4), (8, _LAST, 8)):
        p.load(size, 1, 0, state_off)
        p.load(size, 2, 10, slot)
        p.jump_reg("jne", 1, 2, "new_read")
    p.load(8, 2, 10, _INDEX)
    p.load(8, 1, 0, 16)
    p.jump_reg("jle", 2, 1, "new_read")
    p.store(8, 0, 16, 2)  # remember how far it got; counted already
    p.goto("out")
    p.label("new_read")
    for state_off, slot in ((0, _INO), (8, _LAST), (16, _INDEX)):
        p.load(8, 1, 10, slot)
        p.store(8, 0, state_off, 1)
    p.load(4, 1, 10, _DEV)
    p.store(4, 0, 24, 1)
    p.store(4, 0, 28, 3)
    p.label("count")
    _count(f, counts_fast, fast_slots, counts, lost)
    return p.assemble()


def direct_program(o: Offsets, typed: bool, tgid: int, index: int, watched: int,
                   counts_fast: int, counts: int, lost: int, *, fast_slots: int,
                   passthrough_only: bool = True, keyring: int | None = None) -> bytes:
    """The O_DIRECT read counter; its context is (iocb, iter, dio_flags, done_before)
    (*passthrough_only* and *keyring* as for :func:`filemap_program`)."""
    p = Program()
    f = _Fields(p, typed)
    p.alu_reg("mov", 6, 1)
    p.load(8, 1, 6, 24)
    p.jump("jne", 1, 0, "out")  # a resumed request: its bytes were counted at its start
    _reader(f, o, passthrough_only, keyring)
    p.load(8, 8, 6, 8)  # the iterator
    p.load(8, 9, 6, 0)  # the kiocb
    f.read(6, 8, o.iter_source, 1)
    p.jump("jne", 6, 0, "out")  # a source: a write
    f.read(6, 8, o.iter_count)
    p.store(8, 10, _LAST, 6)
    f.read(6, 9, o.ki_pos)
    p.store(8, 10, _INDEX, 6)
    f.read(8, 9, o.ki_filp)
    f.read(8, 8, o.f_inode)  # r8 = the inode
    _watched_slot(f, o, index, watched)
    _skip_own_reads(p, tgid)
    # bytes = min(position + size, file size) - position, if positive
    p.load(8, 3, 10, _ISIZE)
    p.load(8, 5, 10, _INDEX)
    p.jump_reg("jge", 5, 3, "out")
    p.load(8, 4, 10, _LAST)
    p.alu_reg("add", 4, 5)
    p.jump_reg("jle", 4, 3, "clamped")
    p.alu_reg("mov", 4, 3)
    p.label("clamped")
    p.alu_reg("sub", 4, 5)
    p.store(8, 10, _BYTES, 4)
    _count(f, counts_fast, fast_slots, counts, lost)
    return p.assemble()


def kernel_layout(cache: Path = LAYOUT_CACHE) -> tuple[Offsets, list[int]]:
    """The field offsets and the two tracepoints' BTF ids of the running kernel.

    Reading them from the BTF takes ~0.3 s of Python (every kernel type is walked), and
    each mount's daemon needs them at start: they are kept in *cache* (on /run, so a
    reboot, the only way to another kernel, empties it), under the kernel's release,
    build and BTF size."""
    key = f"{os.uname().release} {os.uname().version} {_btf_size()}"
    try:
        saved = json.loads(cache.read_text())
        if saved["kernel"] == key:
            return Offsets(**saved["offsets"]), [int(i) for i in saved["btf_ids"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        types = KernelTypes.of_running_kernel()
        offsets = Offsets.of(types)
        ids = [types.typedef_id(f"btf_trace_{name}")
               for name in (FILEMAP_TRACEPOINT, DIRECT_TRACEPOINT)]
    except BtfError as exc:
        raise ProbeError(f"kernel BTF: {exc}") from None
    try:
        cache.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}")
        tmp.write_text(json.dumps({"kernel": key, "offsets": asdict(offsets), "btf_ids": ids}))
        tmp.replace(cache)
    except OSError:
        pass  # read again at the next start
    return offsets, ids


def _btf_size() -> int:
    try:
        return VMLINUX.stat().st_size
    except OSError:
        return 0


def kernel_dev(st_dev: int) -> int:
    """A stat() device number as the kernel's ``s_dev`` holds it (MKDEV: 12-bit major
    above a 20-bit minor), which is what the programs see."""
    return (os.major(st_dev) << 20) | os.minor(st_dev)
