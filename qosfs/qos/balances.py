"""Bucket balances handed to the process that takes a mount over.

A successor (``qosfs upgrade``, or the same daemon on a new event loop) goes on from where
every cap stood, debt included, instead of from a full burst: a writer that was held to
its cap would otherwise get a burst's worth through at every handover. The balances travel
as plain data (JSON), on ``time.monotonic()``, since trio's clock differs per run.

Only this mount's own levels (class, per-user and tenant) travel: a cluster level's share
is its coordinator's business, and the backend's dispatch tags start afresh. Kept apart
from the engine because nothing here runs while the mount serves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from qosfs.qos.flow import ClassState
from qosfs.qos.levels import Level, RateLevel

__all__ = ["export_balances", "import_balances"]


def _node_levels(classes: Mapping[str, ClassState], tenants: Mapping[str, Level]
                 ) -> list[tuple[tuple[str, str, int], Level]]:
    """Every class, user and tenant level, by (kind, name, uid or -1)."""
    levels: list[tuple[tuple[str, str, int], Level]] = []
    for name, st in classes.items():
        levels.append((("class", name, -1), st.level))
        if st.group is not None:
            levels += [(("user", name, uid), child)
                       for uid, child in st.group.children.items()]
    levels += [(("tenant", name, -1), level) for name, level in tenants.items()]
    return levels


def export_balances(classes: Mapping[str, ClassState], tenants: Mapping[str, Level],
                    to_monotonic: float) -> list[list[Any]]:
    """What each limited bucket of these levels holds: [kind, name, uid, bucket, tokens,
    updated as ``time.monotonic()``], *to_monotonic* being ``time.monotonic() -
    trio.current_time()``."""
    balances: list[list[Any]] = []
    for key, level in _node_levels(classes, tenants):
        if not isinstance(level, RateLevel) or level.steering is not None:
            continue
        for name, bucket in level.buckets.items():
            if not bucket.unlimited and math.isfinite(bucket.updated):
                balances.append([*key, name, bucket.tokens, bucket.updated + to_monotonic])
    return balances


def import_balances(classes: Mapping[str, ClassState], tenants: Mapping[str, Level],
                    balances: list[list[Any]], to_trio: float) -> int:
    """Put `export_balances`' figures in force (inside a trio run; *to_trio* is
    ``trio.current_time() - time.monotonic()``). Returns how many buckets took one."""
    levels = dict(_node_levels(classes, tenants))
    taken = 0
    for kind, name, uid, key, tokens, updated in balances:
        level = levels.get((kind, name, uid))
        if level is None and kind == "user" and name in classes:
            group = classes[name].group
            level = group.level_for(int(uid)) if group is not None else None
        if not isinstance(level, RateLevel) or level.steering is not None:
            continue
        bucket = level.buckets.get(key)
        if bucket is None or bucket.unlimited:
            continue
        bucket.tokens = min(float(tokens), bucket.burst)
        bucket.updated = float(updated) + to_trio
        taken += 1
    return taken
