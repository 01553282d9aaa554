"""Planners: pure functions `plan(flow_WE, placement, cost_model=None) -> Placement`.

A planner sees the global flow matrix of this iteration (or a prediction of it), the current
placement (owners) and the cost model, and returns where every expert is materialized. The
registry of names is `moeflow.strategies.PLANNERS`; the layer and the simulator both look them up
there, so a strategy added once runs in both.
"""

from __future__ import annotations

from collections.abc import Callable

from moeflow.core.placement import Placement

Planner = Callable[..., Placement]
