"""`convert_moe_blocks`: a `transformers` model's sparse-MoE blocks → `MoEBlock`s on `MoELayer`,
same weights, same numbers; with `group=`, each rank keeps its own experts.

Every block is checked before any is replaced, so an error leaves the model as it was.

Shape suffixes: E experts, O experts this rank owns (holds in its module), D d_model (HF's hidden size),
H d_hidden (HF's expert intermediate size), X any trailing dims.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moeflow.hf.archs import REFUSED, SUPPORTED, BlockSpec, find_blocks
from moeflow.hf.block import GatedSharedExpert, MoEBlock
from moeflow.hf.router import HFRouterGate, check_semantics
from moeflow.hf.weights import LAYOUTS, hf_tensors
from moeflow.layer import MoELayer

FROM_THE_BLOCK = (
    "d_model",
    "d_hidden",
    "num_experts",
    "top_k",
    "gate",
    "expert",
    "expert_options",
    "num_shared_experts",
    "shared_d_hidden",
    "shared_experts",
)
"""`MoELayer` arguments each block determines (its shapes, its router, its experts, its shared MLP)."""


def _check_block(name: str, block: nn.Module, world: int) -> None:
    """Raise one line naming the block unless it can be converted for a group of `world` ranks."""
    cls = type(block).__name__
    spec = SUPPORTED[cls]
    layout = LAYOUTS[spec.experts]
    experts, router = getattr(block, "experts", None), getattr(block, spec.router, None)
    tensors = hf_tensors(experts, layout) if experts is not None else {}
    shapes_ok = len(tensors) == len(layout.tensors) and all(
        t.dim() == (3 if "bias" not in n else 2) for n, t in tensors.items()
    )
    if not (shapes_ok and hasattr(router, "weight")):
        raise TypeError(
            f"{name} ({cls}): expected a router `{spec.router}` and fused experts {list(layout.tensors)} "
            f"(the transformers >= 5.6 layout; per-expert nn.Linear lists of 4.x are not supported)"
        )
    if layout.kind == "swiglu":
        act = getattr(experts, "act_fn", None)
        probe = torch.linspace(-4.0, 4.0, 17)
        if not (callable(act) and torch.allclose(act(probe), F.silu(probe))):
            raise ValueError(
                f"{name} ({cls}): expert activation {type(act).__name__} is not supported "
                f"(moeflow's swiglu experts gate with SiLU)"
            )
    num_experts, d_model, _ = layout.shapes(tensors)
    if num_experts % world:
        raise ValueError(
            f"{name} ({cls}): {num_experts} experts are not divisible by the expert-parallel group size {world}"
        )
    check_semantics(name, router, spec.semantics(block), int(router.top_k), d_model)


def _shared(block: nn.Module, spec: BlockSpec) -> nn.Module | None:
    """The block's shared MLP as a `[T, D] → [T, D]` module (its own objects), or None."""
    if spec.shared == "gated":
        return GatedSharedExpert(block.shared_expert, block.shared_expert_gate)
    return getattr(block, spec.shared_attr) if spec.shared == "plain" else None


def _build(name: str, block: nn.Module, spec: BlockSpec, group, layer_kwargs: dict) -> MoEBlock:
    """The `MoEBlock` for one checked block; takes the experts' tensors out of `block`."""
    layout = LAYOUTS[spec.experts]
    experts, router = block.experts, getattr(block, spec.router)
    tensors = hf_tensors(experts, layout)
    num_experts, d_model, d_hidden = layout.shapes(tensors)
    top_k = int(router.top_k)
    expert_options = (
        {"alpha": float(experts.alpha), "limit": float(experts.limit)} if layout.name == "interleaved" else None
    )
    # The model's own auxiliary loss balances (from the router logits transformers records), so
    # moeflow's balance term is off unless asked for.
    kwargs = {"balance": "none", "balance_weight": 0.0, **layer_kwargs}
    layer = MoELayer(
        d_model,
        d_hidden,
        num_experts,
        top_k,
        gate=HFRouterGate(router, spec.semantics(block), top_k),
        expert=layout.kind,
        expert_options=expert_options,
        shared_experts=_shared(block, spec),
        **kwargs,
    )
    if group is not None:
        layer.to_expert_parallel(group)  # before the copy: each rank copies only its own experts
    device = tensors["gate_up_proj"].device
    rows_O = torch.tensor(layer.experts.expert_ids, device=device)
    full = layout.to_moeflow({n: t.detach() for n, t in tensors.items()})
    for w_name in layer.experts.weights():
        own_OX = full[w_name].index_select(0, rows_O).contiguous()
        trained = tensors[layout.source_of(w_name)].requires_grad  # frozen experts stay frozen
        setattr(layer.experts, w_name, nn.Parameter(own_OX, requires_grad=trained))
    layer.experts.to(device=device)
    for tensor_name in layout.tensors:  # the source keeps no second copy; export puts them back
        delattr(experts, tensor_name)
    jitter = float(getattr(block, "jitter_noise", 0.0) or 0.0) if spec.jitter else 0.0
    moe_block = MoEBlock(layer, block, spec, jitter_noise=jitter)
    return moe_block.train(block.training)


def _refuse_unsupported(model: nn.Module) -> None:
    """Raise, naming the block and the reason, when `model` holds a block moeflow refuses; or,
    when it holds no supported block, name what MoE-like modules it found."""
    refused = find_blocks(model, REFUSED)
    if refused:
        name, _, _, block = refused[0]
        cls = type(block).__name__
        raise ValueError(f"{name} ({cls}) is not supported: {REFUSED[cls]}")
    if not find_blocks(model, SUPPORTED):
        moe_like = sorted({type(m).__name__ for m in model.modules() if "moe" in type(m).__name__.lower()})
        raise ValueError(
            f"{type(model).__name__} has no supported sparse-MoE block (supported: {list(SUPPORTED)}"
            + (f"; found {moe_like})" if moe_like else ")")
        )


def convert_moe_blocks(model: nn.Module, **layer_kwargs) -> int:
    """Replace, in place, every supported sparse-MoE block of `model` (`SUPPORTED`: Mixtral,
    Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2, DeepSeek-V3, GLM-4-MoE, GPT-OSS, Llama 4) with a
    `MoEBlock` on `MoELayer` holding the same weights, in the block's dtype and device; returns how
    many. A block moeflow refuses (`REFUSED`) is named with the reason.

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
    _refuse_unsupported(model)
    blocks = find_blocks(model, SUPPORTED)
    for name, _, _, block in blocks:
        _check_block(name, block, world)
    built = [_build(name, block, SUPPORTED[type(block).__name__], group, layer_kwargs) for name, _, _, block in blocks]
    for (_, parent, attr, _), moe_block in zip(blocks, built):
        setattr(parent, attr, moe_block)
    return len(blocks)
