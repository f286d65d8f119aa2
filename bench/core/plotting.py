"""PNG plots of one run's figures (matplotlib, the ``bench`` extra: ``pip install
'.[bench]'``). :func:`draw` raises ImportError when matplotlib is missing; the caller
writes the report without plots and says so. Each suite's plot functions (its ``chart``)
live with the suite and read the same typed result its tables are rendered from, so plots
and tables never disagree; this module draws them and holds what they share.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

MiB = float(1 << 20)
# (pyplot, a suite's result, output directory, file stem) -> the PNG's file name
PlotFn = Callable[[Any, Any, Path, str], str]


def _pyplot() -> Any:
    # imported by name: an optional dependency, typed as what it is here (Any)
    matplotlib = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def save(plt: Any, fig: Any, out: Path, name: str) -> str:
    fig.tight_layout()
    tmp = out / f"{name}.png.tmp"
    fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    tmp.replace(out / f"{name}.png")
    return f"{name}.png"


def bars(ax: Any, labels: list[str], series: dict[str, list[float | None]],
         ylabel: str) -> None:
    width = 0.8 / max(1, len(series))
    for i, (name, vals) in enumerate(series.items()):
        xs = [x + i * width for x in range(len(labels))]
        ax.bar(xs, [v or 0 for v in vals], width, label=name)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(labels))])
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def draw(jobs: Iterable[tuple[str, PlotFn, Any]], out: Path, prefix: str = ""
         ) -> tuple[dict[str, str], list[str]]:
    """Draw each (plot name, plot function, the suite's result) of *jobs* into *out*;
    returns (plot name -> file, errors). One plot failing spoils only itself."""
    plt = _pyplot()
    files, errors = {}, []
    for name, fn, result in jobs:
        try:
            files[name] = fn(plt, result, out, prefix + name)
        except Exception as exc:
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            plt.close("all")
    return files, errors
