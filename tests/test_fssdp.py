"""Hecate's FSSDP (§3-4): Algorithms 1 and 2 on hand-worked inputs, the planner without processes,
and, on 2 and 4 gloo ranks, AdamW training across re-shardings equal to plain EP (`multirank_fssdp`)."""

from __future__ import annotations

import numpy as np
import pytest

from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import Placement
from moeflow.core.registry import LayerContext
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.strategies import PLANNERS
from moeflow.strategies.planners.base import PrefetchWindow
from moeflow.strategies.planners.fssdp import FSSDPOptions, FSSDPPlanner
from moeflow.strategies.planners.hecate import heterogeneous_sharding, overlap_degree, sparse_materialization

from .multirank_fssdp import check_fssdp_equals_ep

SHAPE = ExpertShape(8, 16)
BIG = ExpertShape(8, 8192)
"""An expert whose parameters outweigh the tokens it would save sending on a slow network."""


def test_algorithm1_top_t_everywhere_when_memory_allows():
    owners = np.array([0, 0, 1, 1])
    holders = sparse_materialization(np.array([10, 50, 5, 30]), owners, 2, None, overlap=2, memory=2)
    assert holders.tolist() == [[True, False], [True, True], [False, True], [True, True]]


def test_algorithm1_replicas_by_load_share_across_nodes_first():
    # 2 nodes x 2 devices, one spare slot each (m = 1), t = 2: 4 slots shared 80 : 10.
    # Expert 0 gets round(3.56) = 4 -> at most W - 1 = 3 copies: first the other node (device 2),
    # then node 0 (device 1; ties -> lower node), then device 3. Expert 1 gets 1 copy; node 1 is full,
    # so it lands on device 0, the only free slot.
    holders = sparse_materialization(np.array([80, 10, 5, 5]), np.arange(4), 4, [0, 0, 1, 1], overlap=2, memory=1)
    assert holders.tolist() == [
        [True, True, True, True],
        [True, True, False, False],
        [False, False, True, False],
        [False, False, False, True],
    ]


def test_algorithm1_nothing_to_copy():
    owners = np.arange(4) // 2
    load = np.array([0, 0, 7, 0])
    assert sparse_materialization(load, owners, 2, None, 4, 4).sum() == 4 + 1  # only the loaded expert
    assert sparse_materialization(load, owners, 2, None, 0, 4).sum() == 4  # t = 0
    assert sparse_materialization(load, owners, 2, None, 4, 0).sum() == 4  # m = 0
    assert overlap_degree(0.01, 0.002, 8) == 5 and overlap_degree(1.0, 0.002, 8) == 8 and overlap_degree(1, 0, 3) == 3


def test_algorithm2_underloaded_first_heaviest_layer_first_equal_slots():
    # Worked by hand in the order of Algorithm 2 (t = 1: each layer's hottest expert is placed last).
    load = np.array([[100, 1, 2, 3], [4, 5, 6, 50]])
    owners = heterogeneous_sharding(load, overlap=1, world=2)
    assert owners.tolist() == [[0, 0, 0, 1], [1, 1, 0, 1]]
    assert np.bincount(owners.ravel(), minlength=2).tolist() == [4, 4]
    # Two nodes: the heaviest expert's node is avoided by the next ones.
    assert heterogeneous_sharding(np.array([[40, 30, 20, 10]]), 0, 4, [0, 0, 1, 1]).tolist() == [[0, 2, 3, 1]]
    with pytest.raises(ValueError, match="slots"):
        heterogeneous_sharding(np.ones((1, 3)), 0, 2)


def test_algorithm2_lets_a_device_own_none_of_a_layer():
    # One very hot layer and one cold: slots stay equal overall, not per layer.
    rng = np.random.default_rng(0)
    load = np.stack([rng.zipf(1.5, 8).astype(float) * 100, np.ones(8)])
    owners = heterogeneous_sharding(load, 2, 4)
    assert np.bincount(owners.ravel(), minlength=4).tolist() == [4, 4, 4, 4]
    for layer in range(2):
        assert sorted(np.flatnonzero(owners[layer] >= 0)) == list(range(8))


def _cm(bandwidth, world=4, flops=1e7):
    return CostModel(Topology.homogeneous(world, bandwidth), gemm_flops_per_s=flops)


def test_planner_runs_on_what_it_planned_from_the_past_and_only_when_copies_pay():
    planner = PLANNERS.build("fssdp", LayerContext(4, 2, SHAPE, _cm(1e12)), {"window": 2})
    owners = Placement.expert_parallel(4, 4)
    hot = np.full((4, 4), 2)
    hot[:, 0] = 400
    fast, slow = _cm(1e12), _cm(1e3)
    assert planner(hot, owners, fast).is_owners_only()  # nothing seen yet
    planned = planner.next_placement()
    assert planned.holders_EW[0].all() and planner.last.accepted >= 1
    assert planner(np.full((4, 4), 2), owners, fast) == planned  # the plan from the past runs
    # A large expert on a slow network: copies never pay, the owners alone.
    planner2 = FSSDPPlanner(BIG)
    planner2(hot, owners, slow)
    assert planner2.next_placement().is_owners_only() and planner2.last.accepted == 0
    # A re-sharding invalidates what was planned for the old owners.
    moved = Placement.owners_only(np.array([1, 0, 2, 3]), 4)
    planner.owners_changed(moved, fast)
    assert np.array_equal(planner.next_placement().owner_E, moved.owner_E)
    with pytest.raises(ValueError, match="needs cost_model"):
        planner(hot, owners)


def test_calibration_adds_copies_only_when_predicted_faster():
    owners = Placement.expert_parallel(4, 4)
    hot = np.full((4, 4), 2)
    hot[:, 3] = 400
    for shape, bandwidth, expect_copies in ((SHAPE, 1e12, True), (BIG, 1e3, False)):
        planner = FSSDPPlanner(shape, FSSDPOptions(calibrate=True))
        got = planner(hot, owners, _cm(bandwidth))  # nothing planned yet: the calibration decides
        assert got.holders_EW[3].sum() > 1 if expect_copies else got.is_owners_only()


def test_degrees_from_options_and_eq1():
    cm = _cm(1e9)
    size = SHAPE.param_bytes(cm.bytes_per_element)
    copy_s = float(cm.p2p_time(size, 0, 1))  # Eq. 1: 3.5 copies' time of dense compute -> t = 3
    planner = FSSDPPlanner(SHAPE, FSSDPOptions(overlap="eq1", memory_bytes=3.5 * size, nonmoe_forward_s=3.5 * copy_s))
    assert planner.degrees(cm, 8, 4) == (3, 3)
    priced = FSSDPPlanner(SHAPE, FSSDPOptions(nonmoe_forward_s=3.5 * copy_s))
    assert (
        priced.degrees(cm, 8, 4)[0] == 8
        and FSSDPPlanner(SHAPE, FSSDPOptions(overlap_degree=2)).degrees(cm, 8, 4)[0] == 2
    )
    assert FSSDPPlanner(SHAPE).degrees(cm, 8, 4) == (8, 2)  # unmeasured: t = E, m = E/W


@pytest.mark.parametrize(
    "options, named",
    [
        ({"window": 0}, "window"),
        ({"memory_experts": 2, "memory_bytes": 10.0}, "memory_experts=2"),
        ({"reshard_interval": -1}, "reshard_interval"),
        ({"min_gain": 1.0}, "min_gain"),
        ({"overlap": "eq8"}, "overlap='eq8'"),
    ],
)
def test_option_errors_name_the_option(options, named):
    with pytest.raises(ValueError, match=named):
        FSSDPOptions(**options)


@pytest.mark.multirank
@pytest.mark.spawned(body=check_fssdp_equals_ep)
@pytest.mark.parametrize("world", [2, 4])
def test_fssdp_training_equals_ep_across_resharding(world, shared_spawns):
    shared_spawns.run(check_fssdp_equals_ep, world)


@pytest.mark.parametrize("name", ["fssdp", "eplb"])
def test_planning_thread_plans_what_inline_planning_plans(name):
    """`planners.ahead`: the search for the next placement runs on the planning thread, on inputs
    captured at submission (the prefetch's measurements change between calls); the placements and
    decisions equal inline planning's, and a copy of a planner carries the finished plan."""
    import copy

    from moeflow.strategies.planners.eplb import EPLBPlanner

    cls = FSSDPPlanner if name == "fssdp" else EPLBPlanner
    threaded, inline = cls(SHAPE), cls(SHAPE, background=False)
    owners, cm = Placement.expert_parallel(4, 4), _cm(1e9)
    hot = np.full((4, 4), 2)
    hot[:, 0] = 400
    flows = [hot, hot[:, [1, 0, 2, 3]], np.full((4, 4), 30), hot]
    for i, flow in enumerate(flows):
        for planner in (threaded, inline):
            planner.use_prefetch(PrefetchWindow(0.01, 0.5) if i % 2 == 1 else None)
        assert threaded(flow, owners, cm) == inline(flow, owners, cm)
    clone = copy.deepcopy(threaded)
    assert clone.next_placement() == threaded.next_placement() == inline.next_placement()
    assert not clone.next_placement().is_owners_only()
    if name == "fssdp":
        assert threaded.last.predicted_s == inline.last.predicted_s and threaded.last.accepted == inline.last.accepted
    else:
        assert threaded.last == inline.last  # the predicted times of the copies prefixes
