"""Command line: ``qosfs mount | check | policy | ctl | top``.

``main(argv) -> int`` never raises for a user mistake: it prints one line naming what is
wrong and returns a distinct exit code (see :mod:`qosfs.errors`); ``--debug`` adds the
traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from qosfs import __version__, ctl, top, tuning
from qosfs.errors import EXIT_DAEMON, QosfsError
from qosfs.logsetup import setup_logging

log = logging.getLogger("qosfs")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qosfs", description="FUSE pass-through filesystem with I/O quality of service")
    parser.add_argument("--version", action="version", version=f"qosfs {__version__}")
    parser.add_argument("--debug", action="store_true", help="verbose logs and tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    m = sub.add_parser("mount", help="mount SOURCE on MOUNTPOINT (in place if omitted)")
    m.add_argument("source")
    m.add_argument("mountpoint", nargs="?", help="defaults to SOURCE (mount in place)")
    m.add_argument("--foreground", "-f", action="store_true", help="do not daemonize")
    m.add_argument("-o", dest="options", action="append", default=[], metavar="OPT[,OPT...]",
                   help="extra FUSE mount options")
    m.add_argument("--io-mode", choices=["auto", "inline", "nowait", "threads"],
                   default="auto", help="how backing syscalls are issued (default: by fs type)")
    m.add_argument("--cache", choices=["auto", "always", "never"], default="auto",
                   help="page cache: revalidate per open (auto), keep, or bypass")
    m.add_argument("--attr-timeout", type=float, default=1.0, metavar="SECONDS")
    m.add_argument("--max-background", type=int, default=tuning.DEFAULT_MAX_BACKGROUND,
                   help="kernel FUSE background queue depth (0 keeps the kernel default)")
    m.add_argument("--read-ahead-kb", type=int, default=tuning.DEFAULT_READ_AHEAD_KB)
    m.add_argument("--log-file", help="log here instead of syslog when daemonized")
    m.add_argument("--policy", metavar="FILE",
                   help="policy file (default: the embedded policy, see 'qosfs policy default')")
    m.add_argument("--no-qos", action="store_true",
                   help="no policy at all: pure pass-through that only counts (a baseline)")
    m.add_argument("--socket", metavar="PATH",
                   help="control socket (default: derived from the mountpoint in /run/qosfs)")
    m.add_argument("--metrics", metavar="[HOST:]PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics "
                        "(HOST defaults to 127.0.0.1)")
    m.set_defaults(func=_cmd_mount)

    ctl.add_parser(sub)
    top.add_parser(sub)

    c = sub.add_parser("check", help="validate a policy file and print it resolved")
    c.add_argument("file")
    c.set_defaults(func=_cmd_check)

    p = sub.add_parser("policy", help="print the embedded default policy")
    p.add_argument("which", choices=["default"])
    p.set_defaults(func=_cmd_policy)
    return parser


def _cmd_mount(args: argparse.Namespace) -> int:
    # Imported in the commands that need them: `qosfs ctl set` is timed from the shell
    # (DESIGN 4.4), so it must not pay for pyfuse3, trio or the policy parser at start.
    from qosfs.exporter import parse_address
    from qosfs.fs import FsOptions
    from qosfs.mount import MountConfig, daemonize_and_mount, run_mount
    from qosfs.policy import load_policy

    options = tuple(o.strip() for opt in args.options for o in opt.split(",") if o.strip())
    cfg = MountConfig(
        source=args.source,
        mountpoint=args.mountpoint or args.source,
        foreground=args.foreground,
        fuse_options=options,
        io_mode=args.io_mode,
        fs_options=FsOptions(entry_timeout=args.attr_timeout, attr_timeout=args.attr_timeout,
                             cache=args.cache),
        max_background=args.max_background,
        read_ahead_kb=args.read_ahead_kb,
        policy_path=args.policy,
        qos=not args.no_qos,
        socket_path=os.path.abspath(args.socket) if args.socket else None,
        metrics=args.metrics,
    )
    if args.policy:
        load_policy(args.policy)  # a bad policy fails here, before anything is mounted
    if args.metrics:
        parse_address(args.metrics)  # likewise a malformed address
    if args.foreground:
        setup_logging(args.debug, daemon=False, log_file=args.log_file)
        return run_mount(cfg)
    setup_logging(args.debug, daemon=True, log_file=args.log_file)
    return daemonize_and_mount(cfg)


def _cmd_check(args: argparse.Namespace) -> int:
    from qosfs.policy import load_policy

    sys.stdout.write(load_policy(args.file).render())
    return 0


def _cmd_policy(args: argparse.Namespace) -> int:
    from qosfs.policy import DEFAULT_POLICY_TEXT

    sys.stdout.write(DEFAULT_POLICY_TEXT)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except QosfsError as exc:
        if args.debug:
            log.exception("failed")
        print(f"qosfs: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug: say so in one line unless asked for the traceback
        if args.debug:
            raise
        print(f"qosfs: internal error: {exc} (run with --debug for details)", file=sys.stderr)
        return EXIT_DAEMON
