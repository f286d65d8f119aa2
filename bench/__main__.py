"""``python -m bench SUITE [options]`` — run from the repository root, as root.

  all          every suite below, then bench/results/REPORT.md, REPORT.json and the plots
  overhead     native vs qosfs --no-qos vs qosfs with a policy far above demand
  caps         bandwidth and IOPS caps: achieved vs configured, per 10 s and per 1 s
  isolation    a dataset reader alone / next to a checkpoint storm, without and with QoS
  live-change  how fast a `qosfs ctl set` (or reload) is in force
  fairshare    three uids sharing a per_user = "fair" class
  metadata     create/stat/open/unlink rates, and under a meta_iops cap
  priorities   a declared backend shared by priority and min_write_bandwidth
  loader       a data loader's samples/s (cold, cached) and a cached re-read, native vs qosfs
  storage      the demo's reader and storm sharing a disk: bare, --no-qos, default policy
  training     MLPerf Storage's AU: DLIO's emulated training under a PyTorch checkpoint
               storm (torch.save, dcp), bare / --no-qos / default policy / latency target
  envelope     what one mount carries (small/large reads, metadata), and a do-nothing floor
  demo         a one-minute look at what QoS does for a dataset reader
  machinery    per-request cost of admission and of the handlers, in-process
  cluster      two mounts sharing one cluster cap through Redis, and its cost to Redis
  latency-target  a reader's latency target held against an uncapped checkpoint storm
  soak         mixed readers, writers, metadata and ctl changes for N minutes, then checks
  merge F      add a suite run on its own (F = its .json) to REPORT.md, marked as such

A single suite writes bench/results/SUITE.md and SUITE.json (and SUITE-*.png).
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from pathlib import Path

from bench.system import REPO

# Suites other branches add (each registers its own subcommand here and writes
# <out>/<name>.md): `all` runs those this tree has, after its own, and REPORT.md includes
# every <name>.md they wrote during the run.
EXTRA_SUITES = ("latency-target",)


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # run the finally blocks: unmount, write partial results


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="short runs, one repetition: `all` takes about 8 minutes instead of "
                        "about 20 (figures are noisier; the report says which mode)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results",
                   help="directory for the report, figures and plots (default: bench/results)")
    p.add_argument("--tmpfs-size", default="6g", help="scratch tmpfs size (default 6g)")
    p.add_argument("--disk-dir", default="/var/tmp", metavar="DIR",
                   help="a directory on a disk-backed filesystem for the disk workloads "
                        "(default /var/tmp; '' to skip them)")
    p.add_argument("--reps", type=int, help="repetitions per measurement (default: each "
                   "suite's own, 1 with --quick)")
    p.add_argument("--quiet-wait", type=float, default=2.0, metavar="SECONDS",
                   help="before each fio run, wait up to this long for the machine to be idle "
                        "(other tenants); 0 disables (default 2)")
    p.add_argument("--qosfs-args", default="", metavar="ARGS",
                   help="extra `qosfs mount` arguments for every mount, e.g. "
                        "'--io-mode threads'")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from bench.session import SUITES

    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="suite", required=True, metavar="SUITE")
    a = sub.add_parser("all", help="every suite, then REPORT.md")
    _common(a)
    a.add_argument("--only", default="", metavar="SUITES",
                   help=f"comma-separated subset of: {', '.join(SUITES)}")
    for name in SUITES:
        _common(sub.add_parser(name, help=f"the {name} suite alone"))
    sub.add_parser("demo", help="a one-minute demo: a reader alone, under a storm, with QoS")
    sub.add_parser("machinery", help="in-process cost per request of admission and of the "
                   "metadata and data handlers (no mount; about a minute)")
    sub.add_parser("cluster", help="two mounts sharing one cluster cap through Redis, and "
                   "what the lease script costs Redis (about a minute)")
    lt = sub.add_parser("latency-target",
                        help="a reader's latency target against an uncapped checkpoint storm")
    lt.add_argument("--quick", action="store_true", help="shorter phases (about 40 s)")
    lt.add_argument("--out", type=Path, default=REPO / "bench" / "results",
                    help="directory for latency-target.md and .json (default: bench/results)")
    mg = sub.add_parser("merge", help="add a single suite's run (its .json) to REPORT.md, "
                        "marked with its own date and commit")
    mg.add_argument("part", type=Path, help="the suite's figures, e.g. bench/results/"
                    "training.json")
    mg.add_argument("--out", type=Path, default=REPO / "bench" / "results",
                    help="directory of REPORT.json and REPORT.md (default: bench/results)")
    sk = sub.add_parser("soak", help="mixed traffic and live changes for N minutes, checked")
    sk.add_argument("--minutes", type=float, default=3.0)
    sk.add_argument("--out", type=Path, help="directory for soak.md and soak.json "
                    "(default: bench/results)")
    return parser, dict(sub.choices)


def _accepts(p: argparse.ArgumentParser, option: str) -> bool:
    return any(option in action.option_strings for action in p._actions)


def main(argv: list[str] | None = None) -> int:
    from bench.session import SUITES, Options, execute

    parser, subparsers = build_parser()
    args = parser.parse_args(argv)
    if args.suite == "demo":
        from bench import demo

        return demo.run()
    if args.suite == "machinery":
        from bench import machinery

        return machinery.run()
    if args.suite == "cluster":
        from bench import cluster

        return cluster.run()
    signal.signal(signal.SIGTERM, _terminate)
    if args.suite == "latency-target":
        from bench import latency_target

        return latency_target.run(args.out, quick=args.quick)
    if args.suite == "merge":
        from bench.session import merge

        print(f"wrote {merge(args.part, args.out)}")
        return 0
    if args.suite == "soak":
        from bench import soak

        return soak.run(args.out or soak.default_out(), args.minutes)
    if args.suite == "all":
        names = [n for n in args.only.split(",") if n] or list(SUITES)
        unknown = [n for n in names if n not in SUITES]
        if unknown:
            parser.error(f"--only: unknown suite(s) {', '.join(unknown)}")
    else:
        names = [args.suite]
    opts = Options(quick=args.quick, out=args.out, tmpfs_size=args.tmpfs_size,
                   disk_dir=args.disk_dir or None, reps=args.reps, quiet_wait=args.quiet_wait,
                   qosfs_args=tuple(shlex.split(args.qosfs_args)),
                   command="python -m bench " + shlex.join(argv if argv is not None
                                                           else sys.argv[1:]))
    extras = tuple(n for n in EXTRA_SUITES if n in subparsers and n not in SUITES) \
        if args.suite == "all" and not args.only else ()

    def run_extra(name: str) -> int:
        p = subparsers[name]
        extra_argv = [name]
        if args.quick and _accepts(p, "--quick"):
            extra_argv.append("--quick")
        if _accepts(p, "--out"):
            extra_argv += ["--out", str(args.out)]
        return main(extra_argv)

    return execute(names, opts, "REPORT" if args.suite == "all" else args.suite,
                   run_extra, extras)


if __name__ == "__main__":
    sys.exit(main())
