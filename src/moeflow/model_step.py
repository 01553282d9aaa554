"""Once per optimizer step, over a model's MoE layers: gradients reduced over the parallel layout,
balance state moved, prefetched gradient sums landed, Hecate's shards re-balanced.

    loss.backward(); all_reduce_gradients(model, layout); optimizer.step()
    maybe_reshard(model, optimizer, step)   # FSSDP layers only (Hecate §4.3)
"""

from __future__ import annotations

import torch
from torch import nn

from moeflow.core.parallel import ParallelLayout, _all_reduce_mean, dense_parameters, expert_parameters
from moeflow.core.resharding import reshard_experts
from moeflow.layer import MoELayer
from moeflow.strategies.planners.fssdp import plan_resharding
from moeflow.strategies.prefetch import BlockPrefetch


def finish_prefetch(model: nn.Module) -> None:
    """Land the gradient sums of prefetched copies still in flight (`strategies.prefetch.BlockPrefetch`)
    before anything reads expert gradients; `all_reduce_gradients` calls it."""
    prefetches = {}
    for module in model.modules():
        if isinstance(module, MoELayer):
            prefetches.update({id(h): h for h in module.hooks if isinstance(h, BlockPrefetch)})
    for prefetch in prefetches.values():
        prefetch.finish()


def all_reduce_gradients(model: nn.Module, layout: ParallelLayout, dense: bool = True) -> None:
    """Once per optimizer step, after backward: make gradients those of the mean loss over the
    global batch, and move every MoE layer's balance state (`MoELayer.update_balance`).

    Each rank's loss is the mean over its own tokens. A dense parameter's gradient is the average
    over all ranks. An expert's gradient already sums every rank's contribution (the all-to-all
    backward brought them to the owner), so it is summed over its replicas only and divided by the
    same world size. Balance terms see the step's expert choices summed over the data-parallel
    replicas, so their state stays identical on every rank. ``dense=False``: the dense gradients
    were already averaged (``training.grad_buckets``).
    """
    finish_prefetch(model)
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.update_balance(layout.balance_group, layout.dp_size * layout.esp_size)
    experts = [p for _, p in expert_parameters(model)]
    for p in experts:  # every shard steps, even one without rows (Hecate §4.3): equal step counts
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if layout.world_size == 1:
        return
    if dense:
        _all_reduce_mean([p for _, p in dense_parameters(model)], None, layout.world_size)
    if layout.dp_size > 1:
        _all_reduce_mean(experts, layout.expert_dp_group, layout.world_size)
    else:
        for p in experts:
            if p.grad is not None:
                p.grad.div_(layout.world_size)


def fssdp_layers(model: nn.Module) -> list:
    """The MoE layers whose planner re-shards (Hecate's FSSDP), in module order."""
    return [
        m
        for m in model.modules()
        if isinstance(m, MoELayer) and m.planner.reshards_owners and m.planner.reshard_interval > 0
    ]


def maybe_reshard(model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int) -> int | None:
    """After optimizer step `step` (1-based): re-shard the model's FSSDP layers together when due
    (`strategies.planners.fssdp.plan_resharding`); returns the experts moved (None when not due).
    Every rank calls it at every step."""
    layers = [m for m in fssdp_layers(model) if m.group is not None and not m.cluster_mismatch]
    if not layers:
        return None
    world = layers[0].placement.world_size
    owner_LE = plan_resharding([m.planner for m in layers], layers[0].cost_model, world, layers[0].node_of, step)
    return None if owner_LE is None else reshard_experts(layers, owner_LE, optimizer)
