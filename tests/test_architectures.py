"""Today's architectures in `MoELayer` (single process; docs/architectures.md): group- and
node-limited routing computed as DeepSeek-V3's router computes it, routed scaling, softmax after
top-k and router biases (GPT-OSS), scaled inputs (Llama 4), the clamped SwiGLU expert, shared
experts (dense, added to the routed output), the sequence-wise and global-batch balance terms,
dense first blocks, and one-line errors for bad options. The multi-rank invariants are in
`test_layer_multirank.py`."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moeflow import MoELayer
from moeflow.core.parallel import dense_parameters, expert_parameters
from moeflow.routing.balance import GShardBalance, SequenceBalance
from moeflow.routing.gates import SigmoidGate, SigmoidOptions, TopKGate, TopKOptions
from moeflow.routing.routing import RoutingLayout

GEN = torch.Generator().manual_seed(0)


def _deepseek_v3_router(logits_TE, bias_E, n_group, topk_group, top_k, normalize, scaling):
    """transformers' DeepseekV3TopkRouter.forward after its linear, verbatim in its operations."""
    num_experts = logits_TE.shape[1]
    scores = logits_TE.sigmoid()
    scores_for_choice = scores + bias_E
    group_scores = scores_for_choice.view(-1, n_group, num_experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, num_experts // n_group).reshape(-1, num_experts)
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if normalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * scaling, topk_indices


def _per_token(routing):
    """`[T, K]` experts and weights of a token-choice routing, each row sorted by expert id."""
    k = routing.expert_A.numel() // routing.num_tokens
    expert_TK = routing.expert_A.view(k, -1).t()
    weight_TK = routing.weight_A.view(k, -1).t()
    order = expert_TK.argsort(1)
    return expert_TK.gather(1, order), weight_TK.gather(1, order)


def test_group_limited_sigmoid_is_deepseek_v3s_router():
    num_experts, top_k, n_group, topk_group = 16, 4, 4, 2
    gate = SigmoidGate(
        8, num_experts, top_k,
        options=SigmoidOptions(normalize=True, scaling_factor=2.5, n_group=n_group, topk_group=topk_group),
    )  # fmt: skip
    x_TD = torch.randn(64, 8, generator=GEN)
    bias_E = torch.randn(num_experts, generator=GEN) * 0.1
    routing = gate(x_TD, bias_E)
    logits_TE = x_TD @ gate.weight.t()
    want_w, want_e = _deepseek_v3_router(logits_TE, bias_E, n_group, topk_group, top_k, True, 2.5)
    order = want_e.argsort(1)
    got_e, got_w = _per_token(routing)
    assert torch.equal(got_e, want_e.gather(1, order))
    torch.testing.assert_close(got_w, want_w.gather(1, order), rtol=1e-6, atol=1e-7)
    # Every token's experts lie in at most topk_group groups, and the limit changed some choices.
    groups_T = [len(set((e // (num_experts // n_group)).tolist())) for e in got_e]
    assert max(groups_T) <= topk_group
    free = SigmoidGate(8, num_experts, top_k, options=SigmoidOptions(normalize=True, scaling_factor=2.5))
    free.load_state_dict(gate.state_dict())
    assert not torch.equal(_per_token(free(x_TD, bias_E))[0], got_e)


def test_group_score_topn_one_is_deepseek_v2s_group_maximum():
    gate = TopKGate(8, 8, 2, options=TopKOptions(normalize=False, n_group=4, topk_group=1, group_score_topn=1))
    x_TD = torch.randn(32, 8, generator=GEN)
    probs_TE = torch.softmax(x_TD @ gate.weight.t(), -1)
    best_group_T = probs_TE.view(-1, 4, 2).amax(-1).argmax(-1)
    got_e, got_w = _per_token(gate(x_TD))
    assert torch.equal(got_e, torch.stack([2 * best_group_T, 2 * best_group_T + 1], 1))
    torch.testing.assert_close(got_w, probs_TE.gather(1, got_e))


def test_node_limited_keeps_each_tokens_experts_on_m_nodes():
    # 4 ranks on 2 nodes, 2 experts per rank: node 0 holds experts 0-3, node 1 holds 4-7.
    layout = RoutingLayout(0, torch.arange(8) // 2, (0, 0, 1, 1))
    gate = TopKGate(8, 8, 4, options=TopKOptions(node_limited=1))
    x_TD = torch.randn(64, 8, generator=GEN)
    got_e, _ = _per_token(gate(x_TD, None, layout))
    assert all(len(set((e // 4).tolist())) == 1 for e in got_e)
    # The node score is the sum of the node's top k/M = 4 probabilities.
    probs_TE = torch.softmax(x_TD @ gate.weight.t(), -1)
    node_T = probs_TE.view(-1, 2, 4).topk(4, -1).values.sum(-1).argmax(-1)
    assert torch.equal(got_e[:, 0] // 4, node_T)
    # Without a layout (one process) nothing is limited: plain top-k.
    plain = TopKGate(8, 8, 4)
    plain.load_state_dict(gate.state_dict())
    assert torch.equal(_per_token(gate(x_TD))[0], _per_token(plain(x_TD))[0])
    with pytest.raises(ValueError, match=r"node_limited=1: 1 node\(s\) of this layout can hold only 4 experts"):
        TopKGate(8, 8, 6, options=TopKOptions(node_limited=1))(x_TD, None, layout)


def test_softmax_after_topk_router_bias_and_scaled_inputs():
    gate = TopKGate(8, 6, 2, options=TopKOptions(softmax_after_topk=True, bias=True))
    with torch.no_grad():
        gate.bias.normal_(generator=GEN)
    x_TD = torch.randn(16, 8, generator=GEN)
    logits_TE = F.linear(x_TD, gate.weight, gate.bias)
    top = logits_TE.topk(2, dim=-1)
    got_e, got_w = _per_token(gate(x_TD))
    order = top.indices.argsort(1)
    assert torch.equal(got_e, top.indices.gather(1, order))
    torch.testing.assert_close(got_w, torch.softmax(top.values, -1).gather(1, order))
    assert gate.bias.requires_grad and any(n == "bias" for n, _ in gate.named_parameters())

    # Llama 4: top-1 sigmoid, the expert's input scaled by the weight, the output unweighted.
    torch.manual_seed(1)
    layer = MoELayer(8, 16, 4, top_k=1, gate="sigmoid", expert="swiglu", gate_options={"scale_inputs": True})
    y_TD = layer(x_TD)
    logits_TE = x_TD @ layer.gate.weight.t()
    e_T = logits_TE.argmax(-1)
    w = layer.experts.weights()
    want = []
    for t in range(16):
        e, xin = int(e_T[t]), x_TD[t] * torch.sigmoid(logits_TE[t, e_T[t]])
        gate, up = xin @ w["w13"][e][:, 0], xin @ w["w13"][e][:, 1]  # w13 [D, 2, H]
        want.append((F.silu(gate) * up) @ w["w2"][e])
    torch.testing.assert_close(y_TD, torch.stack(want), rtol=1e-5, atol=1e-6)


def test_clamped_swiglu_is_gpt_oss_expert_and_shared_experts_are_dense():
    torch.manual_seed(2)
    layer = MoELayer(
        8, 16, 4, top_k=2, expert="clamped_swiglu", expert_options={"alpha": 1.5, "limit": 0.3},
        num_shared_experts=2,
    )  # fmt: skip
    with torch.no_grad():
        for name, p in layer.experts.named_parameters():
            if name.startswith("b"):
                p.normal_(generator=GEN)
    assert layer.shared_experts.d_hidden == 32 and layer.shared_experts.b13.shape == (2, 32)
    x_TD = torch.randn(10, 8, generator=GEN)
    y_TD = layer(x_TD)
    routing = layer.gate(x_TD)
    w = layer.experts.weights()

    def expert(xr, p, e=None):
        pick = (lambda n: p[n][e]) if e is not None else (lambda n: p[n])
        g = (xr @ pick("w13")[:, 0] + pick("b13")[0]).clamp(max=0.3)  # w13 [D, 2, H], b13 [2, H]
        u = (xr @ pick("w13")[:, 1] + pick("b13")[1]).clamp(-0.3, 0.3)
        return ((u + 1) * (g * torch.sigmoid(1.5 * g))) @ pick("w2") + pick("b2")

    shared = dict(layer.shared_experts.named_parameters())
    want = torch.stack([expert(x_TD[t], shared) for t in range(10)])
    for e, t, wt in zip(routing.expert_A.tolist(), routing.token_A.tolist(), routing.weight_A):
        want[t] += wt * expert(x_TD[t], w, e)
    torch.testing.assert_close(y_TD, want, rtol=1e-5, atol=1e-6)
    dense = {n for n, _ in dense_parameters(layer)}
    assert {f"shared_experts.{n}" for n in ("w13", "w2", "b13", "b2")} <= dense
    assert not any(n.startswith("shared") for n, _ in expert_parameters(layer))
    # The routed experts alone are what is dispatched: the flow counts k rows per token.
    assert int(layer.stats.flow.sum()) == 20


def test_sequence_balance_is_deepseek_v3s_per_sequence_loss():
    torch.manual_seed(3)
    layer = MoELayer(8, 16, 4, top_k=2, gate="sigmoid", balance="sequence", balance_weight=0.5)
    x_BTD = torch.randn(3, 5, 8, generator=GEN)
    layer(x_BTD)
    routing = layer.gate(x_BTD.reshape(-1, 8))
    s_TE = torch.sigmoid(x_BTD.reshape(-1, 8) @ layer.gate.weight.t())
    want = 0.0
    for b in range(3):
        rows = slice(5 * b, 5 * b + 5)
        chosen = routing.expert_A.view(2, 15)[:, rows]
        f_E = torch.bincount(chosen.reshape(-1), minlength=4).float() * 4 / (2 * 5)
        p_E = (s_TE[rows] / s_TE[rows].sum(-1, keepdim=True)).mean(0)
        want += float((f_E * p_E).sum().detach()) / 3
    assert float(layer.aux_loss.detach()) == pytest.approx(0.5 * want, rel=1e-6)
    # A [T, D] input is one sequence: GShard's loss of the whole batch (both are 1 when balanced);
    # tokens that are not whole sequences are refused.
    r = layer.gate(x_BTD.reshape(-1, 8))
    torch.testing.assert_close(SequenceBalance(4).loss(r), GShardBalance(4).loss(r))
    r.sequence_length = 4
    with pytest.raises(ValueError, match="15 tokens are not whole sequences of length 4"):
        SequenceBalance(4).loss(r)


def test_global_batch_gshard_uses_the_counts_it_is_given():
    torch.manual_seed(4)
    layer = MoELayer(8, 16, 4, top_k=2, balance_options={"global_batch": True}, balance_weight=1.0)
    plain = MoELayer(8, 16, 4, top_k=2, balance_weight=1.0)
    plain.load_state_dict(layer.state_dict())
    x_TD = torch.randn(12, 8, generator=GEN)
    layer(x_TD), plain(x_TD)
    assert layer.balance.global_counts and not plain.balance.global_counts
    torch.testing.assert_close(layer.aux_loss, plain.aux_loss)  # one process: the global batch is its own
    routing = layer.gate(x_TD)
    counts_E = torch.tensor([10.0, 0.0, 0.0, 30.0])
    want = 4 * (torch.tensor([0.25, 0, 0, 0.75]) * routing.probs_TE.mean(0)).sum()
    torch.testing.assert_close(layer.balance.loss(routing, None, counts_E), want)


def test_moe_first_dense_blocks():
    from moeflow.training.config import ModelConfig, MoEConfig
    from moeflow.training.model import DenseFFN, MoEGPT

    model = MoEGPT(ModelConfig(n_layers=3, d_model=16, n_heads=2, seq_len=8, d_ff=32, moe_first_dense=2), MoEConfig())
    assert [isinstance(b.ffn, DenseFFN) for b in model.blocks] == [True, True, False]
    with pytest.raises(ValueError, match=r"model.moe_first_dense=3 must be in \[0, model.n_layers=3\)"):
        ModelConfig(n_layers=3, moe_first_dense=3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(gate_options={"n_group": 3}), "n_group=3 must divide num_experts=8"),
        (dict(gate="sigmoid", gate_options={"n_group": 4, "topk_group": 5}), r"topk_group=5 must be in \[1, n_group=4"),
        (dict(gate_options={"n_group": 4, "topk_group": 1}, top_k=3), "topk_group=1 groups of 2 experts hold fewer"),
        (dict(gate_options={"topk_group": 2}), "topk_group=2 needs n_group > 1"),
        (dict(gate_options={"n_group": 2, "node_limited": 1}), "node_limited=1 with n_group=2"),
        (dict(gate_options={"n_group": 4, "group_score_topn": 3}), "group_score_topn=3 exceeds the 2 experts"),
        (dict(gate_options={"scaling_factor": 0}), r"scaling_factor=0.0 must be a finite number in \(0, inf\]"),
        (dict(gate="sigmoid", gate_options={"softmax_after_topk": True}), "unknown option 'softmax_after_topk'"),
        (dict(expert="clamped_swiglu", expert_options={"limit": -1.0}), "limit=-1.0 must be a finite number"),
        (dict(expert="swiglu", expert_options={"alpha": 1.0}), "expert='swiglu': unknown option 'alpha'"),
        (dict(num_shared_experts=-1), "num_shared_experts=-1 must be an int >= 0"),
        (dict(shared_d_hidden=8), "shared_d_hidden=8 needs num_shared_experts >= 1"),
        (dict(balance="sequence", gate="expert_choice"), "balance='sequence' shapes a token's choice"),
    ],
)
def test_bad_options_are_one_line_errors_naming_them(kwargs, message):
    kwargs.setdefault("top_k", 2)
    with pytest.raises((ValueError, TypeError), match=message) as excinfo:
        MoELayer(8, 16, 8, **kwargs)
    assert "\n" not in str(excinfo.value)


def test_config_wires_the_new_keys():
    from moeflow.training.config_files import load_config

    cfg = load_config(
        "configs/deepseek_v3_tiny.toml",
        ["moe.expert_options.limit=5", "moe.expert=clamped_swiglu", "moe.gate_options.scaling_factor=2"],
    )
    assert cfg.moe.expert_options == {"limit": 5.0} and cfg.moe.gate_options["scaling_factor"] == 2.0
    assert cfg.moe.num_shared_experts >= 1 and cfg.model.moe_first_dense >= 1
    with pytest.raises(ValueError, match="moe.expert_options for expert='ffn': unknown option 'limit'"):
        load_config(None, ["moe.expert_options.limit=5"])
    assert math.isfinite(cfg.moe.balance_weight)


def test_the_fine_grained_layer_benchmark_compares_the_same_block():
    """`bench.layer` with `block="deepseek_v3"`: moeflow and transformers' `DeepseekV3MoE` hold the
    same weights and compute the same outputs (its experts by `grouped_mm`, a model's default)."""
    pytest.importorskip("transformers")
    from moeflow.bench.layer import LayerBenchConfig, deepseek_block_from

    cfg = LayerBenchConfig(tokens=64, d_model=16, d_hidden=8, num_experts=16, top_k=4, block="deepseek_v3")
    torch.manual_seed(5)
    layer = MoELayer(16, 8, 16, top_k=4, **cfg.layer_kwargs())
    block, impl = deepseek_block_from(layer)
    x_TD = torch.randn(64, 16, generator=GEN)
    assert impl == "grouped_mm" and layer.gate.group_limit.n_group == 8
    torch.testing.assert_close(block(x_TD[None])[0], layer(x_TD), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="block='deepseek_v3' has swiglu experts, got expert='ffn'"):
        LayerBenchConfig(block="deepseek_v3", expert="ffn")
    with pytest.raises(ValueError, match="device='tpu' must be 'cpu', 'cuda' or 'cuda:N'"):
        LayerBenchConfig(device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda': no CUDA device is available here"):
            LayerBenchConfig(device="cuda")


def test_stable_topk_is_the_stable_sort_prefix_with_and_without_ties():
    """`stable_topk` (top-k, then the k ordered; the full sort only where the k-th score ties one
    outside) equals the first k of a stable descending sort, on distinct, tied and masked scores;
    so does its branch-free path for accelerators (`stable_topk_by_key`, forced here on the CPU),
    in every dtype it takes, with −0 beside +0, ±∞ and NaN among the ties."""
    from moeflow.routing.routing import stable_topk, stable_topk_by_key

    gen = torch.Generator().manual_seed(9)
    signed_zeros = torch.randint(-1, 2, (200, 64), generator=gen).float()
    signed_zeros[signed_zeros == 0] = -0.0  # −0 and +0 (−1 · 0 = −0) tie in the sort
    signed_zeros[torch.rand(200, 64, generator=gen) < 0.3] *= 0.0
    specials = torch.randint(-2, 3, (200, 64), generator=gen).float()
    for value, share in ((math.inf, 0.1), (-math.inf, 0.1), (math.nan, 0.05), (-math.nan, 0.05)):
        specials[torch.rand(200, 64, generator=gen) < share] = value
    for scores in (
        torch.randn(200, 64, generator=gen),
        torch.randint(0, 4, (200, 64), generator=gen).float(),  # ties everywhere
        torch.randn(200, 64, generator=gen).masked_fill(torch.rand(200, 64, generator=gen) < 0.7, -math.inf),
        signed_zeros,
    ):
        for k in (1, 6, 8, 64):
            want = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
            assert torch.equal(stable_topk(scores, k), want), k
    for scores in (signed_zeros, specials, torch.randn(200, 64, generator=gen)):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):  # bf16: ties from rounding
            typed = scores.to(dtype)
            for k in (1, 2, 6, 63):
                want = torch.sort(typed, dim=-1, descending=True, stable=True).indices[:, :k]
                assert torch.equal(stable_topk_by_key(typed, k), want), (dtype, k)
