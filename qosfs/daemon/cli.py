"""Command line: ``qosfs mount | upgrade | umount | check | policy | plan | ctl | top |
explain``.

``main(argv) -> int`` never raises for a user mistake: it prints one line naming what is
wrong and returns a distinct exit code (see :mod:`qosfs.core.errors`); ``--debug`` adds the
traceback.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from qosfs import __version__
from qosfs.control import ctl, explain, top
from qosfs.core.errors import EXIT_DAEMON, QosfsError
from qosfs.core.units import UnitError, parse_bandwidth, parse_interval
from qosfs.daemon import tuning, unmount
from qosfs.daemon.logsetup import setup_logging
from qosfs.plan.planner import (
    DEFAULT_EFFICIENCY,
    DTYPE_BYTES,
    OPTIMIZER_MOMENTS,
    STATES,
    PlanError,
    PlanInputs,
    make_plan,
    parse_params,
)

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line, its path arguments marked for completion: ``make install``
    generates the shell completions (shtab) and the man page (argparse-manpage) from it,
    so they cannot drift from the options."""
    from qosfs.daemon.completion import mark_paths

    return mark_paths(_build_parser())


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qosfs", description="FUSE pass-through filesystem with I/O quality of service")
    parser.add_argument("--version", action="version", version=f"qosfs {__version__}")
    parser.add_argument("--debug", action="store_true", help="verbose logs and tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
                        "(passthrough = \"reads\"): every read is served by the daemon")
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

    unmount.add_parser(sub)
    ctl.add_parser(sub)
    top.add_parser(sub)
    explain.add_parser(sub)

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

    p = sub.add_parser(
        "policy", help="print the embedded default policy",
        description="Print the policy a mount without --policy uses, with its comments: "
        "a starting point for your own (qosfs policy default > FILE).")
    p.add_argument("which", choices=["default"])
    p.set_defaults(func=_cmd_policy)
    _add_plan_parser(sub)
    _describe_subcommands(parser)
    return parser


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


def _add_plan_parser(sub: Any) -> None:
    pl = sub.add_parser(
        "plan", help="from model size and checkpoint interval to caps and a policy",
        description="Checkpoint size, write times and the checkpoint cap for a training job, "
        "with every assumption printed; --policy-out writes a policy with those caps. "
        "Sizes and rates are decimal (1 GB = 10^9 bytes).")
    pl.add_argument("--params", required=True, metavar="COUNT",
                    help='parameter count: "70B", "1.5B", "175M", "1T"')
    pl.add_argument("--dtype", choices=list(DTYPE_BYTES), default="bf16",
                    help="training dtype (default: bf16)")
    pl.add_argument("--optimizer", choices=list(OPTIMIZER_MOMENTS), default="adamw",
                    help="moments per parameter: adam(w) 2, sgd 1, none 0 (default: adamw)")
    pl.add_argument("--state", choices=STATES, default="simple",
                    help="simple: weights and moments in the dtype (6 bytes/param for bf16 "
                    "AdamW); mixed: + fp32 master weights, fp32 moments (14)")
    pl.add_argument("--bytes-per-param", type=float, metavar="X",
                    help="override the checkpoint bytes per parameter")
    pl.add_argument("--ranks", type=int, default=1, help="ranks writing shards (default: 1)")
    pl.add_argument("--nodes", type=int, default=1,
                    help="qosfs mounts sharing the storage; policy figures are per mount "
                    "(default: 1)")
    pl.add_argument("--replicas", type=int, default=1,
                    help="copies of the checkpoint written (default: 1, sharded)")
    pl.add_argument("--interval", default="30m", metavar="TIME",
                    help="checkpoint start to next start (default: 30m)")
    pl.add_argument("--backend-write", metavar="RATE", help='storage write bandwidth, "20GB/s"')
    pl.add_argument("--backend-read", metavar="RATE",
                    help="storage read bandwidth (default: reads share the write figure)")
    pl.add_argument("--reserve-read", metavar="RATE",
                    help="read bandwidth that dataset reads keep during a checkpoint")
    pl.add_argument("--efficiency", type=float, default=DEFAULT_EFFICIENCY,
                    help=f"fraction of bandwidth a checkpoint achieves ({DEFAULT_EFFICIENCY})")
    pl.add_argument("--max-stall", metavar="TIME",
                    help="longest tolerable synchronous stall, \"60s\"")
    pl.add_argument("--async", dest="asynchronous", action="store_true",
                    help="checkpoints drain in the background while training goes on")
    pl.add_argument("--target-share", type=float, metavar="FRACTION",
                    help="--async: finish within this share of the interval (default: 0.5)")
    pl.add_argument("--policy-out", metavar="FILE", help="write a policy with the caps")
    pl.add_argument("--json", action="store_true",
                    help="the plan as one JSON object: inputs, figures in bytes, bytes/s "
                    "and seconds, the cap's policy setting, the assumptions")
    pl.set_defaults(func=_cmd_plan)


def _cmd_mount(args: argparse.Namespace) -> int:
    # Imported in the commands that need them: a `qosfs ctl set` is in force within
    # 100 ms counted from the shell (the design's "Live change" guarantee, see
    # docs/control-and-metrics.md), so it must not pay for pyfuse3, trio or the policy
    # parser at start.
    from qosfs.control.exporter import parse_address
    from qosfs.daemon.mount import (
        MountConfig,
        check_own_paths,
        daemonize,
        serves_qosfs,
    )
    from qosfs.daemon.pointer import running_socket_path
    from qosfs.daemon.recover import kept_descriptors, mount_or_recover
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
    # First, without touching the mountpoint: a dead daemon's connection that a keeper
    # holds (a stat there would wait on it) is taken over (issue 31's crash path).
    kept = kept_descriptors(cfg)
    if kept is None and serves_qosfs(cfg.mountpoint):
        # A live qosfs serves it: hand the mount over to this code, as `qosfs upgrade`
        # does, with the policy named here (if any) in force (issue 31).
        from qosfs.daemon.upgrade import adopt_mount

        log.info("%s is served by a live qosfs daemon: taking it over", cfg.mountpoint)
        take_over = functools.partial(adopt_mount, cfg.mountpoint, cfg.socket_path,
                                      args.foreground, requested=cfg)
        return take_over() if args.foreground else daemonize(take_over)
    run = functools.partial(mount_or_recover, cfg, kept)
    return run() if args.foreground else daemonize(run)


def _cmd_upgrade(args: argparse.Namespace) -> int:
    from qosfs.daemon.mount import daemonize
    from qosfs.daemon.upgrade import adopt_mount

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


def _plan_value(parse: Callable[[str], float], flag: str, text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return parse(text)
    except UnitError as exc:
        raise PlanError(f"{flag}: {exc}") from None


def _cmd_plan(args: argparse.Namespace) -> int:
    from qosfs.plan.text import plan_json, plan_policy_text, render_plan  # policy parser

    inputs = PlanInputs(
        params=parse_params(args.params), dtype=args.dtype, optimizer=args.optimizer,
        state=args.state, bytes_per_param=args.bytes_per_param, ranks=args.ranks,
        nodes=args.nodes, replicas=args.replicas,
        interval=_plan_value(parse_interval, "--interval", args.interval) or 0.0,
        backend_write=_plan_value(parse_bandwidth, "--backend-write", args.backend_write),
        backend_read=_plan_value(parse_bandwidth, "--backend-read", args.backend_read),
        reserve_read=_plan_value(parse_bandwidth, "--reserve-read", args.reserve_read),
        efficiency=args.efficiency,
        max_stall=_plan_value(parse_interval, "--max-stall", args.max_stall),
        asynchronous=args.asynchronous, target_share=args.target_share)
    plan = make_plan(inputs)
    policy = plan_policy_text(plan) if args.policy_out else None
    if not args.json:
        sys.stdout.write(render_plan(plan))
    if policy is not None:
        try:
            with open(args.policy_out, "w", encoding="utf-8") as stream:
                stream.write(policy)
        except OSError as exc:
            raise PlanError(f"--policy-out: cannot write {args.policy_out}: "
                            f"{exc.strerror or exc}") from None
        if not args.json:
            print(f"\npolicy written to {args.policy_out}")
    if args.json:
        _print_json({**plan_json(plan), "policy_out": args.policy_out})
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
    except BrokenPipeError:
        # The reader went away (`qosfs plan ... | head`): not an error of ours. Point
        # stdout at /dev/null so the interpreter's flush at exit does not fail again, and
        # exit as a command killed by SIGPIPE would.
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
