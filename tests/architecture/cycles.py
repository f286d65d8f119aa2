"""The first import cycle of a module graph, for the layering tests of qosfs and bench."""

from __future__ import annotations


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
