"""How a plan reads: the report ``qosfs plan`` prints and the policy it writes.

The report puts the figures first and then every assumption behind them, each with the flag
that changes it, so an administrator can see why the cap is what it is before trusting it.
The policy keeps the embedded default's classes, paths and order (a planned policy
classifies exactly like the one administrators know) and changes only the figures; it is
parsed by the same parser ``mount`` and ``check`` use before it is returned.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from typing import Any

from qosfs.core.units import format_bandwidth
from qosfs.plan.planner import (
    Plan,
    PlanError,
    Timing,
    human_rate,
    human_size,
    human_time,
    round_rate,
)
from qosfs.policy.loading import default_policy, parse_policy

WIDTH = 92  # the report and the policy's comments wrap here
_NBSP = "\u00a0"


def _nowrap(text: str) -> str:
    """Keep a formula on one line: textwrap breaks only at ASCII whitespace."""
    return text.replace(" ", _NBSP)


def _pct(frac: float) -> str:
    return f"{frac * 100:.3g}%"


def _count(params: float) -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if params >= scale:
            return f"{params / scale:.4g}{suffix}"
    return f"{params:g}"


def _summary(plan: Plan) -> str:
    i = plan.inputs
    mode = "an asynchronous" if i.asynchronous else "a synchronous"
    ranks = f"{i.ranks} rank{'s' * (i.ranks > 1)} on {i.nodes} mount{'s' * (i.nodes > 1)}"
    every = human_time(i.interval)
    return f"{_count(i.params)} parameters, {ranks}, {mode} checkpoint every {every}"


def render_plan(plan: Plan) -> str:
    """The plan as the administrator reads it: figures first, then every assumption."""
    i, t = plan.inputs, plan.timing
    copies = f"{i.replicas} cop{'ies' if i.replicas > 1 else 'y'} (--replicas)"
    state = "" if i.bytes_per_param is not None else f" (--state {i.state})"
    lines = [
        f"qosfs plan: {_summary(plan)}", "",
        textwrap.fill(f"checkpoint size   {human_size(plan.checkpoint_bytes):>9}   "
                      f"{plan.bytes_per_param:g} bytes/param{state}: {plan.state}", WIDTH,
                      subsequent_indent=" " * 30),
        f"written           {human_size(plan.written_bytes):>9}   {copies}",
        f"per-rank shard    {human_size(plan.shard_bytes):>9}   {human_size(plan.written_bytes)} / "
        f"{i.ranks} rank{'s' * (i.ranks > 1)}",
    ]
    if t is None:
        return "\n".join([*lines, "", "give --backend-write for write times and a cap"]) + "\n"
    lines += [
        "", f"{'':18}{'rate':>11}{'write time':>13}{'share of interval':>20}",
        f"{'full bandwidth':18}{human_rate(t.full_rate):>11}{human_time(t.full_seconds):>13}"
        f"{_pct(t.full_seconds / i.interval):>20}",
        f"{'recommended cap':18}{human_rate(t.cap):>11}{human_time(t.cap_seconds):>13}"
        f"{_pct(t.cap_seconds / i.interval):>20}", "",
    ]
    prose = []
    if i.asynchronous:
        prose.append(f"training goes on while the write drains for {human_time(t.cap_seconds)}; "
                     "it stalls only for the snapshot to host memory (not modeled)")
        if not t.target_met:
            prose.append(f"note: even the highest cap takes {_pct(t.cap_seconds / i.interval)} "
                         f"of the interval, above the {_pct(plan.target_share)} target "
                         "(--target-share)")
    else:
        prose.append(f"training stalls {human_time(t.cap_seconds)} per checkpoint (synchronous)")
    mounts = f" ({human_rate(t.cap)} over {i.nodes} mounts)" if i.nodes > 1 else ""
    prose.append(f'checkpoints class: write_bandwidth = "{format_bandwidth(t.cap_per_mount)}" '
                 f"per mount{mounts}")
    if i.reserve_read:
        prose.append(f"dataset reads keep {human_rate(i.reserve_read)} of the backend's "
                     f"{human_rate(t.backend_read)} (--reserve-read)")
    lines += [textwrap.fill(p, WIDTH, subsequent_indent="  ") for p in prose]
    lines += ["", "assumptions (change them with the flags named):"]
    lines += [textwrap.fill(a, WIDTH, initial_indent="  - ", subsequent_indent="    ")
              .replace(_NBSP, " ") for a in _assumptions(plan, t)]
    return "\n".join(lines) + "\n"


def plan_json(plan: Plan) -> dict[str, Any]:
    """The plan as data (``qosfs plan --json``): the inputs, every figure in bytes, bytes/s
    and seconds, the policy setting it leads to and the assumptions, as the report says
    them. ``timing`` and ``checkpoints_write_bandwidth`` are null without
    ``--backend-write``."""
    i, t = plan.inputs, plan.timing
    inputs = dataclasses.asdict(i)
    if i.asynchronous:
        inputs["target_share"] = plan.target_share
    body: dict[str, Any] = {
        "summary": _summary(plan), "inputs": inputs, "bytes_per_param": plan.bytes_per_param,
        "state": plan.state, "checkpoint_bytes": plan.checkpoint_bytes,
        "written_bytes": plan.written_bytes, "shard_bytes": plan.shard_bytes,
        "timing": None, "checkpoints_write_bandwidth": None, "assumptions": []}
    if t is not None:
        body["timing"] = {**dataclasses.asdict(t),
                          "full_share_of_interval": t.full_seconds / i.interval,
                          "cap_share_of_interval": t.cap_seconds / i.interval}
        body["checkpoints_write_bandwidth"] = format_bandwidth(t.cap_per_mount)
        body["assumptions"] = [a.replace(_NBSP, " ") for a in _assumptions(plan, t)]
    return body


def _assumptions(plan: Plan, t: Timing) -> list[str]:
    i = plan.inputs
    bw, reserve = i.backend_write or 0.0, i.reserve_read or 0.0
    out = [f"a checkpoint achieves {_pct(i.efficiency)} of the storage's bandwidth "
           f"(--efficiency {i.efficiency:g}): at full bandwidth the write time is "
           + _nowrap("size x replicas / (write bandwidth x efficiency)")
           + "; under a cap it moves at the cap, which qosfs meters exactly"]
    if i.backend_read is None:
        out.append(f"reads and writes share one pipe of {human_rate(bw)} (no --backend-read)")
    else:
        out.append(f"reads and writes share the storage's time: reserving a fraction of the "
                   f"{human_rate(i.backend_read)} read bandwidth takes the same fraction of the "
                   f"{human_rate(bw)} write bandwidth")
    share = f" x (1 - {human_rate(reserve)} / {human_rate(t.backend_read)})" if reserve else ""
    highest = _nowrap(f"{human_rate(bw)}{share} x {i.efficiency:g}")
    if i.asynchronous:
        out.append(f"the cap is the lowest that writes {human_size(plan.written_bytes)} in "
                   f"{_pct(plan.target_share)} of the interval (--target-share), at most "
                   f"{highest}")
    else:
        keeping = " while keeping the read reserve" if reserve else ""
        out.append(f"the cap is the highest the storage gives checkpoints{keeping}, for the "
                   f"shortest stall: {highest}")
    if i.nodes == 1:
        out.append("one qosfs mount carries all the traffic (--nodes 1); with N mounts each "
                   "has its own buckets and its policy holds 1/N of the cluster figures")
    else:
        out.append(f"each qosfs mount has its own buckets: the policy holds 1/{i.nodes} of "
                   f"the cluster figures (--nodes {i.nodes}), {i.ranks // i.nodes} "
                   f"rank{'s' * (i.ranks // i.nodes > 1)} per mount")
    out.append("caps are rounded to 3 significant digits; times use the rounded cap")
    return out


# ------------------------------------------------------------------------- policy

def plan_policy_text(plan: Plan) -> str:
    """A policy with the plan's caps, shaped like the embedded default; parsed before return.

    Classes, paths and order come from the default policy, so a planned policy classifies
    exactly as the one administrators already know; only the figures change.
    """
    t, i = plan.timing, plan.inputs
    if t is None:
        raise PlanError("--policy-out needs --backend-write: the caps start from it")
    base = default_policy()
    checkpoints, datasets = base.class_by_name("checkpoints"), base.class_by_name("datasets")
    assert checkpoints is not None and datasets is not None
    per_mount = {key: format_bandwidth(round_rate(value / i.nodes, up=False))
                 for key, value in (("read", t.backend_read), ("write", i.backend_write or 0.0),
                                    ("reserve", i.reserve_read or 0.0)) if value}
    header = (f"qosfs policy written by `qosfs plan`: {_summary(plan)}, "
              f"{human_size(plan.written_bytes)} per checkpoint. Figures are per qosfs mount: each "
              f"mount has its own buckets, so the cluster figures are divided over {i.nodes} "
              f"mount{'s' * (i.nodes > 1)} (--nodes). Check it with `qosfs check FILE`.")
    lines = [
        textwrap.fill(header, WIDTH, initial_indent="# ", subsequent_indent="# "),
        "",
        "# This mount's share of what the storage delivers"
        + (" (one pipe: reads share the write figure)." if i.backend_read is None else "."),
        "[backend]",
        f'read_bandwidth = "{per_mount["read"]}"',
        f'write_bandwidth = "{per_mount["write"]}"',
        "",
        f"# Checkpoint dumps: {human_rate(t.cap)} over all mounts writes a checkpoint in "
        f"{human_time(t.cap_seconds)}",
        f"# ({_pct(t.cap_seconds / i.interval)} of the {human_time(i.interval)} interval).",
        "[classes.checkpoints]",
        f"paths = {_toml_list(checkpoints.paths)}",
        f'write_bandwidth = "{format_bandwidth(t.cap_per_mount)}"',
        "",
        "# Training data: never capped here, first in line when the backend is contended.",
        *(["# min_read_bandwidth: this mount's share of --reserve-read."]
          if "reserve" in per_mount else []),
        "[classes.datasets]",
        f"paths = {_toml_list(datasets.paths)}",
        'priority = "high"',
    ]
    if "reserve" in per_mount:
        lines.append(f'min_read_bandwidth = "{per_mount["reserve"]}"')
    lines += ["", "# Everything else: counted, not capped.", "[classes.default]"]
    text = "\n".join(lines) + "\n"
    parse_policy(text, "<qosfs plan>")  # the parser mount and check use: never write a bad one
    return text


def _toml_list(items: tuple[str, ...]) -> str:
    """A TOML array of strings, wrapped like the default policy's (JSON strings are TOML)."""
    rows: list[str] = []
    row = ""
    for item in (json.dumps(s) + "," for s in items):
        if row and len(row) + len(item) > 88:
            rows.append(row)
            row = ""
        row = f"{row} {item}" if row else item
    return "[\n" + "".join(f"    {r}\n" for r in [*rows, row]) + "]"
