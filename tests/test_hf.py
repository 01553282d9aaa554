"""`moeflow.hf`: Hugging Face MoE models converted to `MoELayer` give the same logits, loss, auxiliary
loss and gradients (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE, OLMoE), bf16 within a stated
tolerance, export back to identical weights, and refuse bad input with one line; on 2 and 4 gloo
ranks the converted model under EP and shadowing equals the single-process original
(`multirank_hf`)."""

from __future__ import annotations

import copy

import pytest
import torch

from moeflow.hf import convert_moe_blocks, export_moe_blocks

from .hf_models import ARCHS, grads_by_original_name, tiny
from .multirank import run_ranks

pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_converted_model_equals_the_original_and_exports_back(arch):
    ref = tiny(arch)
    model = copy.deepcopy(ref)
    assert convert_moe_blocks(model) == 2
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    ref.eval(), model.eval()
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
    ref.train(), model.train()
    out_ref, out = ref(ids, labels=ids), model(ids, labels=ids)
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.aux_loss, out_ref.aux_loss, rtol=1e-6, atol=1e-6)  # its own aux loss
    out_ref.loss.backward(), out.loss.backward()
    want = dict(ref.named_parameters())
    got = grads_by_original_name(model)
    assert got.keys() == want.keys()
    for name, (_, grad) in got.items():
        torch.testing.assert_close(grad, want[name].grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert export_moe_blocks(model) == 2
    assert type(model.model.layers[0].mlp) is type(ref.model.layers[0].mlp)
    for name, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_bf16_stays_close():
    ref = tiny("mixtral").to(torch.bfloat16)
    model = copy.deepcopy(ref)
    convert_moe_blocks(model)
    assert model.model.layers[0].mlp.moe.experts.w1.dtype == torch.bfloat16
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    ref.eval(), model.eval()
    # bf16 keeps 8 bits of mantissa; the two sum the k experts in another order: ~2^-7 relative.
    torch.testing.assert_close(model(ids).logits.float(), ref(ids).logits.float(), rtol=2e-2, atol=2e-2)


def test_bad_input_is_one_line_naming_it():
    from torch import nn

    with pytest.raises(ValueError, match="Linear has no supported sparse-MoE block"):
        convert_moe_blocks(nn.Linear(2, 2))
    model = tiny("mixtral")
    model.model.layers[0].mlp.experts.act_fn = nn.GELU()
    with pytest.raises(ValueError, match="expert activation GELU is not supported"):
        convert_moe_blocks(model)


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_and_shadow_equal_the_original(world):
    from .multirank_hf import check_hf_expert_parallel

    run_ranks(check_hf_expert_parallel, world)
