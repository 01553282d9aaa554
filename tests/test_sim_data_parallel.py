"""`moeflow simulate` on a dp × ep mesh (`sim.data_parallel`) and Hecate's attention overlap
(`sim.attention_overlap`): single process, hand-checked prices.

Shape suffixes: Z replicas, I iterations, L layers, W ranks, E experts.
"""

import json

import numpy as np
import pytest

from moeflow.cli import main
from moeflow.core.expert_shape import ExpertShape
from moeflow.core.registry import Component, LayerContext
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.sim import simulator as sim
from moeflow.sim.attention_overlap import attention_overlapped_copies
from moeflow.sim.data_parallel import MeshLayout, hidden_behind_backward, replica_flows
from moeflow.sim.planning import plan_replay
from moeflow.sim.traces import Trace, synthetic_trace
from moeflow.strategies import PLANNERS
from moeflow.strategies.planners.ep import plan_ep

INTER, INTRA, LAT_ROOT, LAT_NODE = 1e9, 1e10, 1e-6, 1e-7
SHAPE = ExpertShape(32, 64)


def two_by_two(latency: bool = False) -> CostModel:
    """2 nodes × 2 ranks: dp 2 × ep 2 puts one EP group in each node."""
    lat = [LAT_ROOT, LAT_NODE] if latency else 0.0
    return CostModel(Topology.from_spec([[0, 1], [2, 3]], [INTER, INTRA], lat), 1e12)


def layer(**kw) -> sim.SimulatedLayer:
    return sim.SimulatedLayer(SHAPE, **kw)


def rows(results):
    return {(r.strategy, r.schedule): r for r in results}


def test_one_ep_group_of_every_rank_is_the_single_group_replay():
    trace = synthetic_trace("zipf", 5, 2, 4, 8, 300, seed=3)
    cm = two_by_two()
    strategies, schedules = ("ep", "shadow", "fssdp"), ("sync", "pairwise")
    plain = rows(sim.simulate(trace, cm, layer(), strategies, schedules))
    for experts in ("replicate", "fsdp"):
        mesh = rows(sim.simulate(trace, cm, layer(), strategies, schedules, layout=MeshLayout(4, experts)))
        for key, r in plain.items():
            m = mesh[key]
            assert np.array_equal(m.total_I, r.total_I) and np.array_equal(m.layer_total_IL, r.layer_total_IL)
            assert m.summary() == r.summary() and "expert_dp_s" not in m.summary()


def test_expert_all_reduce_by_hand_and_hidden_behind_the_backward():
    # E=4 over ep 2: each rank holds 2 experts; dp groups {0, 2} and {1, 3} cross the 1 GB/s uplinks.
    trace = synthetic_trace("uniform", 2, 3, 4, 4, 200, seed=0)
    cm = two_by_two(latency=True)
    S = 2 * SHAPE.param_bytes(4)
    # Ring all-reduce of 2 ranks: S on each hop (2·(n−1)/n·S); node 0's uplink carries 0→2 and 1→3;
    # 2·(n−1) = 2 steps, each the route latency d→node→root→node→d.
    allreduce = 2 * S / INTER + 2 * (2 * LAT_NODE + 2 * LAT_ROOT)
    (r,) = sim.simulate(trace, cm, layer(), ("ep",), ("sync",), layout=MeshLayout(2), ceiling=False)
    assert r.expert_dp_I == pytest.approx(np.full(2, 3 * allreduce))
    assert r.total_I == pytest.approx(r.layer_total_IL.sum(1) + 3 * allreduce)
    assert r.summary()["expert_dp_exposed_s"] == pytest.approx(3 * allreduce)
    # FSDP2 instead: two all-gathers and a reduce-scatter, (n−1)/n·S per hop each: 1.5× the link time.
    (f,) = sim.simulate(trace, cm, layer(), ("ep",), ("sync",), layout=MeshLayout(2, "fsdp"), ceiling=False)
    assert f.expert_dp_I == pytest.approx(np.full(2, 3 * (1.5 * 2 * S / INTER + 3 * (2 * LAT_NODE + 2 * LAT_ROOT))))
    # Hidden as DDP: layer l's all-reduce starts when its MoE backward (2/3 of its time) is done.
    (h,) = sim.simulate(trace, cm, layer(), ("ep",), ("sync",), layout=MeshLayout(2, overlap_allreduce=True))
    expected = hidden_behind_backward(r.layer_total_IL, 0.0, allreduce)
    assert h.expert_dp_exposed_I == pytest.approx(expected) and np.all(expected < 3 * allreduce)
    assert h.total_I == pytest.approx(r.total_I - 3 * allreduce + expected)


def test_hidden_behind_backward_by_hand():
    # Layers' times 3 and 6 (no dense part): backwards 2 and 4, the last layer's first.
    total_IL = np.array([[3.0, 6.0]])
    assert hidden_behind_backward(total_IL, 0.0, 1.0) == pytest.approx([1.0])  # 4 → 5, then 6 → 7: 1 past 6
    assert hidden_behind_backward(total_IL, 0.0, 3.0) == pytest.approx([4.0])  # 4 → 7, then 7 → 10
    # A dense part of 1 per block: its attention backward (2) follows the MoE backward and hides it.
    with_dense_IL = total_IL + 3.0
    assert hidden_behind_backward(with_dense_IL, 1.0, 1.0) == pytest.approx([0.0])


def test_replicas_wait_for_the_slowest():
    # Replica 0 (ranks 0, 1) is loaded in iteration 0, replica 1 (ranks 2, 3) in iteration 1.
    light, heavy = [[10, 10, 10, 10]] * 2, [[200, 0, 0, 0], [200, 0, 0, 0]]
    flow = np.array([[heavy + light], [light + heavy]], dtype=np.int64)  # [I=2, L=1, W=4, E=4]
    trace = Trace(flow, [0, 1])
    cm = two_by_two()
    (r,) = sim.simulate(trace, cm, layer(), ("ep",), ("sync",), layout=MeshLayout(2), ceiling=False)
    alone = [
        sim.simulate(Trace(flow[:, :, 2 * z : 2 * z + 2], [0, 1]), cm.restricted([2 * z, 2 * z + 1]), layer(), ("ep",))
        for z in range(2)
    ]
    slowest_I = np.maximum(alone[0][0].total_I, alone[1][0].total_I)
    assert alone[0][0].total_I[0] > alone[1][0].total_I[0] and alone[1][0].total_I[1] > alone[0][0].total_I[1]
    assert r.total_I == pytest.approx(slowest_I + r.expert_dp_I)


def test_a_planner_that_reads_the_flow_waits_per_layer(monkeypatch):
    # Owners only, but through a planner that reads the flow: replicas meet at every layer.
    monkeypatch.setitem(
        PLANNERS._components,
        "ep_planner",
        Component("ep_planner", lambda ctx, o: lambda f, p, c=None: plan_ep(f, p, c)),
    )
    light, heavy = [[10, 10, 10, 10]] * 2, [[200, 0, 0, 0], [200, 0, 0, 0]]
    flow = np.array([[heavy + light, light + heavy]], dtype=np.int64)  # layer 0: replica 0 slow; layer 1: replica 1
    trace = Trace(flow, [0])
    cm = two_by_two(latency=True)
    (r,) = sim.simulate(trace, cm, layer(), ("ep_planner",), ("sync",), layout=MeshLayout(2), ceiling=False)
    alone = [
        sim.simulate(Trace(flow[:, :, 2 * z : 2 * z + 2], [0]), cm.restricted([2 * z, 2 * z + 1]), layer(), ("ep",))[0]
        for z in range(2)
    ]
    per_layer = np.maximum(alone[0].layer_total_IL, alone[1].layer_total_IL).sum()
    per_iteration = max(alone[0].total_I[0], alone[1].total_I[0])
    # The flow's all-reduce per layer: a [2, 4] float64 matrix over each dp group of 2, both rings
    # through node 0's uplink (the whole 64-byte buffer per hop for n = 2).
    sync = 2 * (8 * 2 * 4) / INTER + 2 * (2 * LAT_NODE + 2 * LAT_ROOT)
    assert per_layer > per_iteration
    assert r.total_I[0] == pytest.approx(per_layer + 2 * sync + r.expert_dp_I[0])


def test_every_replica_runs_the_placement_planned_on_the_mean_flow():
    trace = synthetic_trace("zipf", 6, 1, 4, 8, 400, skew=1.5, seed=5)
    flow = trace.flow_ILWE.copy()
    flow[:, :, 2:] = flow[:, :, 2:, ::-1]  # the second replica's hot experts are the first's cold ones
    cm = two_by_two().restricted([0, 1])
    ctx = LayerContext(8, 2, SHAPE, cm)
    build = lambda: PLANNERS.build("shadow", ctx, {"min_gain": 0.0})  # noqa: E731
    flows_Z = [flow[:, :, :2], flow[:, :, 2:]]
    mean = (flows_Z[0] + flows_Z[1]) / 2
    plans_Z = plan_replay(build, mean, cm, SHAPE.param_bytes(4), dispatched=flows_Z)
    (on_mean,) = plan_replay(build, mean, cm, SHAPE.param_bytes(4))
    (on_own,) = plan_replay(build, flows_Z[0], cm, SHAPE.param_bytes(4))
    for z, plans in enumerate(plans_Z):
        assert np.array_equal(plans.holders, on_mean.holders)
        assert np.array_equal(plans.computed.sum(-2), flows_Z[z].sum(-2))  # its own tokens, every one computed
    assert not np.array_equal(on_own.holders, on_mean.holders)  # the mean is not either replica's flow
    (r,) = sim.simulate(
        Trace(flow, trace.steps_I),
        two_by_two(),
        layer(options={"strategy": {"min_gain": 0.0}}),
        ("shadow",),
        layout=MeshLayout(2),
        ceiling=False,
    )
    assert np.array_equal(r.replicated_IL, on_mean.holders.sum((-2, -1)) - 8)
    planned, _ = replica_flows(flow, 2)  # the mean in whole tokens, as the layer hands it to its planner
    assert not np.array_equal(mean, np.rint(mean)) and np.array_equal(planned, np.rint(mean))


def test_attention_overlap_by_hand():
    gather_IL, reduce_IL = np.array([[3.0, 1.0]]), np.array([[2.0, 5.0]])
    planned_IL = np.array([[True, True]])
    # forward: max(3−2, 0), max(1−2, 0); backward of block 1: spRS 5 + re-gather of layer 0 (3) − 4 = 4;
    # block 0: spRS 2 − 4 → 0; the last layer's re-gather (1) has nothing before it.
    got = attention_overlapped_copies(gather_IL, reduce_IL, 2.0, True, planned_IL)
    assert got[0] == pytest.approx([1.0, 5.0])
    assert attention_overlapped_copies(gather_IL, reduce_IL, 2.0, False, planned_IL)[0] == pytest.approx([1.0, 1.0])
    not_planned = attention_overlapped_copies(gather_IL, reduce_IL, 2.0, False, np.array([[False, True]]))
    assert not_planned[0] == pytest.approx([3.0, 1.0])


def test_fssdp_copies_hide_behind_the_attention_end_to_end():
    trace = synthetic_trace("zipf", 8, 2, 4, 8, 2000, skew=2.0, seed=1)
    cm = two_by_two()
    args = (("fssdp",), ("sync",))
    bare = rows(sim.simulate(trace, cm, layer(nonmoe_forward_s=1.0), *args, ceiling=False))[("fssdp", "sync")]
    hidden = rows(sim.simulate(trace, cm, layer(nonmoe_forward_s=1.0, overlap_attention=True), *args, ceiling=False))
    hidden = hidden[("fssdp", "sync")]
    counts = 2 * cm.count_exchange_time(8)
    assert bare.replicated_IL[1:].sum() > 0 and bare.other_comm_I.mean() > counts + 1e-9
    # A second of attention hides every copy of a planned placement; the first iteration's owners copy nothing.
    assert hidden.other_comm_I == pytest.approx(np.full(8, counts))


def test_planners_price_copies_behind_the_attention_alone():
    # Hecate's overlap: the windows the planners price copies with hold the attention, not the experts'
    # compute (Eq. 8's `experts_hide`), as `attention_overlap` charges them; the prefetch's hold both.
    from moeflow.sim.pricing import GroupPricing

    cm = two_by_two()
    for overlap_attention, prefetch in ((True, False), (False, True)):
        spec = layer(nonmoe_forward_s=1.0, overlap_attention=overlap_attention, prefetch=prefetch)
        window = GroupPricing(cm, spec, ("sync",), 8, 2, 2).window
        assert window.nonmoe_forward_s == 1.0 and window.experts_hide == prefetch


def test_restricted_cost_model_is_the_sub_cluster():
    full = CostModel.resolve("johnny")
    sub, ref = full.restricted(range(8, 16)), CostModel.resolve("johnny@8")
    assert sub.topology.spec == ref.topology.spec
    assert np.array_equal(sub.topology.path_bandwidth_WW, ref.topology.path_bandwidth_WW)
    assert np.array_equal(sub.topology.path_latency_WW, ref.topology.path_latency_WW)
    assert sub.gemm_flops_per_s == ref.gemm_flops_per_s
    ring = CostModel.resolve("trevor")
    with pytest.raises(ValueError, match="ring node"):
        ring.restricted([0, 1])
    # An asymmetric tree: keeping none of the deepest switch's devices drops that level, the routes
    # among the kept devices unchanged.
    tree = Topology.from_spec([[0, 1], [2, [3, 4]]], [1e9, 2e9, 4e9], [1e-6, 2e-6, 4e-6])
    for kept in ([0, 1, 2], [2, 3], [4, 0]):
        part = tree.restricted(kept)
        ix = np.ix_(kept, kept)
        assert np.array_equal(part.path_bandwidth_WW, tree.path_bandwidth_WW[ix]), kept
        assert np.array_equal(part.path_latency_WW, tree.path_latency_WW[ix]), kept
    assert tree.restricted([0, 1, 2]).depth == 2


def test_bad_layouts_fail_before_any_work(capsys):
    trace = synthetic_trace("uniform", 1, 1, 4, 8, 10)
    cm = two_by_two()
    with pytest.raises(ValueError, match=r"ep_size=3 \(--ep-size\): must divide the cluster's 4 ranks"):
        sim.simulate(trace, cm, layer(), layout=MeshLayout(3))
    with pytest.raises(ValueError, match=r"ep_size=2 \(--ep-size\): the 5 experts must split evenly"):
        sim.simulate(synthetic_trace("uniform", 1, 1, 4, 5, 10), cm, layer(), layout=MeshLayout(2))
    with pytest.raises(ValueError, match="ep_size=0"):
        MeshLayout(0)
    with pytest.raises(ValueError, match="experts='sharded'"):
        MeshLayout(2, "sharded")
    with pytest.raises(ValueError, match="prefetch=True and overlap_attention=True"):
        layer(prefetch=True, overlap_attention=True)
    for argv, message in (
        (["--ep-size", "3"], "ep_size=3 (--ep-size): must divide the cluster's 16 ranks"),
        (["--parallel-experts", "fsdp", "--ep-size", "32"], "ep_size=32 (--ep-size): must divide"),
        (["--prefetch", "--overlap-attention"], "--prefetch with --overlap-attention"),
    ):
        assert main(["simulate", "--cluster", "johnny", "--trace", "zipf", "--iterations", "1", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0]


def test_cli_dp_columns_and_json(capsys):
    base = ["simulate", "--cluster", "johnny", "--trace", "zipf", "--iterations", "2", "--strategy", "ep,fssdp"]
    assert (
        main([*base, "--schedule", "sync", "--ep-size", "8", "--parallel-experts", "fsdp", "--overlap-attention"]) == 0
    )
    out = capsys.readouterr().out
    assert "dp comm" in out and "dp exp." in out
    assert main([*base, "--schedule", "sync", "--ep-size", "8", "--overlap-allreduce", "--json"]) == 0

    doc = json.loads(capsys.readouterr().out)
    assert doc["ep_size"] == 8 and doc["parallel_experts"] == "replicate" and doc["overlap_allreduce"]
    ep = next(r for r in doc["results"] if r["strategy"] == "ep")
    assert 0 < ep["expert_dp_exposed_s"] <= ep["expert_dp_s"]
