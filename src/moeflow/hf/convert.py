"""`convert_moe_blocks`: a `transformers` model's sparse-MoE blocks → `MoEBlock`s on `MoELayer`,
same weights, same numbers; with `group=`, each rank keeps its own experts.

Every block is checked before any is replaced, so an error leaves the model as it was.

Shape suffixes: E experts, L experts held by this rank, D hidden size, I expert intermediate size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moeflow.hf.archs import SUPPORTED, BlockSpec, find_blocks
from moeflow.hf.block import MoEBlock
from moeflow.hf.router import HFRouterGate, check_semantics
from moeflow.hf.weights import swiglu_from_fused
from moeflow.layer import MoELayer

FROM_THE_BLOCK = ("d_model", "d_hidden", "num_experts", "top_k", "gate", "expert")
"""`MoELayer` arguments each block determines (its shapes, its router, its SwiGLU experts)."""


def _check_block(name: str, block: nn.Module, world: int) -> None:
    """Raise one line naming the block unless it can be converted for a group of `world` ranks."""
    cls = type(block).__name__
    experts, router = getattr(block, "experts", None), getattr(block, "gate", None)
    fused = [getattr(experts, p, None) for p in ("gate_up_proj", "down_proj")]
    if not (all(isinstance(p, torch.Tensor) and p.dim() == 3 for p in fused) and hasattr(router, "weight")):
        raise TypeError(
            f"{name} ({cls}): expected a router `gate` and fused experts `gate_up_proj`/`down_proj` "
            f"(the transformers >= 5.6 layout; per-expert nn.Linear lists of 4.x are not supported)"
        )
    act = getattr(experts, "act_fn", None)
    probe = torch.linspace(-4.0, 4.0, 17)
    if not (callable(act) and torch.allclose(act(probe), F.silu(probe))):
        raise ValueError(
            f"{name} ({cls}): expert activation {type(act).__name__} is not supported "
            f"(moeflow's swiglu experts gate with SiLU)"
        )
    num_experts, d_model = fused[0].shape[0], fused[0].shape[2]
    if num_experts % world:
        raise ValueError(
            f"{name} ({cls}): {num_experts} experts are not divisible by the expert-parallel group size {world}"
        )
    check_semantics(name, router, SUPPORTED[cls].semantics(block), int(router.top_k), d_model)


def _build(name: str, block: nn.Module, spec: BlockSpec, group, layer_kwargs: dict) -> MoEBlock:
    """The `MoEBlock` for one checked block; takes the experts' tensors out of `block`."""
    experts, router = block.experts, block.gate
    gate_up_EiD, down_EDI = experts.gate_up_proj, experts.down_proj
    num_experts, d_model = gate_up_EiD.shape[0], gate_up_EiD.shape[2]
    top_k = int(router.top_k)
    semantics = spec.semantics(block)
    # The model's own auxiliary loss balances (from the router logits transformers records), so
    # moeflow's balance term is off unless asked for.
    kwargs = {"balance": "none", "balance_weight": 0.0, **layer_kwargs}
    layer = MoELayer(
        d_model,
        gate_up_EiD.shape[1] // 2,
        num_experts,
        top_k,
        gate=HFRouterGate(router, semantics, top_k),
        expert="swiglu",
        **kwargs,
    )
    if group is not None:
        layer.to_expert_parallel(group)  # before the copy: each rank copies only its own experts
    rows_L = torch.tensor(layer.experts.expert_ids, device=gate_up_EiD.device)
    full = swiglu_from_fused(gate_up_EiD.detach(), down_EDI.detach())
    for w_name in layer.experts.weights():
        own_LX = full[w_name].index_select(0, rows_L).contiguous()
        trained = (down_EDI if w_name == "w2" else gate_up_EiD).requires_grad  # frozen experts stay frozen
        setattr(layer.experts, w_name, nn.Parameter(own_LX, requires_grad=trained))
    layer.to(device=gate_up_EiD.device)
    del experts.gate_up_proj, experts.down_proj  # the source keeps no second copy; export puts them back
    shared = (block.shared_expert, block.shared_expert_gate) if spec.shared_expert else (None, None)
    jitter = float(getattr(block, "jitter_noise", 0.0) or 0.0) if spec.jitter else 0.0
    moe_block = MoEBlock(layer, block, *shared, jitter_noise=jitter)
    return moe_block.train(block.training)


def convert_moe_blocks(model: nn.Module, **layer_kwargs) -> int:
    """Replace, in place, every supported sparse-MoE block of `model` (`SUPPORTED`: Mixtral,
    Qwen2-MoE, Qwen3-MoE, OLMoE) with a `MoEBlock` on `MoELayer` holding the same weights, in the
    block's dtype and device; returns how many.

    `layer_kwargs` go to every `MoELayer` (`group`, `strategy`, `schedule`, `cost_model`, `hooks`,
    `balance`, ...). With `group=`, build or load the same model on every rank first: rank r keeps
    experts `[r·E/W, (r+1)·E/W)`, everything else stays replicated (average its gradients with
    `moeflow.model_step.all_reduce_gradients`). moeflow's balance term is off by default: the
    model's own auxiliary loss (`output_router_logits=True`) keeps working.
    """
    clash = sorted(set(layer_kwargs) & set(FROM_THE_BLOCK))
    if clash:
        raise TypeError(f"convert_moe_blocks: {clash} come from each block (its shapes, router and experts)")
    group = layer_kwargs.pop("group", None)
    world = 1 if group is None else dist.get_world_size(group)
    blocks = find_blocks(model, SUPPORTED)
    if not blocks:
        moe_like = sorted({type(m).__name__ for m in model.modules() if "moe" in type(m).__name__.lower()})
        raise ValueError(
            f"{type(model).__name__} has no supported sparse-MoE block (supported: {list(SUPPORTED)}"
            + (f"; found {moe_like})" if moe_like else ")")
        )
    for name, _, _, block in blocks:
        _check_block(name, block, world)
    built = [_build(name, block, SUPPORTED[type(block).__name__], group, layer_kwargs) for name, _, _, block in blocks]
    for (_, parent, attr, _), moe_block in zip(blocks, built):
        setattr(parent, attr, moe_block)
    return len(blocks)
