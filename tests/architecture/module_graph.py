"""The import graph of a source tree, read from the source, for the layering tests of
qosfs and bench: what a module imports, and the first cycle among them."""

from __future__ import annotations

import ast
from pathlib import Path


def imports_under(path: Path, root: Path, top: str) -> set[str]:
    """The modules under *top* (``qosfs``, ``bench``) that *path* imports, as absolute
    names (*root* is the folder *top* is in). Imports under ``TYPE_CHECKING`` and inside
    functions count too; a ``from X import name`` counts as X and as X.name (name may be
    a module)."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return {name for name in found if name == top or name.startswith(top + ".")}


def first_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """The first cycle found in *graph* (module -> the modules it imports), as the chain
    of names that closes it (``[a, b, a]``), visiting modules in name order; None if
    there is none. A depth-first walk: a module met again while still on the current
    path closes a cycle."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    trail: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        trail.append(name)
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                return [*trail[trail.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        trail.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name)) is not None:
            return cycle
    return None
