"""Core: the vocabulary every layer shares. Imports nothing of qosfs.

- ``errors``: :class:`QosfsError` and the exit code of each kind of failure.
- ``units``: parsing and showing sizes, bandwidths, IOPS and durations.
- ``limit_kinds``: the one table of limit kinds every limit name is derived from.
- ``syscalls``: the few Linux syscalls the ``os`` module lacks, through ctypes.
- ``mountinfo``: ``/proc/self/mountinfo``, parsed in one place.
- ``failures``: unexpected failures the daemon survived, counted and logged once per kind.
- ``keyring``: the mount's session keyring, which marks the reads passed through it.
- ``bpf/``: loading small BPF programs without a compiler (instructions, BTF, bpf(2)).

This file only describes the layer: import names from the module that defines them.
"""
