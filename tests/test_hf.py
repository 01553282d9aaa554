"""`moeflow.hf`: Hugging Face MoE models converted to `MoELayer` give the original's logits, loss,
auxiliary loss and every gradient (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE, OLMoE,
DeepSeek-V2/V3 and GLM-4-MoE with group-limited routing and shared experts, GPT-OSS with its
router bias and clamped SwiGLU, Llama 4 with scaled inputs), bf16 within a stated tolerance,
export back to identical weights (and through `save_pretrained`), reproduce each router's
semantics under a selection bias (folded into DeepSeek-V3's correction bias on export), and refuse
bad input and unsupported blocks with one line naming them. Expert parallelism and copies on 2
and 4 gloo ranks: `multirank_hf`."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from moeflow.hf import MoEBlock, RouterSemantics, convert_moe_blocks, export_moe_blocks

from .hf_models import ARCHS, grads_by_original_name, moe_blocks, tiny
from .multirank_hf import check_hf_expert_parallel

pytest.importorskip("transformers")

IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))


def _assert_same_training_step(ref, model, ids=IDS, seed=None):
    """Loss, the model's own auxiliary loss and every gradient (under the original's names) equal."""
    ref.train(), model.train()
    if seed is not None:
        torch.manual_seed(seed)
    out_ref = ref(ids, labels=ids)
    if seed is not None:
        torch.manual_seed(seed)
    out = model(ids, labels=ids)
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-6, atol=1e-6)
    if out_ref.aux_loss is not None:
        torch.testing.assert_close(out.aux_loss, out_ref.aux_loss, rtol=1e-6, atol=1e-6)
    out_ref.loss.backward(), out.loss.backward()
    want = dict(ref.named_parameters())
    got = grads_by_original_name(model)
    assert got.keys() == want.keys()
    for name, (_, grad) in got.items():
        torch.testing.assert_close(grad, want[name].grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_converted_model_equals_the_original_and_exports_back(arch):
    ref = tiny(arch)
    model = copy.deepcopy(ref)
    assert convert_moe_blocks(model) == 2
    blocks = moe_blocks(model)
    assert len(blocks) == 2 and all(isinstance(b, MoEBlock) for b in blocks)
    ref.eval(), model.eval()
    torch.testing.assert_close(model(IDS).logits, ref(IDS).logits, rtol=1e-5, atol=1e-5)
    _assert_same_training_step(ref, model)  # dropless: every assignment computed, as in the original
    assert export_moe_blocks(model) == 2
    assert [type(b) for b in moe_blocks(model)] == [type(b) for b in moe_blocks(ref)]
    assert model.state_dict().keys() == ref.state_dict().keys()
    for name, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_mixtral_router_jitter_is_drawn_as_the_block_draws_it():
    ref = tiny("mixtral", router_jitter_noise=0.2)
    model = copy.deepcopy(ref)
    convert_moe_blocks(model)
    _assert_same_training_step(ref, model, seed=4)


def test_only_sparse_layers_convert_and_a_trained_model_saves_as_transformers(tmp_path):
    import transformers

    ref = tiny("qwen3_moe", mlp_only_layers=[1])  # layer 1 keeps a dense MLP
    model = copy.deepcopy(ref)
    assert convert_moe_blocks(model) == 1
    assert type(model.model.layers[1].mlp) is type(ref.model.layers[1].mlp)
    for m in (ref, model):  # one SGD step on each
        m.train()
        m(IDS, labels=IDS).loss.backward()
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.1 * p.grad
    export_moe_blocks(model)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    model.save_pretrained(tmp_path)
    loaded = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(loaded(IDS).logits, model.eval()(IDS).logits, rtol=0, atol=0)


def test_a_copy_of_a_converted_model_exports_its_own_weights_in_its_dtype():
    ref = tiny("qwen2_moe")
    model = copy.deepcopy(ref)
    convert_moe_blocks(model)
    twin = copy.deepcopy(model).to(torch.bfloat16)
    block = twin.model.layers[0].mlp
    assert block.source.gate is block.gate and block.source.shared_expert is block.moe.shared_experts.shared_expert
    export_moe_blocks(twin)
    assert type(model.model.layers[0].mlp) is MoEBlock  # the original stays converted
    for name, value in ref.state_dict().items():
        assert torch.equal(twin.state_dict()[name], value.to(torch.bfloat16)), name


@pytest.mark.parametrize("arch", list(ARCHS))
def test_bf16_stays_within_the_stated_tolerance(arch):
    ref = tiny(arch).to(torch.bfloat16)
    model = copy.deepcopy(ref)
    convert_moe_blocks(model)
    assert moe_blocks(model)[0].moe.experts.w13.dtype == torch.bfloat16
    ref.eval(), model.eval()
    # Same router module, so the same experts; the expert GEMMs and the k-term combine round in
    # another order (bf16 keeps 8 mantissa bits: ~2^-8 relative per op). Measured on logits of
    # magnitude ~2: Mixtral (fp32 combine weights) max 0.016; Qwen-MoE and OLMoE (weights rounded
    # to bf16 by their routers) 0; DeepSeek-V2/V3, GLM-4-MoE, GPT-OSS, Llama 4 at most 0.016.
    torch.testing.assert_close(model(IDS).logits.float(), ref(IDS).logits.float(), rtol=2e-2, atol=3e-2)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_selection_bias_reselects_with_the_routers_own_semantics(arch):
    """`balance="aux_free"` makes the gate re-select from the router's logits (its bias starts at 0):
    the same numbers as the router's own top-k; then a bias steers every token to expert 3."""
    ref = tiny(arch)
    model = copy.deepcopy(ref)
    convert_moe_blocks(model, balance="aux_free")
    ref.eval(), model.eval()
    torch.testing.assert_close(model(IDS).logits, ref(IDS).logits, rtol=1e-5, atol=1e-5)
    moe = moe_blocks(model)[0].moe
    moe.balance.bias_E[3] = 10.0
    model(IDS)
    assert (moe.stats.flow[0, 3] == IDS.numel()).item()


def test_the_tiny_configs_exercise_each_architectures_routing_and_experts():
    """Group limits change choices (DeepSeek-V2/V3, GLM-4-MoE), GPT-OSS's clamp acts, and an
    aux-free bias trained on a converted DeepSeek-V3 is exported into its correction bias."""
    from moeflow.hf.router import RouterSemantics

    x_TD = torch.randn(48, 32, generator=torch.Generator().manual_seed(2))
    for arch in ("deepseek_v3", "deepseek_v2", "glm4_moe"):
        model = tiny(arch)
        convert_moe_blocks(model)
        gate = moe_blocks(model)[0].moe.gate
        limited = gate(x_TD).expert_A
        free = RouterSemantics(gate.semantics.order, gate.semantics.normalize, n_group=1)
        bias_E = gate.router.e_score_correction_bias if gate.semantics.correction_bias else None
        assert not torch.equal(free.select(gate.router(x_TD)[0], 2, None, bias_E)[1].t().reshape(-1), limited), arch
    block = moe_blocks(convert(tiny("gpt_oss")))[0]
    w = block.moe.experts.weights()
    gate = x_TD @ w["w13"][0][:, 0] + w["b13"][0][0]
    assert (gate.abs() > block.moe.experts.options.limit).any()

    ref = tiny("deepseek_v3")
    model = copy.deepcopy(ref)
    convert_moe_blocks(model, balance="aux_free")
    moe = moe_blocks(model)[0].moe
    with torch.no_grad():
        moe.balance.bias_E.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(3))
    model.eval()
    trained = model(IDS).logits
    export_moe_blocks(model)
    want = ref.model.layers[1].mlp.gate.e_score_correction_bias + moe.balance.bias_E
    torch.testing.assert_close(model.model.layers[1].mlp.gate.e_score_correction_bias, want, rtol=0, atol=0)
    torch.testing.assert_close(model(IDS).logits, trained, rtol=1e-5, atol=1e-5)


def convert(model):
    convert_moe_blocks(model)
    return model


def test_router_semantics_orders():
    logits_TE = torch.randn(16, 6, generator=torch.Generator().manual_seed(0))
    probs_TE = torch.softmax(logits_TE, -1)
    w, e = RouterSemantics("softmax_topk", normalize=False).select(logits_TE, 2)
    torch.testing.assert_close(w, probs_TE.topk(2).values)
    w, e = RouterSemantics("softmax_topk", normalize=True).select(logits_TE, 2)
    torch.testing.assert_close(w, probs_TE.topk(2).values / probs_TE.topk(2).values.sum(-1, keepdim=True))
    w, e = RouterSemantics("topk_softmax").select(logits_TE, 2)  # Switch-style: softmax over the k logits
    torch.testing.assert_close(w, torch.softmax(logits_TE.topk(2).values, -1))
    assert torch.equal(e, logits_TE.topk(2).indices)
    w, e = RouterSemantics("topk_sigmoid").select(logits_TE, 1)  # Llama 4
    torch.testing.assert_close(w, torch.sigmoid(logits_TE.max(-1, keepdim=True).values))
    w, e = RouterSemantics("sigmoid_topk", normalize=True, scaling_factor=2.0).select(logits_TE, 2)  # DeepSeek-V3
    top = torch.sigmoid(logits_TE).topk(2).values
    torch.testing.assert_close(w, 2.0 * top / top.sum(-1, keepdim=True))
    with pytest.raises(ValueError, match="order='sigmoid'"):
        RouterSemantics("sigmoid")


def test_bad_input_is_one_line_naming_it():
    import transformers

    def one_line(excinfo):
        assert "\n" not in str(excinfo.value)

    with pytest.raises(ValueError, match="Linear has no supported sparse-MoE block") as e:
        convert_moe_blocks(nn.Linear(2, 2))
    one_line(e)
    dense = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)
    )  # fmt: skip
    with pytest.raises(ValueError, match="LlamaForCausalLM has no supported sparse-MoE block") as e:
        convert_moe_blocks(dense)
    one_line(e)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp \(MixtralSparseMoeBlock\): expert activation GELU"):
        convert_moe_blocks(tiny("mixtral", hidden_act="gelu_pytorch_tanh"))
    with pytest.raises(TypeError, match=r"\['gate', 'top_k'\] come from each block"):
        convert_moe_blocks(tiny("olmoe"), gate="topk", top_k=1)
    # Checked before anything is replaced: an error in layer 1 leaves layer 0 unconverted.
    model = tiny("qwen2_moe")
    model.model.layers[1].mlp.experts.act_fn = nn.ReLU()
    with pytest.raises(ValueError, match=r"model.layers.1.mlp \(Qwen2MoeSparseMoeBlock\): expert activation ReLU") as e:
        convert_moe_blocks(model)
    one_line(e)
    assert type(model.model.layers[0].mlp).__name__ == "Qwen2MoeSparseMoeBlock"
    # A block moeflow refuses is named with its reason, before anything is replaced.
    refused = nn.ModuleList([type("PhimoeSparseMoeBlock", (nn.Module,), {})()])
    with pytest.raises(
        ValueError, match=r"0 \(PhimoeSparseMoeBlock\) is not supported: Phi-3.5-MoE's sparsemixer"
    ) as e:
        convert_moe_blocks(refused)
    one_line(e)
    # A router whose first output is probabilities (transformers 5.0-5.5) is not taken for logits.
    model = tiny("olmoe")
    router = model.model.layers[0].mlp.gate
    plain = router.forward
    router.forward = lambda x: (torch.softmax(plain(x)[0].float(), -1), *plain(x)[1:])
    with pytest.raises(ValueError, match=r"model.layers.0.mlp: its router \(OlmoeTopKRouter\) does not compute"):
        convert_moe_blocks(model)


@pytest.mark.multirank
@pytest.mark.spawned(body=check_hf_expert_parallel)
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_and_shadow_equal_the_original(world, shared_spawns):
    shared_spawns.run(check_hf_expert_parallel, world)
