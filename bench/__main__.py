"""``python -m bench SUITE [options]`` — run from the repository root, as root.

The suites and subcommands are those of bench/catalog.py; ``--help`` lists them. A single
suite writes bench/results/SUITE.md and SUITE.json (and SUITE-*.png); ``all`` runs every
suite of the report, then writes bench/results/REPORT.md, REPORT.json and the plots.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import textwrap
from pathlib import Path

from bench.core.system import REPO


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


def _listing() -> str:
    """The --help text's list of suites and subcommands, from the registry."""
    from bench.catalog import COMMANDS, SUITES

    def entry(name: str, about: str) -> list[str]:
        return textwrap.wrap(f"{name:15s} {about}", 88, initial_indent="  ",
                             subsequent_indent=" " * 18)

    lines = [*entry("all", "every suite of the report below, then bench/results/"
                    "REPORT.md, REPORT.json and the plots"
                    + "".join(f"; then {c.name}" for c in COMMANDS if c.after_all)), "",
             "Suites of the report:"]
    for s in SUITES:
        lines += entry(s.name, s.about + ("" if s.in_all else " (not in `all`)"))
    lines += ["", "On their own:"]
    for c in COMMANDS:
        lines += entry(c.name, c.about)
    return "\n".join(lines)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from bench.catalog import COMMANDS, SUITES

    parser = argparse.ArgumentParser(prog="python -m bench",
                                     description=f"{__doc__}\n{_listing()}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="suite", required=True, metavar="SUITE")
    a = sub.add_parser("all", help="every suite, then REPORT.md")
    _common(a)
    a.add_argument("--only", default="", metavar="SUITES",
                   help=f"comma-separated subset of: {', '.join(s.name for s in SUITES)}")
    for suite in SUITES:
        _common(sub.add_parser(suite.name, help=suite.about))
    for command in COMMANDS:
        command.options(sub.add_parser(command.name, help=command.about))
    return parser, dict(sub.choices)


def _accepts(p: argparse.ArgumentParser, option: str) -> bool:
    return any(option in action.option_strings for action in p._actions)


def main(argv: list[str] | None = None) -> int:
    from bench.catalog import BY_NAME, COMMANDS, COMMANDS_BY_NAME, SUITES
    from bench.core.session import Options, execute

    parser, subparsers = build_parser()
    args = parser.parse_args(argv)
    command = COMMANDS_BY_NAME.get(args.suite)
    if command is not None:
        if command.unwinds_on_sigterm:
            signal.signal(signal.SIGTERM, _terminate)
        return command.run(args)
    signal.signal(signal.SIGTERM, _terminate)
    if args.suite == "all":
        names = [n for n in args.only.split(",") if n] or [s.name for s in SUITES if s.in_all]
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            parser.error(f"--only: unknown suite(s) {', '.join(unknown)}")
    else:
        names = [args.suite]
    opts = Options(quick=args.quick, out=args.out, tmpfs_size=args.tmpfs_size,
                   disk_dir=args.disk_dir or None, reps=args.reps, quiet_wait=args.quiet_wait,
                   qosfs_args=tuple(shlex.split(args.qosfs_args)),
                   command="python -m bench " + shlex.join(argv if argv is not None
                                                           else sys.argv[1:]))
    extras = tuple(c.name for c in COMMANDS if c.after_all) \
        if args.suite == "all" and not args.only else ()

    def run_extra(name: str) -> int:
        p = subparsers[name]
        extra_argv = [name]
        if args.quick and _accepts(p, "--quick"):
            extra_argv.append("--quick")
        if _accepts(p, "--out"):
            extra_argv += ["--out", str(args.out)]
        return main(extra_argv)

    return execute(names, opts, "REPORT" if args.suite == "all" else args.suite, BY_NAME,
                   run_extra, extras)


if __name__ == "__main__":
    sys.exit(main())
