"""What the read-counting BPF programs cost per read: a profiling tool for changes to
:mod:`qosfs.passthrough.read_programs`, run by hand as root (``bench uncapped`` gives the
figure of record: fio through a mount with and without the counting)::

    python -m bench.probecost [--dir /var/tmp] [--seconds 5] [--rounds 8] [--bs 4k]
                              [--timing]

fio reads a page-cached file on the directory's filesystem (psync, random, QD1, no
mount), in rounds that alternate the cases, so that a shared machine's drift falls on
each case alike:

- ``none``: no program loaded;
- ``empty``: a program that does nothing, on the same tracepoint: what merely attaching
  a BPF program to ``mm_filemap_get_pages`` costs each read (the tracepoint's call, the
  BPF dispatch, their indirect calls), which no change to the programs can remove;
- ``other``: the programs as a mount loads them, the file watched: what every read on
  the machine that is not passed through pays (a direct read leaves at the credential
  check, before any lookup);
- ``watched``: the programs made to count direct reads too, the file watched: every
  instruction a passed-through read pays.

It prints each case's median IOPS and its ratio to ``none``, and the median CPU time fio
spent per read and what the case adds to ``none``'s (the steadier figure: see
``FioMetrics.cpu_ns_per_io``). With ``--timing``, ``kernel.bpf_stats_enabled`` is on (and
restored after) and each case's programs' own time per run is printed too, as the kernel
measures it: free of the machine's noise, but the timing itself costs two clock reads per
run, inside the figure (the ``empty`` case shows how much) and in the IOPS.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.core.fio import parse_fio_json
from qosfs.core.bpf import syscall as bpf
from qosfs.core.bpf.asm import Program
from qosfs.passthrough.read_probes import ReadProbes
from qosfs.passthrough.read_programs import kernel_layout

STATS = Path("/proc/sys/kernel/bpf_stats_enabled")
SLOT = 1
CASES = ("none", "empty", "other", "watched")


def fio_reads(path: Path, seconds: float, bs: str) -> tuple[float, float]:
    """fio's (IOPS, CPU ns per read: :meth:`FioMetrics.cpu_ns_per_io`)."""
    out = subprocess.run(["fio", "--name=r", f"--filename={path}", "--ioengine=psync",
                          "--rw=randread", f"--bs={bs}", "--invalidate=0", "--time_based",
                          f"--runtime={seconds}", "--output-format=json"],
                         check=True, capture_output=True, timeout=seconds + 60).stdout
    m = parse_fio_json(json.loads(out))
    return m.iops, m.cpu_ns_per_io()


def _run_stats(fds: list[int]) -> tuple[int, int]:
    """(run_time_ns, run_cnt) summed over the programs *fds*, from their fdinfo."""
    ns = runs = 0
    for fd in fds:
        fields = dict(line.split(":\t", 1) for line in
                      Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines() if ":\t" in line)
        if "run_cnt" in fields:
            ns, runs = ns + int(fields["run_time_ns"]), runs + int(fields["run_cnt"])
    return ns, runs


@contextmanager
def _empty_program() -> Iterator[list[int]]:
    """A program that returns at once, on the buffered-read tracepoint (BTF-typed, as
    the counting loads where it can)."""
    _, ids = kernel_layout()
    p = Program()
    p.alu("mov", 0, 0)
    p.exit()
    prog = bpf.prog_load(bpf.PROG_TRACING, p.assemble(), ids[0])
    link = bpf.raw_tracepoint_open(None, prog)
    try:
        yield [prog]
    finally:
        os.close(link)
        os.close(prog)


@contextmanager
def _counting(path: Path, passthrough_only: bool) -> Iterator[list[int]]:
    probes = ReadProbes.load(os.getpid(), max_watched=1024, max_counts=1024,
                             passthrough_only=passthrough_only)
    try:
        st = os.stat(path)
        assert probes.watch(st.st_dev, st.st_ino, SLOT)
        yield probes._fds
    finally:
        probes.close()


@contextmanager
def _nothing() -> Iterator[list[int]]:
    yield []


def measure(path: Path, seconds: float, bs: str) -> dict[str, tuple[float, float, float]]:
    """{case: (IOPS, CPU ns per read, the programs' ns per run)} for one round."""
    setups: dict[str, Callable[[], Any]] = {
        "none": _nothing, "empty": _empty_program,
        "other": lambda: _counting(path, True), "watched": lambda: _counting(path, False)}
    out = {}
    for case in CASES:
        with setups[case]() as fds:
            before = _run_stats(fds)
            iops, cpu_ns = fio_reads(path, seconds, bs)
            after = _run_stats(fds)
        runs = after[1] - before[1]
        out[case] = (iops, cpu_ns, (after[0] - before[0]) / runs if runs else 0.0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp", help="a directory on ext4 or XFS")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--bs", default="4k")
    ap.add_argument("--timing", action="store_true",
                    help="turn kernel.bpf_stats_enabled on and print ns per program run")
    args = ap.parse_args()
    saved = STATS.read_text().strip()
    STATS.write_text("1" if args.timing else "0")
    try:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            path = Path(tmp) / "read.bin"
            path.write_bytes(os.urandom(256 << 20))
            rounds = [measure(path, args.seconds, args.bs) for _ in range(args.rounds)]
    finally:
        STATS.write_text(saved)
    base = statistics.median(r["none"][0] for r in rounds)
    base_cpu = statistics.median(r["none"][1] for r in rounds)
    print(f"{args.rounds} rounds of {args.seconds:g} s, {args.bs} random reads, QD1; medians")
    print(f"{'case':<8} {'IOPS':>10} {'vs none':>8} {'CPU ns/read':>12} {'added':>6}"
          + (f" {'ns/run':>7}" if args.timing else ""))
    for case in CASES:
        iops = statistics.median(r[case][0] for r in rounds)
        cpu = statistics.median(r[case][1] for r in rounds)
        line = f"{case:<8} {iops:>10,.0f} {iops / base:>8.3f} {cpu:>12.0f} {cpu - base_cpu:>6.0f}"
        if args.timing:
            line += f" {statistics.median(r[case][2] for r in rounds):>7.1f}"
        print(line)


if __name__ == "__main__":
    main()
