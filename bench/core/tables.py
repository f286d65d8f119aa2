"""What the suites' parts of REPORT.md share: figures formatted for a table cell, a
markdown table, a plot's image line, a policy block, a verdict against a target, and the
targets (DESIGN §4) more than one suite holds a figure to.

Each suite's section (its table, its plot, how it was measured and the policy it ran
with) lives with the suite (``bench/suites/``); :mod:`bench.core.report` assembles them.
"""

from __future__ import annotations

from collections.abc import Mapping

MiB = float(1 << 20)
Plots = Mapping[str, str]  # plot name -> its file, for the plots drawn in this run

Rows = list[list[str]]  # a table's rows; a headline row is (what, figure, target, result)

# DESIGN §4 targets shared by suites (each suite holds its own other targets)
# policy / no-qos throughput: the QoS machinery costs <= 5% (overhead, metadata)
MACHINERY_MIN = 0.95
SHARE_PCT = 10.0  # fair share and priorities: the 1 s cap tolerance, applied to shares


def mib(v: float | None) -> str:
    return "—" if v is None else f"{v / MiB:,.0f} MiB/s" if v >= 100 * MiB else \
        f"{v / MiB:.1f} MiB/s"


def ops(v: float | None) -> str:
    return "—" if v is None else f"{v / 1e3:.1f}k ops/s" if v >= 1e4 else f"{v:,.0f} ops/s"


def us(v: float | None) -> str:
    return "—" if v is None else f"{v / 1e3:.2f} ms" if v >= 1e3 else f"{v:.0f} µs"


def ratio(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}×"


def pct(v: float | None, signed: bool = True) -> str:
    return "—" if v is None else f"{v:+.1f}%" if signed else f"{v:.0f}%"


def verdict(ok: bool | None, miss: str = "") -> str:
    if ok is None:
        return "—"
    return "pass" if ok else f"**MISS**{' ' + miss if miss else ''}"


def number(v: float | None, fmt: str) -> str:
    return "—" if v is None else fmt.format(v)


def ratio_of(v: float | None, of: float | None) -> str:
    """*v* as a ratio to *of* ("—" when either is unknown)."""
    return ratio(v / of if v is not None and of else None)


def per_metric(metric: str, v: float | None) -> str:
    return mib(v) if metric == "bw" else ops(v)


def table(header: list[str], rows: list[list[str]], align: str = "") -> list[str]:
    """A markdown table; *align* is the separator row (default: first column left, the
    rest right)."""
    spec = align or "|".join(["---"] + ["---:"] * (len(header) - 1))
    return ["| " + " | ".join(header) + " |", f"|{spec}|",
            *("| " + " | ".join(r) + " |" for r in rows)]


def plot(plots: Plots, name: str, alt: str) -> list[str]:
    return [f"![{alt}]({plots[name]})", ""] if name in plots else []


def policy_block(text: str) -> list[str]:
    return ["<details><summary>policy</summary>", "", "```toml", text, "```", "",
            "</details>", ""]
