"""Command line: ``qosfs mount | upgrade | umount | check | policy | plan | ctl | top |
explain``.

``main(argv) -> int`` never raises for a user mistake: it prints one line naming what is
wrong and returns a distinct exit code (see :mod:`qosfs.core.errors`); ``--debug`` adds the
traceback.

``main`` builds the parser of the one subcommand it runs, and each subcommand imports its
modules when its parser is added or it runs: ``qosfs ctl`` starts in a few tens of
milliseconds without the policy model, the planner, trio or pyfuse3 (issue 38;
tests/unit/daemon/test_cli_imports.py). :func:`build_parser` is the whole command line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from qosfs import __version__
from qosfs.core.errors import EXIT_DAEMON, QosfsError


def build_parser() -> argparse.ArgumentParser:
    """The whole command line, its path arguments marked for completion: ``make install``
    generates the shell completions (shtab) and the man page (argparse-manpage) from it,
    so they cannot drift from the options."""
    from qosfs.daemon.completion import mark_paths

    return mark_paths(_build_parser())


def _build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand's parser, or only that of the subcommand *only*: what :func:`main`
    builds, so that a command imports nothing for the others' options."""
    parser = argparse.ArgumentParser(
        prog="qosfs", description="FUSE pass-through filesystem with I/O quality of service")
    parser.add_argument("--version", action="version", version=f"qosfs {__version__}")
    parser.add_argument("--debug", action="store_true", help="verbose logs and tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, add_parser in _COMMANDS.items():
        if only is None or name == only:
            add_parser(sub)
    _describe_subcommands(parser)
    return parser


def _command_named(words: Sequence[str]) -> str | None:
    """The subcommand *words* run: the first word that is not an option (the top-level
    options take no value), if it names one. None for ``--help``, ``--version``, ``--``
    or a mistake: their messages list every subcommand."""
    for word in words:
        if word == "--":
            return None
        if not word.startswith("-"):
            return word if word in _COMMANDS else None
    return None


def _add_mount_parser(sub: Any) -> None:
    from qosfs.daemon import tuning

    m = sub.add_parser(
        "mount", help="mount SOURCE on MOUNTPOINT (in place if omitted)",
        description="Serve SOURCE at MOUNTPOINT (or over SOURCE itself) with the policy's "
        "classes, tenants and caps in front of every request. Returns once the mount "
        "answers (or fails with a one-line reason and a distinct exit code); --foreground "
        "serves in this process, as under systemd. On a MOUNTPOINT a live qosfs serves, "
        "this qosfs takes the mount over as `qosfs upgrade` does: open files carry on, "
        "--policy (if given) replaces the policy in force, other options stay the "
        "running mount's.")
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
    m.add_argument("--no-passthrough", action="store_true",
                   help="never pass reads through to the kernel, whatever the policy says "
                        "(every class whose reads nothing caps passes them through by "
                        "default): every read is served by the daemon")
    m.add_argument("--no-read-counting", action="store_true",
                   help="do not count the reads the kernel serves for passed-through opens "
                        "(BPF programs on the read path, ~60 ns per read): their bytes are "
                        "then in no counter, and ctl status says so")
    m.add_argument("--busy-poll-us", type=int, default=50, metavar="US",
                   help="after a request, poll for the next one this long before "
                        "sleeping (it stops after 4 polls in vain: idle mounts do not "
                        "poll); it saves the wake-ups of each round trip of a caller that "
                        "waits on one request at a time. 0: never poll")
    m.add_argument("--socket", metavar="PATH",
                   help="control socket (default: derived from the mountpoint in /run/qosfs)")
    m.add_argument("--metrics", metavar="[HOST:]PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics "
                        "(HOST defaults to 127.0.0.1)")
    m.add_argument("--keeper", choices=["holder", "systemd", "none"], default="holder",
                   help="who keeps the FUSE connection alive if the daemon dies, so that "
                        "`qosfs mount` run again takes over without breaking open files: a "
                        "small holder process (default), systemd's descriptor store (the "
                        "unit's choice), or nobody")
    m.add_argument("--recover-within", type=float, default=30.0, metavar="SECONDS",
                   help="how long the holder keeps a dead daemon's connection for a new "
                        "daemon; callers wait that long at most, then get ENOTCONN "
                        "(default: 30)")
    m.add_argument("--allow-stacked", action="store_true",
                   help="accept a source that is (inside) a qosfs mount: every request is "
                        "then throttled by both mounts")
    m.set_defaults(func=_cmd_mount)


def _add_upgrade_parser(sub: Any) -> None:
    u = sub.add_parser(
        "upgrade", help="hand a live mount over to a new daemon process (this qosfs)",
        description="Start a new daemon that takes the mount at MOUNTPOINT over from the "
        "one serving it, without unmounting: open files, node ids, the policy in force "
        "and the caps carry on, and the old daemon exits once the new one serves. Run it "
        "after installing a new qosfs; a successor that cannot take over says why and "
        "the old daemon serves on. Returns once the new daemon serves (--foreground: "
        "serves in this process).")
    u.add_argument("mountpoint")
    u.add_argument("--socket", metavar="PATH",
                   help="the mount's control socket (the handover socket is beside it; "
                        "default: found from the mountpoint, also for a mount made with "
                        "--socket)")
    u.add_argument("--foreground", "-f", action="store_true", help="do not daemonize")
    u.add_argument("--log-file", help="log here instead of syslog when daemonized")
    u.set_defaults(func=_cmd_upgrade)


def _add_umount_parser(sub: Any) -> None:
    from qosfs.daemon import unmount

    unmount.add_parser(sub)


# The clients of a running mount: each module adds its own subcommand.
def _add_ctl_parser(sub: Any) -> None:
    from qosfs.control import ctl

    ctl.add_parser(sub)


def _add_top_parser(sub: Any) -> None:
    from qosfs.control import top

    top.add_parser(sub)


def _add_explain_parser(sub: Any) -> None:
    from qosfs.control import explain

    explain.add_parser(sub)


def _add_check_parser(sub: Any) -> None:
    c = sub.add_parser(
        "check", help="validate a policy file and print it resolved",
        description="Validate a policy and print it resolved (every value as the daemon "
        "reads it; the output is itself a valid policy), with notes. An invalid policy is "
        "one line, file:line: key: reason, exit 6. Warnings (file:line, exit 0) name rules "
        "that cannot do what they say: a class an earlier one shadows, a priority or "
        "minimum without effect, fractional IOPS, a path glob that matches nothing a "
        "training job writes.")
    c.add_argument("file")
    c.add_argument("--strict", action="store_true",
                   help="warnings are errors: exit 6 if there is any")
    c.add_argument("--json", action="store_true",
                   help="one JSON object: ok, the policy (in its own keys), warnings with "
                   "file, line and key, notes, and the error of an invalid policy")
    c.set_defaults(func=_cmd_check)


def _add_policy_parser(sub: Any) -> None:
    p = sub.add_parser(
        "policy", help="print the embedded default policy",
        description="Print the policy a mount without --policy uses, with its comments: "
        "a starting point for your own (qosfs policy default > FILE).")
    p.add_argument("which", choices=["default"])
    p.set_defaults(func=_cmd_policy)


def _add_plan_parser(sub: Any) -> None:
    from qosfs.plan import command

    command.add_parser(sub)


def _describe_subcommands(parser: argparse.ArgumentParser) -> None:
    """Give every subcommand's ``--help`` a description: its one-line help where it was
    given no longer one (a subcommand added without one still says what it does)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, subparser in action.choices.items():
                if subparser.description is None and helps.get(name):
                    text = str(helps[name])
                    subparser.description = text[:1].upper() + text[1:] + "."
                _describe_subcommands(subparser)


#: Every subcommand, in the order ``--help`` lists them, and what adds its parser. Each
#: imports what its options need when it is called: ``qosfs ctl`` must not pay for the
#: policy parser, the planner, trio or pyfuse3 (issue 38: ``qosfs ctl status`` in 60 ms,
#: a ``ctl set`` in force within 100 ms counted from the shell).
_COMMANDS: dict[str, Callable[[Any], None]] = {
    "mount": _add_mount_parser,
    "upgrade": _add_upgrade_parser,
    "umount": _add_umount_parser,
    "ctl": _add_ctl_parser,
    "top": _add_top_parser,
    "explain": _add_explain_parser,
    "check": _add_check_parser,
    "policy": _add_policy_parser,
    "plan": _add_plan_parser,
}


def _cmd_mount(args: argparse.Namespace) -> int:
    # Imported in the commands that need them (see _COMMANDS).
    from qosfs.control.exporter import parse_address
    from qosfs.daemon.config import MountConfig
    from qosfs.daemon.logsetup import setup_logging
    from qosfs.daemon.pointer import running_socket_path
    from qosfs.daemon.preflight import check_own_paths
    from qosfs.daemon.start import start_mount
    from qosfs.passthrough.operations import FsOptions
    from qosfs.policy.loading import load_policy

    options = tuple(o.strip() for opt in args.options for o in opt.split(",") if o.strip())
    mountpoint = args.mountpoint or args.source
    # Without --socket, on a live or kept qosfs mount made with --socket PATH: its PATH, as
    # its pointer says (qosfs.daemon.pointer), so that its keeper and handover socket are
    # found and the mount keeps its sockets.
    socket_path = (os.path.abspath(args.socket) if args.socket
                   else running_socket_path(mountpoint))
    cfg = MountConfig(
        source=args.source,
        mountpoint=mountpoint,
        foreground=args.foreground,
        fuse_options=options,
        io_mode=args.io_mode,
        fs_options=FsOptions(entry_timeout=args.attr_timeout, attr_timeout=args.attr_timeout,
                             cache=args.cache),
        max_background=args.max_background,
        read_ahead_kb=args.read_ahead_kb,
        policy_path=args.policy,
        qos=not args.no_qos,
        kernel_passthrough=not args.no_passthrough,
        read_counting=not args.no_read_counting,
        busy_poll_us=max(args.busy_poll_us, 0),
        socket_path=socket_path,
        metrics=args.metrics,
        allow_stacked=args.allow_stacked,
        keeper=args.keeper,
        recover_within=args.recover_within,
    )
    check_own_paths(cfg.mountpoint, {"control socket": cfg.socket_path,
                                     "log file": args.log_file})
    if args.policy:
        load_policy(args.policy)  # a bad policy fails here, before anything is mounted
    if args.metrics:
        parse_address(args.metrics)  # likewise a malformed address
    setup_logging(args.debug, daemon=not args.foreground, log_file=args.log_file)
    # Fresh, recovered after a crash or handed over by a live daemon: decided once.
    return start_mount(cfg, args.foreground)


def _cmd_upgrade(args: argparse.Namespace) -> int:
    import functools

    from qosfs.daemon.daemonize import daemonize
    from qosfs.daemon.logsetup import setup_logging
    from qosfs.daemon.takeover.upgrade import adopt_mount

    socket_path = os.path.abspath(args.socket) if args.socket else None
    setup_logging(args.debug, daemon=not args.foreground, log_file=args.log_file)
    if args.foreground:
        return adopt_mount(args.mountpoint, socket_path, True)
    return daemonize(functools.partial(adopt_mount, args.mountpoint, socket_path, False))


def _cmd_check(args: argparse.Namespace) -> int:
    from qosfs.policy.lint import policy_warnings
    from qosfs.policy.loading import parse_policy, policy_notes, read_policy_text
    from qosfs.policy.model import PolicyError, policy_to_raw

    try:
        text = read_policy_text(args.file)
        policy = parse_policy(text, args.file)
    except PolicyError as exc:
        if args.json:  # the error as data too (an editor or CI marks the line)
            error = {"source": exc.source, "line": exc.line, "key": exc.key,
                     "reason": exc.reason, "message": str(exc)}
            _print_json({"ok": False, "source": args.file, "error": error})
        raise
    warnings = policy_warnings(policy, text)
    failed = bool(args.strict and warnings)
    if args.json:
        _print_json({"ok": not failed, "source": args.file, "policy": policy_to_raw(policy),
                     "warnings": [w.to_json() for w in warnings],
                     "notes": policy_notes(policy), "strict": args.strict})
    elif not failed:
        sys.stdout.write(policy.render())
        for note in policy_notes(policy):  # TOML comments: the output stays a valid policy
            sys.stdout.write(f"# note: {note}\n")
    for warning in warnings:  # stderr: stdout stays a policy (or JSON)
        print(f"qosfs: {'error' if args.strict else 'warning'}: {warning}", file=sys.stderr)
    if failed:
        n = len(warnings)
        raise PolicyError(f"{n} warning{'s' * (n > 1)}, errors under --strict",
                          source=args.file)
    return 0


def _print_json(body: dict[str, Any]) -> None:
    import json

    sys.stdout.write(json.dumps(body, indent=2) + "\n")


def _cmd_policy(args: argparse.Namespace) -> int:
    from qosfs.policy.text import DEFAULT_POLICY_TEXT

    sys.stdout.write(DEFAULT_POLICY_TEXT)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    args = _build_parser(only=_command_named(words)).parse_args(words)
    try:
        return int(args.func(args))
    except QosfsError as exc:
        if args.debug:
            import logging

            logging.getLogger(__name__).exception("failed")
        print(f"qosfs: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`qosfs plan ... | head`): not an error of ours. Point
        # stdout at /dev/null so the interpreter's flush at exit does not fail again, and
        # exit as a command killed by SIGPIPE would.
        import signal

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    except Exception as exc:  # a bug: say so in one line unless asked for the traceback
        if args.debug:
            raise
        # str() of some exceptions is empty (MemoryError): name the type then.
        detail = str(exc) or type(exc).__name__
        print(f"qosfs: internal error: {detail} (run with --debug for details)",
              file=sys.stderr)
        return EXIT_DAEMON
