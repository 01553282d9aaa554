"""FasterMoE topology-aware gate (§4.3, SPEC §1.4): the cross-node bound, on all k choices."""

from __future__ import annotations

import math

import pytest
import torch

from moeflow import MoELayer
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.routing.gates import GateContext, HierarchicalGate, RoutingLayout, TopKGate, build_gate

# Two nodes of two ranks, inter-node 1 GB/s, intra-node 4 GB/s: L/B = 1 / (2 · 4) = 0.125.
TOPO = Topology([[0, 1], [2, 3]], [1e9, 4e9])
LAYOUT = RoutingLayout(rank=1, owner_E=torch.arange(8) // 2, node_of=(0, 0, 1, 1))  # experts 0-3 local


def test_ratio_comes_from_the_topology():
    assert HierarchicalGate.ratio_from_topology(TOPO) == pytest.approx(0.125)
    assert math.isinf(HierarchicalGate.ratio_from_topology(Topology([[0, 1]], 1e9)))
    gate = build_gate("hierarchical", GateContext(16, 8, 2, CostModel(TOPO, gemm_flops_per_s=1e12)))
    assert gate.cross_node_ratio == pytest.approx(0.125)
    with pytest.raises(ValueError, match="gate='hierarchical' needs cost_model"):
        build_gate("hierarchical", GateContext(16, 8, 2))


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
    gate.cross_node_ratio = 0.0
    assert torch.equal(gate(x, layout=single).expert_A, plain(x).expert_A)
    gate.cross_node_ratio = 0.0
    r = gate(x, layout=LAYOUT)
    assert int((r.expert_A >= 4).sum()) == 0


def test_layer_reports_redirected_and_errors():
    cm = CostModel(Topology([[0]], 1e9), gemm_flops_per_s=1e12)
    layer = MoELayer(16, 32, 4, top_k=2, gate="hierarchical", cost_model=cm)
    layer(torch.randn(10, 16))
    assert layer.stats.redirected == 0  # one node: nothing is remote
    with pytest.raises(ValueError, match="cross_node_ratio=-1"):
        HierarchicalGate(16, 8, 2, cross_node_ratio=-1)
    tiny = HierarchicalGate(16, 4, 3, cross_node_ratio=0.0)
    with pytest.raises(ValueError, match="needs >= top_k=3 experts per node"):
        tiny(torch.randn(4, 16), layout=RoutingLayout(0, torch.arange(4) // 2, (0, 1)))
