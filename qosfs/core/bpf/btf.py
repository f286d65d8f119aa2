"""Where the running kernel keeps a field of one of its structs, read from its BTF.

A BPF program that follows kernel pointers (``bpf_probe_read_kernel``) must know field
offsets, and those change with the kernel's version and configuration. The kernel
describes its own types in ``/sys/kernel/btf/vmlinux`` (CONFIG_DEBUG_INFO_BTF, on in
Debian's kernels); this reads the few offsets a program needs from there, so nothing is
compiled against headers. Format: Documentation/bpf/btf.rst (a header, then a type
section of ``struct btf_type`` records, each followed by kind-specific data, then the
string section).
"""

from __future__ import annotations

import struct
from pathlib import Path

VMLINUX = Path("/sys/kernel/btf/vmlinux")

_MAGIC = 0xEB9F
_STRUCT, _UNION, _TYPEDEF = 4, 5, 8
# Bytes of kind-specific data after each btf_type (12 bytes): a fixed size per kind, or
# (in _PER_MEMBER) a size per member, times vlen (the low 16 bits of info).
_EXTRA: dict[int, int] = {
    1: 4,          # INT
    2: 0,          # PTR
    3: 12,         # ARRAY
    7: 0, 8: 0, 9: 0, 10: 0, 11: 0,  # FWD TYPEDEF VOLATILE CONST RESTRICT
    12: 0,         # FUNC
    14: 4,         # VAR
    16: 0,         # FLOAT
    17: 4,         # DECL_TAG
    18: 0,         # TYPE_TAG
}
_PER_MEMBER: dict[int, int] = {
    4: 12,         # STRUCT: name, type, offset
    5: 12,         # UNION
    6: 8,          # ENUM
    13: 8,         # FUNC_PROTO: its parameters
    15: 12,        # DATASEC
    19: 12,        # ENUM64
}


class BtfError(Exception):
    """The kernel's BTF is missing, unreadable, or lacks a struct or field asked for."""


class KernelTypes:
    """The structs and unions of a BTF blob, by name, with their members' byte offsets."""

    def __init__(self, blob: bytes) -> None:
        if len(blob) < 24:
            raise BtfError("BTF too short")
        magic, _version, _flags, hdr_len = struct.unpack_from("<HBBI", blob, 0)
        if magic != _MAGIC:
            raise BtfError("not BTF (bad magic)")
        type_off, type_len, str_off, _str_len = struct.unpack_from("<IIII", blob, 8)
        self._types_at = hdr_len + type_off
        self._strings_at = hdr_len + str_off
        self._blob = blob
        # type id -> (kind, name offset, byte offset of its member records, vlen)
        self._records: list[tuple[int, int, int, int]] = [(0, 0, 0, 0)]  # id 0: void
        self._by_name: dict[str, int] = {}
        self._typedefs: dict[str, int] = {}
        pos, end = self._types_at, self._types_at + type_len
        while pos < end:
            name_off, info, _size = struct.unpack_from("<III", blob, pos)
            kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
            if kind in _EXTRA:
                size = _EXTRA[kind]
            elif kind in _PER_MEMBER:
                size = _PER_MEMBER[kind] * vlen
            else:
                raise BtfError(f"unknown BTF kind {kind}")
            self._records.append((kind, name_off, pos + 12, vlen))
            if kind in (_STRUCT, _UNION) and name_off:
                self._by_name.setdefault(self._string(name_off), len(self._records) - 1)
            elif kind == _TYPEDEF and name_off:
                self._typedefs[self._string(name_off)] = len(self._records) - 1
            pos += 12 + size

    @classmethod
    def of_running_kernel(cls) -> KernelTypes:
        try:
            return cls(VMLINUX.read_bytes())
        except OSError as exc:
            raise BtfError(f"{VMLINUX}: {exc.strerror}") from exc

    def _string(self, offset: int) -> str:
        start = self._strings_at + offset
        return self._blob[start:self._blob.index(b"\0", start)].decode()

    def _member_offset(self, type_id: int, field: str) -> int | None:
        """The byte offset of *field* in struct/union *type_id*, looking into its
        anonymous struct and union members (where the kernel often nests fields)."""
        _kind, _name, at, vlen = self._records[type_id]
        kind_flag = struct.unpack_from("<I", self._blob, at - 8)[0] >> 31
        for i in range(vlen):
            name_off, member_type, offset = struct.unpack_from("<III", self._blob, at + 12 * i)
            bits = int(offset & 0xFFFFFF if kind_flag else offset)
            if name_off and self._string(name_off) == field:
                return bits // 8
            if not name_off:
                inner = self._resolve(member_type)
                if inner is not None:
                    found = self._member_offset(inner, field)
                    if found is not None:
                        return bits // 8 + found
        return None

    def _resolve(self, type_id: int) -> int | None:
        """*type_id* past typedefs and qualifiers, if it is a struct or union."""
        for _ in range(16):
            kind, _name, at, _vlen = self._records[type_id]
            if kind in (_STRUCT, _UNION):
                return type_id
            if kind not in (8, 9, 10, 11, 18):  # TYPEDEF VOLATILE CONST RESTRICT TYPE_TAG
                return None
            type_id = struct.unpack_from("<I", self._blob, at - 4)[0]
        return None

    def offset(self, struct_name: str, field: str) -> int:
        """The byte offset of ``struct_name.field``; raises :class:`BtfError` if either
        is unknown (a kernel this program was not written for)."""
        type_id = self._by_name.get(struct_name)
        if type_id is None:
            raise BtfError(f"the kernel's BTF has no struct {struct_name}")
        found = self._member_offset(type_id, field)
        if found is None:
            raise BtfError(f"the kernel's BTF has no field {struct_name}.{field}")
        return found

    def typedef_id(self, name: str) -> int:
        """The BTF id of typedef *name* (``btf_trace_<tracepoint>`` names a tracepoint's
        prototype, which a BTF-typed tracepoint program is loaded against)."""
        type_id = self._typedefs.get(name)
        if type_id is None:
            raise BtfError(f"the kernel's BTF has no {name}")
        return type_id
