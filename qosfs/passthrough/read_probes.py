"""The maps the read-counting programs share with the daemon, and the programs loaded.

:mod:`qosfs.passthrough.read_programs` assembles the two programs (what they count and
how, and why it is cheap); this module creates their maps, loads and attaches them
(:meth:`ReadProbes.load`), and is the daemon's side of the maps: which files are watched
(``watch``, ``unwatch``), what was counted (``totals``, ``changed_totals``) and a slot
cleared for its next file (``forget``).

The counts are read every half second (:mod:`qosfs.passthrough.read_counting`), for every
watched slot, and a loader's files stay watched while their backing ids are kept idle, so
there may be tens of thousands. The per-CPU counts are an array the daemon maps
(``BPF_F_MMAPABLE``): a reading copies each CPU's region, finds the slots whose bytes
changed since the last reading a block at a time (a bytes compare, in C) and unpacks only
those. With 16,000 files watched, a reading took 16-25 ms when it was a batch lookup of
every slot and a compare of each in Python: the event loop stalled that long twice a
second, reads or none. The ``index`` array, which the programs look a file up in, is
mapped too: a watched file's entry is one store, where a map update through ``bpf(2)``
cost a cold file's open ~25 us of the daemon's CPU.

The programs are attached only while a file is watched. Attached, they cost every
buffered read on the machine a call, through the mount or not (a 4 KiB page-cached read
by any process: +100-180 ns, 6-12%, per mount with programs attached: ``python -m
bench.probecost``'s ``other`` case), and a mount with nothing passed through would count
nothing. So a mount between jobs, or one whose classes all stay in the daemon, costs the
machine's other readers nothing; the first watched file attaches them (two ``bpf(2)``
calls, before that open is answered, so before any of its reads), the last one
unwatched detaches them.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable

from qosfs.core.bpf import syscall as bpf
from qosfs.passthrough.read_programs import (
    DIRECT_TRACEPOINT,
    FILEMAP_TRACEPOINT,
    INDEX_SIZE,
    INDEX_VALUE,
    Offsets,
    ProbeError,
    direct_program,
    filemap_program,
    kernel_dev,
    kernel_layout,
)

#: Bytes of one slot's count in a CPU's region of ``counts_fast``: (uid + 1, bytes, reads).
ENTRY_SIZE = 24
#: Slots compared at once when looking for the ones that changed (1.5 KiB of a region).
BLOCK_SLOTS = 64


class ReadProbes:
    """The loaded programs and their maps; :meth:`load` or :class:`ProbeError`."""

    def __init__(self, max_watched: int, max_counts: int) -> None:
        # Written in place through a mapping: an update through bpf(2) (ctypes and a
        # system call) was ~27 us of a cold file's open on ext4, 4 readers (the
        # daemon's CPU per file, thread time), a store into the mapping well under one.
        self.index = bpf.Map(bpf.MAP_ARRAY, 4, INDEX_VALUE.size, INDEX_SIZE, bpf.MMAPABLE)
        self._index = self.index.mapped()
        # The index's entries as written, by position: [ino, dev, slot, overflow].
        self._entries: dict[int, list[int]] = {}
        self._watching = 0
        self.max_watched = max_watched
        self.watched = bpf.Map(bpf.MAP_HASH, 16, 8, max_watched)
        self.recent = bpf.Map(bpf.MAP_PERCPU_ARRAY, 4, 32, 1)
        # By slot, for the first uid that reads the file on a CPU: (uid + 1, bytes,
        # reads), in that CPU's region of one plain array (read_programs._count says why
        # not a per-CPU array); other uids' reads go to the hash, by (slot, uid), its
        # entries made as they come (most files are read by one uid: it stays small).
        # The array: 24 B x (max_watched + 1) a CPU, ~1.5 MB each as set here.
        self.cpus = bpf.possible_cpus()
        self.fast_slots = max_watched + 1
        self.counts_fast = bpf.Map(bpf.MAP_ARRAY, 4, ENTRY_SIZE, self.fast_slots * self.cpus,
                                   bpf.MMAPABLE)
        self._fast = self.counts_fast.mapped()
        self.counts = bpf.Map(bpf.MAP_PERCPU_HASH, 8, 16, max_counts, bpf.NO_PREALLOC)
        self.lost = bpf.Map(bpf.MAP_ARRAY, 4, 16, 1)
        # Each CPU's region as changed_totals last read it (a forgotten slot zeroed).
        self._seen: list[bytearray] = [bytearray() for _ in range(self.cpus)]
        # The slots the hash held counts of at the last reading: forget deletes the
        # hash keys of those only (a delete of a key that is not there is a system call
        # for nothing, and most files are read by one uid, counted in the array).
        self._in_hash: set[int] = set()
        self._fds: list[int] = []  # the programs loaded
        self._targets: list[str | None] = []  # each one's tracepoint (None: BTF-typed)
        self._links: list[int] = []  # while a file is watched: the programs attached
        self.attach_error = ""  # why the programs could not be attached again, if so
        self.mode = ""  # "tp_btf" or "raw_tp", once loaded

    @classmethod
    def load(cls, tgid: int, max_watched: int = 65536, max_counts: int = 32768,
             passthrough_only: bool = True, keyring: int | None = None) -> ReadProbes:
        """Load both programs (attached from the first watched file on: the module
        docstring says why), counting reads by anyone but *tgid*: BTF-typed where the
        kernel allows (``tp_btf``), else as plain raw tracepoints. Only reads
        passed through a FUSE mount are counted, unless *passthrough_only* is False
        (then a watched file's direct reads are too: the unit tests'); given the serial
        of the mount's session *keyring*, only those passed through this mount."""
        offsets, ids = kernel_layout()
        try:
            probes = cls(max_watched, max_counts)
        except OSError as exc:
            raise ProbeError(f"BPF maps refused: {exc.strerror}") from None
        try:
            try:
                probes._attach_all(offsets, tgid, ids, passthrough_only, keyring)
                probes.mode = "tp_btf"
            except ProbeError:
                probes._unload()
                probes._attach_all(offsets, tgid, None, passthrough_only, keyring)
                probes.mode = "raw_tp"
        except ProbeError:
            probes.close()
            raise
        probes._unlink()  # attached once to know they can be; again at the first watch
        return probes

    def _attach_all(self, o: Offsets, tgid: int, btf_ids: list[int] | None,
                    passthrough_only: bool, keyring: int | None) -> None:
        typed = btf_ids is not None
        maps = (self.counts_fast.fd, self.counts.fd, self.lost.fd)
        watched = (self.index.fd, self.watched.fd)
        programs = (filemap_program(o, typed, tgid, *watched, self.recent.fd, *maps,
                                    fast_slots=self.fast_slots,
                                    passthrough_only=passthrough_only, keyring=keyring),
                    direct_program(o, typed, tgid, *watched, *maps,
                                   fast_slots=self.fast_slots,
                                   passthrough_only=passthrough_only, keyring=keyring))
        for i, (name, program) in enumerate(zip((FILEMAP_TRACEPOINT, DIRECT_TRACEPOINT),
                                                programs, strict=True)):
            self._load_program(name, program, None if btf_ids is None else btf_ids[i])
        if not self._link():  # the kernel may load a program it then will not attach
            raise ProbeError(self.attach_error)

    def _load_program(self, tracepoint: str, program: bytes, btf_id: int | None) -> None:
        try:
            if btf_id is None:
                prog = bpf.prog_load(bpf.PROG_RAW_TRACEPOINT, program)
            else:
                prog = bpf.prog_load(bpf.PROG_TRACING, program, btf_id)
        except OSError as exc:
            raise ProbeError(f"BPF program for {tracepoint} refused: {exc.strerror}") from None
        self._fds.append(prog)
        self._targets.append(None if btf_id else tracepoint)

    def _link(self) -> bool:
        """Attach the programs (the first file watched); False, and why in
        ``attach_error``, if the kernel refuses now."""
        try:
            for target, prog in zip(self._targets, self._fds, strict=True):
                self._links.append(bpf.raw_tracepoint_open(target, prog))
        except OSError as exc:
            self._unlink()
            self.attach_error = f"the counting programs could not be attached: {exc.strerror}"
            return False
        self.attach_error = ""
        return True

    def _unlink(self) -> None:
        """Detach the programs (no file watched): reads elsewhere no longer call them."""
        for fd in reversed(self._links):
            os.close(fd)
        self._links.clear()

    @property
    def attached(self) -> bool:
        return bool(self._links)

    def _unload(self) -> None:
        self._unlink()
        for fd in reversed(self._fds):
            os.close(fd)
        self._fds.clear()
        self._targets.clear()

    def watch(self, st_dev: int, ino: int, slot: int) -> bool:
        """Count reads of the file (*st_dev*, *ino*) under *slot* (a store into the index's
        mapping; a map update of the hash too where its index entry is taken; the
        programs attached if it is the only one); False if *max_watched* files are
        watched, or the programs cannot be attached (``attach_error``)."""
        if self._watching >= self.max_watched or not (self._links or self._link()):
            return False
        dev, at = kernel_dev(st_dev), ino & (INDEX_SIZE - 1)
        entry = self._entries.setdefault(at, [0, 0, 0, 0])
        if entry[0] == 0:
            entry[:3] = ino, dev, slot
        else:
            try:
                self.watched.update(struct.pack("<IIQ", dev, 0, ino),
                                    struct.pack("<II", slot, 0))
            except OSError:
                return False
            entry[3] += 1
        self._write_entry(at, entry)
        self._watching += 1
        return True

    def unwatch(self, st_dev: int, ino: int) -> None:
        """No longer count reads of the file (*st_dev*, *ino*) (nothing if not watched)."""
        dev, at = kernel_dev(st_dev), ino & (INDEX_SIZE - 1)
        entry = self._entries.get(at)
        if entry is None:
            return
        if entry[0] == ino and entry[1] == dev:
            entry[:3] = 0, 0, 0
        elif self.watched.delete(struct.pack("<IIQ", dev, 0, ino)):
            entry[3] -= 1
        else:
            return
        self._write_entry(at, entry)
        if entry == [0, 0, 0, 0]:
            del self._entries[at]
        self._watching -= 1
        if not self._watching:
            self._unlink()

    def _write_entry(self, at: int, entry: list[int]) -> None:
        # A program may read the entry while it changes, as during a map update (which
        # copies the value with no lock either): see read_programs._watched_slot.
        INDEX_VALUE.pack_into(self._index, at * INDEX_VALUE.size, *entry)

    def totals(self, slots: Iterable[int] | None = None,
               ) -> dict[tuple[int, int], tuple[int, int]]:
        """{(slot, uid): (bytes, reads)} counted since each slot was last freed, for
        *slots* (None: every slot) and whatever the hash holds."""
        return self._totals(slots, False)

    def changed_totals(self, slots: Iterable[int]) -> dict[tuple[int, int], tuple[int, int]]:
        """As :meth:`totals`, for those of *slots* whose per-CPU counts changed since the
        last call or that the hash holds counts of: the daemon's drain, where most
        watched files were not read in the last half second. A (slot, uid) left out was
        not read since the last call."""
        return self._totals(slots, True)

    def _totals(self, slots: Iterable[int] | None, changed_only: bool,
                ) -> dict[tuple[int, int], tuple[int, int]]:
        out: dict[tuple[int, int], tuple[int, int]] = {}

        def add(key: tuple[int, int], nbytes: int, nreads: int) -> None:
            had = out.get(key, (0, 0))
            out[key] = (had[0] + nbytes, had[1] + nreads)

        for key in self.counts.all_keys():  # a key deleted meanwhile looks up as None
            for nbytes, nreads in struct.iter_unpack("<QQ", self.counts.lookup(key) or b""):
                add(struct.unpack("<II", key), nbytes, nreads)
        # A (slot, uid) may be counted on one CPU in the array and on another in the
        # hash: a slot the hash holds is read whole, changed or not.
        in_hash = {slot for slot, _ in out}
        self._in_hash = in_hash
        per_cpu = self.fast_slots
        wanted = None if slots is None else \
            slots if isinstance(slots, (set, dict)) else set(slots)
        top = per_cpu if wanted is None else min(max(wanted, default=-1) + 1, per_cpu)
        if top == 0:
            return out
        fast = self._fast
        regions = [fast[cpu * per_cpu * ENTRY_SIZE:(cpu * per_cpu + top) * ENTRY_SIZE]
                   for cpu in range(self.cpus)]
        if changed_only:
            candidates = _changed(regions, self._seen, top) | {s for s in in_hash if s < top}
            self._seen = [bytearray(region) for region in regions]
        else:  # every slot that counted something
            candidates = _changed(regions, [bytes(len(r)) for r in regions], top)
        for slot in sorted(candidates):
            if wanted is not None and slot not in wanted:
                continue
            at = slot * ENTRY_SIZE
            for region in regions:
                owner, nbytes, nreads = struct.unpack_from("<QQQ", region, at)
                if owner:
                    add((slot, owner - 1), nbytes, nreads)
        return out

    def forget(self, slot: int, uids: Iterable[int]) -> None:
        """Drop what *slot* counted (its file is no longer watched), so that the slot
        starts from nothing for the next file: its array entry and its hash keys (*uids*'s,
        if the last reading found the slot in the hash: its file was no longer read
        since). The last reading's copy of the slot is zeroed too, so that the next
        file's count is seen however it compares with the last one's."""
        if slot < self.fast_slots:
            zero = bytes(ENTRY_SIZE)
            for cpu in range(self.cpus):
                at = (cpu * self.fast_slots + slot) * ENTRY_SIZE
                self._fast[at:at + ENTRY_SIZE] = zero
            at = slot * ENTRY_SIZE
            for seen in self._seen:
                if at < len(seen):
                    seen[at:at + ENTRY_SIZE] = zero
        if slot in self._in_hash or slot >= self.fast_slots:
            for uid in uids:
                self.counts.delete(struct.pack("<II", slot, uid))

    def lost_totals(self) -> tuple[int, int]:
        """(bytes, reads) that found ``counts`` full."""
        value = self.lost.lookup(struct.pack("<I", 0))
        return struct.unpack("<QQ", value) if value else (0, 0)

    def close(self) -> None:
        self._unload()
        self._fast.close()
        self._index.close()
        for m in (self.index, self.watched, self.recent, self.counts_fast, self.counts,
                  self.lost):
            m.close()


def _changed(regions: list[bytes], before: list[bytes] | list[bytearray], top: int) -> set[int]:
    """The slots below *top* whose count differs, on some CPU, from *before* (each CPU's
    region as last read): a whole region compared first (an idle mount: one compare a
    CPU), then a block of slots at a time, then the slots of a block that differs."""
    changed: set[int] = set()
    block = BLOCK_SLOTS * ENTRY_SIZE
    for region, seen in zip(regions, before, strict=True):
        if region == seen:
            continue
        for start in range(0, top * ENTRY_SIZE, block):
            end = start + block
            if region[start:end] == seen[start:end]:
                continue
            for at in range(start, min(end, len(region)), ENTRY_SIZE):
                if region[at:at + ENTRY_SIZE] != seen[at:at + ENTRY_SIZE]:
                    changed.add(at // ENTRY_SIZE)
    return changed
