"""`strategy="auto"`: the arbiter's choice on hand-built cost models where the answer is known, the
online correction recovering known scales, its options; equality with plain EP on 2 and 4 gloo ranks
runs in `multirank_prophet`."""

from __future__ import annotations

import numpy as np
import pytest

from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import Placement
from moeflow.core.registry import LayerContext
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.strategies import PLANNERS
from moeflow.strategies.planners.auto import AutoOptions, AutoPlanner, layer_terms
from moeflow.strategies.planners.auto_rest import duplicates

SHAPE = ExpertShape(8, 16)
OWNERS = Placement.expert_parallel(4, 4)


def _auto(bandwidth, shape=SHAPE, flops=1e7, **options):
    cm = CostModel(Topology.homogeneous(4, bandwidth), gemm_flops_per_s=flops)
    return PLANNERS.build("auto", LayerContext(4, 2, shape, cm), options), cm


def _skewed():
    flow = np.full((4, 4), 2)
    flow[:, 0] = 400
    return flow


def test_heavy_skew_with_cheap_copies_leaves_ep():
    auto, cm = _auto(1e12)
    placement = auto(_skewed(), OWNERS, cm)
    assert auto.chosen != "ep" and not placement.is_owners_only()
    assert auto.last.prices_s[auto.chosen] < 0.97 * auto.last.prices_s["ep"]


def test_slow_network_or_balanced_load_stays_ep():
    auto, cm = _auto(1e3, ExpertShape(8, 8192))  # moving a large expert costs more than it saves
    assert auto(_skewed(), OWNERS, cm).is_owners_only() and auto.chosen == "ep"
    auto, cm = _auto(1e12)
    assert auto(np.full((4, 4), 50), OWNERS, cm).is_owners_only() and auto.chosen == "ep"


def test_break_even_few_tokens_stay_ep():
    # One skew, two sizes: 16 tokens save less than copying a 17 KB expert three times costs;
    # 16000 tokens save more.
    auto, cm = _auto(1e6, ExpertShape(8, 256), flops=1e9)
    few = np.full((4, 4), 0)
    few[:, 0] = 4
    assert auto(few, OWNERS, cm).is_owners_only() and auto.chosen == "ep"
    many = few * 1000
    assert not auto(many, OWNERS, cm).is_owners_only()


def test_online_correction_learns_a_machine_twice_as_slow():
    auto, cm = _auto(1e12, min_observations=2)
    for _ in range(4):  # every forward and backward measured twice as slow as predicted, copies included
        auto(_skewed(), OWNERS, cm)
        t = auto._pending
        assert t.copies > 0 and not t.prefetched
        forward, backward = (2.0 * float(np.sum(half)) for half in t.halves())
        auto.observe_time(
            np.array([forward, 0.5 * forward]),
            np.array([t.copies, 0.5 * t.copies]),  # sent now: the slowest rank's wait, 2× its half
            backward_s_W=np.array([0.5 * backward, backward]),
            copies_backward_s_W=np.array([0.25 * t.copies, t.copies]),
        )
    forecast, measured = auto.correction.forecasts[-1]  # out of sample; the one before came from two
    assert forecast == pytest.approx(measured, rel=1e-6) and auto.model_error() < 0.01  # equal layers
    assert measured == pytest.approx(2.0 * (t.compute + t.exchange + t.copies))  # forward + backward
    assert auto.correction.pooled.time(t) == pytest.approx(2.0 * (t.compute + t.exchange + t.copies))
    assert auto.correction.pooled.copy == pytest.approx(2.0) and auto.correction.pooled.copy_back == pytest.approx(2.0)


@pytest.mark.parametrize("copies_factor, after", [(1.0, "shadow"), (3.0, "ep")])
def test_copies_dearer_than_modelled_are_learnt_apart_from_the_exchanges(copies_factor, after):
    """A machine where EP's terms are priced right and copies cost `copies_factor` × the model: the
    arbiter, having chosen the copies on the model's word, returns to EP after one forward of them
    when they cost 3× (and keeps them when the model was right). A single communication factor
    learnt 'exchanges cost 3×' from the same forwards and kept the copies."""
    shape = ExpertShape(8, 1024)
    auto, cm = _auto(1e4, shape, candidates="ep,shadow", min_observations=2)
    node_of, rng = cm.topology.node_of, np.random.default_rng(0)

    def run(flow) -> str:
        terms = layer_terms(flow, auto(flow, OWNERS, cm), cm, shape, node_of)
        forward, backward = (float(np.dot(half, (1.0, 1.0, copies_factor))) for half in terms.halves())
        auto.observe_time(np.array([forward]), backward_s_W=np.array([backward]))
        return auto.chosen

    assert {run(rng.integers(5, 60, (4, 4))) for _ in range(6)} == {"ep"}  # mild loads: the fit learns EP
    skewed = np.full((4, 4), 2)
    skewed[:, 0] = 400
    assert [run(skewed) for _ in range(4)] == ["shadow"] + [after] * 3
    c = auto.correction.pooled
    assert (c.comp, c.comm, c.copy, c.copy_back) == pytest.approx((1.0, 1.0, copies_factor, copies_factor), rel=1e-6)


def test_copies_timed_apart_are_learnt_while_one_placement_keeps_running():
    """Only copies ran (no EP forward to learn the exchanges from), the rest of each forward jittered
    ±10% as a real machine's is: with the copies' wait timed apart the fit finds them 3× dearer and
    the arbiter returns to EP. From the forward's total alone the terms move together, and without
    the prior the jitter landed on the copies' factor (s_comp 2.4, s_comm 0, s_copy 2.7); with the
    compute and exchange held at the profile where the window cannot tell, the copies' is found too."""
    shape = ExpertShape(8, 1024)
    rng = np.random.default_rng(1)
    flows = []
    for _ in range(6):
        flow = rng.integers(1, 6, (4, 4))
        flow[:, 0] = rng.integers(390, 410, 4)
        flows.append(flow)

    def run(timed: bool) -> tuple[list[str], tuple]:
        auto, cm = _auto(1e4, shape, candidates="ep,shadow", min_observations=4)
        chosen = []
        for flow in flows:
            terms = layer_terms(flow, auto(flow, OWNERS, cm), cm, shape, cm.topology.node_of)
            copies = 3.0 * terms.copies / 2
            rest = (terms.compute / 3 + terms.exchange / 2) * rng.uniform(0.9, 1.1)
            forward = np.array([rest + copies])
            auto.observe_time(forward, np.array([copies]) if timed else None)
            chosen.append(auto.chosen)
        return chosen, auto.correction.pooled

    chosen, scales = run(timed=True)
    assert chosen[:4] == ["shadow"] * 4 and chosen[-1] == "ep"
    assert scales.copy == pytest.approx(3.0, rel=1e-9)
    chosen, scales = run(timed=False)
    assert chosen[-1] == "ep" and scales[:3] == pytest.approx((1.0, 1.0, 3.0), rel=0.05)


def test_a_candidate_that_keeps_losing_rests_longer_each_time_and_ep_is_always_priced():
    fast, fast_cm = _auto(1e12)
    copies = fast(_skewed(), OWNERS, fast_cm)  # shadow's copies of the hot expert
    assert not copies.is_owners_only()
    shape = ExpertShape(8, 8192)
    slow_cm = CostModel(Topology.homogeneous(4, 1e3), gemm_flops_per_s=1e7)  # copying a large expert: dear
    auto = AutoPlanner(shape, {"shadow": lambda flow, placement, cm: copies}, AutoOptions(candidates="ep,shadow"))
    priced_at = []
    for call in range(20):
        assert auto(_skewed(), OWNERS, slow_cm).is_owners_only() and auto.chosen == "ep"
        assert "ep" in auto.last.prices_s
        if "shadow" in auto.last.prices_s:
            priced_at.append(call)
        else:
            assert auto.last.resting == ["shadow"]
    assert priced_at == [0, 2, 5, 10, 19]  # rests 1, 2, 4, 8 (max_rest), 8 calls
    for _ in range(9):  # the copies become cheap: priced again after the rest, then every call
        auto(_skewed(), OWNERS, fast_cm)
    assert auto.chosen == "shadow" and all(auto(_skewed(), OWNERS, fast_cm) == copies for _ in range(3))
    assert auto.last.resting == [] and auto.rest["shadow"] == [0, 1]

    # A resting planner is asked only at the call before it is priced again; one that plans ahead
    # records the other calls' flows (no search), one that decides on the current flow is skipped.
    class Recorder:
        plans_ahead = True

        def __init__(self):
            self.asked, self.observed = [], []

        def __call__(self, flow, placement, cm):
            self.asked.append(len(self.asked) + len(self.observed))
            return copies

        def observe(self, flow):
            self.observed.append(len(self.asked) + len(self.observed))

        def next_placement(self):
            return None

    recorder = Recorder()
    auto = AutoPlanner(shape, {"shadow": recorder}, AutoOptions(candidates="ep,shadow"))
    for _ in range(20):
        auto(_skewed(), OWNERS, slow_cm)
    assert recorder.asked == [0, 1, 2, 4, 5, 9, 10, 18, 19]  # priced at 0, 2, 5, 10, 19, and the calls before
    assert sorted(recorder.asked + recorder.observed) == list(range(20))
    always = AutoPlanner(shape, dict(auto.planners), AutoOptions(candidates="ep,shadow", max_rest=0))
    for _ in range(3):
        always(_skewed(), OWNERS, slow_cm)
        assert set(always.last.prices_s) == {"ep", "shadow"}


def test_a_planner_that_proposes_the_winners_placement_rests():
    fast, fast_cm = _auto(1e12)
    copies = fast(_skewed(), OWNERS, fast_cm)
    assert not copies.is_owners_only()

    class Planner:
        def __init__(self, ahead: bool, plan: Placement | None = copies, proposal: Placement = copies):
            self.plans_ahead, self.prefetched, self.asked, self.plan, self.proposal = ahead, False, 0, plan, proposal

        def __call__(self, flow, placement, cm):
            self.asked += 1
            return self.proposal

        def observe(self, flow):
            pass

        def next_placement(self):
            return self.plan

    # The first proposal wins the tie; the second adds nothing and rests 1, 2, 4, 8 calls.
    first, second = Planner(False), Planner(False)
    auto = AutoPlanner(SHAPE, {"shadow": first, "eplb": second}, AutoOptions(candidates="ep,shadow,eplb"))
    priced_at = []
    for call in range(20):
        assert auto(_skewed(), OWNERS, fast_cm) == copies and auto.chosen == "shadow"
        priced_at += [call] if "eplb" in auto.last.prices_s else []
    assert priced_at == [0, 2, 5, 10, 19] and first.asked == 20

    # Prefetched: a duplicate that plans ahead rests only while the winner plans ahead too (the
    # prefetch keeps something to send); otherwise it is priced every call (here it has no plan yet).
    for winner_ahead, expected in ((False, list(range(20))), (True, [0, 2, 5, 10, 19])):
        winner, duplicate = Planner(winner_ahead), Planner(True, None)
        auto = AutoPlanner(SHAPE, {"shadow": winner, "prophet": duplicate}, AutoOptions(candidates="ep,shadow,prophet"))
        auto.prefetched, auto.nonmoe_forward_s, auto.hidden_share = True, 1.0, 1.0
        priced_at = []
        for call in range(20):
            auto.next_placement()
            assert auto(_skewed(), OWNERS, fast_cm) == copies
            assert auto.chosen == ("shadow+prefetch" if winner_ahead and call else "shadow")
            priced_at += [call] if "prophet" in auto.last.prices_s else []
        assert priced_at == expected

    # Plain EP's placement too: on an even load the planners that propose it rest, in a prefetched
    # layer those that plan ahead as well (nothing was sent ahead: the prefetch had nothing to send),
    # and wake as soon as EP's price rises by `rest_margin` (here: a skewed load).
    even = np.full((4, 4), 50)
    for prefetched in (False, True):
        ahead, now = Planner(True, None, OWNERS), Planner(False, None, OWNERS)
        auto = AutoPlanner(SHAPE, {"prophet": ahead, "shadow": now}, AutoOptions(candidates="ep,shadow,prophet"))
        auto.prefetched, auto.nonmoe_forward_s, auto.hidden_share = prefetched, 1.0, 1.0
        priced_at = []
        for call in range(20):
            auto.next_placement()
            assert auto(even, OWNERS, fast_cm).is_owners_only() and auto.chosen == "ep"
            assert ("prophet" in auto.last.prices_s) == ("shadow" in auto.last.prices_s)
            priced_at += [call] if "prophet" in auto.last.prices_s else []
        assert priced_at == [0, 2, 5, 10, 19] and now.asked == 9  # priced, and the calls before
        ahead.proposal = now.proposal = copies
        assert auto(_skewed(), OWNERS, fast_cm) == copies and {"prophet", "shadow"} <= set(auto.last.prices_s)
        # A plan ahead was sent and lost to EP on the real flow: those that plan ahead keep being asked.
        proposals = {"ep": OWNERS, "prophet": OWNERS, "shadow": OWNERS}
        rested = ["shadow"] if prefetched else ["prophet", "shadow"]
        assert duplicates(proposals, "ep", auto.planners, prefetched, sent_ahead=True) == rested


def test_options_name_the_bad_value():
    with pytest.raises(ValueError, match="candidates='ep,magic'"):
        AutoOptions(candidates="ep,magic")
    with pytest.raises(ValueError, match="min_gain"):
        AutoOptions(min_gain=1.5)
    with pytest.raises(ValueError, match="max_rest=-1"):
        AutoOptions(max_rest=-1)
    with pytest.raises(ValueError, match="rest_margin"):
        AutoOptions(rest_margin=float("nan"))
    with pytest.raises(ValueError, match="half_life=0"):
        AutoOptions(half_life=0)
    auto, _ = _auto(1e12, candidates="ep,shadow")
    assert list(auto.planners) == ["shadow"]
    with pytest.raises(ValueError, match="needs cost_model"):
        auto(_skewed(), OWNERS)


def test_planned_ahead_choice_is_offered_to_the_prefetch_and_wins_when_hidden():
    # A slow network: the copies a step ahead hide behind the dense compute, the others do not.
    auto, cm = _auto(1e5)
    auto.prefetched, auto.nonmoe_forward_s, auto.hidden_share = True, 10.0, 1.0  # as BlockPrefetch sets them
    assert auto.next_placement() is None
    auto(_skewed(), OWNERS, cm)
    planned = auto.next_placement()
    assert planned is not None and not planned.is_owners_only()
    assert auto(_skewed(), OWNERS, cm) == planned and auto.chosen.endswith("+prefetch")
    sent_now = auto.price(layer_terms(_skewed(), planned, cm, SHAPE, cm.topology.node_of))
    assert auto.last.prices_s[auto.chosen] < sent_now
    # Shadowing proposes the very placement sent ahead: it would run on those copies, at their price.
    assert auto.last.prices_s["shadow"] == auto.last.prices_s[auto.chosen]
    assert auto._pending.prefetched  # and the forward is observed as one with its copies sent ahead
    assert all(p.prefetched and p.hidden_share == 1.0 for p in auto._ahead())  # measurements passed on


@pytest.mark.parametrize("old", ["no correction object", "forward-only correction"])
def test_an_older_checkpoint_resumes_and_learns_again(old):
    """A planner pickled before the correction had its own object (its factors lived on the
    planner), or before it timed backwards: it resumes with a fresh correction instead of failing."""
    import pickle

    auto, cm = _auto(1e12)
    auto(_skewed(), OWNERS, cm)
    state = auto.__getstate__()
    if old == "no correction object":
        del state["correction"]
    else:
        del state["correction"].prior_weight
    resumed = pickle.loads(pickle.dumps(auto))
    resumed.__dict__.clear()
    resumed.__setstate__(state)
    assert resumed(_skewed(), OWNERS, cm) == auto(_skewed(), OWNERS, cm)
    assert resumed.correction.pooled == type(resumed.correction.pooled)()  # every factor 1 again
