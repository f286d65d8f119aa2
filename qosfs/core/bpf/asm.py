"""BPF instructions, spelled so a program reads like the assembly in the kernel's docs.

Each method appends one instruction (Documentation/bpf/standardization/
instruction-set.rst); jumps name a label, resolved by :meth:`Program.assemble`. Only the
instructions qosfs's programs use are here. Registers: r0 return value, r1-r5 helper
arguments (clobbered by a call), r6-r9 kept across calls, r10 the read-only frame pointer
(the stack is the 512 bytes below it).
"""

from __future__ import annotations

import struct

# Helper function ids (enum bpf_func_id, include/uapi/linux/bpf.h).
MAP_LOOKUP_ELEM = 1
MAP_UPDATE_ELEM = 2
GET_SMP_PROCESSOR_ID = 8
GET_CURRENT_PID_TGID = 14
GET_CURRENT_UID_GID = 15
GET_CURRENT_TASK = 35
PROBE_READ_KERNEL = 113
GET_CURRENT_TASK_BTF = 158

_ALU64, _JMP, _LDX, _ST, _STX, _LD = 0x07, 0x05, 0x01, 0x02, 0x03, 0x00
_K, _X = 0x00, 0x08
_SIZES = {8: 0x18, 4: 0x00, 2: 0x08, 1: 0x10}  # DW, W, H, B
_MEM, _IMM, _ATOMIC = 0x60, 0x00, 0xC0
_OPS = {"add": 0x00, "sub": 0x10, "mul": 0x20, "and": 0x50, "lsh": 0x60, "rsh": 0x70,
        "mov": 0xB0}
_JUMPS = {"jeq": 0x10, "jgt": 0x20, "jge": 0x30, "jne": 0x50, "jlt": 0xA0, "jle": 0xB0,
          "jsle": 0xD0}
_PSEUDO_MAP_FD = 1


class Program:
    """A growing list of instructions and labels."""

    def __init__(self) -> None:
        self._insns: list[tuple[int, int, int, int | str, int]] = []  # code dst src off imm
        self._labels: dict[str, int] = {}

    def _emit(self, code: int, dst: int = 0, src: int = 0, off: int | str = 0,
              imm: int = 0) -> None:
        self._insns.append((code, dst, src, off, imm))

    def label(self, name: str) -> None:
        self._labels[name] = len(self._insns)

    def alu(self, op: str, dst: int, imm: int) -> None:
        """``dst op= imm`` on 64 bits (``mov`` sets it)."""
        self._emit(_ALU64 | _OPS[op] | _K, dst, imm=imm)

    def alu_reg(self, op: str, dst: int, src: int) -> None:
        """``dst op= src`` on 64 bits."""
        self._emit(_ALU64 | _OPS[op] | _X, dst, src)

    def load(self, size: int, dst: int, src: int, off: int) -> None:
        """``dst = *(size *)(src + off)``."""
        self._emit(_LDX | _MEM | _SIZES[size], dst, src, off)

    def store(self, size: int, dst: int, off: int, src: int) -> None:
        """``*(size *)(dst + off) = src``."""
        self._emit(_STX | _MEM | _SIZES[size], dst, src, off)

    def store_imm(self, size: int, dst: int, off: int, imm: int) -> None:
        """``*(size *)(dst + off) = imm``."""
        self._emit(_ST | _MEM | _SIZES[size], dst, off=off, imm=imm)

    def atomic_add(self, dst: int, off: int, src: int) -> None:
        """``lock *(u64 *)(dst + off) += src`` (counters other CPUs bump too)."""
        self._emit(_STX | _ATOMIC | _SIZES[8], dst, src, off, imm=0)

    def map_fd(self, dst: int, fd: int) -> None:
        """``dst = map`` (a 16-byte load the kernel rewrites to the map's address)."""
        self._emit(_LD | _IMM | _SIZES[8], dst, _PSEUDO_MAP_FD, imm=fd)
        self._emit(0)

    def jump(self, op: str, dst: int, imm: int, target: str) -> None:
        """``if dst op imm goto target`` (unsigned compares but ``jsle``)."""
        self._emit(_JMP | _JUMPS[op] | _K, dst, off=target, imm=imm)

    def jump_reg(self, op: str, dst: int, src: int, target: str) -> None:
        """``if dst op src goto target``."""
        self._emit(_JMP | _JUMPS[op] | _X, dst, src, off=target)

    def goto(self, target: str) -> None:
        self._emit(_JMP | 0x00, off=target)

    def call(self, helper: int) -> None:
        self._emit(_JMP | 0x80, imm=helper)

    def exit(self) -> None:
        self._emit(_JMP | 0x90)

    def assemble(self) -> bytes:
        out = bytearray()
        for i, (code, dst, src, target, imm) in enumerate(self._insns):
            off = self._labels[target] - i - 1 if isinstance(target, str) else target
            out += struct.pack("<BBhi", code, (src << 4) | dst, off, imm)
        return bytes(out)
