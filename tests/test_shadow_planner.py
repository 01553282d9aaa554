"""FasterMoE shadowing planner (§4.1, Algorithm 1): a pure function, tested without processes."""

from __future__ import annotations

import numpy as np
import pytest

from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import Placement
from moeflow.core.registry import LayerContext
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.strategies import PLANNERS
from moeflow.strategies.planners.shadow import ShadowOptions, ShadowPlanner

D, H = 8, 16
SHAPE = ExpertShape(D, H)


def planner_by_name(name, experts=4, shape=SHAPE, **options):
    """A planner as the layer builds it (its context carries the layer's cost model; the planner is
    a pure function that receives the cost model with every call)."""
    cost_model = CostModel(Topology.homogeneous(4, 1e9), gemm_flops_per_s=P)
    return PLANNERS.build(name, LayerContext(experts, 1, shape, cost_model), options)


P = 1e9  # GEMM FLOP/s


def _cost_model(bandwidth, world=4):
    return CostModel(Topology.homogeneous(world, bandwidth), gemm_flops_per_s=P)


def _hot_flow(m, n_hot=5):
    """4 ranks, one expert each; every other rank sends m tokens to expert 1, rank 1 keeps n_hot."""
    flow = np.zeros((4, 4))
    flow[[0, 2, 3], 1] = m
    flow[1, 1] = n_hot
    return flow


def test_flip_threshold_matches_hand_worked_eq7_eq8():
    # EP: rank 1 computes 3m + n_hot; its downlink carries 3m tokens; no copies.
    # Shadow {1}: every rank computes its own m (rank 1: n_hot); no tokens; one broadcast + one
    # reduce of the expert (pipelined ring: every link carries the parameters once).
    m, n_hot = 2, 1
    param_bytes = SHAPE.param_count * 4
    comp_gain = 3 * 4 * D * H * ((3 * m + n_hot) - max(m, n_hot)) / P
    comm_loss_bytes = 2 * param_bytes - 4 * 3 * m * D * 4  # copies (fwd + bwd) minus tokens (4 a2a)
    assert comm_loss_bytes > 0  # Eq. 9 fails: the model is dearer to move than the tokens ...
    threshold = comm_loss_bytes / comp_gain  # ... so Eq. 10 decides: shadow iff bandwidth > this
    planner = ShadowPlanner(SHAPE)
    owners = Placement.expert_parallel(4, 4)
    for factor, expect in ((0.5, []), (2.0, [1])):
        cm = _cost_model(factor * threshold)
        placement = planner(_hot_flow(m, n_hot), owners, cm)
        assert planner.last.shadowed == expect, f"bandwidth = {factor} x threshold"
        assert placement.holders_EW[1].all() == bool(expect)
        ep_time = 3 * 4 * D * H * (3 * m + n_hot) / P + 4 * 3 * m * D * 4 / (factor * threshold)
        assert planner.last.predicted_s[0] == pytest.approx(ep_time)


def test_hot_expert_with_half_the_tokens_is_shadowed_and_balanced_load_is_not():
    cm = CostModel.from_preset("johnny")  # 16 ranks, 2 nodes: FasterMoE's cluster
    world, experts, d, h = 16, 32, 1024, 4096
    planner = planner_by_name("shadow", experts, ExpertShape(d, h))
    owners = Placement.expert_parallel(experts, world)
    tokens = 2048  # per rank, top-1
    uniform = np.full((world, experts), tokens / experts)
    planner(uniform, owners, cm)
    assert planner.last.shadowed == []
    hot = np.full((world, experts), tokens / 2 / (experts - 1))
    hot[:, 7] = tokens / 2  # expert 7 receives half of every rank's tokens
    placement = planner(hot, owners, cm)
    assert 7 in planner.last.shadowed and placement.holders_EW[7].all()
    assert planner.last.best_s < planner.last.predicted_s[0]
    # Greedy order is by tokens *received* (column sums): the hot expert comes first.
    assert planner.last.shadowed[0] == 7


def test_prefix_search_takes_a_hot_pair_that_algorithm1_stops_before():
    """Two equally hot experts on two ranks: shadowing either alone leaves the other rank as slow
    as before (plus the copies), so Algorithm 1 stops at once; the pair balances the load."""
    flow = np.full((4, 4), 10.0)
    flow[:, 1] = flow[:, 2] = 400.0
    owners = Placement.expert_parallel(4, 4)
    cm = _cost_model(1e7)  # slow enough that copying the cold experts does not pay
    greedy, prefix = planner_by_name("shadow_greedy"), planner_by_name("shadow")
    options = (greedy.options.search, greedy.options.min_gain, prefix.options.search, prefix.options.min_gain)
    assert options == ("greedy", 0.0, "prefix", 0.05)
    greedy(flow, owners, cm)
    placement = prefix(flow, owners, cm)
    assert greedy.last.shadowed == [] and greedy.last.predicted_s[1] >= greedy.last.predicted_s[0]
    assert sorted(prefix.last.shadowed) == [1, 2] and placement.holders_EW[[1, 2]].all()
    assert prefix.last.best_s < prefix.last.predicted_s[0]
    # The gain must clear min_gain: just above the predicted gain, nothing is shadowed.
    gain = 1 - prefix.last.best_s / prefix.last.predicted_s[0]
    cautious = planner_by_name("shadow", min_gain=gain + 0.01)
    assert cautious(flow, owners, cm) == owners and cautious.last.shadowed == []
    assert planner_by_name("shadow", min_gain=gain - 0.01)(flow, owners, cm).holders_EW[[1, 2]].all()
    # The vectorised pricing of every prefix equals pricing each shadow set on its own.
    for i, t in enumerate(prefix.last.predicted_s):
        mask = np.isin(np.arange(4), prefix.last.candidates[:i])
        assert float(prefix.cost(flow, owners.owner_E, mask, cm)) == pytest.approx(t)


def test_planner_contract_and_errors():
    planner = ShadowPlanner(ExpertShape(D, H, "swiglu"), ShadowOptions(max_shadowed=0))
    owners = Placement.expert_parallel(4, 4)
    placement = planner(_hot_flow(1000), owners, _cost_model(1e12))
    assert placement == owners and planner.last.shadowed == []
    with pytest.raises(ValueError, match="needs cost_model"):
        ShadowPlanner(SHAPE)(_hot_flow(1), owners, None)
    with pytest.raises(ValueError, match="cost model has 2 devices"):
        ShadowPlanner(SHAPE)(_hot_flow(1), owners, _cost_model(1e9, world=2))
    with pytest.raises(ValueError, match="strategy_options for strategy='shadow'.*max_shadowed=-1"):
        planner_by_name("shadow", max_shadowed=-1)
    with pytest.raises(ValueError, match="min_gain=1.5"):
        ShadowOptions(min_gain=1.5)
    with pytest.raises(ValueError, match="search='best'"):
        planner_by_name("shadow", search="best")
    with pytest.raises(ValueError, match="strategy='shadow' needs a cost model"):
        PLANNERS.build("shadow", LayerContext(4, 1, SHAPE))
    assert ExpertShape(4, 8, "swiglu").param_count == 96 and ExpertShape(4, 8).param_count == 2 * 32 + 12


def test_literal_eq8_would_shadow_a_uniform_load_and_the_planner_does_not():
    """Why the planner keeps the token all-to-all in its shadow cost (module docstring): Eq. 8 as
    printed drops it, so under a perfectly uniform load it already predicts a gain."""
    cm = CostModel.from_preset("johnny")
    d, h, world = 1024, 4096, 16
    loads_W = np.full(world, 8192.0)  # balanced, and B > h: Eq. 9 holds, so literal Eq. 8 "gains"
    # Eq. 7 and Eq. 8 as printed: W_net the slowest link, an expert 2·h·d parameters, no α.
    w_net, p = float(cm.topology.bandwidth_L.min()), cm.gemm_flops_per_s
    eq7 = (3 * 4 * loads_W * h * d / p + 4 * loads_W * d * 4 / w_net).max()
    eq8 = (3 * 4 * loads_W * h * d / p).max() + 2 * 1 * (2 * h * d * 4) / w_net
    literal_gain = eq7 - eq8
    assert literal_gain > 0
    planner = ShadowPlanner(ExpertShape(d, h))
    planner(np.full((world, 32), 8192.0 / 32), Placement.expert_parallel(32, world), cm)
    assert planner.last.shadowed == []
