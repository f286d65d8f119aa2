"""BPF without a compiler: the few pieces qosfs needs to load its own small programs.

- ``asm``: BPF instructions and labels, assembled to the kernel's encoding.
- ``btf``: struct field offsets and typedef ids from the running kernel's BTF.
- ``syscall``: bpf(2) through ctypes: maps, program load, raw tracepoint attach.

This file only describes the package: import names from the module that defines them.
"""
