"""A table fitted to a terminal's width: columns dropped or abbreviated in a stated order.

``qosfs top`` has more columns than 80 characters hold. Squeezing every column until it
fits leaves headers cut to a letter or two (``T…``, ``R…``) that nobody can read. Instead
each table states, most expendable first, what gives way: a column goes whole, a long
header takes its documented short form, or a column's cells are cut (ending in ``…``)
down to a floor. Steps apply one at a time, only while the table is still too wide, so a
wide terminal shows everything; a column the caller keeps (the one sorted by) is never
touched. If the table is still too wide when the steps run out, the caller crops it.

Example::

    >>> table = fit(["NAME", "RATE", "TOTAL"], [["ckpt", "8MiB/s", "12GiB"]], 14,
    ...             (Step("drop", "TOTAL"),))
    >>> table.lines()
    ['NAME  RATE', 'ckpt  8MiB/s']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

GAP = 2  # spaces between two columns
ELLIPSIS = "…"
DROP, DROP_IF_EMPTY, ABBREVIATE, SHORTEN = "drop", "drop if empty", "abbreviate", "shorten"


@dataclass(frozen=True)
class Step:
    """One way a table gives way: ``drop`` the column, ``drop if empty`` (no row has a
    value in it), ``abbreviate`` its header to ``short``, or ``shorten`` its cells to what
    fits but no fewer than ``floor`` characters."""

    action: str
    header: str
    short: str = ""
    floor: int = 12

    def describe(self) -> str:
        """The step in words, as the tables' documentation lists it."""
        if self.action == ABBREVIATE:
            return f"{self.header} becomes {self.short}"
        if self.action == SHORTEN:
            return (f"{self.header} is cut to what fits, ending in {ELLIPSIS}, but to no "
                    f"fewer than {self.floor} characters")
        if self.action == DROP_IF_EMPTY:
            return f"{self.header} goes if no row shown has one"
        return f"{self.header} goes"


@dataclass(frozen=True)
class Fitted:
    """The columns that fit: their indices in the full table, headers and cells, in order."""

    columns: tuple[int, ...]
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    widths: tuple[int, ...]

    def aligned(self, right: frozenset[int] = frozenset()) -> list[list[str]]:
        """The header and rows, each cell padded to its column's width: columns in
        ``right`` (full-table indices) right-aligned, the others left-aligned."""
        return [[cell.rjust(w) if col in right else cell.ljust(w)
                 for col, cell, w in zip(self.columns, cells, self.widths, strict=True)]
                for cells in (self.headers, *self.rows)]

    def lines(self, right: frozenset[int] = frozenset()) -> list[str]:
        """The header and rows as text, columns ``GAP`` spaces apart."""
        return [(" " * GAP).join(cells).rstrip() for cells in self.aligned(right)]


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:max(0, width - 1)].rstrip() + ELLIPSIS


def fit(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int | None,
        steps: Sequence[Step], keep: frozenset[int] = frozenset(),
        suffix: Mapping[int, str] | None = None) -> Fitted:
    """The table fitted to ``width`` characters (``None``: every column, whole).

    ``suffix`` is appended to some headers (the sort mark) and counts in their width.
    Columns in ``keep`` are never dropped, abbreviated or shortened. Every step names a
    header of ``headers``; one naming another table's column is a bug, and raises.
    """
    suffix = suffix or {}
    names = list(headers)
    shown = list(range(len(headers)))
    caps: dict[int, int] = {}  # shortened columns: their widest cell

    def natural(i: int) -> int:
        return max([len(names[i] + suffix.get(i, "")), *(len(r[i]) for r in rows)])

    def used() -> int:
        return (sum(min(natural(i), caps.get(i, natural(i))) for i in shown)
                + GAP * (len(shown) - 1))

    for step in steps:
        i = list(headers).index(step.header)
        if width is None or used() <= width:
            break
        if i not in shown or i in keep:
            continue
        if step.action == DROP or (step.action == DROP_IF_EMPTY
                                   and not any(r[i] for r in rows)):
            shown.remove(i)
            caps.pop(i, None)
        elif step.action == ABBREVIATE:
            names[i] = step.short
        elif step.action == SHORTEN:
            caps[i] = max(step.floor, len(names[i] + suffix.get(i, "")))
    if width is not None:  # room a later step freed goes back to the shortened columns
        for i in caps:
            caps[i] = min(natural(i), caps[i] + max(0, width - used()))
    widths = tuple(min(natural(i), caps.get(i, natural(i))) for i in shown)
    return Fitted(
        columns=tuple(shown),
        headers=tuple(names[i] + suffix.get(i, "") for i in shown),
        rows=tuple(tuple(_cut(r[i], caps[i]) if i in caps else r[i] for i in shown)
                   for r in rows),
        widths=widths)


def wrap(parts: Sequence[str], separator: str, width: int | None) -> list[str]:
    """``parts`` joined by ``separator`` into as few lines of at most ``width`` characters
    as keep each part whole; a part longer than a line is cut, ending in ``…``."""
    if width is None:
        return [separator.join(parts)]
    lines: list[str] = []
    line = ""
    for part in parts:
        if line and len(line) + len(separator) + len(part) <= width:
            line += separator + part
            continue
        if line:
            lines.append(line)
        line = _cut(part, width)
    return [*lines, line] if line else lines


def crop(text: str, width: int | None) -> str:
    """One line cut to ``width`` characters, ending in ``…`` when cut."""
    return text if width is None else _cut(text, width)
