"""``python -m bench SUITE [options]`` — run from the repository root, as root.

Suites:
  demo       a one-minute look at what QoS does for a dataset reader
  overhead   pass-through cost: each workload on native tmpfs and through qosfs (no policy)
  live-change  how fast a raised cap (ctl set / reload) reaches a writer already waiting
  latency-target  a reader's latency target held against an uncapped checkpoint storm
  soak       mixed readers, writers, metadata and ctl changes for N minutes, then checks

More suites (cap accuracy, isolation) plug in as further subcommands.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from pathlib import Path


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # run the finally blocks: unmount, write partial results


def main(argv: list[str] | None = None) -> int:
    from bench import overhead

    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="suite", required=True, metavar="SUITE")
    o = sub.add_parser("overhead", help="qosfs pass-through vs native tmpfs")
    o.add_argument("--quick", action="store_true",
                   help="256 MiB files, 3 s jobs, 1 repetition (about a minute)")
    o.add_argument("--out", type=Path, default=overhead.default_out(),
                   help="directory for overhead.md and overhead.json (default: bench/results)")
    o.add_argument("--reps", type=int, help="repetitions per side (default 3, quick 1)")
    o.add_argument("--size", help="file size for data workloads (default 1g, quick 256m)")
    o.add_argument("--runtime", type=int, help="seconds per timed job (default 10, quick 3)")
    o.add_argument("--nrfiles", type=int, default=10000, help="files for metadata workloads")
    o.add_argument("--tmpfs-size", default="6g", help="scratch tmpfs size (default 6g)")
    o.add_argument("--qosfs-args", default="", metavar="ARGS",
                   help="extra `qosfs mount` arguments, e.g. '--io-mode threads'")
    o.add_argument("--only", default="", metavar="NAMES",
                   help="comma-separated groups: seqread, seqwrite, randread, meta (a row "
                        "name such as seqread-direct selects its group)")
    o.add_argument("--quiet-wait", type=float, default=2.0, metavar="SECONDS",
                   help="before each run, wait up to this long for the machine to be idle "
                        "(other tenants); 0 disables (default 2)")
    sub.add_parser("demo", help="a one-minute demo: a reader alone, under a storm, with QoS")
    from bench import live_change

    lc = sub.add_parser("live-change", help="delay until a raised cap reaches a parked writer")
    lc.add_argument("--out", type=Path, default=live_change.default_out(),
                    help="directory for live-change.md and .json (default: bench/results)")
    from bench import latency_target

    lt = sub.add_parser("latency-target",
                        help="a reader's latency target against an uncapped checkpoint storm")
    lt.add_argument("--quick", action="store_true", help="shorter phases (about 40 s)")
    lt.add_argument("--out", type=Path, default=latency_target.default_out(),
                    help="directory for latency-target.md and .json (default: bench/results)")
    sk = sub.add_parser("soak", help="mixed traffic and live changes for N minutes, checked")
    sk.add_argument("--minutes", type=float, default=3.0)
    sk.add_argument("--out", type=Path, help="directory for soak.md and soak.json "
                    "(default: bench/results)")
    args = parser.parse_args(argv)
    if args.suite == "latency-target":
        signal.signal(signal.SIGTERM, _terminate)
        return latency_target.run(args.out, quick=args.quick)
    if args.suite == "soak":
        from bench import soak

        signal.signal(signal.SIGTERM, _terminate)
        return soak.run(args.out or soak.default_out(), args.minutes)
    if args.suite == "demo":
        from bench import demo

        return demo.run()
    if args.suite == "live-change":
        signal.signal(signal.SIGTERM, _terminate)
        return live_change.run(args.out)

    signal.signal(signal.SIGTERM, _terminate)
    cfg = overhead.Config(
        quick=args.quick,
        out=args.out,
        reps=args.reps or (1 if args.quick else 3),
        size=args.size or ("256m" if args.quick else "1g"),
        runtime=args.runtime or (3 if args.quick else 10),
        nrfiles=args.nrfiles,
        tmpfs_size=args.tmpfs_size,
        qosfs_args=tuple(shlex.split(args.qosfs_args)),
        only=tuple(x for x in args.only.split(",") if x),
        quiet_wait=args.quiet_wait,
    )
    return overhead.run(cfg)


if __name__ == "__main__":
    sys.exit(main())
