"""The EPLB baseline (`strategy="eplb"`): replication and packing by hand, the weaknesses fixed,
the planner's pricing; its equality with plain EP runs in `multirank_prophet` (2 and 4 ranks)."""

from __future__ import annotations

import numpy as np
import pytest

from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import Placement
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.strategies.planners.eplb import EPLBOptions, EPLBPlanner, pack_copies, replicate_experts


def test_replicas_go_to_the_largest_load_per_copy():
    assert replicate_experts(np.array([90, 30, 10, 10]), 3) == [0, 0, 0]  # 90, 45, then 30 = 30: lower id
    assert replicate_experts(np.array([90, 60, 10, 10]), 3) == [0, 1, 0]
    assert replicate_experts(np.array([1, 1]), 0) == []


def test_copies_packed_lightest_node_then_device_never_twice_on_a_rank():
    # Loads per copy: e0 90/3 = 30, e1 60/2 = 30; devices start at [30, 30, 10, 10] (owners 0..3).
    # e0 -> node 1 (20 < 60), device 2; e1 -> node 1 (50 < 60), device 3; e0 again -> device 1: the
    # only free slot on a device without e0 (device 0 owns it).
    placed = pack_copies([0, 1, 0], np.array([90, 60, 10, 10]), np.arange(4), 4, 1, [0, 0, 1, 1])
    assert placed == [(0, 2), (1, 3), (0, 1)]
    # Many copies of one expert, few ranks: each rank holds it at most once, the rest left out.
    placed = pack_copies([0] * 5, np.array([100, 1]), np.array([0, 1]), 2, 3)
    assert placed == [(0, 1)]


def test_planner_prices_the_copies_and_plans_from_the_past():
    shape = ExpertShape(8, 16)
    owners = Placement.expert_parallel(4, 4)
    hot = np.full((4, 4), 2)
    hot[:, 0] = 400
    fast = CostModel(Topology.homogeneous(4, 1e12), gemm_flops_per_s=1e7)
    planner = EPLBPlanner(shape, EPLBOptions(redundant_slots=1))
    assert planner(hot, owners, fast).is_owners_only()  # nothing seen yet
    planned = planner.next_placement()
    assert planned.holders_EW[0].sum() > 1 and planned.holders_EW.sum(1).max() <= 4
    assert (planned.materialized_EW().sum(0) <= 1).all()  # one redundant slot per rank
    assert planner(hot, owners, fast) == planned
    # Large experts on a slow network: moving weights costs more than it saves.
    slow = CostModel(Topology.homogeneous(4, 1e3), gemm_flops_per_s=1e7)
    big = EPLBPlanner(ExpertShape(8, 8192))
    big(hot, owners, slow)
    assert big.next_placement().is_owners_only()
    with pytest.raises(ValueError, match="redundant_slots"):
        EPLBOptions(redundant_slots=-1)
    with pytest.raises(ValueError, match="needs cost_model"):
        planner(hot, owners)
