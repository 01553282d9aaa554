"""Plain expert parallelism: every expert only on its owner."""

from __future__ import annotations

import numpy as np

from moeflow.core.placement import Placement
from moeflow.strategies.planners.base import Planner


def plan_ep(flow_WE: np.ndarray, placement: Placement, cost_model: object = None) -> Placement:
    """Owners only, whatever the load: the baseline every other strategy must match numerically."""
    del flow_WE, cost_model  # EP ignores the load by definition
    if placement.is_owners_only():
        return placement  # the usual case: no new object on every forward
    return Placement.owners_only(placement.owner_E, placement.world_size)


class EPPlanner(Planner):
    """`strategy="ep"` (`plan_ep`)."""

    name = "ep"
    reads_flow = False

    def __call__(self, flow_WE: np.ndarray, placement: Placement, cost_model: object = None) -> Placement:
        return plan_ep(flow_WE, placement, cost_model)
