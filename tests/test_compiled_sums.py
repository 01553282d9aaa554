"""The compiled running sums (`perf.compiled_sums`) price placements as the NumPy path does, to the
bit: every term of every candidate, the copies' bound and the bounded searches, on hundreds of
random whole flows over clusters of one to eight nodes (nodes hanging from the root, so that the
sources that spread over every holder are summed per holder; nodes of any layout; gloo's trees;
fits; pipelined copy trees); and the planners built on them decide alike."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import Placement
from moeflow.core.registry import LayerContext
from moeflow.perf import placement_pricing
from moeflow.perf.alpha_beta import AlphaBeta
from moeflow.perf.costmodel import CostModel
from moeflow.perf.everywhere_pricing import EverywherePricer
from moeflow.perf.placement_pricing import PlacementPricer, PlacementTerms
from moeflow.perf.topology import Topology
from moeflow.sim.traces import resolve_trace, synthetic_trace
from moeflow.strategies import PLANNERS

SHAPE = ExpertShape(8, 16)
FIELDS = ("compute_s", "a2a_s", "trans_s", "agg_s", "trans_prefetched_s", "agg_prefetched_s", "copies_Z")


def _cost_model(rng) -> CostModel:
    """A cluster of 1 to 8 nodes: presets' link classes, or two halves with fits and gloo's trees; a
    fitted GEMM launch (as `moeflow profile` fits) or one host's cores shared (processor sharing)."""
    kind = int(rng.integers(7))
    if kind >= 5:
        base = _cost_model(rng)
        fits = dict(base.fits)
        if kind == 5 or rng.random() < 0.5:
            fits["gemm"] = AlphaBeta(float(rng.choice([1e-5, 1e-3])), 1e-12)
        cores = int(rng.integers(1, base.topology.num_devices + 1)) if kind == 6 else None
        return dataclasses.replace(base, fits=fits, host_cores=cores)
    if kind == 0:
        return CostModel.from_preset(f"johnny@{int(rng.choice([8, 16, 24, 32]))}")
    if kind == 1:
        return CostModel.from_preset(f"hecate_a@{int(rng.choice([8, 16]))}").with_copy_chunks(int(rng.integers(1, 5)))
    world = int(rng.choice([2, 4, 6, 8, 12]))
    if kind == 2:
        return CostModel(Topology.homogeneous(world, 10 ** rng.uniform(6, 10)), 1e9)
    halves = [list(range(world // 2)), list(range(world // 2, world))]
    topo = Topology.from_spec(halves, [10 ** rng.uniform(6, 9), 1e10], [5e-6, 1e-6])
    fits = {"elementwise": AlphaBeta(1e-5, 1e-10), "a2a": AlphaBeta(2e-4, 1e-9)}
    return CostModel(topo, 1e9, fits, backend="gloo" if kind == 3 else "nccl")


def _flow(rng, world: int, experts: int) -> np.ndarray:
    """Whole counts, silent ranks, equal columns, remainders of every size when split."""
    flow = rng.integers(0, 60, (world, experts)).astype(float)
    flow[rng.random(world) < 0.2] = 0.0
    flow[:, rng.random(experts) < 0.2] = float(rng.integers(0, 60))
    return flow.astype(np.int64) if rng.random() < 0.3 else flow  # as the count exchange gives them


def _holders(rng, cm: CostModel, owner: int) -> np.ndarray:
    """One expert's holders: a few ranks, whole nodes, everywhere, or the owner alone."""
    world = cm.topology.num_devices
    node_of = np.asarray(cm.topology.node_of)
    kind = rng.integers(4)
    if kind == 0:
        row = rng.random(world) < rng.uniform(0.05, 0.5)
    elif kind == 1:
        row = np.isin(node_of, rng.choice(node_of.max() + 1, int(rng.integers(1, node_of.max() + 2))))
    else:
        row = np.full(world, kind == 2)
    row[owner] = True
    return row


def _both(monkeypatch, build, *args):
    """`build(*args)` with the compiled sums on, then off."""
    out = []
    for compiled in (True, False):
        monkeypatch.setattr(placement_pricing, "COMPILED", compiled)
        out.append(build(*args))
    return out


def _equal(got: PlacementTerms, want: PlacementTerms) -> None:
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)


def _shadow_price(t: PlacementTerms) -> np.ndarray:
    return 3 * t.compute_s + 4 * t.a2a_s + t.trans_s + t.agg_s


def _price_all(cm, flow, owner_E, steps, rows, order, order_rows, placements) -> tuple:
    """Every way a pricer prices: prefixes, placements, the copies' bound, bounded searches."""
    pricer = PlacementPricer(flow, owner_E, cm, SHAPE, cm.topology.node_of)
    every = EverywherePricer(flow, owner_E, cm, SHAPE, cm.topology.node_of)
    ones = np.ones((order.size, cm.topology.num_devices), dtype=bool)
    return (
        pricer.compiled,
        pricer.prefixes(steps, rows),
        pricer.placements([p.holders_EW for p in placements]),
        pricer.copies_of_prefixes(order, order_rows),
        PlacementPricer(flow, owner_E, cm, SHAPE, cm.topology.node_of).cheapest_prefixes(
            order, order_rows, _shadow_price
        ),
        every.cheapest_prefixes(order, ones, _shadow_price),
    )


def test_compiled_prices_equal_the_numpy_path(monkeypatch):
    """Prefixes (an expert changed twice included), several placements at once, the copies' bound
    and the bounded search: the same floats with and without the compiled sums, 250 cases."""
    rng = np.random.default_rng(11)
    compiled_runs = 0
    for _ in range(250):
        cm = _cost_model(rng)
        world = cm.topology.num_devices
        experts = world * int(rng.integers(1, 4))
        flow = _flow(rng, world, experts)
        owner_E = rng.integers(0, world, experts) if rng.random() < 0.3 else np.arange(experts) % world
        steps = rng.integers(0, experts, int(rng.integers(1, 2 * experts)))
        rows = np.stack([_holders(rng, cm, owner_E[e]) for e in steps])
        distinct = np.unique(steps, return_index=True)[1]
        order, order_rows = steps[np.sort(distinct)], rows[np.sort(distinct)]
        placements = [
            Placement.owners_only(owner_E, world).with_holders(rng.random((experts, world)) < p)
            for p in (0.0, 0.1, 0.4, 1.0)
        ]
        got, want = _both(monkeypatch, _price_all, cm, flow, owner_E, steps, rows, order, order_rows, placements)
        assert got[0] and not want[0]
        compiled_runs += 1
        _equal(got[1], want[1])
        _equal(got[2], want[2])
        for a, b in zip(got[3:], want[3:]):
            np.testing.assert_array_equal(a, b)
    assert compiled_runs == 250


def _prefixes(cm, flow, owner_E, steps, rows) -> PlacementTerms:
    return PlacementPricer(flow, owner_E, cm, SHAPE, cm.topology.node_of).prefixes(steps, rows)


def test_spread_sources_summed_per_holder_at_64_ranks(monkeypatch):
    """Eight nodes of eight under one root (johnny@64): most sources spread over every holder of an
    expert copied to a few other nodes — summed per holder, remainders wrapping round the ring."""
    rng = np.random.default_rng(3)
    cm = CostModel.from_preset("johnny@64")
    owner_E = np.arange(128) % 64
    for _ in range(6):
        flow = rng.integers(0, 30, (64, 128)).astype(float)
        steps = rng.permutation(128)[:40]
        rows = np.stack([_holders(rng, cm, owner_E[e]) for e in steps])
        got, want = _both(monkeypatch, _prefixes, cm, flow, owner_E, steps, rows)
        _equal(got, want)


def test_a_state_taken_back_from_its_memo_equals_it_dispatched_again():
    """`dispatch_terms` takes a step's before-state back from the sums the earlier step that made it
    kept for the sources that spread (`_dispatch_memo`): the same rows as dispatching it again
    (no step named in `earlier_Q`), from the owners' state and from an empty one (so that every
    entry counted per route latency shows), with experts copied again and again as EPLB does."""
    from moeflow.perf import compiled_sums
    from moeflow.perf.compiled_routes import EVERY_ROW, kept_rows

    rng = np.random.default_rng(5)
    memo_used = 0
    for _ in range(60):
        cm = CostModel.from_preset(f"johnny@{int(rng.choice([16, 24, 32, 64]))}")
        world = cm.topology.num_devices
        experts = world * int(rng.integers(1, 3))
        flow = _flow(rng, world, experts).astype(float)
        owner_E = np.arange(experts) % world
        pricer = PlacementPricer(flow, owner_E, cm, SHAPE, cm.topology.node_of)
        assert pricer.compiled and pricer._spread_by_holder
        # An expert's holders grow one rank at a time (EPLB's copies), or are drawn anew.
        steps, rows, held = [], [], {}
        for _ in range(int(rng.integers(4, 40))):
            e = int(rng.integers(0, min(experts, 6)))
            row = held.get(e, np.eye(world, dtype=bool)[owner_E[e]]).copy()
            if rng.random() < 0.7:
                row[int(rng.integers(world))] = True
            else:
                row = _holders(rng, cm, owner_E[e])
            steps.append(e)
            rows.append(row)
            held[e] = row
        steps, rows = np.array(steps), np.stack(rows)
        start = np.zeros(steps.size, dtype=bool)
        start[0] = True
        if rng.random() < 0.5:  # several candidates: each starts again from the owners
            start[rng.random(steps.size) < 0.2] = True
        prev = pricer._previous(steps, owner_E[steps], rows, start)
        memo_used += int((pricer._earlier >= 0).sum())
        topo = cm.topology
        for zero in (False, True):
            base = [np.zeros_like(a) if zero else a for a in (pricer.tokens0, pricer.traffic0, pricer.classes0)]
            keep = kept_rows(start) if rng.random() < 0.5 else EVERY_ROW
            runs = [
                compiled_sums.dispatch_terms(
                    pricer._flow_EW,
                    steps,
                    rows,
                    prev,
                    start,
                    earlier,
                    pricer._node_W,
                    topo.route_tables,
                    True,
                    float(pricer.tok_bytes),
                    *base,
                    pricer.inv_bw_L,
                    topo.latency_classes,
                    keep,
                )
                for earlier in (pricer._earlier, np.full(steps.size, -1))
            ]
            for got, want in zip(*runs):
                np.testing.assert_array_equal(got, want)
    assert memo_used > 200


def test_fractional_flows_and_local_counts_take_the_numpy_path():
    """A window's mean (fractional counts) and Pro-Prophet's per-device local counts are not summed
    compiled: the pricer says so, and still prices."""
    cm = CostModel.from_preset("johnny@16")
    flow = np.full((16, 32), 2.5)
    pricer = PlacementPricer(flow, np.arange(32) % 16, cm, SHAPE, cm.topology.node_of)
    assert not pricer.compiled
    whole = PlacementPricer(np.rint(flow), np.arange(32) % 16, cm, SHAPE, cm.topology.node_of)
    assert whole.compiled and not whole._compiled_terms(detail=True)
    terms = whole.prefixes(np.array([0]), np.ones((1, 16), dtype=bool), detail=True)
    assert terms.local_ZW is not None


def _decide(ctx, flow, owners, cm) -> list[Placement]:
    out = [PLANNERS.build(name, ctx)(flow, owners, cm) for name in ("shadow", "shadow_greedy")]
    for name in ("prophet", "eplb", "fssdp"):
        search, inputs = PLANNERS.build(name, ctx).search(flow, owners, cm)
        out.append(search(*inputs)[0])
    return out


@pytest.mark.parametrize("preset", ["johnny@32", "hecate_b@16"])
def test_planners_decide_alike_compiled_or_not(monkeypatch, preset):
    """Shadowing and the searches of Pro-Prophet, EPLB and FSSDP (Hecate's) on the shipped trace
    unfolded to the cluster and on Zipf 1.2: the same placements either way."""
    cm = CostModel.from_preset(preset)
    world = cm.topology.num_devices
    experts = 2 * world
    ctx = LayerContext(experts, 2, SHAPE, cm)
    owners = Placement.expert_parallel(experts, world)
    trace = resolve_trace("smartmoe").rescale(world, experts).flow_ILWE[::40, 0]
    zipf = synthetic_trace("zipf", 4, 1, world, experts, 4096, 2, skew=1.2, seed=1).flow_ILWE[:, 0]
    for flow in [*np.rint(trace), *np.rint(zipf)]:
        got, want = _both(monkeypatch, _decide, ctx, flow, owners, cm)
        for a, b in zip(got, want):
            assert a == b


def test_a_shadow_search_on_the_everywhere_kernel_equals_the_general_one(monkeypatch):
    """`EverywherePricer.cheapest_prefixes` on `perf.compiled_everywhere` (the copies of every prefix
    first, then rounds of prefixes going on from the last state) against the general pricer's
    search: the same floats, bounded and not, with searches of one round and of several, and on
    cost models that price every device (a fitted GEMM launch, shared cores: `perf.compiled_rows`)."""
    from moeflow.perf import compiled_everywhere

    rounds = []
    rows_of = compiled_everywhere.everywhere_rows
    monkeypatch.setattr(compiled_everywhere, "everywhere_rows", lambda *a: rounds.append(a[1].size) or rows_of(*a))
    big = ExpertShape(1024, 4096)  # copies that cost as much as some tokens: the bound stops searches
    rng = np.random.default_rng(8)
    several = 0
    for case in range(30):
        cm = CostModel.from_preset(["johnny@64", "johnny@16", "hecate_a@16"][case % 3])
        if case % 5 in (3, 4):  # a cost model that prices every device: a GEMM launch, shared cores
            gemm = {"gemm": AlphaBeta(float(rng.choice([1e-5, 1e-3])), 1e-12)} if case % 5 == 3 else {}
            cm = dataclasses.replace(cm, fits={**cm.fits, **gemm}, host_cores=None if gemm else 4)
        world = cm.topology.num_devices
        experts = world * int(rng.choice([2, 4]))
        skew = rng.uniform(0.6, 1.6)
        flow = synthetic_trace("zipf", 1, 1, world, experts, 8192, 2, skew=skew, seed=case).flow_ILWE[0, 0]
        flow = np.rint(flow).astype(np.int64)
        owner_E = np.arange(experts) // (experts // world)
        order = np.argsort(-flow.sum(0), kind="stable")[: int(rng.integers(1, experts + 1))]
        ones = np.ones((order.size, world), dtype=bool)
        for bounded in (True, False):
            rounds.clear()
            every = EverywherePricer(flow.astype(float), owner_E, cm, big, cm.topology.node_of, whole=True)
            got = every.cheapest_prefixes(order, ones, _shadow_price, bounded=bounded)
            general = PlacementPricer(flow.astype(float), owner_E, cm, big, cm.topology.node_of, whole=True)
            want = general.cheapest_prefixes(order, ones, _shadow_price, bounded=bounded)
            np.testing.assert_array_equal(got, want)
            assert sum(rounds) == got.size - 1  # every prefix priced once, on the everywhere kernel
            several += len(rounds) > 1
    assert several >= 3


def test_plans_priced_one_by_one_with_what_they_keep_equal_each_priced_alone(monkeypatch):
    """`of_placements` on the compiled sums (each plan alone; its steps and copies kept on it, the
    shadow steps' kernels for plans held everywhere) against `placements` of each plan alone with
    fresh placements, on several flows and cost models in turn (what a plan keeps is this cost
    model's), and against the NumPy path."""
    rng = np.random.default_rng(12)
    for _ in range(40):
        first = _cost_model(rng)
        models = [first, first.with_copy_chunks(int(rng.integers(2, 5)))]  # the same cluster, other copies
        world = first.topology.num_devices
        experts = world * int(rng.integers(1, 4))
        owner_E = rng.integers(0, world, experts) if rng.random() < 0.3 else np.arange(experts) % world
        alone = Placement.owners_only(owner_E, world)
        plans = [
            alone,
            Placement.held_everywhere(owner_E, world, rng.integers(0, experts, int(rng.integers(1, 6)))),
            *(alone.with_holders(rng.random((experts, world)) < p) for p in (0.05, 0.3)),
            alone.with_holders(np.stack([_holders(rng, models[0], owner_E[e]) for e in range(experts)])),
        ]
        for cm in [*models, *models]:  # each model twice: the second time from what the plans keep
            flow = _flow(rng, world, experts)
            got = PlacementPricer(flow, owner_E, cm, SHAPE, cm.topology.node_of).of_placements(plans)
            for z, plan in enumerate(plans):
                fresh = Placement(plan.owner_E.copy(), plan.holders_EW.copy())
                want = PlacementPricer(flow, owner_E, cm, SHAPE, cm.topology.node_of).placements([fresh.holders_EW])
                for name in FIELDS:
                    assert getattr(got, name)[z] == getattr(want, name)[0], name
            monkeypatch.setattr(placement_pricing, "COMPILED", False)
            numpy = PlacementPricer(flow, owner_E, cm, SHAPE, cm.topology.node_of).of_placements(plans)
            monkeypatch.setattr(placement_pricing, "COMPILED", True)
            for name in FIELDS:
                np.testing.assert_allclose(getattr(got, name), getattr(numpy, name), rtol=1e-12, err_msg=name)


def test_a_mean_of_replicas_flows_is_priced_in_whole_tokens_on_the_kernels(monkeypatch):
    """With data-parallel replicas the layer plans on the mean of their flows: shadowing, alone and
    inside `auto`, prices it rounded (as the dispatch sends whole tokens), on the shadow steps'
    kernel — the same decision as on the rounded flow itself."""
    from moeflow.perf import compiled_everywhere

    calls = []
    rows_of = compiled_everywhere.everywhere_rows
    monkeypatch.setattr(compiled_everywhere, "everywhere_rows", lambda *a: calls.append(1) or rows_of(*a))
    cm = CostModel.from_preset("johnny@16")
    owners = Placement.expert_parallel(32, 16)
    ctx = LayerContext(32, 2, ExpertShape(1024, 4096), cm)
    zipf = synthetic_trace("zipf", 4, 1, 16, 32, 4096, 2, skew=1.2, seed=4).flow_ILWE[:, 0]
    auto = PLANNERS.build("auto", ctx)
    for a, b in zip(np.rint(zipf[:2]), np.rint(zipf[2:])):
        mean = (a + b) / 2.0  # two replicas: halves
        assert not np.array_equal(mean, np.rint(mean))
        calls.clear()
        shadow = PLANNERS.build("shadow", ctx)
        got = shadow(mean, owners, cm)
        assert calls  # the kernel, not the NumPy path
        assert got == PLANNERS.build("shadow", ctx)(np.rint(mean), owners, cm)
        auto(mean, owners, cm)
        assert auto.planners["shadow"].last.shadowed == shadow.last.shadowed
