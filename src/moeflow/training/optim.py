"""AdamW with decoupled weight decay on matrices only, linear warmup + cosine decay, and clipping
to the global gradient norm over dense and sharded expert gradients (EP shards, ESP hidden slices)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from moeflow.core.expert_sharding import hidden_slice_parameters
from moeflow.core.parallel import ParallelLayout, dense_parameters, expert_parameters


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
    return param.dim() < 2 or leaf in ("bias", "b1", "b13", "b2")


def build_optimizer(model: torch.nn.Module, cfg) -> torch.optim.AdamW:
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not _is_no_decay(n, p)], "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in named if _is_no_decay(n, p)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def clip_gradients(model: torch.nn.Module, layout: ParallelLayout, max_norm: float) -> float:
    """Clip to the global gradient norm and return it (before clipping).

    Dense gradients are identical on every rank after all_reduce_gradients; expert gradients are
    sharded, so their squared norms are summed over the EP group (each expert counted once). Under
    expert sharding (FSMoE §3) the hidden slices (w1 or w13 columns, their biases, w2 rows) differ on every ESP
    member, so their squares are summed over the ESP group first, while `b2`, whole and identical on
    every member, counts once. Expert-DP replicas hold the same gradients: never summed over them.
    """
    sliced_ids = hidden_slice_parameters(model)
    experts = [p for _, p in expert_parameters(model) if p.grad is not None]
    dense = [p.grad for _, p in dense_parameters(model) if p.grad is not None]
    sliced = [p.grad for p in experts if id(p) in sliced_ids]
    whole = [p.grad for p in experts if id(p) not in sliced_ids]
    device = next(model.parameters()).device

    def squared(grads: list[torch.Tensor]) -> torch.Tensor:
        return torch.nn.utils.get_total_norm(grads).float() ** 2 if grads else torch.zeros((), device=device)

    dense_sq, sliced_sq, whole_sq = squared(dense), squared(sliced), squared(whole)
    if layout.esp_size > 1:
        dist.all_reduce(sliced_sq, group=layout.esp_group)
    expert_sq = sliced_sq + whole_sq
    if layout.ep_size > 1:
        dist.all_reduce(expert_sq, group=layout.ep_group)
    total = (dense_sq + expert_sq).sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_([p for p in model.parameters() if p.grad is not None], max_norm, total)
    return float(total)
