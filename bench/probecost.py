"""What the read-counting BPF programs cost per read, in nanoseconds, as the kernel
measures them: a profiling tool for changes to :mod:`qosfs.passthrough.read_probes`, run
by hand (root; ``bench uncapped`` gives the figure of record, fio through a mount with and
without the counting)::

    python -m bench.probecost [--dir /var/tmp] [--seconds 5] [--rounds 3] [--bs 4k]

With ``kernel.bpf_stats_enabled`` on (this tool turns it on and restores it), the kernel
times every run of a program and shows the total in the program's fdinfo (``run_time_ns``,
``run_cnt``): what each read pays inside the program, free of the machine's noise, which a
2-core shared machine would drown an A/B of whole fio runs in. The programs are loaded to
count this machine's direct reads of a watched file (no mount), which take the same
instructions as a passed-through read but for the credential check.

Per round, fio reads a cached file (psync, random, QD1):

- ``none``: no programs loaded;
- ``other``: the programs as a mount loads them (passthrough reads only), the file
  watched: what every read on the machine that is not passed through pays (these direct
  reads leave at the credential check, before any lookup);
- ``watched``: the programs counting direct reads too, the file watched: the
  instructions a passed-through read pays, all of them.

It prints, per case, fio's IOPS and the programs' ns per run. ``kernel.bpf_stats_enabled``
itself costs two clock reads per run, inside the figure: on this VM an empty program
measured 58 ns, so subtract that floor to compare with fio's time per read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from qosfs.passthrough.read_probes import ReadProbes

STATS = Path("/proc/sys/kernel/bpf_stats_enabled")
SLOT = 1


def fio_iops(path: Path, seconds: float, bs: str) -> float:
    out = subprocess.run(["fio", "--name=r", f"--filename={path}", "--ioengine=psync",
                          "--rw=randread", f"--bs={bs}", "--invalidate=0", "--time_based",
                          f"--runtime={seconds}", "--output-format=json"],
                         check=True, capture_output=True, timeout=seconds + 60).stdout
    return float(json.loads(out)["jobs"][0]["read"]["iops"])


def program_stats(probes: ReadProbes) -> list[tuple[int, int]]:
    """(run_time_ns, run_cnt) of each loaded program, from its fdinfo."""
    found = []
    for fd in probes._fds:
        fields = dict(line.split(":\t", 1) for line in
                      Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines() if ":\t" in line)
        if "run_cnt" in fields:
            found.append((int(fields["run_time_ns"]), int(fields["run_cnt"])))
    return found


def measure(path: Path, seconds: float, bs: str) -> dict[str, tuple[float, float]]:
    """{case: (IOPS, ns per program run)} for one round."""
    out = {"none": (fio_iops(path, seconds, bs), 0.0)}
    for case, passthrough_only in (("other", True), ("watched", False)):
        probes = ReadProbes.load(os.getpid(), max_watched=1024, max_counts=1024,
                                 passthrough_only=passthrough_only)
        try:
            st = os.stat(path)
            assert probes.watch(st.st_dev, st.st_ino, SLOT)
            before = program_stats(probes)
            iops = fio_iops(path, seconds, bs)
            after = program_stats(probes)
            ns = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
            runs = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
            out[case] = (iops, ns / runs if runs else 0.0)
        finally:
            probes.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp", help="a directory on ext4 or XFS")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bs", default="4k")
    args = ap.parse_args()
    saved = STATS.read_text().strip()
    STATS.write_text("1")
    try:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            path = Path(tmp) / "read.bin"
            path.write_bytes(os.urandom(256 << 20))
            rounds = [measure(path, args.seconds, args.bs) for _ in range(args.rounds)]
    finally:
        STATS.write_text(saved)
    base = statistics.median(r["none"][0] for r in rounds)
    print(f"{'case':<8} {'IOPS':>10} {'vs none':>8} {'ns/run':>7}")
    for case in ("none", "other", "watched"):
        iops = statistics.median(r[case][0] for r in rounds)
        ns = statistics.median(r[case][1] for r in rounds)
        print(f"{case:<8} {iops:>10,.0f} {iops / base:>8.3f} {ns:>7.1f}")


if __name__ == "__main__":
    main()
