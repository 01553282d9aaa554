"""Planners (the `strategy` axis): pure functions of numbers, `planner(flow_WE, placement,
cost_model) -> Placement`, with their capabilities declared (`base.Planner`). The registry of names
is `moeflow.strategies.PLANNERS`; the layer and the simulator both look them up there, so a
strategy added once runs in both.
"""

from moeflow.strategies.planners.base import PlanAheadPlanner, Planner, PrefetchWindow

__all__ = ["PlanAheadPlanner", "Planner", "PrefetchWindow"]
