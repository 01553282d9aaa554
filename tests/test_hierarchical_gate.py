"""FasterMoE topology-aware gate (§4.3): the cross-node bound, on all k choices, per node."""

from __future__ import annotations

import math

import pytest
import torch

from moeflow import MoELayer
from moeflow.core.expert_shape import ExpertShape
from moeflow.core.registry import LayerContext
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.routing import GATES
from moeflow.routing.gates import RoutingLayout, TopKGate
from moeflow.routing.hierarchical import HierarchicalGate, cross_node_ratios

# Two nodes of two ranks, inter-node 1 GB/s, intra-node 4 GB/s: L/B = 1 / (2 · 4) = 0.125.
TOPO = Topology([[0, 1], [2, 3]], [1e9, 4e9])
LAYOUT = RoutingLayout(rank=1, owner_E=torch.arange(8) // 2, node_of=(0, 0, 1, 1))  # experts 0-3 local


def _ctx(cost_model=None) -> LayerContext:
    return LayerContext(8, 2, ExpertShape(16, 8), cost_model)


def test_ratio_comes_from_the_topology_of_each_node():
    assert cross_node_ratios(TOPO) == pytest.approx([0.125] * 4)
    assert all(math.isinf(r) for r in cross_node_ratios(Topology([[0, 1]], 1e9)))
    gate = GATES.build("hierarchical", _ctx(CostModel(TOPO, gemm_flops_per_s=1e12)))
    assert gate.cross_node_ratio == pytest.approx([0.125] * 4)
    with pytest.raises(ValueError, match="gate='hierarchical' needs a cost model"):
        GATES.build("hierarchical", _ctx())
    assert GATES.build("hierarchical", _ctx(), {"cross_node_ratio": 0.3}).cross_node_ratio == [0.3]
    # Asymmetric: a node of 3 devices (links 8 GB/s) behind a 2 GB/s uplink, and a lone device on a
    # 2 GB/s link whose node hangs off the root at 1 GB/s. Node 0: W_net / (M · W_local) =
    # 2e9 / (3 · 8e9); the lone device (M = 1): its own link is its local transfer, 1e9 / 2e9 — each
    # node's own numbers, not node 0's read for everyone.
    asym = Topology([[[0, 1, 2]], [3]], [1e9, 2e9, 8e9])
    uplinks = [asym.node_uplink_bandwidth(w) for w in range(4)]
    assert uplinks == [2e9, 2e9, 2e9, 1e9] and asym.device_link_bandwidth(3) == 2e9
    assert cross_node_ratios(asym) == pytest.approx([2 / 24, 2 / 24, 2 / 24, 1 / 2])


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_cross_node_assignments_never_exceed_the_bound(top_k):
    torch.manual_seed(top_k)
    gate = HierarchicalGate(16, 8, top_k, cross_node_ratio=0.125)
    plain = TopKGate(16, 8, top_k)
    plain.weight.data.copy_(gate.weight.data)
    with torch.no_grad():
        gate.weight[4:] += 0.5  # make remote experts attractive, so the bound bites
        plain.weight[4:] += 0.5
    x = torch.rand(200, 16)
    r, before = gate(x, layout=LAYOUT), plain(x, layout=LAYOUT)
    limit = math.floor(0.125 * top_k * 200)
    remote_before = int((before.expert_A >= 4).sum())
    remote_after = int((r.expert_A >= 4).sum())
    assert remote_before > limit and remote_after == limit
    assert r.redirected == remote_before - limit
    expert_TK = r.expert_A.view(top_k, 200).t()
    assert all(len(set(row.tolist())) == top_k for row in expert_TK), "a token chose an expert twice"
    # The kept remote assignments are the highest-scoring remote ones.
    probs = r.probs_TE
    kept = probs.gather(1, before.expert_A.view(top_k, 200).t())[before.expert_A.view(top_k, 200).t() >= 4]
    threshold = torch.sort(kept, descending=True).values[limit - 1]
    assert probs.gather(1, expert_TK)[expert_TK >= 4].min() >= threshold
    # Weights: softmax over the finally chosen logits, i.e. the chosen probabilities renormalised.
    weight_TK = r.weight_A.view(top_k, 200).t()
    chosen = probs.gather(1, expert_TK)
    torch.testing.assert_close(weight_TK, chosen / chosen.sum(1, keepdim=True))


def test_under_the_bound_nothing_changes_and_single_node_is_plain_topk():
    torch.manual_seed(0)
    gate = HierarchicalGate(16, 8, 2, cross_node_ratio=1.0)
    plain = TopKGate(16, 8, 2)
    plain.weight.data.copy_(gate.weight.data)
    x = torch.randn(50, 16)
    assert torch.equal(gate(x, layout=LAYOUT).expert_A, plain(x).expert_A)
    single = RoutingLayout.single(8)
    gate.cross_node_ratio = [0.0]
    assert torch.equal(gate(x, layout=single).expert_A, plain(x).expert_A)
    r = gate(x, layout=LAYOUT)
    assert int((r.expert_A >= 4).sum()) == 0


def test_layer_reports_redirected_and_errors():
    cm = CostModel(Topology([[0]], 1e9), gemm_flops_per_s=1e12)
    layer = MoELayer(16, 32, 4, top_k=2, gate="hierarchical", cost_model=cm)
    layer(torch.randn(10, 16))
    assert layer.stats.redirected == 0  # one node: nothing is remote
    with pytest.raises(ValueError, match="cross_node_ratio=-1"):
        HierarchicalGate(16, 8, 2, cross_node_ratio=-1)


@pytest.mark.parametrize("ratio", [0.0, 0.2])
def test_a_node_with_fewer_than_k_experts_keeps_the_choices_it_cannot_move(ratio):
    """One device per node holding 2 experts, k = 3: every token needs at least one remote expert.
    The gate moves what it can (never below that floor), keeps each token's best remote choices,
    and never gives a token the same expert twice — where it used to raise."""
    torch.manual_seed(1)
    gate = HierarchicalGate(16, 4, 3, cross_node_ratio=ratio)
    layout = RoutingLayout(0, torch.arange(4) // 2, (0, 1))  # experts 0, 1 local
    x = torch.randn(50, 16)
    r = gate(x, layout=layout)
    expert_TK = r.expert_A.view(3, 50).t()
    assert all(len(set(row.tolist())) == 3 for row in expert_TK)
    remote_T = (expert_TK >= 2).sum(1)
    assert int(remote_T.min()) >= 1  # the floor: 3 choices, 2 local experts
    forced = 50  # one remote choice per token cannot move
    assert int(remote_T.sum()) == max(forced, math.floor(ratio * 150))
    # The choice kept remote is the token's best remote expert.
    probs = r.probs_TE
    for t in range(50):
        kept = [e for e in expert_TK[t].tolist() if e >= 2]
        if len(kept) == 1:
            assert probs[t, kept[0]] == probs[t, 2:].max()
