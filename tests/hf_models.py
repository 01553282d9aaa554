"""Tiny random-weight `transformers` MoE models for the moeflow.hf tests (no hub access)."""

from __future__ import annotations

import torch

from moeflow.hf import MoEBlock
from moeflow.hf.weights import LAYOUTS

COMMON = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, output_router_logits=True,
)  # fmt: skip
MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, head_dim=4,
           num_key_value_heads=4)  # fmt: skip
"""DeepSeek's multi-head latent attention at tiny size."""
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
    # Group-limited sigmoid routing (4 groups of 2 experts, 2 kept), scaling, a shared expert, the
    # first block dense: 3 blocks, 2 MoE. DeepSeek-V2 keeps 1 group: with its group maximum as the
    # score and top-2, keeping 2 groups would never change a choice.
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            num_hidden_layers=3,
            **MLA,
        ),
    ),  # fmt: skip
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=8,
            n_group=4,
            topk_group=1,
            topk_method="group_limited_greedy",
            n_shared_experts=2,
            routed_scaling_factor=1.5,
            first_k_dense_replace=1,
            num_hidden_layers=3,
            **MLA,
        ),
    ),  # fmt: skip
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=8,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            routed_scaling_factor=1.5,
            first_k_dense_replace=1,
            num_hidden_layers=3,
            head_dim=8,
        ),
    ),  # fmt: skip
    # Router bias, softmax over the top-k logits, clamped SwiGLU experts with biases (a small limit
    # so that the clamp acts on these weights).
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(intermediate_size=16, num_local_experts=4, head_dim=8, swiglu_limit=0.5, layer_types=None),
    ),
    # Top-1 sigmoid with the input scaled, a shared expert.
    "llama4": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            intermediate_size=16,
            intermediate_size_mlp=48,
            num_local_experts=4,
            num_experts_per_tok=1,
            head_dim=8,
            attention_chunk_size=64,
        ),
    ),  # fmt: skip
}
NEW_ARCHS = ("deepseek_v3", "deepseek_v2", "glm4_moe", "gpt_oss", "llama4")
"""The architectures of docs/architectures.md (beside the four of docs/hf.md)."""


def experts_key(arch: str) -> str:
    """The config key of the expert count."""
    return {"mixtral": "num_local_experts", "gpt_oss": "num_local_experts", "llama4": "num_local_experts"}.get(
        arch, "n_routed_experts" if arch in ("deepseek_v3", "deepseek_v2", "glm4_moe") else "num_experts"
    )


def moe_blocks(model) -> list:
    """The sparse-MoE blocks (or their `MoEBlock`s) of a tiny model, in depth order."""
    out = []
    for layer in model.model.layers:
        mlp = getattr(layer, "mlp", None) or layer.feed_forward
        if hasattr(mlp, "experts") or isinstance(mlp, MoEBlock):
            out.append(mlp)
    return out


def tiny(arch: str, seed: int = 0, **overrides):
    """A 2- (or 3-) layer model of `arch` with 4 or 8 experts, top-2 (Llama 4: top-1), weights
    ~ N(0, 0.1), biases and correction biases too (the default init leaves routers at zero: every
    expert would tie)."""
    import transformers

    cfg_name, model_name, extra = ARCHS[arch]
    config = getattr(transformers, cfg_name)(**{**COMMON, "num_experts_per_tok": 2, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 or "bias" in name:
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
    return model


def grads_by_original_name(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient under the unconverted model's names (converted experts mapped
    back to their `transformers` layout; under EP, only this rank's experts, by global id)."""
    out = {}
    for module_name, module in model.named_modules():
        if isinstance(module, MoEBlock):
            e = module.moe.experts
            layout = LAYOUTS[module.spec.experts]
            for name, grad in layout.to_hf({n: p.grad for n, p in e.weights().items()}).items():
                out[f"{module_name}.experts.{name}"] = (e.expert_ids, grad)
            for name, p in module.named_parameters():
                if not name.startswith("moe.experts."):
                    out[f"{module_name}.{module.original_name(name)}"] = (None, p.grad)
    inside = {f"{n}." for n, m in model.named_modules() if isinstance(m, MoEBlock)}
    for name, p in model.named_parameters():
        if not any(name.startswith(prefix) for prefix in inside):
            out[name] = (None, p.grad)
    return out
