"""``qosfs plan``: from a cluster's size and the storage's capacity to per-node caps and a
policy text."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qosfs.core.faces import lazy_face

if TYPE_CHECKING:
    from qosfs.plan.planner import PlanError, PlanInputs, make_plan, parse_params
    from qosfs.plan.text import plan_policy_text, render_plan

_EXPORTS = {
    "planner": ("PlanError", "PlanInputs", "make_plan", "parse_params"),
    "text": ("plan_policy_text", "render_plan"),
}
__all__ = [
    "PlanError", "PlanInputs", "make_plan", "parse_params", "plan_policy_text", "render_plan",
]

if not TYPE_CHECKING:  # type checkers read the imports above
    __getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
