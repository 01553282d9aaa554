"""`schedule="auto"` as numbers: the block's load from the dispatch plan, the round robin of the
trials, the preferred corrected price after them (a later candidate only for `min_gain`), the board
that gives a model's layers one schedule per forward, and the simulator's price (the same rules).
Equality with `sync` on gloo ranks, one schedule for both layers in every forward and a data-fed
first layer's backward timing are checked in `multirank_prophet` (model `autos`)."""

from __future__ import annotations

import numpy as np
import pytest

from moeflow import MoELayer
from moeflow.core.expert_shape import ExpertShape
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.strategies import SCHEDULES
from moeflow.strategies.dispatchers import A2ADispatcher
from moeflow.strategies.schedules.auto import (
    AutoSchedule,
    AutoScheduleOptions,
    ScheduleDecision,
    preferred,
    retrial_members,
    round_factors,
    share_schedule_choice,
    step_load,
)
from moeflow.strategies.schedules.pairwise import PairwiseSchedule
from moeflow.strategies.schedules.sync import SyncSchedule

SHAPE = ExpertShape(8, 16)


def _arbiter(trials=2, min_gain=0.03) -> AutoSchedule:
    cm = CostModel(Topology.homogeneous(4, 1e9), gemm_flops_per_s=1e9)
    options = AutoScheduleOptions(trials=trials, min_gain=min_gain)
    return AutoSchedule({"sync": SyncSchedule(), "pairwise": PairwiseSchedule()}, SHAPE, cm, options)


def test_step_load_from_the_dispatch_plan():
    plan_SED = np.zeros((2, 3, 2))
    plan_SED[0, 0, 0], plan_SED[0, 2, 1], plan_SED[1, 1, 0] = 5, 7, 2
    step = step_load(plan_SED, SHAPE, [0, 0])
    np.testing.assert_array_equal(step.send_tokens_WW, [[5, 7], [2, 0]])
    np.testing.assert_array_equal(step.computed_WE, [[5, 2, 0], [0, 0, 7]])


def test_trials_round_robin_then_the_cheapest_corrected_price():
    auto = _arbiter(trials=2)
    predicted = {"sync": 1.0, "pairwise": 0.5}
    chosen = []
    for _ in range(4):
        decision = _call(auto, predicted, {"sync": 1.0, "pairwise": 0.5})
        assert decision.exploring
        chosen.append(decision.chosen)
    assert chosen == ["sync", "pairwise", "pairwise", "sync"]  # rounds alternate direction
    auto.finish_round(None)
    # Both measured at their predictions: the model's prices decide.
    assert auto.choose(predicted).chosen == "pairwise" and not auto.choose(predicted).exploring
    # Measured: pairwise's overlap is not there on this machine (3x its prediction) → sync.
    auto.timings["sync"].factor, auto.timings["pairwise"].factor = 1.0, 3.0
    decision = auto.choose(predicted)
    assert decision.chosen == "sync" and decision.prices == {"sync": 1.0, "pairwise": 1.5}


def test_a_later_candidate_replaces_an_earlier_one_only_for_min_gain():
    assert preferred({"sync": 1.0, "pairwise": 0.98, "pipeline": 0.96}, 0.03) == "pipeline"  # 4% below sync
    assert preferred({"sync": 1.0, "pairwise": 0.90, "pipeline": 0.89}, 0.03) == "pairwise"  # 1% below pairwise
    assert preferred({"sync": 1.0, "pairwise": 0.90, "pipeline": 0.89}, 0.0) == "pipeline"
    assert preferred({"sync": 1.0, "pairwise": 1.0}, 0.0) == "sync"  # ties: the first
    auto = _arbiter(trials=1)
    auto.calls = 2  # past the trials
    assert auto.choose({"sync": 1.0, "pairwise": 0.98}).chosen == "sync"
    assert auto.choose({"sync": 1.0, "pairwise": 0.96}).chosen == "pairwise"
    eager = _arbiter(trials=1, min_gain=0.0)
    eager.calls = 2
    assert eager.choose({"sync": 1.0, "pairwise": 0.98}).chosen == "pairwise"


def test_layers_sharing_a_board_run_the_schedule_cheapest_over_the_model():
    """Layer 0 alone would keep sync (pairwise 1% cheaper there), layer 1 alone pairwise (20%): on one
    board the first layer of each forward picks for both, on the sum over the layers (2.0 vs 1.79
    once both have posted)."""
    first, second = _arbiter(trials=1), _arbiter(trials=1)

    class _Layer:
        def __init__(self, schedule):
            self.schedule = schedule

    assert share_schedule_choice([_Layer(first)]) is None  # one arbiter: nothing to share
    board = share_schedule_choice([_Layer(first), _Layer(SyncSchedule()), _Layer(second)])
    assert first.board is board and second.board is board
    first.calls = second.calls = 2  # past the trials
    assert first.choose({"sync": 1.0, "pairwise": 0.99}).chosen == "sync"  # only its own prices yet
    assert second.choose({"sync": 1.0, "pairwise": 0.8}).chosen == "sync"  # this forward is decided
    first.calls = second.calls = 3
    assert first.choose({"sync": 1.0, "pairwise": 0.99}).chosen == "pairwise"  # with layer 1's 0.8
    assert board.total(id(first), {"sync": 1.0, "pairwise": 0.99}) == pytest.approx({"sync": 2.0, "pairwise": 1.79})
    assert second.choose({"sync": 1.0, "pairwise": 1.5}).chosen == "pairwise"  # decided: pairwise, dear or not
    # The next forward: a dearer pairwise in layer 1 turns the whole model to sync (2.0 vs 2.49).
    first.calls = second.calls = 4
    assert first.choose({"sync": 1.0, "pairwise": 0.99}).chosen == "sync"
    other = AutoSchedule({"sync": SyncSchedule()}, SHAPE, first.cost_model)
    with pytest.raises(ValueError, match="different candidates"):
        share_schedule_choice([_Layer(first), _Layer(other)])


def _call(auto: AutoSchedule, predicted: dict[str, float], cost_s: dict[str, float]) -> ScheduleDecision:
    """One call as `execute` makes it, without a group: a round that has run is agreed, then the
    choice, measured at `cost_s` when in a round."""
    if auto.round is not None and auto.calls >= auto.round.end:
        auto.finish_round(None)
    decision = auto.choose(predicted)
    if decision.exploring:
        auto.round.timed[decision.chosen] = ([cost_s[decision.chosen], 0.0], predicted[decision.chosen])
    auto.calls += 1
    return decision


def _run_round(auto: AutoSchedule, predicted: dict[str, float], cost_s: dict[str, float]) -> list[str]:
    """The calls of the round due now, and its agreement; returns the round's order."""
    orders = [_call(auto, predicted, cost_s).chosen]
    while auto.calls < auto.round.end:
        orders.append(_call(auto, predicted, cost_s).chosen)
    auto.finish_round(None)
    return orders


def test_rounds_after_the_trials_every_few_forwards_among_the_close_candidates():
    """Trials: every candidate, each round reversed; then a re-trial round every `retrial_every`
    forwards of the chosen schedule and the candidates priced within `retrial_band` of it."""
    cm = CostModel(Topology.homogeneous(4, 1e9), gemm_flops_per_s=1e9)
    options = AutoScheduleOptions(trials=2, retrial_every=3, retrial_band=0.1)
    schedules = {"sync": SyncSchedule(), "pairwise": PairwiseSchedule(), "pipeline": PairwiseSchedule()}
    auto = AutoSchedule(schedules, SHAPE, cm, options)
    predicted = {"sync": 1.0, "pairwise": 1.0, "pipeline": 1.0}
    orders = [_run_round(auto, predicted, {"sync": 1.3, "pairwise": 1.0, "pipeline": 1.05}) for _ in range(2)]
    assert orders == [["sync", "pairwise", "pipeline"], ["pipeline", "pairwise", "sync"]]
    assert len(auto.rounds) == 1  # the first round: a warm-up
    assert auto.timings["pipeline"].factor == pytest.approx(1.05)
    between = []
    while not (decision := auto.choose(predicted)).exploring:
        between.append(decision.chosen)
        auto.calls += 1
    assert between == ["pairwise"] * 3  # 3 forwards, then a round
    assert auto.round.order == ["pairwise", "pipeline"]  # sync priced 30% above pairwise: not re-tried
    assert retrial_members({"sync": 1.3, "pairwise": 1.0, "pipeline": 1.2}, "pairwise", 0.1) == []
    with pytest.raises(ValueError, match="retrial_every=0"):
        AutoScheduleOptions(retrial_every=0)
    with pytest.raises(ValueError, match="retrial_band=-0.1"):
        AutoScheduleOptions(retrial_band=-0.1)


def test_a_slow_spell_of_the_running_schedule_moves_every_factor_alike():
    """pairwise is 10% cheaper than sync on this machine; after the trials the machine slows by 30%
    for a while, then recovers. Factors from each candidate's own latest calls priced the running
    pairwise at its slow-spell times against sync's trial times and switched; compared within
    rounds, pairwise keeps running throughout."""
    auto = _arbiter(trials=3)
    auto.options = AutoScheduleOptions(trials=3, retrial_every=4, retrial_band=0.5)
    predicted = {"sync": 1.0, "pairwise": 1.0}
    chosen = []
    for forward in range(60):
        speed = 1.3 if 10 <= forward < 40 else 1.0
        decision = _call(auto, predicted, {"sync": speed * 1.0, "pairwise": speed * 0.9})
        if not decision.exploring:
            chosen.append(decision.chosen)
    assert set(chosen) == {"pairwise"} and len(chosen) > 20
    assert auto.timings["sync"].factor / auto.timings["pairwise"].factor == pytest.approx(1 / 0.9)


def test_the_factors_are_paired_within_rounds():
    """Each round's ratios (measured / predicted per call: the calls ran different flows); the
    reference (in most rounds) at its median, the others at theirs over it in the rounds both ran."""
    rounds = [{"sync": 2.0, "pairwise": 1.0}, {"sync": 4.0, "pairwise": 2.2}, {"pairwise": 9.0}, {"pairwise": 1.1}]
    factors = round_factors(rounds, ["sync", "pairwise"])
    assert factors["pairwise"] == pytest.approx(1.65)  # median of 1.0, 2.2, 9.0, 1.1
    assert factors["sync"] == pytest.approx(1.65 * np.median([2.0, 4.0 / 2.2]))
    assert round_factors([], ["sync"]) == {}
    assert round_factors([{"sync": 2.0}], ["sync", "pairwise"]) == {"sync": 2.0}  # pairwise: none yet
    # A round's backward: counted when every member's ran, else forward only for all (evaluation).
    from moeflow.strategies.schedules.auto import _Round

    whole = _Round(0, 0, ["sync", "pairwise"], {"sync": ([1.0, 1.0], 1.0), "pairwise": ([1.0, 0.5], 0.5)})
    assert whole.ratios() == {"sync": 2.0, "pairwise": 3.0}
    partial = _Round(0, 0, ["sync", "pairwise"], {"sync": ([1.0, 1.0], 1.0), "pairwise": ([1.0, None], 0.5)})
    assert partial.ratios() == {"sync": 1.0, "pairwise": 2.0}


def test_placements_are_priced_with_the_running_schedules_correction():
    """A placement's price comes from the correction fitted on the layers the running schedule ran:
    where pairwise was measured to hide the exchanges, copies that only cut the exchange stop paying."""
    from moeflow.core.placement import Placement
    from moeflow.strategies.planners.auto import AutoPlanner, layer_terms
    from moeflow.strategies.planners.auto_correction import Correction

    cm = CostModel(Topology.homogeneous(4, 1e6), gemm_flops_per_s=1e9)
    shape = ExpertShape(64, 128)
    flow = np.full((4, 4), 10)
    flow[:, 0] = 400  # expert 0 hot
    owners = Placement.expert_parallel(4, 4)
    extra_EW = np.zeros((4, 4), dtype=bool)
    extra_EW[0] = True
    copied = owners.with_holders(extra_EW)
    auto = AutoPlanner(shape, {})
    auto.correction.by_schedule["pairwise"] = Correction(comm=0.01)  # measured: pairwise hides the exchanges
    prices = {}
    for schedule in ("sync", "pairwise"):
        auto.running_schedule = schedule
        prices[schedule] = {
            n: auto.price(layer_terms(flow, p, cm, shape)) for n, p in {"ep": owners, "copy": copied}.items()
        }
    assert prices["sync"]["copy"] < prices["sync"]["ep"]  # no fit of its own yet: the pooled one (1s)
    assert prices["pairwise"]["ep"] < prices["pairwise"]["copy"]


def test_simulator_price_is_the_cheapest_candidate_per_iteration():
    auto = _arbiter()
    cm = auto.cost_model
    send = np.full((3, 4, 4), 1000.0)
    send[1] *= 50  # iteration 1: heavy traffic
    computed = np.full((3, 4, 8), 500.0)
    from moeflow.strategies.schedules.base import StepLoad

    step = StepLoad(send, computed, SHAPE, [0, 1, 2, 3])
    dispatcher = A2ADispatcher()
    best = auto.predict(step, cm, dispatcher)
    sync, pairwise = (s.predict(step, cm, dispatcher).total_s for s in auto.candidates.values())
    np.testing.assert_allclose(best.total_s, np.where(pairwise < 0.97 * sync, pairwise, sync))
    eager = _arbiter(min_gain=0.0)
    np.testing.assert_allclose(eager.predict(step, cm, dispatcher).total_s, np.minimum(sync, pairwise))
    # Over (iterations, layers): one schedule per iteration for every layer, on the sum over layers.
    send_IL = np.stack([send, send[::-1] * 0.2])  # [2 iterations, 3 layers, W, W]
    step_IL = StepLoad(send_IL, np.stack([computed, computed]), SHAPE, [0, 1, 2, 3])
    sync, pairwise = (s.predict(step_IL, cm, dispatcher).total_s for s in auto.candidates.values())
    take_I = pairwise.sum(1) < 0.97 * sync.sum(1)
    np.testing.assert_allclose(auto.predict(step_IL, cm, dispatcher).total_s, np.where(take_I[:, None], pairwise, sync))
    alone_IL = pairwise < 0.97 * sync
    assert (alone_IL.any(1) & ~alone_IL.all(1)).all()  # not vacuous: alone, the layers would disagree


def test_options_and_registry_errors():
    cm = CostModel(Topology.homogeneous(2, 1e9), gemm_flops_per_s=1e9)
    with pytest.raises(ValueError, match="candidates='sync,sync'"):
        AutoScheduleOptions(candidates="sync,sync")
    with pytest.raises(ValueError, match="min_gain=1.5"):
        AutoScheduleOptions(min_gain=1.5)
    with pytest.raises(ValueError, match="trials"):
        AutoScheduleOptions(trials=0)
    with pytest.raises(ValueError, match=r"unknown \['fast'\]"):
        MoELayer(8, 16, 4, schedule="auto", schedule_options={"candidates": "sync,fast"}, cost_model=cm)
    with pytest.raises(ValueError, match="needs a cost model"):
        MoELayer(8, 16, 4, schedule="auto")
    # Every registered schedule but itself by default; pairwise left out with another dispatcher.
    layer = MoELayer(8, 16, 4, schedule="auto", cost_model=cm, dispatch="hierarchical")
    assert "pairwise" not in layer.schedule.candidates and "sync" in layer.schedule.candidates
    assert set(MoELayer(8, 16, 4, schedule="auto", cost_model=cm).schedule.candidates) == set(SCHEDULES) - {"auto"}
