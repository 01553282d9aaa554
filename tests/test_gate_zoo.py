"""The gate zoo (FSMoE §2.1): sigmoid, X-MoE, expert choice and SoftMoE, hand-worked, single process.
(Their equality with the single-process layer under expert parallelism is in test_layer_multirank.)"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moeflow import MoELayer
from moeflow.core.expert_shape import ExpertShape
from moeflow.core.registry import LayerContext
from moeflow.routing import GATES
from moeflow.routing.expert_choice import ExpertChoiceGate
from moeflow.routing.gates import SigmoidGate, XMoEGate, XMoEOptions
from moeflow.routing.soft import SoftGate, SoftOptions


def _with_logits(gate, logits_TE):
    """Make x = I_T produce exactly `logits_TE` through a linear gate (weight = logitsᵀ)."""
    logits = torch.as_tensor(logits_TE, dtype=torch.float32)
    with torch.no_grad():
        gate.weight.zero_()
        gate.weight[:, : logits.shape[0]] = logits.t()
    return torch.eye(logits.shape[0], gate.weight.shape[1])


def test_sigmoid_scores_each_expert_by_its_own_sigmoid():
    gate = SigmoidGate(4, 3, 2)
    x = _with_logits(gate, [[2.0, -1.0, 0.5]])
    r = gate(x)
    s = torch.sigmoid(torch.tensor([2.0, -1.0, 0.5]))
    assert r.expert_A.tolist() == [0, 2]
    torch.testing.assert_close(r.weight_A, s[[0, 2]])  # not renormalised: they need not sum to 1
    torch.testing.assert_close(r.probs_TE[0], s / s.sum())  # balance terms see normalised scores
    normalized = SigmoidGate(4, 3, 2, normalize=True)
    r = normalized(_with_logits(normalized, [[2.0, -1.0, 0.5]]))
    torch.testing.assert_close(r.weight_A, s[[0, 2]] / s[[0, 2]].sum())


def test_xmoe_is_cosine_over_a_clamped_learned_temperature():
    torch.manual_seed(0)
    gate = XMoEGate(8, 4, 1, XMoEOptions(proj_dim=3, temperature=0.5))
    x = torch.randn(5, 8)
    z = F.normalize(x @ gate.proj.t(), dim=-1)
    w = F.normalize(gate.weight, dim=-1)
    torch.testing.assert_close(gate.logits(x), (z @ w.t()) / 0.5)
    assert gate.logits(x).abs().max() <= 1 / 0.5 + 1e-6  # cosines are in [-1, 1]
    r = gate(x)
    assert r.weight_A.shape == (5,) and torch.allclose(r.weight_A, torch.ones(5))  # top-1, renormalised
    with torch.no_grad():
        gate.log_temperature.fill_(math.log(1e-6))
    assert float(gate.temperature.detach()) == pytest.approx(0.01)  # clamped at min_temperature
    (gate(x).probs_TE[:, 0].sum()).backward()
    assert gate.proj.grad is not None and gate.weight.grad is not None
    for bad, message in (
        ({"proj_dim": 0}, "proj_dim=0"),
        ({"temperature": 5.0}, "temperature=5.0"),
        ({"min_temperature": 0.0}, "min_temperature=0.0"),
        ({"min_temperature": 0.5, "max_temperature": 0.1}, "max_temperature=0.1"),
    ):
        with pytest.raises(ValueError, match=message):
            XMoEOptions(**bad)


def test_expert_choice_takes_each_experts_top_c_tokens_ties_to_the_earlier_token():
    gate = ExpertChoiceGate(4, 2, 1)  # C = ceil(1·1·4/2) = 2 tokens per expert
    logits = [[1.0, 0.0], [1.0, 0.0], [0.0, 0.0], [0.0, 3.0]]
    x = _with_logits(gate, logits)
    r = gate(x)
    probs = torch.softmax(torch.tensor(logits), -1)
    # Expert 0's scores: t0 = t1 (tie: t0 first) > t2 > t3; expert 1's: t3 > t2 > t0 = t1.
    assert r.kind == "expert_choice" and r.expert_A.tolist() == [0, 0, 1, 1]
    assert r.token_A.tolist() == [0, 1, 3, 2]
    torch.testing.assert_close(r.weight_A, probs[[0, 1, 3, 2], [0, 0, 1, 1]])
    # A token may get 0..E experts: t2 once, t0 once, t3 once; with c = 2 (C = 4) every token twice.
    assert ExpertChoiceGate(4, 2, 1, capacity_factor=2.0).capacity(4) == 4
    assert ExpertChoiceGate(4, 2, 1).capacity(0) == 0
    # The layer: no drop on top, the combine is the weighted sum of a token's picks.
    layer = MoELayer(4, 8, 2, top_k=1, gate="expert_choice")
    assert layer.balance.__class__.__name__ == "NoBalance"  # balance by construction
    _with_logits(layer.gate, logits)
    y = layer(x)
    full = layer.experts(x[[0, 1, 3, 2]], [2, 2])
    expect = torch.zeros(4, 4).index_add(0, r.token_A, full * r.weight_A[:, None])
    torch.testing.assert_close(y, expect)
    assert layer.stats.expert_counts.tolist() == [2, 2] and layer.stats.dropped == 0


def test_soft_slots_mix_tokens_and_outputs_mix_slots():
    torch.manual_seed(1)
    gate = SoftGate(6, 3, SoftOptions(slots_per_expert=2))
    x = torch.randn(5, 6)
    r = gate(x)
    D, C = r.slots.dispatch_TA, r.slots.combine_TA
    torch.testing.assert_close(D.sum(0), torch.ones(6))  # each slot: a convex mix of the tokens
    torch.testing.assert_close(C.sum(1), torch.ones(5))  # each token: a convex mix of the slots
    assert r.kind == "soft" and r.expert_A.tolist() == [0, 0, 1, 1, 2, 2] and r.token_A is None
    layer = MoELayer(6, 12, 3, top_k=1, gate="soft", gate_options={"slots_per_expert": 2})
    layer.gate.load_state_dict(gate.state_dict())
    y = layer(x)
    slot_rows = D.t() @ x
    expert_out = layer.experts(slot_rows, [2, 2, 2])
    torch.testing.assert_close(y, C @ expert_out, rtol=1e-5, atol=1e-6)
    assert layer.stats.dropped == 0 and layer.stats.expert_counts.tolist() == [2, 2, 2]
    y.sum().backward()
    assert layer.gate.weight.grad.abs().sum() > 0  # the mixing is differentiable
    empty = layer(torch.zeros(0, 6))  # no tokens: empty slots, an empty output
    assert empty.shape == (0, 6)


def test_gate_names_options_and_balance_rules():
    ctx = LayerContext(4, 2, ExpertShape(8, 8))
    assert isinstance(GATES.build("xmoe", ctx, {"proj_dim": 4}), XMoEGate)
    with pytest.raises(ValueError, match=r"gate_options for gate='soft'.*slots_per_expert=0"):
        GATES.build("soft", ctx, {"slots_per_expert": 0})
    with pytest.raises(ValueError, match=r"gate='bogus'.*'expert_choice'.*'soft'"):
        MoELayer(8, 8, 4, gate="bogus")
    with pytest.raises(ValueError, match=r"balance='gshard'.*gate='expert_choice' routes by expert choice"):
        MoELayer(8, 8, 4, gate="expert_choice", balance="gshard")
    with pytest.raises(ValueError, match=r"balance='aux_free'.*gate='soft' routes through slots"):
        MoELayer(8, 8, 4, gate="soft", balance="aux_free")
    with pytest.raises(ValueError, match=r"capacity_factor=1.0 with gate='soft'"):
        MoELayer(8, 8, 4, gate="soft", capacity_factor=1.0)
    assert MoELayer(8, 8, 4, gate="sigmoid").balance.__class__.__name__ == "GShardBalance"
