"""What a benchmark suite and a subcommand are, as the runner sees them (the list of them
is :mod:`bench.catalog`).

Two kinds of entry:

* :class:`Suite`: a suite of the report. Its runner takes the session's :class:`Run`
  (fio, scratch areas, mode) and returns its figures as a typed record
  (:mod:`bench.core.typed`); the report reads that record back from ``<stem>.json`` and
  renders its headline rows, its section and its plots. A suite's runner, record,
  headline, section and plots live together in its module under ``bench/suites/``.
* :class:`Command`: a subcommand that runs on its own terms (its own mounts, its own
  output), from a module of ``bench/`` itself. One with ``after_all`` also runs at the end of
  ``python -m bench all``, and the ``<name>.md`` it writes there is included in REPORT.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from bench.core.context import Run
from bench.core.tables import Plots, Rows
from bench.core.typed import Record

R = TypeVar("R", bound=Record)


@dataclass(frozen=True)
class Suite(Generic[R]):
    """A suite of the report (see the module docstring)."""

    name: str
    about: str  # one line, for --help
    runner: Callable[[Run], R]
    result: type[R]  # what the runner returns and <stem>.json holds for it
    headline: Callable[[R], Rows]  # (what, figure, target, result) rows
    section: Callable[[Plots, R], list[str]]  # its part of REPORT.md
    plots: tuple[tuple[str, Callable[[Any, R, Path, str], str]], ...] = ()
    in_all: bool = True  # run by `python -m bench all` (make bench, make bench-quick)
    # why this machine cannot run it (given fio's path), or None
    unavailable: Callable[[str], str | None] = lambda fio: None

    def load(self, data: Any, where: str) -> R:
        """The suite's record from JSON; ResultMismatch (naming *where* and the field)
        when the data does not have its shape."""
        return self.result.from_json(data, where)


@dataclass(frozen=True)
class Command:
    """A subcommand that runs on its own (see the module docstring)."""

    name: str
    about: str
    run: Callable[[argparse.Namespace], int]
    options: Callable[[argparse.ArgumentParser], None] = lambda parser: None
    after_all: bool = False  # `all` runs it last; its <name>.md joins REPORT.md
    # SIGTERM unwinds it like Ctrl-C (unmount, write what was measured); the others
    # clean up in their own way and are left the default action
    unwinds_on_sigterm: bool = True


Suites = dict[str, Suite[Any]]  # by name, in report order
