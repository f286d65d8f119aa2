"""The bpf(2) commands qosfs uses, through ctypes: create a map, read and change its
entries, load a program, attach it to a raw tracepoint.

Only what counting passed-through reads needs (:mod:`qosfs.passthrough.read_probes`);
no libbpf, no compiler: the programs are a few dozen instructions built in Python
(:mod:`qosfs.core.bpf.asm`) against offsets from the kernel's BTF
(:mod:`qosfs.core.bpf.btf`). Every call raises :class:`OSError` with the kernel's errno;
a refused program load carries the verifier's log in its message.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import struct

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long

_SYS_BPF = 321  # x86_64 (arch/x86/entry/syscalls/syscall_64.tbl)
_ATTR_SIZE = 128  # enough for every command used here; the kernel zero-checks the rest

# enum bpf_cmd (include/uapi/linux/bpf.h)
_MAP_CREATE, _MAP_LOOKUP_ELEM, _MAP_UPDATE_ELEM, _MAP_DELETE_ELEM = 0, 1, 2, 3
_MAP_GET_NEXT_KEY, _PROG_LOAD, _RAW_TRACEPOINT_OPEN = 4, 5, 17

# enum bpf_map_type
MAP_HASH, MAP_ARRAY, MAP_PERCPU_HASH, MAP_PERCPU_ARRAY, MAP_LRU_HASH = 1, 2, 5, 6, 9
_PER_CPU = (MAP_PERCPU_HASH, MAP_PERCPU_ARRAY)
# enum bpf_prog_type
PROG_RAW_TRACEPOINT = 17
PROG_TRACING = 26
# enum bpf_attach_type: a PROG_TRACING program on a tracepoint (tp_btf)
TRACE_RAW_TP = 23
# map update flags
ANY, NOEXIST = 0, 1
# map creation flags: a hash map whose entries are allocated as they are added, instead
# of all at creation (a per-CPU hash of 32,768 took ~40 ms to create preallocated)
NO_PREALLOC = 1
#: ``BPF_F_MMAPABLE`` (Linux 5.5): an array map whose values the daemon maps (`Map.mapped`).
MMAPABLE = 1 << 10

_LOG_SIZE = 1 << 16


def _call(cmd: int, attr: bytes | ctypes.Array[ctypes.c_char]) -> int:
    """bpf(2) with *attr* (bytes, or a buffer of ``_ATTR_SIZE`` the caller reads back
    what the kernel wrote into)."""
    buf = ctypes.create_string_buffer(attr, _ATTR_SIZE) if isinstance(attr, bytes) else attr
    ret = int(_libc.syscall(_SYS_BPF, cmd, buf, _ATTR_SIZE))
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


def map_create(map_type: int, key_size: int, value_size: int, max_entries: int,
               flags: int = 0) -> int:
    """A new map's descriptor (closing it frees the map once no program holds it)."""
    return _call(_MAP_CREATE, struct.pack("<IIIII", map_type, key_size, value_size,
                                          max_entries, flags))


def possible_cpus() -> int:
    """How many CPUs the kernel may run (a per-CPU map holds a value for each)."""
    with open("/sys/devices/system/cpu/possible") as f:
        return max(int(part.split("-")[-1]) for part in f.read().strip().split(",")) + 1


class Map:
    """A map's descriptor and its key and value sizes, with the element commands. A
    per-CPU map's lookup gives every CPU's value, one after the other (each padded to 8
    bytes); an update from here sets every CPU's."""

    __slots__ = ("fd", "key_size", "max_entries", "value_size")

    def __init__(self, map_type: int, key_size: int, value_size: int, max_entries: int,
                 flags: int = 0) -> None:
        self.fd = map_create(map_type, key_size, value_size, max_entries, flags)
        self.key_size, self.max_entries = key_size, max_entries
        self.value_size = value_size if map_type not in _PER_CPU \
            else (value_size + 7) // 8 * 8 * possible_cpus()

    def _elem(self, cmd: int, key: bytes, value: ctypes.Array[ctypes.c_char] | None,
              flags: int = 0) -> int:
        k = ctypes.create_string_buffer(key, self.key_size)
        v = ctypes.addressof(value) if value is not None else 0
        return _call(cmd, struct.pack("<IIQQQ", self.fd, 0, ctypes.addressof(k), v, flags))

    def lookup(self, key: bytes) -> bytes | None:
        value = ctypes.create_string_buffer(self.value_size)
        try:
            self._elem(_MAP_LOOKUP_ELEM, key, value)
        except FileNotFoundError:
            return None
        return value.raw

    def update(self, key: bytes, value: bytes, flags: int = ANY) -> None:
        self._elem(_MAP_UPDATE_ELEM, key, ctypes.create_string_buffer(value, self.value_size),
                   flags)

    def delete(self, key: bytes) -> bool:
        """Remove *key*; False if it was not there."""
        try:
            self._elem(_MAP_DELETE_ELEM, key, None)
        except FileNotFoundError:
            return False
        return True

    def all_keys(self) -> list[bytes]:
        """Every key now in the map (a hash map's order; entries added meanwhile may be
        missed, which the next walk sees)."""
        out: list[bytes] = []
        key = ctypes.create_string_buffer(self.key_size)
        nxt = ctypes.create_string_buffer(self.key_size)
        first = True
        while True:
            attr = struct.pack("<IIQQ", self.fd, 0, 0 if first else ctypes.addressof(key),
                               ctypes.addressof(nxt))
            try:
                _call(_MAP_GET_NEXT_KEY, attr)
            except FileNotFoundError:
                return out
            out.append(nxt.raw)
            ctypes.memmove(key, nxt, self.key_size)
            first = False

    def mapped(self) -> mmap.mmap:
        """An array map's values as shared memory, one after the other (each padded to 8
        bytes), read and written in place with no system call: for a map made with
        ``MMAPABLE``. A program's plain stores may be seen half done (a value's first
        field new, its second not yet), as by a lookup."""
        stride = (self.value_size + 7) // 8 * 8
        size = -(-(stride * self.max_entries) // mmap.PAGESIZE) * mmap.PAGESIZE
        return mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def prog_load(prog_type: int, instructions: bytes, attach_btf_id: int = 0,
              license_: str = "GPL") -> int:
    """Load a program; its descriptor. A refusal raises OSError with the verifier's log.

    *attach_btf_id* (with ``PROG_TRACING``): the BTF id of the ``btf_trace_<name>``
    typedef of the tracepoint it is for; the verifier then knows the arguments' types
    and lets the program follow their pointers with plain loads."""
    insns = ctypes.create_string_buffer(instructions, len(instructions))
    lic = ctypes.create_string_buffer(license_.encode())
    log = ctypes.create_string_buffer(_LOG_SIZE)
    expected = TRACE_RAW_TP if prog_type == PROG_TRACING else 0
    # union bpf_attr's BPF_PROG_LOAD fields, up to attach_btf_id (include/uapi/linux/bpf.h)
    attr = struct.pack("<IIQQIIQII16sIIIIQIIQII", prog_type, len(instructions) // 8,
                       ctypes.addressof(insns), ctypes.addressof(lic), 1, _LOG_SIZE,
                       ctypes.addressof(log), 0, 0, b"qosfs_reads", 0, expected,
                       0, 0, 0, 0, 0, 0, 0, attach_btf_id)
    try:
        return _call(_PROG_LOAD, attr)
    except OSError as exc:
        text = log.value.decode(errors="replace").strip().splitlines()
        raise OSError(exc.errno, f"{exc.strerror}: {' / '.join(text[-6:])}") from None


def raw_tracepoint_open(name: str | None, prog_fd: int) -> int:
    """Attach *prog_fd* to the raw tracepoint *name* (no tracefs needed; None for a
    ``PROG_TRACING`` program, which names its tracepoint at load); closing the returned
    descriptor detaches it."""
    tp = ctypes.create_string_buffer(name.encode()) if name is not None else None
    return _call(_RAW_TRACEPOINT_OPEN, struct.pack(
        "<QI", ctypes.addressof(tp) if tp is not None else 0, prog_fd))
