"""Once per optimizer step, over a model's MoE layers: gradients reduced over the parallel layout,
balance state moved, prefetched gradient sums landed, Hecate's shards re-balanced.

    loss.backward(); all_reduce_gradients(model, layout); optimizer.step()
    maybe_reshard(model, optimizer, step)   # FSSDP layers only (Hecate §4.3)

Under gradient accumulation (several micro-steps per optimizer step) `set_gradient_sync(model,
False)` before the micro-steps but the last keeps FSDP2's gradients local until then.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

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


def layer_groups(layer: MoELayer, layout: ParallelLayout) -> tuple:
    """(replicas, balance) groups of `layer`: the layout's dp and dp × esp groups when the layer is
    expert-parallel over the layout's EP group, else those the layer was given (Hecate's FSSDP over
    the whole dp × ep mesh has no replicas: `training.model.parallelize`)."""
    if layer.group is layout.ep_group:
        return layout.expert_dp_group, layout.balance_group
    return layer.replica_group, layer.balance_group


def all_reduce_gradients(model: nn.Module, layout: ParallelLayout, dense: bool = True) -> None:
    """Once per optimizer step, after backward (after the last micro-step's): make gradients those
    of the mean loss over the global batch, and move every MoE layer's balance state
    (`MoELayer.update_balance`).

    Each rank's loss is the mean over its own tokens. A dense parameter's gradient is the average
    over all ranks. An expert's gradient already sums every rank's contribution (the all-to-all
    backward brought them to the owner), so it is summed over its replicas only and divided by the
    same world size. Balance terms see the step's expert choices summed over the data-parallel
    replicas, so their state stays identical on every rank. ``dense=False``: the dense gradients
    were already averaged (``training.grad_buckets``). Parameters sharded by FSDP2 (DTensors,
    `training.model.parallelize`) were reduce-scattered by it with the same result: left alone.
    """
    finish_prefetch(model)
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    for layer in layers:
        layer.update_balance(layer_groups(layer, layout)[1])
    for _, p in expert_parameters(model):  # every shard steps, even one without rows (Hecate §4.3)
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if layout.world_size == 1:
        return
    if dense:
        plain = [p for _, p in dense_parameters(model) if not isinstance(p, DTensor)]
        _all_reduce_mean(plain, None, layout.world_size)
    by_group: dict[int, tuple] = {}
    for layer in layers:
        replicas = layer_groups(layer, layout)[0]
        plain = [p for p in layer.experts.parameters() if not isinstance(p, DTensor)]
        by_group.setdefault(id(replicas), (replicas, []))[1].extend(plain)
    for replicas, params in by_group.values():
        if replicas is not None:
            _all_reduce_mean(params, replicas, layout.world_size)
        else:
            for p in params:
                p.grad.div_(layout.world_size)


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """Gradient accumulation under FSDP2: `False` before the micro-steps whose gradients stay
    unsharded and local (no reduce-scatter), `True` before the last one (its backward reduces the
    sum). Replicated parameters need nothing: `all_reduce_gradients` runs once, after the last."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(sync, recurse=False)


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
