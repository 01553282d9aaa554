"""Tiny random-weight `transformers` MoE models for the moeflow.hf tests (no hub access)."""

from __future__ import annotations

import torch

from moeflow.hf import MoEBlock

COMMON = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, output_router_logits=True,
)  # fmt: skip
ARCHS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=48, num_local_experts=4)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(intermediate_size=48, moe_intermediate_size=24, num_experts=4, norm_topk_prob=True, head_dim=8),
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(intermediate_size=48, num_experts=4)),
}


def tiny(arch: str, seed: int = 0, **overrides):
    """A 2-layer model of `arch` with 4 experts, top-2, weights ~ N(0, 0.1) (the default init
    leaves routers at zero: every expert would tie)."""
    import transformers

    cfg_name, model_name, extra = ARCHS[arch]
    config = getattr(transformers, cfg_name)(**{**COMMON, "num_experts_per_tok": 2, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    return model


def grads_by_original_name(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient under the unconverted model's names (converted experts mapped
    back to `gate_up_proj` / `down_proj`; under EP, only this rank's experts, by global id)."""
    out = {}
    for module_name, module in model.named_modules():
        if isinstance(module, MoEBlock):
            e, ids = module.moe.experts, module.moe.experts.expert_ids
            gate_up = torch.cat([e.w1.grad, e.w3.grad], dim=2).transpose(1, 2)
            out[f"{module_name}.experts.gate_up_proj"] = (ids, gate_up)
            out[f"{module_name}.experts.down_proj"] = (ids, e.w2.grad.transpose(1, 2))
    for name, p in model.named_parameters():
        if ".moe.experts." in name:
            continue
        out[name.replace(".moe.gate.router.", ".gate.")] = (None, p.grad)
    return out
