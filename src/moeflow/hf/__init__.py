"""Hugging Face `transformers` MoE models on moeflow (docs/hf.md): swap their sparse-MoE blocks for
`MoELayer`s holding the same weights, train them with any moeflow strategy, export them back.

    model = AutoModelForCausalLM.from_config(config)      # or from_pretrained
    convert_moe_blocks(model, group=ep_group, strategy="shadow", cost_model=cm)
    ...train...
    export_moe_blocks(model); model.save_pretrained(path)  # a plain `transformers` model again

Supported blocks (transformers 5.x): Mixtral, Qwen2-MoE (with its shared expert), Qwen3-MoE, OLMoE —
every block with the 5.x layout: a router module `gate` returning (logits, top-k weights, top-k
experts) and fused experts `gate_up_proj [E, 2I, D]`, `down_proj [E, D, I]` with a SiLU gate. This
package never imports `transformers` (`pip install moeflow[hf]` brings it for the examples and
tests); it recognises the blocks by class name.

Shape suffixes: E experts, D hidden size, I expert intermediate size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moeflow.core.layer import MoELayer
from moeflow.hf.block import BlockRouter, MoEBlock

SUPPORTED = ("MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "OlmoeSparseMoeBlock")
"""Class names of the sparse-MoE blocks `convert_moe_blocks` replaces."""

__all__ = ["SUPPORTED", "MoEBlock", "convert_moe_blocks", "export_moe_blocks"]


def _blocks(model: nn.Module, cls_names) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, block) of every block whose class name is in `cls_names`."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child).__name__ in cls_names:
                found.append((parent, name, child))
    return found


def _check(block: nn.Module) -> None:
    experts = getattr(block, "experts", None)
    act = getattr(experts, "act_fn", None)
    if not (hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj") and hasattr(block, "gate")):
        raise TypeError(
            f"{type(block).__name__}: expected a router `gate` and fused experts `gate_up_proj`/`down_proj` "
            f"(the transformers 5.x layout)"
        )
    probe = torch.linspace(-3, 3, 7)
    if not isinstance(act, nn.Module) or not torch.allclose(act(probe), torch.nn.functional.silu(probe)):
        raise ValueError(
            f"{type(block).__name__}: expert activation {type(act).__name__} is not supported "
            f"(moeflow's experts are SwiGLU: SiLU gate)"
        )


def _layer(block: nn.Module, layer_kwargs: dict) -> MoELayer:
    """A `MoELayer` with the block's router as gate and its experts' weights (all of them: the
    group, if any, is applied after the copy so that each rank keeps its own)."""
    experts = block.experts
    num_experts, two_i, d_model = experts.gate_up_proj.shape
    inter = two_i // 2
    top_k = int(getattr(block.gate, "top_k", getattr(block, "top_k", 0)))
    group = layer_kwargs.pop("group", None)
    world = 1 if group is None else dist.get_world_size(group)
    if num_experts % world:
        raise ValueError(
            f"{type(block).__name__}: {num_experts} experts are not divisible by the expert-parallel group size {world}"
        )
    kwargs = {"balance": "none", "balance_weight": 0.0, **layer_kwargs}
    layer = MoELayer(d_model, inter, num_experts, top_k, gate=BlockRouter(block.gate), expert="swiglu", **kwargs)
    dtype = experts.gate_up_proj.dtype
    with torch.no_grad():
        w = experts.gate_up_proj.detach()
        layer.experts.w1.copy_(w[:, :inter, :].transpose(1, 2))
        layer.experts.w3.copy_(w[:, inter:, :].transpose(1, 2))
        layer.experts.w2.copy_(experts.down_proj.detach().transpose(1, 2))
    layer.experts.to(device=experts.gate_up_proj.device, dtype=dtype)
    return layer.to_expert_parallel(group) if group is not None else layer


def convert_moe_blocks(model: nn.Module, **layer_kwargs) -> int:
    """Replace, in place, every supported sparse-MoE block of `model` with a `MoEBlock` on `MoELayer`
    holding the same weights; returns how many. `layer_kwargs` go to `MoELayer` (`group`,
    `strategy`, `schedule`, `cost_model`, ...; the balance term is off by default: the model's own
    auxiliary loss, computed from its router logits, keeps working). Build the model with the same
    seed (or load the same weights) on every rank before converting with `group=`."""
    blocks = _blocks(model, SUPPORTED)
    if not blocks:
        present = sorted({type(m).__name__ for m in model.modules() if "moe" in type(m).__name__.lower()})
        raise ValueError(
            f"{type(model).__name__} has no supported sparse-MoE block (supported: {list(SUPPORTED)}"
            + (f"; found {present}" if present else "")
            + ")"
        )
    config = getattr(model, "config", None)
    for parent, name, block in blocks:
        _check(block)
        layer = _layer(block, dict(layer_kwargs))
        shared = getattr(block, "shared_expert", None), getattr(block, "shared_expert_gate", None)
        setattr(parent, name, MoEBlock(layer, (type(block), config), *shared))
    return len(blocks)


def _full_experts(layer: MoELayer) -> dict[str, torch.Tensor]:
    """Every expert's weights `[E, ...]` on every rank, gathered from their owners."""
    out = {}
    for name, param in layer.experts.weights().items():
        full = param.new_zeros((layer.num_experts, *param.shape[1:]))
        if layer.experts.expert_ids:
            full[torch.tensor(layer.experts.expert_ids, device=param.device)] = param.detach()
        if layer.group is not None:
            dist.all_reduce(full, group=layer.group)  # each expert has one owner: the sum is a gather
        out[name] = full
    return out


def export_moe_blocks(model: nn.Module) -> int:
    """The reverse of `convert_moe_blocks`, in place: every `MoEBlock` becomes the model's original
    block class again, with the router, the shared expert and every expert's weights (gathered from
    their owners under expert parallelism: a collective, call it on every rank). Returns how many."""
    blocks = _blocks(model, ("MoEBlock",))
    for parent, name, block in blocks:
        cls, config = block.source
        original = cls(config)
        w = _full_experts(block.moe)
        with torch.no_grad():
            original.experts.gate_up_proj.copy_(torch.cat([w["w1"], w["w3"]], dim=2).transpose(1, 2))
            original.experts.down_proj.copy_(w["w2"].transpose(1, 2))
        original.gate = block.gate
        if block.shared_expert is not None:
            original.shared_expert, original.shared_expert_gate = block.shared_expert, block.shared_expert_gate
        original.to(device=w["w1"].device, dtype=w["w1"].dtype)
        original.train(block.training)
        setattr(parent, name, original)
    return len(blocks)
