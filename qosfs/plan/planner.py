"""Capacity planning for checkpoints: from model size and interval to a QoS policy.

Administrators think "a 70B model, AdamW, a checkpoint every 30 minutes, storage that does
20 GB/s, dataset reads that need 8 GB/s"; a policy speaks in bytes per second per mount.
This module is the arithmetic in between, pure and with every assumption named, so that
``qosfs plan`` prints the figures together with the reasons they are what they are.

The model (figures are decimal: 1 GB = 10^9 bytes, as in storage data sheets):

- Checkpoint size S = params x bytes per parameter. ``simple`` state: weights and the
  optimizer's moments in the training dtype, (1 + moments) x dtype bytes (6 for bf16 AdamW,
  the figure behind "7B = 42 GB"); ``mixed``: dtype weights + fp32 master weights + fp32
  moments (14 for bf16 AdamW). ``bytes_per_param`` overrides both.
- Written per checkpoint W = S x replicas; each rank writes W / ranks.
- Reads and writes share the storage's time: reserving R of its read bandwidth Br leaves
  the fraction 1 - R/Br of its write bandwidth Bw to checkpoints. Given only Bw, the
  storage is one pipe (Br = Bw), so the reserve comes straight off the write figure.
- A checkpoint achieves ``efficiency`` of the bandwidth it may use (stragglers, metadata,
  file creation): at full bandwidth it takes T = W / (Bw x efficiency), and the highest cap
  that keeps the reserve is Bw x (1 - R/Br) x efficiency. Under a cap no higher than that
  the write moves at the cap, because qosfs meters bytes exactly.
- Synchronous checkpoints stall training for the whole write, so the cap is the highest
  one. Asynchronous ones drain in the background, so the cap is the lowest that finishes
  within ``target_share`` of the interval, leaving the most to everyone else.
- The interval runs from one checkpoint's start to the next; the share is T / interval.
- Each qosfs mount has its own token buckets: policy figures are the cluster figures
  divided over ``nodes`` mounts, each writing the shards of ranks / nodes ranks.
- Caps are rounded to three significant digits (down, or up for an asynchronous cap that
  must not be slower than needed), and every time printed is computed from the rounded cap
  that goes into the policy.

:mod:`qosfs.plan.report` turns a :class:`Plan` into the report and the policy file.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from decimal import Decimal

from qosfs.core.errors import EXIT_PLAN, QosfsError
from qosfs.core.units import format_bandwidth, show_value

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
OPTIMIZER_MOMENTS = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}
OPTIMIZER_STATE = {"adamw": "2 AdamW moments", "adam": "2 Adam moments", "sgd": "SGD momentum",
                   "none": ""}
STATES = ("simple", "mixed")
MASTER_BYTES = 4  # mixed precision keeps fp32 master weights and fp32 moments
DEFAULT_INTERVAL = 1800.0
DEFAULT_EFFICIENCY = 0.8
DEFAULT_TARGET_SHARE = 0.5
SIG_DIGITS = 3
MAX_PARAMS = 1e15
_COUNT_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}
_COUNT = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kKmMbBtT]?)\s*")


class PlanError(QosfsError):
    """Inputs out of range, or a plan the storage cannot carry out; says by how much."""

    exit_code = EXIT_PLAN


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """What the administrator states; bandwidths in bytes/s, times in seconds."""

    params: float
    dtype: str = "bf16"
    optimizer: str = "adamw"
    state: str = "simple"
    bytes_per_param: float | None = None
    ranks: int = 1
    nodes: int = 1
    replicas: int = 1
    interval: float = DEFAULT_INTERVAL
    backend_write: float | None = None
    backend_read: float | None = None
    reserve_read: float | None = None
    efficiency: float = DEFAULT_EFFICIENCY
    max_stall: float | None = None
    asynchronous: bool = False
    target_share: float | None = None  # None: DEFAULT_TARGET_SHARE when asynchronous


@dataclass(frozen=True, slots=True)
class Timing:
    """Write times and caps; cluster-wide bandwidths in bytes/s, times in seconds."""

    backend_read: float  # as given, or the write figure when reads and writes share a pipe
    full_rate: float  # backend_write x efficiency
    full_seconds: float
    highest_cap: float  # the highest cap that keeps the read reserve (rounded down)
    cap: float  # the recommended cap
    cap_per_mount: float  # what the policy says: cap / nodes
    cap_seconds: float
    target_met: bool  # asynchronous: the write fits in target_share of the interval


@dataclass(frozen=True, slots=True)
class Plan:
    """The figures ``qosfs plan`` prints; ``timing`` is None without a backend figure."""

    inputs: PlanInputs
    bytes_per_param: float
    state: str  # what a parameter's bytes are made of, for the output
    checkpoint_bytes: float
    written_bytes: float
    shard_bytes: float
    timing: Timing | None = None

    @property
    def target_share(self) -> float:
        """The asynchronous target, as given or by default."""
        share = self.inputs.target_share
        return DEFAULT_TARGET_SHARE if share is None else share


def parse_params(value: str) -> float:
    """``"70B"``, ``"7b"``, ``"1.5B"``, ``"175M"``, ``"1T"`` or digits: a parameter count.

    ``B`` is billions here (not bytes): that is how model sizes are spoken of.
    """
    match = _COUNT.fullmatch(value)
    if match is None:
        raise PlanError('--params: expected a parameter count like "70B", "1.5B", "175M" or '
                        f'"1T", got {show_value(value)}')
    count = float(match[1]) * _COUNT_SUFFIX[match[2].lower()]
    if not 1 <= count <= MAX_PARAMS:
        raise PlanError(f"--params: expected 1 to 1000T parameters, got {show_value(value)}")
    return count


def make_plan(inputs: PlanInputs) -> Plan:
    """Checkpoint size, write times and the recommended cap; raises :class:`PlanError`."""
    _validate(inputs)
    bpp, state = _bytes_per_param(inputs)
    size = inputs.params * bpp
    written = size * inputs.replicas
    plan = Plan(inputs, bpp, state, size, written, written / inputs.ranks)
    if inputs.backend_write is None:
        return plan
    return dataclasses.replace(plan, timing=_timing(inputs, written, plan.target_share))


def _validate(i: PlanInputs) -> None:
    for flag, value, known in (("--dtype", i.dtype, DTYPE_BYTES),
                               ("--optimizer", i.optimizer, OPTIMIZER_MOMENTS),
                               ("--state", i.state, STATES)):
        if value not in known:
            raise PlanError(f"{flag}: expected one of {', '.join(known)}, got {show_value(value)}")
    for flag, count in (("--ranks", i.ranks), ("--nodes", i.nodes), ("--replicas", i.replicas)):
        if count < 1:
            raise PlanError(f"{flag}: expected at least 1, got {count}")
    if i.ranks % i.nodes:
        raise PlanError(f"--nodes {i.nodes} does not divide --ranks {i.ranks}: the plan "
                        "assumes every mount writes the same number of shards")
    for flag, frac in (("--efficiency", i.efficiency), ("--target-share", i.target_share)):
        if frac is not None and not 0 < frac <= 1:
            raise PlanError(f"{flag}: expected a fraction above 0 and at most 1, got {frac:g}")
    if i.bytes_per_param is not None and not 0 < i.bytes_per_param < math.inf:
        raise PlanError(f"--bytes-per-param: expected a number above 0, got {i.bytes_per_param:g}")
    if i.state == "mixed" and i.bytes_per_param is None and DTYPE_BYTES[i.dtype] >= MASTER_BYTES:
        raise PlanError(f"--state mixed needs a 16-bit --dtype (bf16 or fp16): {i.dtype} weights "
                        "are their own master copy, use --state simple")
    if i.asynchronous and i.max_stall is not None:
        raise PlanError("--max-stall applies to synchronous checkpoints; an asynchronous one "
                        "stalls training only for its snapshot (drop --async or --max-stall)")
    if not i.asynchronous and i.target_share is not None:
        raise PlanError("--target-share applies to asynchronous checkpoints (add --async)")
    if i.backend_write is None:
        needs_write: tuple[tuple[str, float | None], ...] = (
            ("--backend-read", i.backend_read), ("--reserve-read", i.reserve_read),
            ("--max-stall", i.max_stall))
        for option, given in needs_write:
            if given is not None:
                raise PlanError(f"{option} needs --backend-write: every time and cap starts "
                                "from the storage's write bandwidth")


def _bytes_per_param(i: PlanInputs) -> tuple[float, str]:
    if i.bytes_per_param is not None:
        return i.bytes_per_param, "given by --bytes-per-param"
    dtype, moments = DTYPE_BYTES[i.dtype], OPTIMIZER_MOMENTS[i.optimizer]
    optimizer = OPTIMIZER_STATE[i.optimizer]
    if i.state == "simple":
        what = f"{i.dtype} weights" + (f" + {optimizer} in {i.dtype}" if moments else "")
        return float(dtype * (1 + moments)), what
    what = (f"{i.dtype} weights + fp32 master weights"
            + (f" + {optimizer} in fp32" if moments else ""))
    return float(dtype + MASTER_BYTES * (1 + moments)), what


def _timing(i: PlanInputs, written: float, target_share: float) -> Timing:
    assert i.backend_write is not None
    bw, eff, interval = i.backend_write, i.efficiency, i.interval
    br = i.backend_read if i.backend_read is not None else bw
    reserve = i.reserve_read or 0.0
    spelled = format_bandwidth  # figures the user typed, spelled as they would type them
    if reserve > br:
        raise PlanError(f"--reserve-read {spelled(reserve)} exceeds the backend's read "
                        f"bandwidth {spelled(br)} by {human_rate(reserve - br)}{_pipe(i)}")
    if reserve == br:
        raise PlanError(f"--reserve-read {spelled(reserve)} is all of the backend's read "
                        f"bandwidth{_pipe(i)}, leaving nothing for checkpoints")
    size, period = human_size(written), human_time(interval)
    full = bw * eff
    if written / full > interval:
        took = human_time(written / full)
        raise PlanError(
            f"a {size} checkpoint cannot finish within the {period} interval even at full "
            f"bandwidth: at {human_rate(full)} ({spelled(bw)} x efficiency {eff:g}) it takes "
            f"{took}, {human_time(written / full - interval)} too long; it needs "
            f"{human_rate(written / interval / eff)} of backend write bandwidth or an "
            f"--interval of at least {took}")
    per_mount_max = round_rate(bw * (1 - reserve / br) * eff / i.nodes, up=False)
    highest = per_mount_max * i.nodes
    if written / highest > interval:
        late = (f"it takes {human_time(written / highest)}, "
                f"{human_time(written / highest - interval)} too long")
        head = f"a {size} checkpoint cannot finish within the {period} interval"
        if not reserve:  # only the rounding to 3 digits stands between it and the interval
            raise PlanError(f"{head} at the highest cap, {human_rate(highest)} (rounded down): "
                            f"{late}; lengthen --interval")
        most = br * (1 - written / (interval * bw * eff))
        fix = (f"reserve at most {human_rate(round_rate(most, up=False))}" if most > 0
               else "drop --reserve-read")
        raise PlanError(f"{head} while {spelled(reserve)} is reserved for reads: at the "
                        f"highest cap that keeps the reserve, {human_rate(highest)}, {late}; "
                        f"{fix} or lengthen --interval")
    per_mount, met = per_mount_max, True
    if i.asynchronous:
        needed = written / (target_share * interval)
        met = needed <= highest
        if met:
            per_mount = min(round_rate(needed / i.nodes, up=True), per_mount_max)
    cap = per_mount * i.nodes
    if i.max_stall is not None and written / cap > i.max_stall:
        keeps = " that keeps the read reserve" if reserve else ""
        raise PlanError(
            f"a synchronous {size} checkpoint stalls training for {human_time(written / cap)} "
            f"at the highest cap{keeps}, {human_rate(cap)}: "
            f"{human_time(written / cap - i.max_stall)} over --max-stall "
            f"{human_time(i.max_stall)}; it needs {human_rate(written / i.max_stall)} for "
            "checkpoints (or use --async)")
    return Timing(br, full, written / full, highest, cap, per_mount, written / cap, met)


def _pipe(i: PlanInputs) -> str:
    return "" if i.backend_read is not None else " (no --backend-read: reads share --backend-write)"


def round_rate(x: float, *, up: bool) -> float:
    """``x`` to SIG_DIGITS significant digits, so the policy reads "9.6GB/s", not 9.59...e9."""
    exponent = math.floor(math.log10(x)) - (SIG_DIGITS - 1)
    scaled = x / 10.0**exponent
    n = math.ceil(scaled - 1e-9) if up else math.floor(scaled + 1e-9)
    return float(Decimal(n).scaleb(exponent))


# ---------------------------------------------------------- figures for people

def _si(x: float, unit: str) -> str:
    """Three significant digits with a decimal prefix: ``420 GB``, ``9.6 GB/s``."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale * 0.9995:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def human_size(nbytes: float) -> str:
    """Bytes for people: ``420 GB``."""
    return _si(nbytes, "B")


def human_rate(bps: float) -> str:
    """Bytes per second for people: ``9.6 GB/s``."""
    return _si(bps, "B/s")


def human_time(seconds: float) -> str:
    """Seconds for people: ``43.8 s``, ``15 min``, ``1.04 h``."""
    if seconds < 99.95:
        return f"{seconds:.3g} s"
    if seconds < 99.95 * 60:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"
