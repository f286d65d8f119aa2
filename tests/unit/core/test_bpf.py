"""The compiler-free BPF pieces: instruction encoding and labels, and struct offsets read
from a BTF blob (a synthetic one whose answers are known, and the running kernel's)."""

from __future__ import annotations

import struct

import pytest

from qosfs.core.bpf.asm import Program
from qosfs.core.bpf.btf import VMLINUX, BtfError, KernelTypes


def test_instructions_are_encoded_as_the_kernel_reads_them() -> None:
    p = Program()
    p.alu("mov", 0, 7)  # r0 = 7
    p.jump("jeq", 1, 0, "done")  # if r1 == 0 goto done
    p.load(8, 2, 1, 16)  # r2 = *(u64 *)(r1 + 16)
    p.atomic_add(0, 8, 2)  # lock *(u64 *)(r0 + 8) += r2
    p.map_fd(1, 5)  # r1 = map 5 (two slots)
    p.label("done")
    p.exit()
    code = p.assemble()
    insns = [struct.unpack_from("<BBhi", code, i) for i in range(0, len(code), 8)]
    assert insns == [
        (0xB7, 0x00, 0, 7),
        (0x15, 0x01, 4, 0),  # jumps over the 4 instructions to "done"
        (0x79, 0x12, 16, 0),
        (0xDB, 0x20, 8, 0),
        (0x18, 0x11, 0, 5),
        (0x00, 0x00, 0, 0),
        (0x95, 0x00, 0, 0),
    ]


def _btf() -> bytes:
    """A BTF blob: int (id 1), struct outer { int a; union { int b; struct inner c; }; }
    (id 2, the union anonymous: id 3), struct inner { int x; int y; } (id 4), a typedef
    btf_trace_demo (id 5) of int."""
    strings = b"\0int\0outer\0a\0b\0c\0inner\0x\0y\0btf_trace_demo\0"

    def name(s: str) -> int:
        return strings.index(b"\0" + s.encode() + b"\0") + 1

    def typ(name_off: int, kind: int, vlen: int, size: int) -> bytes:
        return struct.pack("<III", name_off, (kind << 24) | vlen, size)

    types = typ(name("int"), 1, 0, 4) + struct.pack("<I", 32)
    types += typ(name("outer"), 4, 2, 12)
    types += struct.pack("<III", name("a"), 1, 0) + struct.pack("<III", 0, 3, 32)
    types += typ(0, 5, 2, 8)
    types += struct.pack("<III", name("b"), 1, 0) + struct.pack("<III", name("c"), 4, 0)
    types += typ(name("inner"), 4, 2, 8)
    types += struct.pack("<III", name("x"), 1, 0) + struct.pack("<III", name("y"), 1, 32)
    types += typ(name("btf_trace_demo"), 8, 0, 1)
    header = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(types), len(types),
                         len(strings))
    return header + types + strings


def test_member_offsets_are_found_through_anonymous_unions() -> None:
    types = KernelTypes(_btf())
    assert types.offset("outer", "a") == 0
    assert types.offset("outer", "b") == 4  # in the anonymous union at bit 32
    assert types.offset("outer", "c") == 4
    assert types.offset("inner", "y") == 4
    assert types.typedef_id("btf_trace_demo") == 5


def test_unknown_structs_fields_and_blobs_are_refused_with_their_name() -> None:
    types = KernelTypes(_btf())
    with pytest.raises(BtfError, match="no struct nothing"):
        types.offset("nothing", "a")
    with pytest.raises(BtfError, match=r"no field outer\.z"):
        types.offset("outer", "z")
    with pytest.raises(BtfError, match="no btf_trace_other"):
        types.typedef_id("btf_trace_other")
    with pytest.raises(BtfError, match="bad magic"):
        KernelTypes(b"\0" * 32)


@pytest.mark.skipif(not VMLINUX.exists(), reason="the kernel publishes no BTF")
def test_the_running_kernels_fields_are_where_its_headers_put_them() -> None:
    types = KernelTypes.of_running_kernel()
    assert types.offset("address_space", "host") == 0  # the first field since 2.6
    assert types.offset("kiocb", "ki_filp") == 0
    offsets = {types.offset("inode", f) for f in ("i_ino", "i_sb", "i_size")}
    assert len(offsets) == 3 and all(0 < o < 1024 for o in offsets)
