"""Planners: callables `plan(flow_WE, placement, cost_model=None) -> Placement` (SPEC.md §6).

A planner sees the global flow matrix of this iteration (or a prediction of it), the current
placement (owners) and the cost model, and returns where every expert is materialized. Strategies
are registered by name in `PLANNERS` as factories of a `PlannerContext` (the layer's shapes); the
layer and the simulator both look them up here, so a strategy added once runs in both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moeflow.core.placement import Placement
from moeflow.core.registry import build_named
from moeflow.strategies.planners.ep import plan_ep
from moeflow.strategies.planners.shadow import ShadowPlanner

Planner = Callable[..., Placement]


@dataclass(frozen=True)
class PlannerContext:
    """The layer shapes a planner prices its decisions with."""

    num_experts: int
    d_model: int
    d_hidden: int
    expert: str = "ffn"


PLANNERS: dict[str, Callable[[PlannerContext | None], Planner]] = {
    "ep": lambda ctx: plan_ep,
    "shadow": lambda ctx: ShadowPlanner(ctx.d_model, ctx.d_hidden, ctx.expert),
    # FasterMoE's Algorithm 1 as published (stop at the first expert that does not help, no margin),
    # to compare against the default search by name from train / bench / simulate.
    "shadow_greedy": lambda ctx: ShadowPlanner(ctx.d_model, ctx.d_hidden, ctx.expert, search="greedy", min_gain=0.0),
}
NEEDS_CONTEXT = {"shadow", "shadow_greedy"}


def get_planner(strategy: str | Planner, ctx: PlannerContext | None = None) -> Planner:
    """The planner for a strategy name, or the callable itself (DESIGN.md §3.1: objects allowed)."""
    if ctx is None and isinstance(strategy, str) and strategy in NEEDS_CONTEXT:
        raise ValueError(f"strategy={strategy!r} needs the layer shapes (a PlannerContext)")
    return build_named("strategy", strategy, PLANNERS, ctx, callable)


__all__ = ["PLANNERS", "Planner", "PlannerContext", "ShadowPlanner", "get_planner", "plan_ep"]
