"""Hand-worked gate and balance cases (single process)."""

from __future__ import annotations

import math

import pytest
import torch

from moeflow import MoELayer
from moeflow.core.expert_shape import ExpertShape
from moeflow.core.registry import LayerContext
from moeflow.routing import BALANCES, GATES
from moeflow.routing.balance import AuxFreeBalance, GShardBalance, router_z_loss
from moeflow.routing.gates import NoisyTopKGate, SwitchGate, TopKGate


def _ctx(d_model: int, num_experts: int, top_k: int) -> LayerContext:
    return LayerContext(num_experts, top_k, ExpertShape(d_model, 8))


def _gate_with_logits(gate, logits_E):
    """Make x = [1, 0, ...] produce exactly `logits_E` (weight column 0 = logits)."""
    with torch.no_grad():
        gate.weight.zero_()
        gate.weight[:, 0] = torch.tensor(logits_E)
    x = torch.zeros(1, gate.weight.shape[1])
    x[0, 0] = 1.0
    return x


def test_topk_selects_largest_and_renormalises():
    gate = TopKGate(4, 3, 2)
    x = _gate_with_logits(gate, [1.0, 2.0, 3.0])
    r = gate(x)
    p = torch.softmax(torch.tensor([1.0, 2.0, 3.0]), 0)
    assert r.expert_A.tolist() == [2, 1]  # choice-major: first choice, then second
    torch.testing.assert_close(r.weight_A, torch.stack([p[2], p[1]]) / (p[2] + p[1]))
    assert r.token_A.tolist() == [0, 0]


def test_ties_go_to_lower_expert_id():
    gate = TopKGate(4, 4, 2)
    x = _gate_with_logits(gate, [0.5, 2.0, 2.0, 2.0])
    assert gate(x).expert_A.tolist() == [1, 2]


def test_unnormalised_and_switch_keep_raw_probabilities():
    p = torch.softmax(torch.tensor([0.0, 1.0, 3.0]), 0)
    raw = TopKGate(4, 3, 2, normalize=False)
    torch.testing.assert_close(raw(_gate_with_logits(raw, [0.0, 1.0, 3.0])).weight_A, torch.stack([p[2], p[1]]))
    switch = SwitchGate(4, 3)
    r = switch(_gate_with_logits(switch, [0.0, 1.0, 3.0]))
    assert r.expert_A.tolist() == [2]
    torch.testing.assert_close(r.weight_A, p[2:3])
    with pytest.raises(ValueError, match="top_k=2"):
        SwitchGate(4, 3, top_k=2)


def test_choice_major_order_for_several_tokens():
    gate = TopKGate(2, 3, 2)
    with torch.no_grad():
        gate.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]))
    r = gate(torch.tensor([[2.0, 0.0], [0.0, 2.0]]))
    assert r.token_A.tolist() == [0, 1, 0, 1]
    assert r.expert_A.tolist() == [0, 1, 2, 2]


def test_noisy_topk_is_plain_topk_in_eval_and_noisy_in_training():
    torch.manual_seed(0)
    noisy = NoisyTopKGate(8, 6, 2)
    plain = TopKGate(8, 6, 2)
    plain.weight.data.copy_(noisy.weight.data)
    x = torch.randn(64, 8)
    noisy.eval()
    assert torch.equal(noisy(x).expert_A, plain(x).expert_A)
    noisy.train()
    r = noisy(x)
    assert not torch.equal(r.expert_A, plain(x).expert_A)
    sums = torch.zeros(64).index_add(0, r.token_A, r.weight_A)
    torch.testing.assert_close(sums, torch.ones(64))
    (r.weight_A.sum() + r.probs_TE.sum()).backward()
    assert noisy.noise_weight.grad is not None and noisy.noise_weight.grad.abs().sum() > 0


def test_routing_math_is_fp32_for_bf16_input():
    gate = TopKGate(8, 4, 2)
    r = gate(torch.randn(5, 8, dtype=torch.bfloat16))
    assert r.weight_A.dtype == r.probs_TE.dtype == torch.float32


def test_build_gate_errors_list_valid_names_and_options_are_validated():
    with pytest.raises(ValueError, match=r"gate='nope'.*noisy_topk"):
        GATES.build("nope", _ctx(4, 2, 1))
    raw = GATES.build("topk", _ctx(4, 3, 2), {"normalize": "false"})  # text, as from --set
    assert isinstance(raw, TopKGate) and raw.normalize is False
    unknown = r"gate_options for gate='topk': unknown option 'normalise' \(did you mean 'normalize'\?\); valid: "
    with pytest.raises(ValueError, match=unknown):
        GATES.build("topk", _ctx(4, 3, 2), {"normalise": True})
    with pytest.raises(ValueError, match=r"gate_options for gate='switch': unknown option 'x'; valid: none"):
        GATES.build("switch", _ctx(4, 3, 1), {"x": 1})
    with pytest.raises(ValueError, match=r"gate_options.*normalize='maybe'"):
        GATES.build("topk", _ctx(4, 3, 2), {"normalize": "maybe"})
    with pytest.raises(ValueError, match=r"options apply to a gate chosen by name"):
        GATES.build(TopKGate(4, 3, 2), _ctx(4, 3, 2), {"normalize": False})


def test_gshard_loss_hand_worked():
    gate = TopKGate(4, 2, 1)
    x = torch.zeros(2, 4)
    x[0, 0], x[1, 1] = 1.0, 1.0
    with torch.no_grad():
        gate.weight.copy_(torch.tensor([[2.0, 0, 0, 0], [0, 0, 0, 0]]))
    r = gate(x)  # token 0 -> expert 0 (p=softmax(2,0)), token 1 tie -> expert 0 (p = 0.5)
    assert r.expert_A.tolist() == [0, 0]
    p0 = torch.softmax(torch.tensor([2.0, 0.0]), 0)
    mean_p = (p0 + torch.tensor([0.5, 0.5])) / 2
    expected = 2 * (1.0 * mean_p[0] + 0.0 * mean_p[1])
    torch.testing.assert_close(GShardBalance(2).loss(r), expected)


def test_gshard_loss_is_one_under_uniform_routing():
    gate = TopKGate(4, 4, 2)
    gate.weight.data.zero_()
    x = torch.randn(6, 4)
    r = gate(x)  # all ties: every token picks experts 0 and 1 -> f = [.5,.5,0,0], P = 1/4
    torch.testing.assert_close(GShardBalance(4).loss(r), torch.tensor(1.0))


def test_router_z_loss_value():
    logits = torch.tensor([[0.0, math.log(3.0)]])
    torch.testing.assert_close(router_z_loss(logits), torch.tensor(math.log(4.0) ** 2))


def test_aux_free_bias_moves_against_load_and_steers_selection():
    bal = AuxFreeBalance(3, update_rate=0.1)
    bal.observe(torch.tensor([[6, 1, 0], [4, 0, 1]]))  # expert counts [10, 1, 1]
    assert bal.bias_E[0] < 0 < bal.bias_E[1] and bal.bias_E[1] == bal.bias_E[2]
    gate = TopKGate(4, 3, 1)
    x = _gate_with_logits(gate, [0.1, 0.0, -1.0])
    assert gate(x).expert_A.tolist() == [0]
    r = gate(x, bal.selection_bias())
    assert r.expert_A.tolist() == [1]
    # The bias changes selection only: the weight is still the (renormalised) probability.
    torch.testing.assert_close(r.weight_A, torch.tensor([1.0]))
    with pytest.raises(ValueError, match="update_rate=-1"):
        AuxFreeBalance(3, update_rate=-1)
    with pytest.raises(ValueError, match=r"balance='x'.*aux_free"):
        BALANCES.build("x", _ctx(4, 3, 1))
    with pytest.raises(ValueError, match=r"balance_options for balance='aux_free'.*update_rate=-0.5"):
        BALANCES.build("aux_free", _ctx(4, 3, 1), {"update_rate": -0.5})


def test_aux_free_layer_moves_its_bias_once_per_step_from_training_forwards_only():
    """The layer accumulates the step's choices (training forwards only) and hands them to the
    balance term when the step ends (`update_balance`, called by `all_reduce_gradients`)."""
    torch.manual_seed(0)
    layer = MoELayer(8, 16, 4, top_k=1, balance="aux_free", balance_options={"update_rate": 0.1})
    x = torch.randn(32, 8)
    layer.eval()
    layer(x)
    layer.update_balance()
    assert torch.all(layer.balance.bias_E == 0), "eval forwards do not move the bias"
    layer.train()
    layer(x)
    layer(x)
    assert torch.all(layer.balance.bias_E == 0), "the bias moves at the end of the step, not per forward"
    counts = layer.stats.choices.sum(0).double()
    layer.update_balance()
    assert torch.equal(layer.balance.bias_E, 0.1 * torch.sign(counts.mean() - counts).float())
    layer.update_balance()  # nothing accumulated since: no further move
    assert torch.equal(layer.balance.bias_E, 0.1 * torch.sign(counts.mean() - counts).float())
