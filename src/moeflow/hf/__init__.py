"""Hugging Face `transformers` MoE models on moeflow (docs/hf.md): swap their sparse-MoE blocks for
`MoELayer`s holding the same weights, train them with any moeflow strategy, export them back.

    model = MixtralForCausalLM(config)                      # or from_pretrained(...)
    convert_moe_blocks(model, group=ep_group, strategy="shadow", cost_model=cm)
    ...train (all_reduce_gradients(model, layout) after each backward)...
    export_moe_blocks(model); model.save_pretrained(path)   # a plain transformers model again

Supported (`transformers` >= 5.6, < 6; `pip install moeflow[hf]`): Mixtral, Qwen2-MoE (shared
expert kept), Qwen3-MoE, OLMoE. This package never imports `transformers`: it recognises the blocks
by class name (`archs.SUPPORTED`).

Files: `archs` (which blocks, their layout and router flags), `router` (the block's router as a
`MoELayer` gate), `weights` (fused ↔ SwiGLU layouts, gathering experts), `block` (the replacing
module), `convert`, `export`.
"""

from moeflow.hf.archs import SUPPORTED, BlockSpec
from moeflow.hf.block import MoEBlock
from moeflow.hf.convert import convert_moe_blocks
from moeflow.hf.export import export_moe_blocks
from moeflow.hf.router import HFRouterGate, RouterSemantics

__all__ = [
    "SUPPORTED",
    "BlockSpec",
    "HFRouterGate",
    "MoEBlock",
    "RouterSemantics",
    "convert_moe_blocks",
    "export_moe_blocks",
]
