"""`strategy="auto"`: the choice on hand-built cost models where the answer is known, the per-term
correction recovering known scales, the placement sent ahead priced as hidden, its options;
equality with plain EP on 2 and 4 gloo ranks (and the factors agreed across ranks) runs in
`multirank_prophet`."""

from __future__ import annotations

import numpy as np
import pytest

from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import Placement
from moeflow.core.registry import LayerContext
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.strategies import PLANNERS
from moeflow.strategies.planners.auto import AutoOptions, layer_terms
from moeflow.strategies.planners.base import PrefetchWindow
from moeflow.strategies.timing import Sample

SHAPE = ExpertShape(8, 16)
OWNERS = Placement.expert_parallel(4, 4)


def _auto(bandwidth, shape=SHAPE, flops=1e7, **options):
    cm = CostModel(Topology.homogeneous(4, bandwidth), gemm_flops_per_s=flops)
    return PLANNERS.build("auto", LayerContext(4, 2, shape, cm), options), cm


def _skewed():
    flow = np.full((4, 4), 2)
    flow[:, 0] = 400
    return flow


def _measured(t, compute=1.0, exchange=1.0, copies=1.0) -> Sample:
    """The forward of terms `t` on a machine `compute`/`exchange`/`copies` × the model."""
    return Sample(copies * t.copies_forward, compute * t.compute, compute * t.compute + exchange * t.exchange)


def test_heavy_skew_with_cheap_copies_leaves_ep():
    auto, cm = _auto(1e12)
    placement = auto(_skewed(), OWNERS, cm)
    assert auto.choice() != "ep" and not placement.is_owners_only()
    assert auto.last.prices_s[auto.choice()] < 0.97 * auto.last.prices_s["ep"]
    assert list(auto.last.prices_s) == ["ep", "shadow", "prophet", "eplb", "fssdp"]  # every candidate, every call


def test_slow_network_or_balanced_load_stays_ep():
    auto, cm = _auto(1e3, ExpertShape(8, 8192))  # moving a large expert costs more than it saves
    assert auto(_skewed(), OWNERS, cm).is_owners_only() and auto.choice() == "ep"
    auto, cm = _auto(1e12)
    assert auto(np.full((4, 4), 50), OWNERS, cm).is_owners_only() and auto.choice() == "ep"


def test_break_even_few_tokens_stay_ep():
    # One skew, two sizes: 16 tokens save less than copying a 17 KB expert three times costs;
    # 16000 tokens save more.
    auto, cm = _auto(1e6, ExpertShape(8, 256), flops=1e9)
    few = np.full((4, 4), 0)
    few[:, 0] = 4
    assert auto(few, OWNERS, cm).is_owners_only() and auto.choice() == "ep"
    assert not auto(few * 1000, OWNERS, cm).is_owners_only()


def test_the_correction_learns_a_machine_twice_as_slow():
    auto, cm = _auto(1e6, candidates="ep,shadow")  # the hot expert shadowed, the rest exchanged
    for _ in range(3):
        auto(_skewed(), OWNERS, cm)
        t = auto.pending[-1]
        assert t.copies_forward > 0  # shadowing's copies, sent now
        auto.observe_time([_measured(t, 2.0, 2.0, 2.0)])
    assert [auto.factor(term) for term in ("compute", "exchange", "copies")] == pytest.approx([2.0] * 3)
    assert auto.price(t) == pytest.approx(2.0 * (3 * t.compute + 2 * t.exchange + t.copies))
    assert auto.model_error() == pytest.approx(0.5 / 3)  # the first of three forecasts used factors of 1
    auto(_skewed(), OWNERS, cm)
    auto.observe_time([_measured(auto.pending[-1], 2.0, 2.0, 2.0)])
    assert auto.errors[-1][0] == pytest.approx(auto.errors[-1][1])  # learned: forecast = measured


@pytest.mark.parametrize("copies_factor, after", [(1.0, "shadow"), (3.0, "ep")])
def test_copies_dearer_than_modelled_are_learnt_apart_from_the_exchanges(copies_factor, after):
    """EP's terms priced right, copies costing `copies_factor` × the model: having chosen the copies
    on the model's word, `auto` returns to EP after one measured forward of them when they cost 3×,
    and keeps them when the model was right. The exchanges' factor stays 1."""
    shape = ExpertShape(8, 1024)
    auto, cm = _auto(1e4, shape, candidates="ep,shadow")
    rng = np.random.default_rng(0)
    chosen = []
    for flow in [rng.integers(5, 60, (4, 4)) for _ in range(3)] + [_skewed()] * 4:
        auto(flow, OWNERS, cm)
        chosen.append(auto.choice())
        auto.observe_time([_measured(auto.pending[-1], copies=copies_factor)])
    assert chosen == ["ep"] * 3 + ["shadow"] + [after] * 3
    assert auto.factor("exchange") == pytest.approx(1.0) and auto.factor("copies") == pytest.approx(copies_factor)


def test_measurements_pair_with_the_latest_planned_forwards():
    auto, cm = _auto(1e12, candidates="ep,shadow")
    for _ in range(3):
        auto(_skewed(), OWNERS, cm)
    t = auto.pending[-1]
    auto.observe_time([_measured(t, compute=5.0)] * 2)  # two forwards measured: the last two planned
    assert auto.factor("compute") == pytest.approx(5.0) and not auto.pending


def test_the_placement_sent_ahead_is_priced_as_hidden_and_offered_to_the_prefetch():
    # A slow network: the copies a step ahead hide behind the dense compute, those sent now do not.
    auto, cm = _auto(1e5, candidates="ep,prophet")
    auto.use_prefetch(PrefetchWindow(nonmoe_forward_s=10.0, hidden_share=1.0))  # as BlockPrefetch sets it
    assert auto.planners["prophet"].prefetch == auto.prefetch  # handed on to the planners that plan ahead
    assert auto.next_placement() is None  # nothing won yet
    auto(_skewed(), OWNERS, cm)  # prophet has no plan yet: EP
    auto.next_placement()
    auto(_skewed(), OWNERS, cm)  # its plan is the one sent ahead: priced hidden, it wins
    assert auto.choice() == "prophet"
    planned = auto.next_placement()
    assert planned is not None and not planned.is_owners_only() and auto.sent_ahead == planned
    assert auto(_skewed(), OWNERS, cm) == planned and auto.choice() == "prophet"
    sent_now = auto.price(layer_terms(_skewed(), planned, cm, SHAPE, cm.topology.node_of))
    assert auto.last.prices_s["prophet"] < sent_now and auto.pending[-1].copies_forward == 0.0
    assert auto.sent_ahead is None  # one call's


def test_options_name_the_bad_value():
    with pytest.raises(ValueError, match="candidates='ep,magic'"):
        AutoOptions(candidates="ep,magic")
    with pytest.raises(ValueError, match="min_gain"):
        AutoOptions(min_gain=1.5)
    with pytest.raises(ValueError, match="smoothing"):
        AutoOptions(smoothing=0.0)
    with pytest.raises(ValueError, match="searches='sometimes'"):
        AutoOptions(searches="sometimes")
    auto, _ = _auto(1e12, candidates="shadow")
    assert list(auto.planners) == ["ep", "shadow"]  # plain EP, the guard's reference, always
    with pytest.raises(ValueError, match="needs cost_model"):
        auto(_skewed(), OWNERS)


def test_one_candidate_searches_per_call_in_turn_and_the_others_plans_stand():
    """In turns the planning thread gets one search per call (`AutoPlanner.replanned`); a candidate
    out of turn runs its standing plan, records the flow and starts nothing (`Planner.hold`)."""
    auto, cm = _auto(1e12, searches="turns")
    assert auto.searching == ["prophet", "eplb", "fssdp"]  # shadowing decides on the current flow
    turns, plans = [], []
    for call in range(7):
        auto(_skewed() + call, OWNERS, cm)
        turns.append(auto.replanned)
        plans.append({n: auto.planners[n].next_placement() for n in auto.searching})
    assert turns == [["prophet"], ["eplb"], ["fssdp"]] * 2 + [["prophet"]]
    for call in range(1, 7):
        for name in auto.searching:
            if name not in turns[call]:
                assert plans[call][name] is plans[call - 1][name]  # the plan stood
    assert all(np.array_equal(auto.planners[n].history[-1], _skewed() + 6) for n in auto.searching)  # recorded


@pytest.mark.parametrize("searches, world, turns", [("auto", 4, False), ("auto", 64, True), ("all", 64, False)])
def test_small_layers_search_every_candidate_every_call(searches, world, turns):
    """`searches="auto"`: every candidate searches every call below `TURNS_FROM` ranks × experts."""
    cm = CostModel(Topology.homogeneous(world, 1e12), gemm_flops_per_s=1e7)
    auto = PLANNERS.build("auto", LayerContext(world, 2, SHAPE, cm), {"searches": searches})
    flow = np.full((world, world), 2)
    flow[:, 0] = 400
    auto(flow, Placement.expert_parallel(world, world), cm)
    assert auto.replanned == (["prophet"] if turns else ["prophet", "eplb", "fssdp"])


def test_hold_runs_the_standing_plan_without_starting_a_search():
    auto, cm = _auto(1e12)
    prophet = auto.planners["prophet"]
    prophet(_skewed(), OWNERS, cm)  # plans the next call on the planning thread
    planned = prophet.next_placement()
    assert planned is not None and not planned.is_owners_only()
    assert prophet.hold(_skewed(), OWNERS, cm) == planned
    assert prophet.next_plan._plan[0] is planned  # no future: the same plan stands for the next call
    assert prophet.hold(_skewed() * 2, OWNERS, cm) == planned and len(prophet.history) == 3


@pytest.mark.parametrize("fractional", [False, True])
def test_shadowing_inside_auto_decides_as_shadowing_alone(fractional):
    # `auto` hands its pricer of the call's flow to shadowing (`Planner.on_pricer`) where the flow
    # is whole counts; a fractional flow (a mean of replicas' flows) is priced by shadowing itself.
    rng = np.random.default_rng(3)
    cm = CostModel.from_preset("johnny@16")
    owners = Placement.expert_parallel(32, 16)
    shape = ExpertShape(64, 256)
    auto = PLANNERS.build("auto", LayerContext(32, 2, shape, cm), {"candidates": "ep,shadow"})
    alone = PLANNERS.build("shadow", LayerContext(32, 2, shape, cm))
    shadowed = 0
    for skew in np.linspace(0.0, 2.5, 12):
        weights = np.arange(1, 33, dtype=np.float64) ** -skew
        flow = rng.multinomial(4096, weights / weights.sum(), size=16).astype(np.float64)
        if fractional:
            flow = flow + rng.choice([0.0, 0.5], size=flow.shape)
        auto(flow, owners, cm)
        assert auto.planners["shadow"].last == alone.decide(flow, owners, cm)
        shadowed += bool(auto.planners["shadow"].last.shadowed)
    assert 0 < shadowed < 12  # decisions both ways


def test_the_candidates_record_and_search_after_the_call_and_their_readers_wait():
    """`auto` returns before its candidates record the flow and search (one job on the planning
    thread, `_after_call`); whoever reads a candidate's next plan, a copy or the next call waits for
    that job, so each sees what running it inline gives."""
    import pickle

    auto, cm = _auto(1e12)
    inline, _ = _auto(1e12)
    for call in range(4):
        flow = _skewed() + 3 * call
        auto(flow, OWNERS, cm)
        for planner in inline.planners.values():  # the same steps, one after the other, on this thread
            if planner.plans_ahead:
                planner.current(flow, OWNERS, cm)
                planner.record(flow, OWNERS, cm, search=True)
        for name in auto.searching:
            assert auto.planners[name].next_placement() == inline.planners[name].next_placement()
            assert np.array_equal(auto.planners[name].history[-1], flow)
    copy = pickle.loads(pickle.dumps(auto))  # the job settled first: a checkpoint carries its result
    assert np.array_equal(copy.planners["eplb"].history[-1], _skewed() + 9)


def test_a_candidate_whose_search_fails_fails_its_readers_not_hangs_them():
    auto, cm = _auto(1e12)
    auto(_skewed(), OWNERS, cm)
    for name in auto.searching:  # the first call's job done (its plans made)
        auto.planners[name].next_placement()

    def broken(*args):
        raise RuntimeError("search failed")

    auto.planners["eplb"].search = lambda *args: (broken, ())
    auto(_skewed(), OWNERS, cm)
    with pytest.raises(RuntimeError, match="search failed"):
        auto.planners["eplb"].next_placement()
    with pytest.raises(RuntimeError, match="search failed"):
        auto.planners["fssdp"].next_placement()  # recorded after the failed one: never made
    with pytest.raises(RuntimeError, match="search failed"):
        auto(_skewed(), OWNERS, cm)  # the next call meets the job's error
