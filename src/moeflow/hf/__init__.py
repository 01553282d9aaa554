"""Hugging Face `transformers` MoE models on moeflow (docs/hf.md): swap their sparse-MoE blocks for
`MoELayer`s holding the same weights, train them with any moeflow strategy, export them back.

    model = MixtralForCausalLM(config)                      # or from_pretrained(...)
    convert_moe_blocks(model, group=ep_group, strategy="shadow", cost_model=cm)
    ...train (all_reduce_gradients(model, layout) after each backward)...
    export_moe_blocks(model); model.save_pretrained(path)   # a plain transformers model again

Supported (`transformers` >= 5.6, < 6; `pip install moeflow[hf]`): Mixtral, Qwen2-MoE (shared
expert kept), Qwen3-MoE, OLMoE, DeepSeek-V2, DeepSeek-V3, GLM-4-MoE (group-limited sigmoid routing,
shared experts), GPT-OSS (router bias, softmax after top-k, clamped SwiGLU experts with biases),
Llama 4 text (top-1 sigmoid, scaled inputs, shared expert). Blocks moeflow refuses are named with
the reason (`archs.REFUSED`). This package never imports `transformers`: it recognises the blocks
by class name (`archs.SUPPORTED`).

Files: `archs` (which blocks, their router and layouts), `router` (the block's router as a
`MoELayer` gate), `weights` (the experts' layouts ↔ moeflow's, gathering experts), `block` (the
replacing module), `convert`, `export`.
"""

from moeflow.hf.archs import REFUSED, SUPPORTED, BlockSpec
from moeflow.hf.block import GatedSharedExpert, MoEBlock
from moeflow.hf.convert import convert_moe_blocks
from moeflow.hf.export import export_moe_blocks
from moeflow.hf.router import HFRouterGate, RouterSemantics

__all__ = [
    "REFUSED",
    "SUPPORTED",
    "BlockSpec",
    "GatedSharedExpert",
    "HFRouterGate",
    "MoEBlock",
    "RouterSemantics",
    "convert_moe_blocks",
    "export_moe_blocks",
]
