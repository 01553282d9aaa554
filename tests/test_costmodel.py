"""CostModel: α-β fits, FasterMoE link model by hand, paper formulas, JSON, TA-MoE Table 1."""

import numpy as np
import pytest

from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import plain_ep_owners
from moeflow.perf.costmodel import AlphaBeta, CostModel
from moeflow.perf.placement_pricing import PlacementPricer
from moeflow.perf.topology import Topology
from moeflow.routing.topology_aware import TABLE1_EVEN, TABLE1_UNEVEN
from moeflow.strategies.planners.prophet_model import prophet_layer_times


def lat_comp(m, tokens_W, d, h, kind="ffn"):
    """FasterMoE Eq. 1 with each device's tokens on one expert."""
    return m.compute_time(np.asarray(tokens_W)[..., None], ExpertShape(d, h, kind))


def two_nodes(inter=1e9, intra=1e10):
    return CostModel(Topology.from_spec([[0, 1], [2, 3]], [inter, intra]), gemm_flops_per_s=1e12)


def test_fit_recovers_fsmoe_published_constants():
    # FSMoE §6.2 sweep: 2^18 .. 24·2^18 float32 elements; all-to-all α = 0.2352 ms,
    # β = 1.854e-6 ms per element (FSMoE §6.2).
    elems = np.arange(1, 25) * 2**18
    nbytes = 4 * elems
    alpha, beta = 0.2352e-3, 1.854e-6 * 1e-3 / 4
    exact = AlphaBeta.fit(nbytes, alpha + beta * nbytes)
    assert exact.alpha_s == pytest.approx(alpha, rel=1e-9) and exact.beta_s_per_unit == pytest.approx(beta, rel=1e-9)
    assert exact.r2 == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    noisy = AlphaBeta.fit(nbytes, (alpha + beta * nbytes) * (1 + 0.01 * rng.standard_normal(24)))
    assert noisy.beta_s_per_unit == pytest.approx(beta, rel=0.02)
    assert noisy.alpha_s == pytest.approx(alpha, abs=0.2 * alpha)
    assert 0.99 < noisy.r2 < 1.0
    with pytest.raises(ValueError, match="distinct sizes"):
        AlphaBeta.fit([1, 1], [2, 3])


def test_fit_never_goes_negative():
    # decreasing times at small sizes would give α < 0 unconstrained
    fit = AlphaBeta.fit([1, 2, 3, 4], [0.0, 0.0, 1.0, 2.0])
    assert fit.alpha_s >= 0 and fit.beta_s_per_unit >= 0
    assert np.all(fit([0, 1, 2]) >= 0)


def test_uniform_a2a_by_hand():
    # Each of 4 ranks sends S/4 to every rank. Node uplink s0->s carries 4·S/4 = S at 1 GB/s;
    # a device uplink carries 3·S/4 at 10 GB/s. Busiest link: S / 1e9.
    m = two_nodes()
    S = 8e6
    assert float(m.a2a_time(np.full((4, 4), S / 4))) == pytest.approx(S / 1e9)
    # an exchange inside node 0 only never touches the network: 2 MB on d0->s0 at 10 GB/s
    flow = np.zeros((4, 4))
    flow[0, 1] = 2e6
    assert float(m.a2a_time(flow)) == pytest.approx(2e6 / 1e10)
    assert float(m.a2a_time(np.zeros((4, 4)))) == 0.0
    # vectorised over leading dims
    assert m.a2a_time(np.stack([flow, 2 * flow])).shape == (2,)


def test_collectives_by_hand():
    m = CostModel(Topology.homogeneous(4, 1e9), gemm_flops_per_s=1e12)
    S = 4e6
    # ring all-reduce: each rank sends 2·(n−1)/n·S to its neighbour; hop i->i+1 uses d_i->s, s->d_i+1
    assert m.collective_time("all_reduce", S) == pytest.approx(1.5 * S / 1e9)
    assert m.collective_time("all_gather", S) == pytest.approx(0.75 * S / 1e9)
    assert m.collective_time("broadcast", S) == pytest.approx(S / 1e9)
    assert m.collective_time("reduce", S, ranks=[0, 2]) == pytest.approx(S / 1e9)
    assert m.collective_time("all_reduce", S, ranks=[3]) == 0.0
    with pytest.raises(ValueError, match="kind='gather'"):
        m.collective_time("gather", S)
    with pytest.raises(ValueError, match="ranks="):
        m.collective_time("all_reduce", S, ranks=[0, 0])
    assert float(m.p2p_time(1e6, 0, 3)) == pytest.approx(1e6 / 1e9)


def test_compute_eq1_and_gemm_fit():
    m = two_nodes()
    # FasterMoE Eq. 1: forward of a 2-layer expert is 4·B·h·d FLOPs; the slowest device counts.
    B = np.array([100, 400, 0, 50])
    assert float(lat_comp(m, B, 64, 256)) == pytest.approx(4 * 400 * 64 * 256 / 1e12)
    assert float(lat_comp(m, B, 64, 256, "swiglu")) == pytest.approx(6 * 400 * 64 * 256 / 1e12)
    fitted = CostModel(m.topology, 1e12, {"gemm": AlphaBeta(1e-5, 2e-12, "flop")})
    # α paid per GEMM launch (2 per ffn expert), not by an idle device
    t = fitted.device_compute_time(B[:, None], ExpertShape(64, 256))
    assert t[2] == 0.0 and t[1] == pytest.approx(2e-5 + 2e-12 * 4 * 400 * 64 * 256)
    # ... and once per GEMM of every expert that has tokens, as the per-expert kernels launch
    tokens_WE = np.array([[100, 0, 0], [200, 200, 0], [0, 0, 0], [50, 0, 0]])
    t = fitted.device_compute_time(tokens_WE, ExpertShape(64, 256))
    assert t[1] == pytest.approx(2 * 2e-5 + 2e-12 * 4 * 400 * 64 * 256)


def test_a2a_fit_calibrates_link_model():
    topo = Topology.from_spec([[0, 1], [2, 3]], [1e9, 1e10])
    fit = AlphaBeta(2e-4, 3e-9)
    m = CostModel(topo, 1e12, {"a2a": fit})
    for n in (1e5, 1e6, 4e6):
        assert float(m.a2a_time(np.full((4, 4), n / 4))) == pytest.approx(fit(n))  # uniform = the fit
    skew = np.full((4, 4), 1e5)
    skew[:, 3] = 1e6  # everyone floods device 3: busier links than uniform of the same total
    uniform = np.full((4, 4), skew.sum() / 16)
    assert float(m.a2a_time(skew)) > float(m.a2a_time(uniform))


def test_ta_moe_table1_ordering():
    # TA-MoE §3.3 Table 1 on [[0,1],[0̂,1̂]], 128 MB per device: uneven (1/4 self, 1/2 neighbour,
    # 1/8 each remote) beats even (1/4 each) when the inter-node link is the bottleneck.
    even, uneven = TABLE1_EVEN, TABLE1_UNEVEN
    S = 128 * 2**20
    for inter in (2e9, 6.25e9, 12.5e9):
        m = two_nodes(inter=inter, intra=12e9)
        assert float(m.a2a_time(uneven * S)) < float(m.a2a_time(even * S))
    m = two_nodes(inter=12.5e9, intra=12e9)  # 100 Gb/s IB behind ~12 GB/s PCIe 3.0 devices
    assert float(m.a2a_time(even * S)) / float(m.a2a_time(uneven * S)) == pytest.approx(1.28, abs=0.02)
    m = two_nodes(inter=1e9, intra=12e9)  # very slow network: the speedup reaches 2 (node uplink halves)
    assert float(m.a2a_time(even * S)) / float(m.a2a_time(uneven * S)) == pytest.approx(2.0)


def test_prophet_formulas():
    m = two_nodes(inter=1e9, intra=1e10)
    d, h = 64, 256
    B = np.array([4000, 1000, 1000, 1000])
    # Pro-Prophet Eq. 1-8
    t = prophet_layer_times(
        m,
        recv_tokens_W=[10, 20, 30, 40],
        compute_tokens_W=B,
        copies=2 * (4 - 1),  # s = 2 experts, each to D - n = 3 devices
        shape=ExpertShape(d, h),
        nonmoe_forward_s=0.0,
    )
    bbar = m.mean_bandwidth_bytes_per_s
    assert float(t["a2a"]) == pytest.approx(40 * d * 4 / bbar)
    size = (2 * d * h + d + h) * 4  # an ffn expert's parameters
    assert float(t["trans"]) == pytest.approx(2 * 3 * size / (4 * bbar))
    assert float(t["fec"]) == pytest.approx(4 * 4000 * d * h / 1e12)
    assert float(t["total"]) == pytest.approx(4 * t["a2a"] + 3 * t["fec"] + 2 * t["trans"])
    assert float(t["overlapped"]) <= float(t["total"])
    # B̄ on [[0,1],[2,3]]: of the 12 ordered pairs, 4 are intra (10 GB/s) and 8 inter (1 GB/s)
    assert bbar == pytest.approx((4 * 1e10 + 8 * 1e9) / 12)


def test_fsmoe_chunk_time_and_op_time():
    m = CostModel.from_preset("fsmoe_a")
    fit = m.fits["a2a"]
    assert fit.alpha_s == pytest.approx(2.87e-4) and fit.beta_s_per_unit == pytest.approx(2.21e-10 / 4)
    assert float(m.chunk_time("a2a", 8e6, 4)) == pytest.approx(fit.alpha_s + 2e6 * fit.beta_s_per_unit)
    with pytest.raises(ValueError, match="degree"):
        m.chunk_time("a2a", 1e6, 0)
    plain = CostModel.from_preset("johnny")
    assert plain.fits == {} and plain.gemm_flops_per_s == pytest.approx(0.9 * 14e12)
    assert float(plain.op_time("gemm", 1e12)) == pytest.approx(1e12 / plain.gemm_flops_per_s)
    assert np.all(np.diff(plain.op_time("all_reduce", [1e6, 2e6, 4e6])) > 0)


def test_json_roundtrip_and_errors(tmp_path):
    m = CostModel(
        Topology.from_spec([[0, 1], [2, 3]], [1e9, 1e10]),
        2e12,
        {"a2a": AlphaBeta(1e-4, 1e-9, r2=0.99), "gemm": AlphaBeta(1e-5, 1e-12, "flop")},
    )
    m.save(tmp_path / "cm.json")
    again = CostModel.load(tmp_path / "cm.json")
    assert again.to_dict() == m.to_dict()
    flow = np.random.default_rng(0).integers(0, 1000, (4, 4)) * 1e3
    assert float(again.a2a_time(flow)) == pytest.approx(float(m.a2a_time(flow)))
    with pytest.raises(ValueError, match="unknown operation kinds"):
        CostModel(m.topology, 1e12, {"allreduce": AlphaBeta(0, 1)})
    with pytest.raises(ValueError, match="gemm_flops_per_s=0"):
        CostModel(m.topology, 0)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        CostModel.load(tmp_path / "nope.json")
    with pytest.raises(ValueError, match="cost model 'mars': not a topology preset"):
        CostModel.resolve("mars")


def test_materialize_traffic():
    m = two_nodes(inter=1e9, intra=1e10)
    owner = np.array([0, 1, 2, 3])
    holders = np.eye(4, dtype=bool)
    assert float(m.materialize_time(1e6, holders, owner)) == 0.0
    holders[0, :] = True  # expert 0 copied from rank 0 to 1, 2, 3
    # The tree: 0 -> 1 and 0 -> one relay on node 1 (the uplink carries one copy), then the relay
    # -> its node-mate inside node 1; straight from the owner the uplink would carry two.
    assert float(m.materialize_time(1e6, holders, owner)) == pytest.approx(1e6 / 1e9 + 1e6 / 1e10)
    assert float(m.materialize_time(1e6, holders, owner, direct=True)) == pytest.approx(2e6 / 1e9)
    holders[0, 1] = False  # node 1 only: one transfer in, then the fan-out
    assert m.materialize_time(1e6, holders[None].repeat(3, 0), owner) == pytest.approx(
        np.full(3, 1e6 / 1e9 + 1e6 / 1e10)
    )


def test_copies_of_shadowed_experts_by_hand():
    """Experts held everywhere: NCCL runs one ring broadcast per owner (each link carries the
    parameters once), gloo across nodes the two-level tree for all owners at once."""
    owner = np.repeat(np.arange(4), 2)
    holders = np.eye(4, dtype=bool)[owner]
    holders[[2, 5]] = True  # one expert of rank 1 and one of rank 2 shadowed
    nccl, gloo = two_nodes(inter=1e8, intra=1e9), two_nodes(inter=1e8, intra=1e9)
    gloo.backend = "gloo"
    # NCCL: two broadcasts, each bound by the 1e8 inter-node link.
    assert nccl.copies_time(1e6, holders, owner, "materialize") == pytest.approx(2 * 1e6 / 1e8)
    # gloo tree: stage 1 = 1 -> 3 and 2 -> 0 cross the link in opposite directions at once (10 ms),
    # with 1 -> 0 and 2 -> 3 inside the nodes; stage 2 = the leaders forward inside their node (1 ms).
    for direction in ("materialize", "reduce"):
        assert gloo.copies_time(1e6, holders, owner, direction) == pytest.approx(1e6 / 1e8 + 1e6 / 1e9)
    # A profiled `copies` fit (every owner at once, forward + back) calibrates the tree's link
    # model: here measured twice as slow as the links allow (η = 2), on links that carry as much
    # each way. It prices the bytes that cross bytes going the other way: stage 1 (1 -> 3 against
    # 2 -> 0) at twice the link's time, stage 2 (one way inside each node) at the link's.
    everywhere = np.ones((4, 4), dtype=bool)
    ideal = 2 * gloo.copies_time(1.0, everywhere, np.arange(4), "materialize")
    fits = {"copies": AlphaBeta(0.0, 2 * ideal, "byte", 1.0, "test")}
    calibrated = CostModel(gloo.topology, 1e12, fits, backend="gloo")
    assert calibrated.copies_time(1.0, everywhere, np.arange(4), "materialize") == pytest.approx(ideal)
    assert calibrated.copies_time(1e6, holders, owner, "reduce") == pytest.approx(2 * 1e6 / 1e8 + 1e6 / 1e9)
    one_way = np.eye(4, dtype=bool)[owner]
    one_way[2] = True  # only rank 1's expert shadowed: it crosses the link alone, at the link's time
    assert calibrated.copies_time(1e6, one_way, owner) == pytest.approx(1e6 / 1e8 + 1e6 / 1e9)
    assert CostModel(nccl.topology, 1e12, fits).copies_time(1e6, holders, owner) == pytest.approx(2e6 / 1e8)
    with pytest.raises(ValueError, match="backend='mpi'"):
        CostModel(Topology.homogeneous(2, 1e9), 1e9, backend="mpi")
    assert CostModel.from_dict(gloo.to_dict()).backend == "gloo"


def test_uncalibrated_a2a_is_fastermoe_eq2():
    topo = Topology.from_spec([[0, 1], [2, 3]], [1e9, 1e10])
    m = CostModel(topo, 1e12, {"a2a": AlphaBeta(2e-4, 3e-9)}, a2a_calibration=False)
    S = 8e6
    assert float(m.a2a_time(np.full((4, 4), S / 4))) == pytest.approx(S / 1e9)  # busiest link only
    again = CostModel.from_dict(m.to_dict())
    assert again.a2a_calibration is False


def test_processor_sharing_on_a_shared_host():
    # 4 CPU ranks on 2 cores, profiled "all busy" times [1, 1, 1, 3] s: all four share the cores
    # for 1 s (three finish), then the hot rank runs alone at full speed: 1.0 s of full-core
    # work left (1.5 total - 0.5 done). Makespan 2 s instead of the dedicated-device max of 3 s.
    topo = Topology.homogeneous(4, 1e9)
    flops_per_s = 4 * 8 * 8 * 1.0  # 1 token = 1 s
    shared = CostModel(topo, flops_per_s, host_cores=2)
    dedicated = CostModel(topo, flops_per_s)
    B = np.array([1, 1, 1, 3])
    assert float(lat_comp(dedicated, B, 8, 8)) == pytest.approx(3.0)
    assert float(lat_comp(shared, B, 8, 8)) == pytest.approx(2.0)
    assert float(lat_comp(shared, np.full(4, 2), 8, 8)) == pytest.approx(2.0)  # balanced: unchanged
    assert lat_comp(shared, np.stack([B, 2 * B]), 8, 8).tolist() == pytest.approx([2.0, 4.0])
    assert CostModel.from_dict(shared.to_dict()).host_cores == 2
    with pytest.raises(ValueError, match="host_cores=0"):
        CostModel(topo, 1.0, host_cores=0)


@pytest.mark.parametrize(
    "preset, backend, chunks",
    [("johnny", None, 1), ("hecate_a", None, 1), ("johnny", "gloo", 1), ("johnny", None, 4), ("johnny", "gloo", 3)],
)
def test_placement_pricer_prices_copies_as_copies_time(preset, backend, chunks):
    """The vectorised pricer's copies (trees per stage, deltas per step) equal `copies_time` of each
    placement, as run and as the prefetch sends them, on nodes of 8 with NCCL and on gloo, with the
    trees in one piece or in the chunk pipeline (`copy_chunks`)."""
    rng = np.random.default_rng(0)
    cm = CostModel.from_preset(preset).with_copy_chunks(chunks)
    cm.backend = backend or cm.backend
    W = cm.topology.num_devices
    owner = plain_ep_owners(2 * W, W)
    shape = ExpertShape(256, 1024, "ffn")
    pricer = PlacementPricer(rng.integers(0, 50, (W, 2 * W)), owner, cm, shape, cm.topology.node_of)
    candidates = [np.eye(W, dtype=bool)[owner] | (rng.random((2 * W, W)) < p) for p in (0.0, 0.05, 0.2, 0.5)]
    candidates[1][rng.integers(0, 2 * W, 3)] = True  # some held everywhere
    terms = pricer.placements(candidates)
    size = shape.param_bytes(cm.bytes_per_element)
    for c, holders in enumerate(candidates):
        for got, direction, tree in [
            (terms.trans_s, "materialize", None),
            (terms.agg_s, "reduce", None),
            (terms.trans_prefetched_s, "materialize", False),
            (terms.agg_prefetched_s, "reduce", False),
        ]:
            assert got[c] == pytest.approx(cm.copies_time(size, holders, owner, direction, tree), rel=1e-9, abs=1e-12)


def _trees_time_stage_after_stage(cm, param_bytes, holders_EW, owner_E) -> float:
    """The copy trees priced by hand from their edges, each stage whole and one after the other:
    per stage its busiest link plus its slowest route's latency, summed."""
    from moeflow.core.placement import tree_edges

    topo = cm.topology
    _, src, dst, stage = tree_edges(holders_EW, owner_E, topo.node_of)
    total = 0.0
    for s in (0, 1):
        m = stage == s
        if m.any():
            hops = topo.route_WWH[src[m], dst[m]].reshape(-1)
            traffic_L = np.bincount(hops, minlength=len(topo.links) + 1)[:-1] * float(param_bytes)
            total += float(cm.stage_time_from_traffic(traffic_L)) + float(topo.path_latency_WW[src[m], dst[m]].max())
    return total


def test_copy_chunks_price_the_trees_pipelined_by_hand():
    """Hecate §4.1's chunk pipeline (`core.copy_rounds`) priced as it runs: c + 1 rounds, each the
    slower stage's piece: (t1/c + l1) + (c - 1)·max(t1/c + l1, t2/c + l2) + (t2/c + l2); c = 1 is
    t1 + l1 + t2 + l2, to the bit; a tree with one stage is sent (and priced) whole; the
    prefetch (`tree=False`) sends each stage whole whatever c."""
    topo = Topology.from_spec([[0, 1], [2, 3]], [1e9, 1e10], [2e-4, 1e-5])
    whole = CostModel(topo, 1e12)
    piped = CostModel(topo, 1e12, copy_chunks=4)
    owner = np.arange(4)
    holders = np.eye(4, dtype=bool)
    holders[0, [2, 3]] = True  # 0 -> relay 2 (across the uplink), then 2 -> 3 inside node 1
    t1, t2 = 1e6 / 1e9, 1e6 / 1e10
    l1, l2 = float(topo.path_latency_WW[0, 2]), float(topo.path_latency_WW[2, 3])
    assert l1 > l2 > 0
    a, b = t1 / 4 + l1, t2 / 4 + l2
    for direction in ("materialize", "reduce"):
        assert whole.copies_time(1e6, holders, owner, direction) == pytest.approx(t1 + l1 + t2 + l2, rel=1e-12)
        assert piped.copies_time(1e6, holders, owner, direction) == pytest.approx(a + 3 * max(a, b) + b, rel=1e-12)
        assert piped.copies_time(1e6, holders, owner, direction, tree=False) == whole.copies_time(
            1e6, holders, owner, direction
        )
    assert float(piped.materialize_time(1e6, holders, owner)) == pytest.approx(a + 3 * max(a, b) + b, rel=1e-12)
    # Equal stages (both bound by the ranks' 1e9 links): 5 pieces' time for 8, the pipeline's best.
    slow_second = CostModel(Topology.from_spec([[0, 1], [2, 3]], [1e10, 1e9]), 1e12, copy_chunks=4)
    assert slow_second.copies_time(1e6, holders, owner) == pytest.approx(5 * 1e-3 / 4, rel=1e-12)
    holders[0, 3] = False  # one holder on node 1: no second stage, the messages go whole
    assert piped.copies_time(1e6, holders, owner) == whole.copies_time(1e6, holders, owner)
    assert piped.copies_time(1e6, holders, owner) == pytest.approx(t1 + l1, rel=1e-12)
    assert whole.with_copy_chunks(1) is whole and whole.with_copy_chunks(4).copy_chunks == 4
    for bad in (0, -1, 2.0, True, "4"):
        with pytest.raises(ValueError, match=f"^copy_chunks must be an integer >= 1, got {bad!r}$".replace("(", r"\(")):
            CostModel(topo, 1e12, copy_chunks=bad)


@pytest.mark.parametrize("preset, backend", [("johnny", None), ("hecate_b", None), ("johnny", "gloo")])
def test_copy_chunks_one_prices_the_stages_one_after_the_other(preset, backend):
    """c = 1 gives the stages' sum (`_trees_time_stage_after_stage`) to the bit; c = 4 changes it
    only where a tree has a second stage."""
    rng = np.random.default_rng(3)
    cm = CostModel.from_preset(preset)
    cm.backend = backend or cm.backend
    W = cm.topology.num_devices
    owner = plain_ep_owners(2 * W, W)
    changed = 0
    for p in (0.0, 0.02, 0.1, 0.4):
        holders = np.eye(W, dtype=bool)[owner] | (rng.random((2 * W, W)) < p)
        sequential = _trees_time_stage_after_stage(cm, 3e6, holders, owner)
        assert cm._trees_time(3e6, holders, owner, cm.copy_chunks) == sequential
        stages = cm.tree_stage_terms(3e6, holders, owner)
        piped = cm.with_copy_chunks(4)._trees_time(3e6, holders, owner, 4)
        assert (piped != sequential) == (stages[0][2] and stages[1][2])
        changed += piped != sequential
    assert changed
