"""The planners restated over arrays make the decisions of the loop versions they replaced
(tests/reference_planners.py, today's functions verbatim): identical placements, step lists and
choices, predicted times to fp tolerance — on hundreds of random flows (several sizes, equal loads,
silent ranks, fractional flows as a window's mean gives them, nodes of any layout, cost models
with and without fits) and on the shipped SmartMoE trace's flows."""

from __future__ import annotations

import numpy as np
import pytest

from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import Placement
from moeflow.core.registry import LayerContext
from moeflow.perf import placement_pricing
from moeflow.perf.alpha_beta import AlphaBeta
from moeflow.perf.costmodel import CostModel
from moeflow.perf.everywhere_pricing import EverywherePricer
from moeflow.perf.placement_pricing import PlacementPricer
from moeflow.perf.topology import Topology
from moeflow.sim.traces import resolve_trace
from moeflow.strategies import PLANNERS
from moeflow.strategies.planners import eplb, fssdp, hecate
from moeflow.strategies.planners.auto import layer_terms
from moeflow.strategies.planners.base import Planner
from moeflow.strategies.planners.prophet import ProphetOptions, prophet_search
from moeflow.strategies.planners.prophet_model import Pricing
from moeflow.strategies.planners.shadow import ShadowOptions, ShadowPlanner

from . import reference_planners as ref

SIZES = (1, 2, 3, 4, 6, 8, 12, 16)


def _nodes(rng, world: int) -> list[int]:
    per = int(rng.choice([d for d in range(1, world + 1) if world % d == 0]))
    node_of = np.arange(world) // per
    return (rng.permutation(node_of) if rng.random() < 0.3 else node_of).tolist()


def _flow(rng, world: int, experts: int) -> np.ndarray:
    """Integer counts with equal columns and silent ranks; a third fractional (a window's mean)."""
    flow = rng.integers(0, 40, (world, experts)).astype(float)
    flow[rng.random(world) < 0.2] = 0.0
    flow[:, rng.random(experts) < 0.3] = float(rng.integers(0, 40))
    return flow + rng.random((world, experts)) if rng.random() < 0.3 else flow


def _cost_model(rng, world: int) -> CostModel:
    kind = rng.integers(3)
    if kind == 0 or world % 2:
        return CostModel(Topology.homogeneous(world, 10 ** rng.uniform(6, 10)), 1e9)
    halves = [list(range(world // 2)), list(range(world // 2, world))]
    topo = Topology.from_spec(halves, [10 ** rng.uniform(6, 9), 1e10], [5e-6, 1e-6])
    if kind == 1:
        return CostModel(topo, 1e9, host_cores=2)
    fits = {
        "gemm": AlphaBeta(1e-4, 1e-11, "flop"),
        "elementwise": AlphaBeta(1e-5, 1e-10),
        "a2a": AlphaBeta(2e-4, 1e-9),
        "copies": AlphaBeta(1e-4, 2e-9),
    }
    return CostModel(topo, 1e9, fits, backend="gloo")  # copies through the two-stage tree


def _trace_flows(count: int) -> list[np.ndarray]:
    """Flows of the shipped SmartMoE trace (16 ranks x 32 experts), spread over iterations and layers."""
    flow = resolve_trace("smartmoe").flow_ILWE
    picks = np.linspace(0, flow.shape[0] * flow.shape[1] - 1, count).astype(int)
    return [flow.reshape(-1, *flow.shape[2:])[p].astype(float) for p in picks]


def _same_prices(got: list[float], expect: list[float]) -> bool:
    """The prefixes priced have the loop version's prices; those left unpriced (their copies alone
    cost more than the best priced prefix: `PlacementPricer.cheapest_prefixes`) are dearer. True if
    some were left unpriced."""
    priced = len(got)
    np.testing.assert_allclose(got, expect[:priced], rtol=1e-9)
    assert priced == len(expect) or min(expect[priced:]) > min(got)
    return priced < len(expect)


def test_pricing_many_placements_equals_pricing_each_plan():
    """`PlacementPricer` (owners once, each placement's changed experts) against the plan of each
    placement priced whole (`placement_times` of the loop version), both copy paths, 150 cases."""
    rng = np.random.default_rng(1)
    shape = ExpertShape(8, 16)
    for _ in range(150):
        world = int(rng.choice(SIZES))
        experts = world * int(rng.integers(1, 4))
        flow = np.rint(_flow(rng, world, experts))
        cm = _cost_model(rng, world)
        owners = Placement.owners_only(rng.integers(0, world, experts), world)
        placements = [owners.with_holders(rng.random((experts, world)) < p) for p in (0.0, 0.2, 0.6, 1.0)]
        priced = PlacementPricer(flow, owners.owner_E, cm, shape, cm.topology.node_of).placements(
            [p.holders_EW for p in placements]
        )
        for c, p in enumerate(placements):
            plan = ref.dispatch_counts(flow.astype(np.int64), p, cm.topology.node_of)
            for prefetched, trans, agg in (
                (False, priced.trans_s, priced.agg_s),
                (True, priced.trans_prefetched_s, priced.agg_prefetched_s),
            ):
                expect = ref.placement_times(cm, plan, p.holders_EW, p.owner_E, shape, prefetched)
                got = {"a2a": 4 * priced.a2a_s[c], "fec": priced.compute_s[c], "trans": trans[c], "agg": agg[c]}
                for term, value in expect.items():
                    assert got[term] == pytest.approx(value, rel=1e-9, abs=1e-15), term


def test_shadow_steps_priced_directly_equal_the_general_pricer(monkeypatch):
    """`EverywherePricer` (an expert held everywhere per step) gives the general pricer's floats, bit
    for bit: every prefix's terms, the copies' bound, and the bounded search that reuses the bound's
    broadcasts; 200 cases over every cost-model kind (gloo's trees across nodes take the general path).
    Both in NumPy (the compiled sums take whole flows: tests/test_compiled_sums.py)."""
    monkeypatch.setattr(placement_pricing, "COMPILED", False)
    rng = np.random.default_rng(5)
    shape = ExpertShape(8, 16)
    direct = 0
    for _ in range(200):
        world = int(rng.choice(SIZES))
        experts = world * int(rng.integers(1, 4))
        flow, cm = _flow(rng, world, experts), _cost_model(rng, world)
        owner_E = rng.integers(0, world, experts)
        order = rng.permutation(experts)[: int(rng.integers(0, experts + 1))]
        rows = np.ones((order.size, world), dtype=bool)
        general = PlacementPricer(flow, owner_E, cm, shape, cm.topology.node_of)
        fast = EverywherePricer(flow, owner_E, cm, shape, cm.topology.node_of)
        direct += fast._direct(order, rows, np.arange(order.size) == 0, False)
        np.testing.assert_array_equal(fast.copies_of_prefixes(order, rows), general.copies_of_prefixes(order, rows))
        for q in (order.size, order.size // 2):  # a prefix of the order the bound priced
            want, got = general.prefixes(order[:q], rows[:q]), fast.prefixes(order[:q], rows[:q])
            for name in ("compute_s", "a2a_s", "trans_s", "agg_s", "trans_prefetched_s", "tokens_ZW", "copies_Z"):
                np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
        price = lambda t: 3 * t.compute_s + 4 * t.a2a_s + t.trans_s + t.agg_s  # noqa: E731
        np.testing.assert_array_equal(
            EverywherePricer(flow, owner_E, cm, shape, cm.topology.node_of).cheapest_prefixes(order, rows, price),
            general.cheapest_prefixes(order, rows, price),
        )
    assert direct > 80  # most cases take the direct path


def test_shadow_decides_as_the_loop_version():
    rng = np.random.default_rng(2)
    cases = [(_flow(rng, w, w * int(rng.integers(1, 4))), _cost_model(rng, w)) for w in rng.choice(SIZES[1:], 200)]
    johnny = CostModel.from_preset("johnny")
    cases += [(flow, johnny) for flow in _trace_flows(12)]
    pruned = 0
    for flow, cm in cases:
        world, experts = flow.shape
        owners = Placement.owners_only(rng.integers(0, world, experts), world)
        shape = ExpertShape(8, int(rng.choice([16, 1024])))
        for options in (ShadowOptions(), ShadowOptions(search="greedy", min_gain=0.0), ShadowOptions(max_shadowed=2)):
            got = ShadowPlanner(shape, options).decide(flow, owners, cm)
            # Shadowing prices whole tokens (a window's or replicas' mean rounded, as the dispatch
            # sends them and the other planners price them); the loop version took the fractions.
            expect = ref.ShadowReference(shape, options).decide(np.rint(flow), owners, cm)
            assert (got.shadowed, got.candidates) == (expect.shadowed, expect.candidates)
            pruned += _same_prices(got.predicted_s, expect.predicted_s)
    assert pruned > 10  # the copies' bound cut the search short in many cases


def test_prophet_search_steps_and_prefix_as_the_loop_version():
    rng = np.random.default_rng(3)
    cases = [(_flow(rng, w, w * int(rng.integers(1, 4))), _cost_model(rng, w)) for w in rng.choice(SIZES[1:], 200)]
    johnny = CostModel.from_preset("johnny")
    cases += [(flow, johnny) for flow in _trace_flows(12)]
    steps = pruned = 0
    for flow, cm in cases:
        world, experts = flow.shape
        owners = Placement.owners_only(rng.integers(0, world, experts), world)
        options = ProphetOptions(
            keep_out=int(rng.choice([0, 0, 1, 2])),
            balance_alpha=float(rng.choice([0.0, 0.1, 0.5])),
            min_gain=float(rng.choice([0.0, 0.05])),
            model=str(rng.choice(["links", "paper"])),
            overlap=bool(rng.random() < 0.3),
            nonmoe_forward_s=1e-3,
        )
        shape = ExpertShape(8, int(rng.choice([16, 1024])))
        got, got_d = prophet_search(flow, owners, cm, shape, options)
        expect, expect_d = ref.prophet_search(flow, owners, cm, shape, options)
        assert got_d.steps == expect_d.steps and got_d.accepted == expect_d.accepted and got == expect
        pruned += _same_prices(got_d.predicted_s, expect_d.predicted_s)
        steps += len(got_d.steps)
    assert steps > 2000 and pruned > 5  # the searches went deep; the copies' bound cut some pricing short


def test_hecate_algorithms_as_the_loop_versions():
    rng = np.random.default_rng(4)
    for _ in range(400):
        world = int(rng.choice(SIZES))
        experts = world * int(rng.integers(1, 4))
        node_of = _nodes(rng, world)
        load = rng.integers(0, 50, experts).astype(float)
        load[rng.random(experts) < 0.4] = 7.0  # ties
        load += rng.random(experts) if rng.random() < 0.3 else 0.0
        owners = rng.integers(0, world, experts)
        t, m = int(rng.integers(0, experts + 2)), int(rng.integers(0, 5))
        got = hecate.sparse_materialization(load, owners, world, node_of, t, m)
        np.testing.assert_array_equal(got, ref.sparse_materialization(load, owners, world, node_of, t, m))
        layers = int(rng.integers(1, 4))
        if (layers * experts) % world == 0:
            load_LE = rng.integers(0, 30, (layers, experts)).astype(float)
            load_LE[:, rng.random(experts) < 0.4] = 3.0
            load_LE += rng.random((layers, experts)) if rng.random() < 0.3 else 0.0
            np.testing.assert_array_equal(
                hecate.heterogeneous_sharding(load_LE, t, world, node_of),
                ref.heterogeneous_sharding(load_LE, t, world, node_of),
            )


def test_eplb_replication_and_packing_as_the_loop_versions():
    rng = np.random.default_rng(5)
    for _ in range(400):
        world = int(rng.choice(SIZES))
        experts = world * int(rng.integers(1, 4))
        load = rng.integers(0, 50, experts).astype(float)
        load[rng.random(experts) < 0.4] = 9.0
        load = np.zeros(experts) if rng.random() < 0.05 else load
        extra = int(rng.integers(0, 3 * world + 1))
        copies = eplb.replicate_experts(load, extra)
        assert copies == ref.replicate_experts(load, extra)
        owners, slots, node_of = rng.integers(0, world, experts), int(rng.integers(0, 3)), _nodes(rng, world)
        got = eplb.pack_copies(copies, load, owners, world, slots, node_of)
        assert got == ref.pack_copies(copies, load, owners, world, slots, node_of)


def test_fssdp_and_eplb_plans_as_the_loop_versions():
    rng = np.random.default_rng(6)
    cases = [(_flow(rng, w, w * int(rng.integers(1, 4))), _cost_model(rng, w)) for w in rng.choice(SIZES[1:], 150)]
    johnny = CostModel.from_preset("johnny")
    cases += [(flow, johnny) for flow in _trace_flows(12)]
    for flow, cm in cases:
        world, experts = flow.shape
        owners = Placement.owners_only(rng.integers(0, world, experts), world)
        shape = ExpertShape(8, int(rng.choice([16, 1024])))
        pricing = Pricing(
            bool(rng.random() < 0.3), 1e-3, float(rng.choice([1.0, 0.5])), str(rng.choice(["links", "paper"]))
        )
        min_gain, t, m = float(rng.choice([0.0, 0.05])), int(rng.integers(0, experts + 1)), int(rng.integers(0, 4))
        got, got_d = fssdp.fssdp_plan(flow, owners, cm, shape, t, m, pricing, min_gain)
        expect, expect_d = ref.fssdp_plan(flow, owners, cm, shape, t, m, pricing, min_gain)
        assert got == expect and got_d.accepted == expect_d.accepted
        _same_prices(got_d.predicted_s, expect_d.predicted_s)
        slots = int(rng.integers(0, 3))
        got, got_s = eplb.eplb_plan(flow, owners, cm, shape, slots, pricing, min_gain)
        expect, expect_s = ref.eplb_plan(flow, owners, cm, shape, slots, pricing, min_gain)
        assert got == expect
        _same_prices(got_s, expect_s)


class _Recorded(Planner):
    """A planner that keeps what it proposed (to price it again the loop version's way)."""

    def __init__(self, inner: Planner) -> None:
        self.inner, self.plans_ahead, self.proposed = inner, inner.plans_ahead, None

    def __call__(self, flow_WE, placement, cost_model=None):
        self.proposed = self.inner(flow_WE, placement, cost_model)
        return self.proposed

    def current(self, flow_WE, placement, cost_model=None):
        self.proposed = self.inner.current(flow_WE, placement, cost_model)
        return self.proposed

    def defer(self):
        return self.inner.defer()

    def record(self, flow_WE, placement, cost_model, search, deferred=None):
        self.inner.record(flow_WE, placement, cost_model, search, deferred)

    def next_placement(self):
        return self.inner.next_placement()

    def planned(self):
        return self.inner.planned()

    def use_prefetch(self, window):
        self.inner.use_prefetch(window)


def test_auto_prices_every_proposal_as_the_loop_version():
    """`auto`'s one pass over the proposals' changed experts against `layer_terms` of the loop
    version on each proposal; the choice is the cheapest of those prices (or plain EP)."""
    from moeflow.strategies.planners.base import PrefetchWindow

    rng = np.random.default_rng(7)
    shape = ExpertShape(8, 64)
    cm = CostModel.from_preset("johnny")
    auto = PLANNERS.build("auto", LayerContext(32, 2, shape, cm))
    auto.planners = {name: _Recorded(p) for name, p in auto.planners.items()}
    auto.use_prefetch(PrefetchWindow(1e-3, 0.5))
    owners = Placement.expert_parallel(32, 16)
    flows = _trace_flows(24) + [_flow(rng, 16, 32) for _ in range(24)]
    chosen = set()
    for flow in flows:
        auto.next_placement()
        sent = auto.sent_ahead
        auto(flow, owners, cm)
        prices = {}
        for name, planner in auto.planners.items():
            p = planner.proposed
            window = auto.prefetch if sent is not None and p == sent else None
            prices[name] = auto.price(ref.layer_terms(flow, p, cm, shape, cm.topology.node_of, window))
        assert list(prices) == list(auto.last.prices_s)
        np.testing.assert_allclose(list(auto.last.prices_s.values()), list(prices.values()), rtol=1e-9)
        best = min(prices, key=prices.get)
        assert auto.choice() == (best if prices[best] <= (1 - auto.options.min_gain) * prices["ep"] else "ep")
        chosen.add(auto.choice())
        assert layer_terms(flow, auto.planners["shadow"].proposed, cm, shape, cm.topology.node_of) == pytest.approx(
            ref.layer_terms(flow, auto.planners["shadow"].proposed, cm, shape, cm.topology.node_of), rel=1e-9
        )
    assert len(chosen) > 1  # the trace and the random flows make it choose more than one planner


def test_window_estimate_is_the_stacked_mean():
    """`PlanAheadPlanner.estimate` from its running sum equals the mean of the stacked window to the
    bit: whole counts (float and integer arrays), fractional flows entering and leaving the window."""
    from moeflow.strategies.planners.base import PlanAheadPlanner

    rng = np.random.default_rng(8)
    for window in (1, 2, 3, 5, 10):
        planner = PlanAheadPlanner(window, background=False)
        for _ in range(40):
            flow = rng.integers(0, 10**6, (6, 12))
            kind = rng.integers(4)
            if kind == 1:
                flow = flow.astype(float)
            elif kind == 2:
                flow = flow / 3.0  # a mean of three replicas' flows
            planner.observe(flow)
            expect = np.mean(np.stack([np.asarray(f, dtype=np.float64) for f in planner.history]), axis=0)
            got = planner.estimate()
            assert got.dtype == np.float64 and np.array_equal(got, expect)


def test_owners_terms_by_node_equal_routing_every_pair(monkeypatch):
    """Where nodes hang from the root, `PlacementPricer` sums the owners' bytes per node (only the
    pairs inside a node routed): the same link bytes and latency-class counts, to the bit, as
    routing every pair (`Topology.link_traffic`); whole and fractional flows, any owners."""
    from moeflow.core.placement import send_by_owner
    from moeflow.perf import placement_pricing

    monkeypatch.setattr(placement_pricing, "BY_NODE_FROM", 0)  # per node at any size
    rng = np.random.default_rng(9)
    shape = ExpertShape(8, 16)
    checked = 0
    for _ in range(60):
        world = int(rng.choice([2, 4, 8, 16]))
        experts = world * int(rng.integers(1, 4))
        johnny = world >= 8 and rng.random() < 0.5
        cm = CostModel.from_preset(f"johnny@{world}") if johnny else _cost_model(rng, world)
        flow = _flow(rng, world, experts)
        owner = rng.integers(0, world, experts) if rng.random() < 0.5 else np.arange(experts) // (experts // world)
        pricer = PlacementPricer(flow, owner, cm, shape, cm.topology.node_of)
        sent = flow.copy()
        sent[owner, np.arange(experts)] = 0
        topo = cm.topology
        traffic = topo.link_traffic(send_by_owner(sent, owner) * pricer.tok_bytes)
        positive = send_by_owner((sent > 0).astype(np.int64), owner)
        classes = np.bincount(topo.latency_class_WW.reshape(-1), weights=positive.reshape(-1), minlength=pricer.N)
        assert np.array_equal(pricer.traffic0, traffic) and np.array_equal(pricer.classes0, classes)
        checked += topo.nodes_under_root
    assert checked > 20


def test_prefix_search_at_scale_prices_as_the_dense_sums(monkeypatch):
    """Searches of 100-300 steps on 64 ranks x 256 experts in 8 nodes (several blocks of
    `perf.prefix_max`, spread and one-holder states, experts stepped once or many times): the prices of
    `cheapest_prefixes` equal, to the bit, those of every prefix summed densely (`running_sums` on a
    pricer told the flow is not whole), and the prefixes it leaves unpriced are dearer; with the
    copy trees in one piece and in the chunk pipeline (`copy_chunks` 4)."""
    from moeflow.perf import placement_pricing, prefix_max
    from moeflow.sim.traces import synthetic_trace
    from moeflow.strategies.planners.prophet_model import price_terms

    monkeypatch.setattr(prefix_max, "RUNNING_MAX_FROM", 0)  # running maxima at any size
    monkeypatch.setattr(placement_pricing, "BY_NODE_FROM", 0)
    rng = np.random.default_rng(10)
    world, experts = 64, 256
    cm = CostModel.from_preset(f"johnny@{world}")
    shape = ExpertShape(1024, 4096)
    owners = Placement.expert_parallel(experts, world)
    trace = synthetic_trace("zipf", 4, 1, world, experts, 1024, 2, skew=1.2, seed=3)
    piped = cm.with_copy_chunks(4)  # the last two searches price the trees in the chunk pipeline
    for i, flow in enumerate(trace.flow_ILWE[:, 0].astype(float)):
        once = i % 2 == 0
        cm = piped if i >= 2 else cm
        steps = int(rng.integers(100, 300))
        chosen = rng.permutation(experts)[:steps] if once else rng.choice(experts, steps, p=flow.sum(0) / flow.sum())
        holders = owners.holders_EW.copy()
        rows = np.zeros((steps, world), dtype=bool)
        for j, e in enumerate(chosen):
            holders[e, rng.choice(world, int(rng.integers(1, 40 if once else 4)))] = True
            rows[j] = holders[e]
        for pricing in (Pricing(), Pricing(overlap=True, nonmoe_forward_s=1e-3)):

            def price(t, pricing=pricing, cm=cm):
                return price_terms(t, cm, shape, pricing)

            fast = PlacementPricer(flow, owners.owner_E, cm, shape, cm.topology.node_of, whole=True)
            dense = PlacementPricer(flow, owners.owner_E, cm, shape, cm.topology.node_of, whole=False)
            dense.max_stages = False
            expect = price(dense.prefixes(chosen, rows))
            got = fast.cheapest_prefixes(chosen, rows, price, bounded=not pricing.overlap)
            assert np.array_equal(got, expect[: got.size])
            assert got.size == expect.size or expect[got.size :].min() > got.min()
