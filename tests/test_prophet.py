"""Pro-Prophet (§IV-V): the planner as a pure function, its prediction and interval, the cost
formulas by hand; and, on 2 and 4 gloo ranks, training equal to plain EP with and without the
block-wise prefetch (`multirank_prophet`)."""

from __future__ import annotations

import numpy as np
import pytest

from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import Placement, dispatch_counts
from moeflow.core.registry import LayerContext
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.strategies import PLANNERS
from moeflow.strategies.planners.prophet import ProphetOptions, ProphetPlanner, price_placement, prophet_search
from moeflow.strategies.planners.prophet_model import overlapped_copies, prophet_layer_times

from .multirank_prophet import check_prophet_equals_ep

SHAPE = ExpertShape(8, 16)
OWNERS = Placement.expert_parallel(4, 4)


def _cm(bandwidth=1e7, world=4):
    return CostModel(Topology.homogeneous(world, bandwidth), gemm_flops_per_s=1e9)


def test_hot_expert_goes_exactly_to_its_heavy_senders():
    # Expert 0 (rank 0) receives 60 tokens from ranks 1 and 2 each; rank 3 sends it nothing.
    flow = np.array([[10, 1, 1, 1], [60, 1, 1, 1], [60, 1, 1, 1], [0, 1, 1, 1]], float)
    placement, decision = prophet_search(flow, OWNERS, _cm(1e8), SHAPE)
    assert decision.steps[0] == (0, [1, 2])  # the top senders; never rank 3
    assert placement.holders_EW[0].tolist() == [True, True, True, False]
    # keep_out=n (Algorithm 1's n): n of its senders, the lightest, do not receive it.
    placement, decision = prophet_search(flow, OWNERS, _cm(1e8), SHAPE, ProphetOptions(keep_out=1))
    assert decision.steps[0] == (0, [1])


def test_balanced_load_replicates_nothing():
    flow = np.full((4, 4), 25.0)
    placement, decision = prophet_search(flow, OWNERS, _cm(1e12), SHAPE)
    assert decision.steps == [] and decision.accepted == 0 and placement.is_owners_only()


def test_best_prefix_and_growing_transfer_count_eq_1_to_6():
    # Step 1 relieves rank 0 (expert 0 everywhere); step 2 copies expert 1 to rank 0 for 2 tokens,
    # which costs more than it saves: the planner returns the prefix of one step.
    flow = np.array([[40, 2, 1, 1], [40, 50, 1, 1], [40, 0, 1, 1], [40, 0, 1, 1]], float)
    options = ProphetOptions(model="paper", min_gain=0.0, balance_alpha=0.0)
    cm = _cm(1e7)
    placement, decision = prophet_search(flow, OWNERS, cm, SHAPE, options)
    assert decision.steps[:2] == [(0, [1, 2, 3]), (1, [0])] and len(decision.steps) > 2
    assert decision.accepted == 1 == int(np.argmin(decision.predicted_s))
    assert placement.holders_EW.astype(int).tolist() == [[1, 1, 1, 1], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    # Every prefix priced by Eq. 1-6 by hand, with s·(D−n) the copies of *all* steps so far (the
    # public code's counter only moved on accepted steps).
    holders = OWNERS.holders_EW.copy()
    for k, (expert, to) in enumerate([(None, [])] + decision.steps):
        if expert is not None:
            holders[expert, to] = True
        plan_SEW = dispatch_counts(flow.astype(np.int64), Placement(OWNERS.owner_E, holders))
        H_W = plan_SEW.sum((0, 1))
        R_W = H_W - np.einsum("ses->s", plan_SEW)
        bbar, size = cm.mean_bandwidth_bytes_per_s, SHAPE.param_bytes(4)
        copies = int(holders.sum() - 4)
        fec = H_W.max() * SHAPE.forward_flops_per_token / 1e9
        by_hand = 4 * R_W.max() * 8 * 4 / bbar + 3 * fec + 2 * copies * size / (4 * bbar)
        assert decision.predicted_s[k] == pytest.approx(by_hand)
        assert decision.predicted_s[k] == pytest.approx(
            float(prophet_layer_times(cm, R_W, H_W, copies, SHAPE)["total"])
        )


def test_min_gain_margin_keeps_plain_ep():
    flow = np.array([[40, 2, 1, 1], [40, 50, 1, 1], [40, 0, 1, 1], [40, 0, 1, 1]], float)
    _, decision = prophet_search(flow, OWNERS, _cm(1e7), SHAPE, ProphetOptions(min_gain=0.0))
    gain = 1 - decision.predicted_s[decision.accepted] / decision.predicted_s[0]
    assert gain > 0.1
    _, decision = prophet_search(flow, OWNERS, _cm(1e7), SHAPE, ProphetOptions(min_gain=min(0.99, gain + 0.01)))
    assert decision.accepted == 0


def test_eq8_overlap_and_links_model_use_the_shared_cost_model():
    assert float(overlapped_copies(5.0, 9.0, 2.0, 1.0)) == pytest.approx((5 - 2 - 1) + (9 - 4 - 2))
    assert float(overlapped_copies(1.0, 1.0, 2.0, 0.0)) == 0.0
    # Half the windows hide copies: max(0, 5 - 0.5·3) + max(0, 9 - 0.5·6); none: Eq. 6's sum.
    assert float(overlapped_copies(5.0, 9.0, 2.0, 1.0, hidden_share=0.5)) == pytest.approx(3.5 + 6.0)
    assert float(overlapped_copies(5.0, 9.0, 2.0, 1.0, hidden_share=0.0)) == pytest.approx(14.0)
    # The dense part's windows alone (Hecate §3.2's overlap with the attention): max(0, 5 − 1) + max(0, 9 − 2).
    assert float(overlapped_copies(5.0, 9.0, 2.0, 1.0, experts_hide=False)) == pytest.approx(4.0 + 7.0)
    flow = np.array([[10, 1, 1, 1], [60, 1, 1, 1], [60, 1, 1, 1], [0, 1, 1, 1]], float)
    extra = np.zeros((4, 4), dtype=bool)
    extra[0, [1, 2]] = True
    placement = OWNERS.with_holders(extra)
    cm = _cm(1e8)
    plan_SEW = dispatch_counts(flow.astype(np.int64), placement)
    compute, a2a = cm.sync_step_times(plan_SEW.sum(1), plan_SEW.sum(0).T, SHAPE)
    size = SHAPE.param_bytes(4)
    copies = sum(cm.copies_time(size, placement.holders_EW, placement.owner_E, d) for d in ("materialize", "reduce"))
    options = ProphetOptions()
    assert price_placement(flow, placement, cm, SHAPE, options) == pytest.approx(float(compute + a2a) + copies)
    hidden = price_placement(flow, placement, cm, SHAPE, ProphetOptions(overlap=True, nonmoe_forward_s=1.0))
    assert hidden == pytest.approx(float(compute + a2a))  # a second of dense compute hides the copies


def test_planned_from_the_past_with_interval_and_predictor():
    cm = _cm(1e8)
    hot0 = np.array([[10, 1, 1, 1], [60, 1, 1, 1], [60, 1, 1, 1], [0, 1, 1, 1]], float)
    hot2 = hot0[:, [2, 1, 0, 3]]  # expert 2 hot instead
    planner = ProphetPlanner(SHAPE, ProphetOptions(predictor="last"), background=False)
    assert planner(hot0, OWNERS, cm).is_owners_only()  # nothing seen yet: plain EP
    second = planner(hot2, OWNERS, cm)  # runs on the plan made from hot0 (mispredicted)
    assert second == prophet_search(hot0, OWNERS, cm, SHAPE)[0] and second.holders_EW[0, 1]
    assert planner(hot2, OWNERS, cm) == prophet_search(hot2, OWNERS, cm, SHAPE)[0]
    # The moving average over a window of 2; re-planning every 2 calls.
    planner = ProphetPlanner(SHAPE, ProphetOptions(window=2, plan_interval=2), background=False)
    planner(hot0, OWNERS, cm)
    p2 = planner(hot2, OWNERS, cm)
    p3 = planner(hot2, OWNERS, cm)
    assert p2 == p3 == prophet_search(hot0, OWNERS, cm, SHAPE)[0]  # planned at call 1, kept for 2 calls
    p4 = planner(hot0, OWNERS, cm)
    assert p4 == prophet_search((hot2 + hot2) / 2, OWNERS, cm, SHAPE)[0]  # re-planned at call 3
    # The background thread plans the same placements.
    threaded = ProphetPlanner(SHAPE, ProphetOptions(predictor="last"))
    inline = ProphetPlanner(SHAPE, ProphetOptions(predictor="last"), background=False)
    for flow in (hot0, hot2, hot2, hot0):
        assert threaded(flow, OWNERS, cm) == inline(flow, OWNERS, cm)


def test_options_are_checked_by_name():
    ctx = LayerContext(4, 2, SHAPE, _cm())
    assert isinstance(PLANNERS.build("prophet", ctx, {"plan_interval": 3}), ProphetPlanner)
    for bad, key in (
        ({"predictor": "median"}, "predictor"),
        ({"window": 0}, "window"),
        ({"plan_interval": 0}, "plan_interval"),
        ({"min_gain": 1.0}, "min_gain"),
        ({"model": "exact"}, "model"),
        ({"keep_out": -1}, "keep_out"),
        ({"bogus": 1}, "bogus"),
    ):
        with pytest.raises(ValueError, match=key):
            PLANNERS.build("prophet", ctx, bad)
    with pytest.raises(ValueError, match="cost model"):
        PLANNERS.build("prophet", LayerContext(4, 2, SHAPE, None))


@pytest.mark.spawned(body=check_prophet_equals_ep)
@pytest.mark.parametrize("world", [2, 4])
def test_prophet_training_equals_plain_ep(world, shared_spawns):
    shared_spawns.run(check_prophet_equals_ep, world)
