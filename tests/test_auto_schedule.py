"""`schedule="auto"` as numbers: the block's load from the dispatch plan, two rounds of trials (the
first a warm-up), then the cheapest corrected price (a later candidate only for `min_gain`), the
level an unmeasured candidate takes, and the simulator's price (the same rule). Equality with
`sync` on gloo ranks and the factors agreed across ranks are checked in `multirank_prophet`."""

from __future__ import annotations

import numpy as np
import pytest

from moeflow import MoELayer
from moeflow.core.expert_shape import ExpertShape
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.strategies.dispatchers import A2ADispatcher
from moeflow.strategies.schedules.auto import AutoSchedule, AutoScheduleOptions, preferred
from moeflow.strategies.schedules.base import StepLoad
from moeflow.strategies.schedules.pairwise import PairwiseSchedule
from moeflow.strategies.schedules.sync import SyncSchedule
from moeflow.strategies.timing import Sample

SHAPE = ExpertShape(8, 16)


def _arbiter(min_gain=0.03, smoothing=1.0) -> AutoSchedule:
    cm = CostModel(Topology.homogeneous(4, 1e9), gemm_flops_per_s=1e9)
    options = AutoScheduleOptions(min_gain=min_gain, smoothing=smoothing)
    return AutoSchedule({"sync": SyncSchedule(), "pairwise": PairwiseSchedule()}, SHAPE, cm, options)


def _run(auto: AutoSchedule, predicted: dict, cost_s: dict, forwards: int) -> list[str]:
    """`forwards` forwards, each candidate measured at `cost_s`; their times agreed after them."""
    chosen = [auto.decide(predicted) for _ in range(forwards)]
    auto.observe_time([Sample(0.0, 0.0, cost_s[name]) for name in chosen])
    return chosen


def test_step_load_from_the_dispatch_plan():
    plan_SEW = np.zeros((2, 3, 2))
    plan_SEW[0, 0, 0], plan_SEW[0, 2, 1], plan_SEW[1, 1, 0] = 5, 7, 2
    step = StepLoad.of_plan(plan_SEW, SHAPE, [0, 0])
    np.testing.assert_array_equal(step.send_tokens_WW, [[5, 7], [2, 0]])
    np.testing.assert_array_equal(step.computed_WE, [[5, 2, 0], [0, 0, 7]])


def test_two_rounds_of_trials_then_the_cheapest_corrected_price():
    auto = _arbiter()
    predicted = {"sync": 1.0, "pairwise": 0.5}
    # Measured: pairwise's overlap is not there on this machine (3x its prediction) → sync.
    assert _run(auto, predicted, {"sync": 1.0, "pairwise": 1.5}, 4) == ["sync", "pairwise"] * 2
    assert auto.factors["sync"].value == 1.0 and auto.factors["pairwise"].value == 3.0  # warm-up round left out
    assert _run(auto, predicted, {"sync": 1.0, "pairwise": 1.5}, 3) == ["sync"] * 3
    assert auto.last == {"sync": 1.0, "pairwise": 1.5}
    # The machine changes: sync slows to 2x; pairwise's old factor now prices it lower.
    assert _run(auto, predicted, {"sync": 2.0, "pairwise": 1.5}, 2) == ["sync"] * 2
    assert auto.decide(predicted) == "pairwise"


def test_a_later_candidate_replaces_an_earlier_one_only_for_min_gain():
    assert preferred(np.array([1.0, 0.98]), 0.03) == 0 and preferred(np.array([1.0, 0.96]), 0.03) == 1
    assert preferred(np.array([1.0, 0.98]), 0.0) == 1
    np.testing.assert_array_equal(preferred(np.array([[1.0, 1.0], [0.98, 0.5], [0.99, 0.4]]), 0.03), [0, 2])


def test_an_unmeasured_candidate_takes_the_level_of_the_measured():
    auto = _arbiter()
    auto.factors["sync"].update(2.0, 1.0)
    assert auto.prices({"sync": 1.0, "pairwise": 0.8}) == {"sync": 2.0, "pairwise": 1.6}


def test_simulator_price_is_the_preferred_candidate_per_iteration_and_layer():
    auto = _arbiter()
    cm = auto.cost_model
    send = np.full((3, 2, 4, 4), 1000.0)
    send[1] *= 50  # iteration 1: heavy traffic
    step = StepLoad(send, np.full((3, 2, 4, 8), 500.0), SHAPE, [0, 1, 2, 3])
    dispatcher = A2ADispatcher()
    best = auto.predict(step, cm, dispatcher)
    sync, pairwise = (s.predict(step, cm, dispatcher) for s in auto.candidates.values())
    take = pairwise.total_s < 0.97 * sync.total_s
    assert take.any() and not take.all()  # not vacuous: each wins somewhere
    np.testing.assert_allclose(best.total_s, np.where(take, pairwise.total_s, sync.total_s))
    np.testing.assert_allclose(best.compute_s, np.where(take, pairwise.compute_s, sync.compute_s))
    eager = _arbiter(min_gain=0.0)
    np.testing.assert_allclose(eager.predict(step, cm, dispatcher).total_s, np.minimum(sync.total_s, pairwise.total_s))


def test_options_and_registry_errors():
    cm = CostModel(Topology.homogeneous(2, 1e9), gemm_flops_per_s=1e9)
    with pytest.raises(ValueError, match="candidates='sync,sync'"):
        AutoScheduleOptions(candidates="sync,sync")
    with pytest.raises(ValueError, match="min_gain=1.5"):
        AutoScheduleOptions(min_gain=1.5)
    with pytest.raises(ValueError, match="smoothing"):
        AutoScheduleOptions(smoothing=2.0)
    with pytest.raises(ValueError, match=r"unknown \['fast'\]"):
        MoELayer(8, 16, 4, schedule="auto", schedule_options={"candidates": "sync,fast"}, cost_model=cm)
    with pytest.raises(ValueError, match="needs a cost model"):
        MoELayer(8, 16, 4, schedule="auto")
    # Every registered schedule but itself by default; pairwise left out with another dispatcher.
    layer = MoELayer(8, 16, 4, schedule="auto", cost_model=cm, dispatch="hierarchical")
    assert "pairwise" not in layer.schedule.candidates and "sync" in layer.schedule.candidates


def test_a_cost_model_of_another_group_runs_the_simplest_candidate(tmp_path):
    """A resume on another process count: the layer runs without the cost model's group size, and
    `schedule="auto"` has nothing to price — `sync` runs (it used to fail on the plan's shape)."""
    import torch
    import torch.distributed as dist

    cm = CostModel(Topology.homogeneous(2, 1e9), gemm_flops_per_s=1e9)  # two devices; the group has one
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        layer = MoELayer(8, 16, 4, schedule="auto", cost_model=cm).to_expert_parallel(dist.group.WORLD)
        assert layer.cluster_mismatch
        y = layer(torch.randn(10, 8))
        assert y.shape == (10, 8) and layer.stats.schedule == "sync"
    finally:
        dist.destroy_process_group()


def test_a_resumed_schedule_continues_where_the_run_stopped():
    # A checkpoint carries `state()`: the trial rounds are behind the resumed run and the factors
    # price as before, so it chooses what the uninterrupted run chooses.
    predicted, cost_s = {"sync": 1.0, "pairwise": 0.5}, {"sync": 1.0, "pairwise": 1.5}
    run = _arbiter()
    _run(run, predicted, cost_s, 5)
    resumed = _arbiter()
    resumed.load_state(run.state())
    assert _run(resumed, predicted, cost_s, 4) == _run(run, predicted, cost_s, 4) == ["sync"] * 4
    assert resumed.state() == run.state()
    afresh = _arbiter()  # without the state: two trial rounds again
    assert _run(afresh, predicted, cost_s, 4) == ["sync", "pairwise"] * 2
    other = AutoSchedule({"sync": SyncSchedule()}, SHAPE, run.cost_model)  # other candidates: afresh
    other.load_state(run.state())
    assert other.calls == 0
