"""TA-MoE (§4): LP target vs closed forms, constraints, smoothing, loss == GShard, gradients, steering.

Pure and single-process. Shape suffixes: W ranks, E experts, T tokens, A assignments.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeflow import MoELayer
from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import cross_node_share, send_by_owner
from moeflow.core.registry import LayerContext
from moeflow.perf.costmodel import AlphaBeta, CostModel
from moeflow.perf.topology import Topology
from moeflow.routing import BALANCES
from moeflow.routing.balance import GShardBalance
from moeflow.routing.gates import TopKGate
from moeflow.routing.ta_moe import TAMoEBalance, TAMoEOptions
from moeflow.routing.topology_aware import flow_from_target, solve_dispatch_lp
from moeflow.routing.topology_aware import target_dispatch_pattern as _target


def links(topo: Topology) -> CostModel:
    """A cost model priced by the topology's links alone (GEMM throughput unused here)."""
    return CostModel(topo, gemm_flops_per_s=1.0)


def target_dispatch_pattern(topo, *args, **kwargs):
    return _target(links(topo) if isinstance(topo, Topology) else topo, *args, **kwargs)


def pair_cost_matrices(topo):
    return (links(topo) if isinstance(topo, Topology) else topo).pair_costs()


def owner_share(flow_WE, node_of):
    """Share crossing nodes when every expert e is computed by rank e (plain EP, one per rank)."""
    flow = np.asarray(flow_WE)
    return cross_node_share(send_by_owner(flow, np.arange(flow.shape[1])), node_of)


TOPOLOGIES = {
    "homogeneous": lambda: Topology.homogeneous(4, 10e9, 1e-6),
    "ring": lambda: Topology.ring([50e9, 25e9, 50e9, 25e9], 15e9),
    "tree_2x2": lambda: Topology.from_spec([[0, 1], [2, 3]], [1e9, 10e9], [5e-6, 1e-6]),
    "tree_3x2": lambda: Topology.from_spec([[0, 1], [2, 3], [4, 5]], [1e9, 10e9]),
    "asymmetric": lambda: Topology.from_spec([[[0, 1], [2, 3]], [[4, 5]]], [1e9, 5e9, 20e9], [5e-6, 2e-6, 1e-6]),
}


def pair_volume_WW(c_WE, owner_E, W):
    onehot_EW = np.zeros((len(owner_E), W))
    onehot_EW[np.arange(len(owner_E)), owner_E] = 1
    return np.asarray(c_WE) @ onehot_EW


def max_pair_cost(c_WE, owner_E, alpha_WW, beta_WW, bytes_per_rank):
    vol_WW = pair_volume_WW(c_WE, owner_E, alpha_WW.shape[0])
    has = np.bincount(owner_E, minlength=alpha_WW.shape[0]) > 0
    return float((alpha_WW + beta_WW * bytes_per_rank * vol_WW)[:, has].max())


# ---- target pattern --------------------------------------------------------------------------
def test_homogeneous_target_is_uniform():
    # TA-MoE §4.2: same α, β for every delivery -> ĉ = k·S/N, here per token k/E.
    c_WE = target_dispatch_pattern(Topology.homogeneous(4, 10e9, 2e-6), 8, 2, 256, 64, smoothing=0.0)
    np.testing.assert_allclose(c_WE, np.full((4, 8), 2 / 8), atol=1e-7)


@pytest.mark.parametrize("spec", [[[0, 1], [2, 3]], [[0, 1, 2], [3, 4, 5]], [[0, 1], [2, 3], [4, 5]]])
@pytest.mark.parametrize("top_k", [1, 2])
def test_two_level_tree_matches_closed_form(spec, top_k):
    # Per-device volume per token x (same node, sender included) and y (other node):
    # Eq. 2 with α = 0 is tight on every pair at the optimum: β1·x = β2·y, m·x + (W−m)·y = k.
    # This optimum is unique at the pair level: any pair below x or y forces another above.
    topo = Topology.from_spec(spec, [1e9, 8e9])
    W, m = topo.num_devices, len(spec[0])
    beta1, beta2 = 1 / 8e9, 1 / 1e9
    y = top_k / (m * beta2 / beta1 + (W - m))
    x = y * beta2 / beta1
    E = 2 * W
    c_WE = target_dispatch_pattern(topo, E, top_k, 512, 32, smoothing=0.0)
    owner_E = np.arange(E) // 2
    vol_WW = pair_volume_WW(c_WE, owner_E, W)
    same_WW = np.equal.outer(topo.node_of, topo.node_of)
    np.testing.assert_allclose(vol_WW[same_WW], x, rtol=1e-7)
    np.testing.assert_allclose(vol_WW[~same_WW], y, rtol=1e-7)
    if 2 * m == W:
        # The closed form written as a balance, m·x·β1 = (W−m)·y·β2 — the same for two nodes.
        assert m * x * beta1 == pytest.approx((W - m) * y * beta2)


def test_two_level_tree_with_latency_matches_closed_form():
    # With α: α1 + β1·B·x = α2 + β2·B·y (pair costs equalised), m·x + (W−m)·y = k.
    topo = Topology.from_spec([[0, 1], [2, 3]], [1e9, 8e9], [20e-6, 1e-6])
    alpha_WW, beta_WW = pair_cost_matrices(topo)
    a1, a2 = alpha_WW[0, 1], alpha_WW[0, 2]
    assert a1 == pytest.approx(2e-6) and a2 == pytest.approx(42e-6)  # 2 hops; 2 + 2 hops
    S, d, k = 1024, 128, 2
    B = S * d * 4
    b1, b2 = 1 / 8e9, 1 / 1e9
    # 2x + 2y = k and a1 + b1·B·x = a2 + b2·B·y
    A = np.array([[2.0, 2.0], [b1 * B, -b2 * B]])
    x, y = np.linalg.solve(A, [k, a2 - a1])
    assert 0 < y < x
    c_WE = target_dispatch_pattern(topo, 4, k, S, d, smoothing=0.0)
    vol_WW = pair_volume_WW(c_WE, np.arange(4), 4)
    assert vol_WW[0, 1] == pytest.approx(x, rel=1e-6)
    assert vol_WW[0, 2] == pytest.approx(y, rel=1e-6)
    # Larger batches: α matters less, remote share grows towards the α = 0 closed form.
    c_big = target_dispatch_pattern(topo, 4, k, 16 * S, d, smoothing=0.0)
    assert c_big[0, 2] > c_WE[0, 2]


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_constraints_and_optimality_on_every_family(name, smoothing):
    topo = TOPOLOGIES[name]()
    W, k, S, d = topo.num_devices, 2, 256, 64
    E = 2 * W
    # A non-contiguous owner map with uneven expert counts per rank (every rank owns one or more).
    owner_E = np.concatenate([np.arange(W), np.arange(W)[::-1]])
    owner_E[-1] = 1  # rank 0 owns one expert, rank 1 three
    assert np.bincount(owner_E).tolist()[:2] == [1, 3]
    c_WE = target_dispatch_pattern(topo, E, k, S, d, owner_E=owner_E, smoothing=smoothing)
    np.testing.assert_allclose(c_WE.sum(1), k, atol=1e-9)  # Eq. 3
    np.testing.assert_allclose(c_WE.sum(0), k * W / E, atol=1e-9)  # Eq. 4
    assert np.all(c_WE >= smoothing * k / E - 1e-9)
    if smoothing:
        assert np.all(c_WE > 0)
    # The LP optimum is no worse than uniform and its t* is the pattern's slowest pair.
    alpha_WW, beta_WW = pair_cost_matrices(topo)
    B = S * d * 4
    raw_WE, t_star = solve_dispatch_lp(alpha_WW, beta_WW, owner_E, k, B)
    assert max_pair_cost(raw_WE, owner_E, alpha_WW, beta_WW, B) == pytest.approx(t_star, rel=1e-5)
    uniform = max_pair_cost(np.full((W, E), k / E), owner_E, alpha_WW, beta_WW, B)
    if name == "homogeneous":
        assert t_star == pytest.approx(uniform, rel=1e-6)
    else:
        assert t_star < 0.9 * uniform


def test_asymmetric_tree_keeps_the_lone_node_mostly_local():
    # [[[0,1],[2,3]],[[4,5]]]: 4 and 5 reach the rest only through the slow root link.
    topo = TOPOLOGIES["asymmetric"]()
    c_WE = target_dispatch_pattern(topo, 6, 1, 1024, 64, smoothing=0.0)
    uniform_WE = np.full((6, 6), 1 / 6)
    node_of = [0, 0, 0, 0, 1, 1]  # the two top-level subtrees (topo.node_of splits the first one)
    assert owner_share(c_WE, node_of) < 0.5 * owner_share(uniform_WE, node_of)
    lone_to_lone = c_WE[4:, 4:].sum() / c_WE[4:].sum()
    assert lone_to_lone > 0.8


def test_smoothing_formula_and_no_starved_expert():
    topo = Topology.from_spec([[0, 1], [2, 3]], [1e8, 10e9])
    raw = target_dispatch_pattern(topo, 8, 2, 256, 64, smoothing=0.0)
    lam = 0.25
    smooth = target_dispatch_pattern(topo, 8, 2, 256, 64, smoothing=lam)
    np.testing.assert_allclose(smooth, (1 - lam) * raw + lam * 2 / 8, atol=1e-9)
    assert smooth.min() >= lam * 2 / 8 - 1e-12
    np.testing.assert_allclose(target_dispatch_pattern(topo, 8, 2, 256, 64, smoothing=1.0), 2 / 8)


def test_pair_costs_prefer_profiled_p2p_fits():
    topo = Topology.from_spec([[0, 1], [2, 3]], [1e9, 8e9])
    fits = {
        "p2p_intra": AlphaBeta(3e-6, 1 / 2e9),
        "p2p_inter": AlphaBeta(30e-6, 1 / 1e8),
    }
    alpha_WW, beta_WW = pair_cost_matrices(CostModel(topo, 1e12, fits))
    assert alpha_WW[0, 1] == pytest.approx(3e-6) and beta_WW[0, 1] == pytest.approx(1 / 2e9)
    assert alpha_WW[1, 3] == pytest.approx(30e-6) and beta_WW[1, 3] == pytest.approx(1 / 1e8)
    # Self delivery priced like the cheapest peer (TA-MoE §4.2 homogeneous case).
    assert alpha_WW[2, 2] == pytest.approx(3e-6) and beta_WW[2, 2] == pytest.approx(1 / 2e9)
    # Without fits: the topology's routes (2 hops inside a node, 4 across; bottleneck bandwidth).
    alpha_t, beta_t = pair_cost_matrices(topo)
    assert beta_t[0, 1] == pytest.approx(1 / 8e9) and beta_t[0, 3] == pytest.approx(1 / 1e9)


# ---- stats -----------------------------------------------------------------------------------
def test_cross_node_share_hand_worked():
    # ranks 0,1 on node 0; 2,3 on node 1; experts 0..3 owned by ranks 0..3.
    flow_WE = np.array([[3, 1, 2, 0], [0, 0, 0, 4], [1, 1, 1, 1], [0, 0, 0, 0]])
    # crossing: rank0 -> e2 (2); rank1 -> e3 (4); rank2 -> e0, e1 (2) => 8 of 14
    assert owner_share(flow_WE, [0, 0, 1, 1]) == pytest.approx(8 / 14)
    assert owner_share(flow_WE, [0, 0, 0, 0]) == 0.0
    assert owner_share(np.zeros((4, 4)), [0, 0, 1, 1]) == 0.0
    assert cross_node_share(flow_WE, None) == 0.0  # no node layout
    with pytest.raises(ValueError, match=r"node_of=\[0, 1\]"):
        cross_node_share(np.ones((4, 4)), [0, 1])


def test_flow_from_target_keeps_row_totals():
    topo = Topology.from_spec([[0, 1], [2, 3]], [1e8, 8e9])
    c_WE = target_dispatch_pattern(topo, 8, 2, 1000, 16)
    flow = flow_from_target(c_WE, 1000)
    assert flow.dtype == np.int64 and flow.sum(1).tolist() == [2000] * 4
    assert np.abs(flow - c_WE * 1000).max() < 1
    np.testing.assert_array_equal(flow_from_target([[0.5, 0.25, 0.25]], 3), [[1, 1, 1]])  # remainders .5 .75 .75
    with pytest.raises(ValueError, match="c_WE"):
        flow_from_target([[-1.0, 2.0]], 4)


# ---- loss --------------------------------------------------------------------------------------
def random_routing(T=37, E=8, k=2, seed=0):
    torch.manual_seed(seed)
    gate = TopKGate(16, E, k)
    return gate(torch.randn(T, 16))


def test_loss_equals_gshard_under_uniform_target():
    E, k = 8, 2
    routing = random_routing(E=E, k=k)
    ref = GShardBalance(E).loss(routing)
    explicit = TAMoEBalance(E, k, 16, target_WE=np.full((4, E), k / E))
    homogeneous = TAMoEBalance(E, k, 16, cost_model=CostModel(Topology.homogeneous(4, 1e10, 1e-6), 1e12))
    for bal in (explicit, homogeneous):
        for rank in range(4):
            assert bal.loss(routing, rank).item() == pytest.approx(ref.item(), abs=1e-6)
    # ...and so are its gradients.
    g_ref = torch.autograd.grad(ref, routing.logits_TE, retain_graph=True)[0]
    g_ta = torch.autograd.grad(explicit.loss(routing, 1), routing.logits_TE)[0]
    torch.testing.assert_close(g_ta, g_ref, atol=1e-6, rtol=1e-5)


def test_gshard_loss_option_keeps_the_steering_and_drops_the_topology_from_the_loss():
    # loss="gshard": GShard's value and gradient whatever the target; the steering still moves.
    E, k = 8, 2
    routing = random_routing(E=E, k=k)
    ref = GShardBalance(E).loss(routing)
    target = np.tile(np.linspace(0.1, 0.4, E) / np.linspace(0.1, 0.4, E).sum() * k, (2, 1))
    bal = TAMoEBalance(E, k, 16, target_WE=target, options=TAMoEOptions(loss="gshard"))
    ta = TAMoEBalance(E, k, 16, target_WE=target)
    assert abs(ta.loss(routing, 1).item() - ref.item()) > 0.05, "the TA-MoE loss differs here"
    for rank in range(2):
        assert bal.loss(routing, rank).item() == pytest.approx(ref.item(), abs=1e-6)
    g_ref = torch.autograd.grad(ref, routing.logits_TE, retain_graph=True)[0]
    g_bal = torch.autograd.grad(bal.loss(routing, 0), routing.logits_TE)[0]
    torch.testing.assert_close(g_bal, g_ref, atol=1e-6, rtol=1e-5)
    bal.observe(torch.tensor([[8.0] + [0.0] * (E - 1), [1.0] * E]))
    assert bal.selection_bias(0)[0] < 0 < bal.selection_bias(0)[-1]
    with pytest.raises(ValueError, match=r"loss='ta-moe'"):
        TAMoEOptions(loss="ta-moe")


def test_default_target_is_smoothed_by_0_3():
    # λ = 0.3 by default in training (TAMoEOptions.smoothing): ĉ = 0.7·LP optimum + 0.3·uniform.
    cm = links(Topology.from_spec([[0, 1], [2, 3]], [25e6, 2.7e9]))
    assert TAMoEOptions().smoothing == 0.3
    bal = TAMoEBalance(8, 2, 128, cost_model=cm)
    raw = _target(cm, 8, 2, 512, 128, smoothing=0.0)
    np.testing.assert_allclose(bal.target(512), 0.7 * raw + 0.3 * 2 / 8, atol=1e-9)


def test_loss_hand_worked_non_uniform_target():
    # T=2 tokens, E=2, k=1: both pick expert 0. c = [1, 0]; m = mean probs; ĉ row = [0.8, 0.2].
    logits = torch.tensor([[2.0, 0.0], [1.0, 0.0]], requires_grad=True)
    gate = TopKGate(2, 2, 1)
    routing = gate._route(logits, None)
    bal = TAMoEBalance(2, 1, 2, target_WE=[[0.8, 0.2], [0.2, 0.8]])
    m0 = torch.softmax(logits, -1)[:, 0].mean()
    assert bal.loss(routing, 0).item() == pytest.approx(m0.item() / 0.8)
    assert bal.loss(routing, 1).item() == pytest.approx(m0.item() / 0.2)


def test_loss_gradient_drives_dispatch_towards_target():
    # A toy gate trained on the TA-MoE loss alone: the dispatch shares c move to the target ĉ.
    torch.manual_seed(0)
    E, k, T = 4, 1, 512
    target_WE = np.array([[0.55, 0.25, 0.1, 0.1], [0.1, 0.1, 0.25, 0.55]])
    bal = TAMoEBalance(E, k, 8, target_WE=target_WE)
    gate = TopKGate(8, E, k)
    x_TD = torch.randn(T, 8)
    opt = torch.optim.SGD(gate.parameters(), lr=0.5)

    def l1_to_target(rank):
        routing = gate(x_TD)
        c_E = torch.bincount(routing.expert_A, minlength=E).double() / T
        return float((c_E - torch.as_tensor(target_WE[rank])).abs().sum())

    rank = 0
    before = l1_to_target(rank)
    # One step: the probability of the most over-served expert (largest c/ĉ) goes down.
    routing = gate(x_TD)
    c_E = torch.bincount(routing.expert_A, minlength=E).double() / T
    worst = int(torch.argmax(c_E / torch.as_tensor(target_WE[rank])))
    p_before = routing.probs_TE.mean(0)[worst].item()
    bal.loss(routing, rank).backward()
    opt.step()
    opt.zero_grad()
    assert gate(x_TD).probs_TE.mean(0)[worst].item() < p_before
    for _ in range(300):
        bal.loss(gate(x_TD), rank).backward()
        opt.step()
        opt.zero_grad()
    after = l1_to_target(rank)
    assert after < 0.5 * before and after < 0.15


def test_layer_with_ta_moe_balance():
    torch.manual_seed(0)
    cm = CostModel(Topology.from_spec([[0, 1], [2, 3]], [1e8, 8e9]), 1e12)
    layer = MoELayer(16, 32, 8, top_k=2, balance="ta_moe", balance_weight=0.5, cost_model=cm)
    assert isinstance(layer.balance, TAMoEBalance)
    # A 4-device cost model on one process: the term runs in its topology-free form (GShard's loss).
    x = torch.randn(3, 16)
    with pytest.warns(UserWarning, match="describes 4 devices but this expert-parallel group has 1"):
        layer(x)
    gshard = 0.5 * GShardBalance(8).loss(layer.gate(x))
    assert layer.aux_loss.item() == pytest.approx(gshard.item(), rel=1e-6)
    # α = 0 here: one cached target serves every token count.
    layer.balance.target(15)
    layer.balance.target(7)
    assert list(layer.balance._targets) == [None]
    # The layer applies the loss of its own rank, scaled by balance_weight (explicit 1-rank target).
    target = layer.balance.target(15)[:1] * 0 + np.linspace(0.1, 0.4, 8)[None, :]
    layer = MoELayer(16, 32, 8, top_k=2, balance=TAMoEBalance(8, 2, 16, target_WE=target), balance_weight=0.5)
    x = torch.randn(3, 5, 16)
    y = layer(x)
    assert y.shape == x.shape
    routing = layer.gate(x.reshape(-1, 16))
    expect = 0.5 * layer.balance.loss(routing, 0)
    assert layer.aux_loss.item() == pytest.approx(expect.item(), rel=1e-6)
    layer.aux_loss.backward()
    assert layer.gate.weight.grad is not None and layer.gate.weight.grad.abs().sum() > 0


def test_targets_are_cached_per_token_count_when_alpha_matters():
    model = CostModel(Topology.from_spec([[0, 1], [2, 3]], [1e9, 8e9], [50e-6, 1e-6]), 1e12)
    bal = TAMoEBalance(4, 1, 8, cost_model=model, options=TAMoEOptions(smoothing=0.1))
    small, big = bal.target(4), bal.target(4096)
    assert sorted(bal._targets) == [4, 4096]
    assert not np.allclose(small, big)
    assert bal.target(4) is small


# ---- bad input -------------------------------------------------------------------------------
def test_factory_requires_cost_model():
    with pytest.raises(ValueError, match=r"balance='ta_moe'.*cost_model=None"):
        BALANCES.build("ta_moe", LayerContext(8, 2, ExpertShape(16, 8)))
    with pytest.raises(ValueError, match="balance='ta_moe'"):
        MoELayer(16, 32, 8, top_k=2, balance="ta_moe")


def test_bad_inputs_name_argument_and_value():
    topo = Topology.from_spec([[0, 1], [2, 3]], [1e9, 8e9])
    with pytest.raises(ValueError, match=r"smoothing=1\.5"):
        target_dispatch_pattern(topo, 8, 2, 16, 8, smoothing=1.5)
    with pytest.raises(ValueError, match=r"smoothing=-0\.1"):
        target_dispatch_pattern(topo, 8, 2, 16, 8, smoothing=-0.1)
    with pytest.raises(ValueError, match=r"top_k=9"):
        target_dispatch_pattern(topo, 8, 9, 16, 8)
    with pytest.raises(ValueError, match=r"tokens_per_rank=0"):
        target_dispatch_pattern(topo, 8, 2, 0, 8)
    with pytest.raises(TypeError, match=r"d_model=2\.5"):
        target_dispatch_pattern(topo, 8, 2, 16, 2.5)
    with pytest.raises(ValueError, match=r"num_experts=6 must be a positive multiple of the expert-parallel size 4"):
        target_dispatch_pattern(topo, 6, 2, 16, 8)
    with pytest.raises(ValueError, match=r"owner_E=\[0, 1, 2, 7\]"):
        target_dispatch_pattern(topo, 4, 1, 16, 8, owner_E=[0, 1, 2, 7])
    with pytest.raises(ValueError, match=r"smoothing=0"):
        TAMoEOptions(smoothing=0)
    with pytest.raises(ValueError, match=r"steer_limit=-1"):
        TAMoEOptions(steer_limit=-1)
    with pytest.raises(ValueError, match="exactly one of"):
        TAMoEBalance(4, 1, 8)
    with pytest.raises(ValueError, match="target_WE"):
        TAMoEBalance(2, 1, 8, target_WE=[[1.0, 0.0]])
    bal = TAMoEBalance(4, 1, 8, cost_model=links(topo))
    with pytest.raises(ValueError, match=r"rank=4"):
        bal.loss(random_routing(E=4, k=1), 4)
    with pytest.raises(ValueError, match=r"alpha_WW"):
        solve_dispatch_lp(-np.ones((2, 2)), np.ones((2, 2)), np.arange(2), 1, 10.0)


def _dispatch_after_training(steer_rate: float, steps: int = 300) -> tuple[np.ndarray, np.ndarray]:
    """Two 'ranks' share one gate and see i.i.d. tokens but want opposite experts (as two nodes do
    on [[0],[1]]): returns (dispatch share per rank [2, 4], target share [2, 4])."""
    torch.manual_seed(0)
    target = np.array([[0.8, 0.8, 0.2, 0.2], [0.2, 0.2, 0.8, 0.8]])  # per token, rows sum to k = 2
    bal = TAMoEBalance(4, 2, 8, target_WE=target, options=TAMoEOptions(steer_rate=steer_rate, steer_limit=1.0))
    gate = TopKGate(8, 4, 2)
    opt = torch.optim.SGD(gate.parameters(), lr=0.1)
    for _ in range(steps):
        flow, loss = torch.zeros(2, 4, dtype=torch.long), 0.0
        for rank in range(2):
            r = gate(torch.randn(64, 8), bal.selection_bias(rank))
            flow[rank] = torch.bincount(r.expert_A, minlength=4)
            loss = loss + bal.loss(r, rank)
        opt.zero_grad()
        loss.backward()  # the shared gate gets both ranks' gradients, as all_reduce would give it
        opt.step()
        bal.observe(flow)
    share = flow.double().numpy() / 64
    return share, target


def test_shared_gate_alone_cannot_reach_a_rank_dependent_target_but_steering_does():
    loss_only, target = _dispatch_after_training(steer_rate=0.0)
    steered, _ = _dispatch_after_training(steer_rate=0.01)
    gap_loss_only = np.abs(loss_only - target).sum()
    gap_steered = np.abs(steered - target).sum()
    assert gap_loss_only > 1.5  # the two ranks' pulls cancel: the dispatch stays near uniform
    assert gap_steered < 0.5 * gap_loss_only
    # The global load stays balanced (the target's columns are equal).
    assert np.abs(steered.sum(0) - 1.0).max() < 0.3


def test_steering_bias_moves_against_the_target_gap_bounded_and_training_only():
    bal = TAMoEBalance(4, 1, 8, target_WE=np.full((2, 4), 0.25), options=TAMoEOptions(steer_rate=0.1, steer_limit=0.25))
    bal.observe(torch.tensor([[4, 0, 0, 0], [1, 1, 1, 1]]))  # rank 0 over-serves expert 0
    assert bal.selection_bias(0)[0] < 0 < bal.selection_bias(0)[1]
    assert torch.all(bal.selection_bias(1) == 0)
    for _ in range(5):
        bal.observe(torch.tensor([[4, 0, 0, 0], [1, 1, 1, 1]]))
    assert bal.selection_bias(0)[0] == pytest.approx(-0.25) and bal.selection_bias(0)[1] == pytest.approx(0.25)
    bal.eval()
    assert bal.selection_bias(0) is None, "in eval() every rank routes a token alike"
    bal.train()
    assert bal.selection_bias(None) is None, "no topology: no steering"
    off = TAMoEBalance(4, 1, 8, target_WE=np.full((2, 4), 0.25), options=TAMoEOptions(steer_rate=0))
    assert off.selection_bias(0) is None
    with pytest.raises(ValueError, match="steer_rate=-1"):
        TAMoEOptions(steer_rate=-1)


def test_ta_moe_in_the_layer_steers_from_choices_before_capacity_and_stops_with_its_loss():
    """The layer hands TA-MoE the step's choices *before* capacity drops (what its loss counts),
    and with `balance_weight=0` the term is off: no loss, no bias, no state moving."""
    topo = Topology.from_spec([[0]], 1e9)  # one device: the EP group of a single process
    torch.manual_seed(0)
    opts = {"steer_rate": 0.05, "steer_limit": 0.5}
    layer = MoELayer(
        8, 16, 4, top_k=2, balance="ta_moe", cost_model=links(topo), capacity_factor=0.5, balance_options=opts
    )
    layer(torch.randn(40, 8) + torch.tensor([3.0] + [0.0] * 7))
    stats = layer.stats
    assert stats.dropped > 0 and not torch.equal(stats.flow, stats.choices)
    choices = stats.choices.double()
    layer.update_balance()
    target = torch.as_tensor(layer.balance.target(40), dtype=torch.float64)
    expected = 0.05 * torch.sign(target * choices.sum(1, keepdim=True) / 2 - choices)
    torch.testing.assert_close(layer.balance.bias_WE.double(), expected)
    off = MoELayer(
        8, 16, 4, top_k=2, balance="ta_moe", balance_weight=0.0, cost_model=links(topo), balance_options=opts
    )
    off.balance.bias_WE.fill_(0.3)  # a bias from earlier training is not applied either
    x = torch.randn(40, 8)
    plain = off.gate(x)
    assert torch.equal(off(x) * 0 + 0, off(x) * 0) and torch.equal(
        off.stats.choices[0], torch.bincount(plain.expert_A, minlength=4)
    )
    off.update_balance()
    assert torch.all(off.balance.bias_WE == 0.3) and off.aux_loss.item() == 0.0
