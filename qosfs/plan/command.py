"""``qosfs plan``: its options, and the plan printed (or as JSON) with its policy written.

The command line (:mod:`qosfs.daemon.cli`) imports this module only when ``qosfs plan``
runs or the whole parser is built (completions, man page).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from qosfs.core.units import UnitError, parse_bandwidth, parse_interval
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


def add_parser(sub: Any) -> None:
    """Add ``qosfs plan`` to the main parser's subcommands."""
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
    pl.set_defaults(func=run)


def _plan_value(parse: Callable[[str], float], flag: str, text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return parse(text)
    except UnitError as exc:
        raise PlanError(f"{flag}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    """``qosfs plan``: print the plan (or its JSON) and write its policy if asked."""
    from qosfs.plan.report import plan_json, plan_policy_text, render_plan  # policy parser

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
        sys.stdout.write(json.dumps({**plan_json(plan), "policy_out": args.policy_out},
                                    indent=2) + "\n")
    return 0
