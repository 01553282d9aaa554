"""Planners: pure functions `plan(flow_WE, placement, cost_model=None) -> Placement` (SPEC.md §6).

A planner sees the global flow matrix of this iteration (or a prediction of it), the current
placement (owners) and the cost model, and returns where every expert is materialized. Register a
new strategy by adding it to `PLANNERS`; the layer and the simulator both look strategies up here.
"""

from __future__ import annotations

from collections.abc import Callable

from moeflow.placement import Placement
from moeflow.planners.ep import plan_ep

Planner = Callable[..., Placement]

PLANNERS: dict[str, Planner] = {"ep": plan_ep}


def get_planner(strategy: str | Planner) -> Planner:
    """The planner for a strategy name, or the callable itself (DESIGN.md §3.1: objects allowed)."""
    if callable(strategy):
        return strategy
    if not isinstance(strategy, str) or strategy not in PLANNERS:
        raise ValueError(f"unknown strategy={strategy!r}; valid: {sorted(PLANNERS)}")
    return PLANNERS[strategy]


__all__ = ["PLANNERS", "Planner", "get_planner", "plan_ep"]
