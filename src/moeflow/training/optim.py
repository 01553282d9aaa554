"""AdamW with decoupled weight decay on matrices only, linear warmup + cosine decay, and clipping
to the global gradient norm over dense and sharded expert gradients (EP shards, ESP hidden slices,
FSDP2 shards)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moeflow.core import dispatch
from moeflow.core.expert_sharding import hidden_slice_parameters
from moeflow.core.parallel import ParallelLayout, dense_parameters
from moeflow.layer import MoELayer
from moeflow.model_step import layer_groups


def lr_factor(completed_steps: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """LR multiplier for the update after `completed_steps` updates: linear warmup, cosine decay."""
    step = completed_steps + 1
    if step <= warmup_steps:
        return step / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _is_no_decay(name: str, param: torch.Tensor) -> bool:
    # Biases (also the per-expert b1/b2, which are 2-D [E_local, H]) and LayerNorm gains are not decayed.
    leaf = name.rsplit(".", 1)[-1]
    return param.dim() < 2 or leaf in ("bias", "b1", "b2")


def build_optimizer(model: torch.nn.Module, cfg) -> torch.optim.AdamW:
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not _is_no_decay(n, p)], "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in named if _is_no_decay(n, p)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def _copies(model: torch.nn.Module, layout: ParallelLayout) -> dict[int, int]:
    """For every parameter, how many ranks hold the same values of its local tensor: dense
    replicated on every rank (world) or FSDP-sharded (1); an expert tensor on its data-parallel
    replicas (unless FSDP shards it over them), and `b2`, whole on every ESP member, times those."""
    sliced_ids = hidden_slice_parameters(model)
    copies = {id(p): 1 if isinstance(p, DTensor) else layout.world_size for _, p in dense_parameters(model)}
    for layer in (m for m in model.modules() if isinstance(m, MoELayer)):
        replicas = dispatch.group_size(layer_groups(layer, layout)[0])
        members = dispatch.group_size(layer.esp_group)
        for p in layer.experts.parameters():
            held = 1 if isinstance(p, DTensor) else replicas
            copies[id(p)] = held * (1 if id(p) in sliced_ids else members)
    return copies


def clip_gradients(model: torch.nn.Module, layout: ParallelLayout, max_norm: float) -> float:
    """Clip to the global gradient norm and return it (before clipping).

    The squared norm of every local gradient is divided by the number of ranks holding the same
    values (`_copies`: dense gradients are identical on every rank after all_reduce_gradients, or
    FSDP2 shards; an expert's on its data-parallel replicas; under expert sharding, FSMoE §3, the
    hidden slices differ on every ESP member while `b2` is the same on all) and summed over all
    ranks in one all-reduce: each element counted once, in float64.
    """
    copies = _copies(model, layout)
    device = next(iter(p.to_local() if isinstance(p, DTensor) else p for p in model.parameters())).device
    squared = torch.zeros((), dtype=torch.float64, device=device)
    grads = []
    for p in model.parameters():
        if p.grad is None:
            continue
        grads.append(p.grad)
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        squared += torch.linalg.vector_norm(local, dtype=torch.float64).square() / copies[id(p)]
    if layout.world_size > 1:
        dist.all_reduce(squared)
    total = squared.sqrt().float()
    if max_norm > 0:  # torch.nn.utils.clip_grads_with_norm_'s factor, for DTensor and plain gradients alike
        coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        for g in grads:
            g.mul_(coef)
    return float(total)
