"""`schedule="auto"` as numbers: the block's load from the dispatch plan, the round robin of the
trials, the cheapest corrected price after them, and the simulator's price (the cheapest candidate).
Equality with `sync` on gloo ranks is checked in `multirank_prophet` (model `autos`)."""

from __future__ import annotations

import numpy as np
import pytest

from moeflow import MoELayer
from moeflow.core.expert_shape import ExpertShape
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.strategies import SCHEDULES
from moeflow.strategies.dispatchers import A2ADispatcher
from moeflow.strategies.schedules.auto import AutoSchedule, AutoScheduleOptions, step_load
from moeflow.strategies.schedules.pairwise import PairwiseSchedule
from moeflow.strategies.schedules.sync import SyncSchedule

SHAPE = ExpertShape(8, 16)


def _arbiter(trials=2) -> AutoSchedule:
    cm = CostModel(Topology.homogeneous(4, 1e9), gemm_flops_per_s=1e9)
    return AutoSchedule(
        {"sync": SyncSchedule(), "pairwise": PairwiseSchedule()}, SHAPE, cm, AutoScheduleOptions(trials=trials)
    )


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
        decision = auto.choose(predicted)
        assert decision.exploring
        chosen.append(decision.chosen)
        auto.calls += 1
    assert chosen == ["sync", "pairwise", "sync", "pairwise"]
    # Before any measurement: the model's prices decide.
    assert auto.choose(predicted).chosen == "pairwise" and not auto.choose(predicted).exploring
    # Measured: pairwise's overlap is not there on this machine (3x its prediction) → sync.
    auto.timings["sync"].factor, auto.timings["pairwise"].factor = 1.0, 3.0
    decision = auto.choose(predicted)
    assert decision.chosen == "sync" and decision.prices == {"sync": 1.0, "pairwise": 1.5}


def test_agreement_points_after_the_trials_then_powers_of_two():
    auto = _arbiter(trials=2)
    points = []
    for call in range(1, 20):
        auto.calls = call
        points.append(call) if auto._agreement_point() else None
    assert points == [4, 8, 16]


def test_factors_skip_the_warm_up_call():
    auto = _arbiter()
    timing = auto.timings["sync"]
    timing.measured_s.extend([9.0, 2.0, 2.2, 1.8])
    timing.predicted_s.extend([1.0, 1.0, 1.0, 1.0])
    assert timing.medians() == (2.0, 1.0)


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
    each = [s.predict(step, cm, dispatcher).total_s for s in auto.candidates.values()]
    np.testing.assert_allclose(best.total_s, np.minimum(*each))


def test_options_and_registry_errors():
    cm = CostModel(Topology.homogeneous(2, 1e9), gemm_flops_per_s=1e9)
    with pytest.raises(ValueError, match="candidates='sync,sync'"):
        AutoScheduleOptions(candidates="sync,sync")
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
