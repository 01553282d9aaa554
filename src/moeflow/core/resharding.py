"""Moving whole expert shards between ranks: Hecate's heterogeneous re-sharding (§4.3).

Every `reshard_interval` optimizer steps the FSSDP layers of a model are re-sharded together
(`strategies.planners.hecate.heterogeneous_sharding`, Algorithm 2, on each layer's estimated load —
the same global flows on every rank, so every rank computes the same plan without talking).
`reshard_experts` then moves each expert whose owner changes: its parameters *and* its optimizer
state (every state tensor shaped like the parameter: AdamW's moments; the scalar step count is the
same on every rank) travel in one batched point-to-point exchange, and each rank rebuilds its
parameters with the rows of the experts it now owns, in ascending global id — new `nn.Parameter`
objects (a leaf's autograd metadata keeps its old shape if only `.data` changes), put in the old
ones' places in the optimizer's parameter groups with their state. Their row count may be 0.
Training then continues as if nothing had moved: the same weights and
moments, keyed by the same global ids in checkpoints (tested against plain EP step by step).

Call between optimizer steps, with gradients cleared (`zero_grad(set_to_none=True)`): a gradient
would have to move too, and there is none to move then.

Shape suffixes: L MoE layers, E experts of one layer, W ranks of the expert-parallel group.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from moeflow.core import dispatch
from moeflow.core.copy_rounds import batched_p2p
from moeflow.core.placement import Placement


def _state_tensors(param: nn.Parameter, optimizer: torch.optim.Optimizer | None) -> list[str]:
    """Names of the optimizer state tensors that hold one row per expert (shaped like `param`)."""
    state = optimizer.state.get(param, {}) if optimizer is not None else {}
    return sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == param.shape)


def reshard_experts(layers: Sequence, owner_LE: np.ndarray, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Give every expert of `layers[l]` the owner `owner_LE[l, e]`, moving parameters and optimizer
    state (module docstring). Collective over the layers' group; returns the experts moved."""
    owner_LE = np.asarray(owner_LE, dtype=np.int64)
    if owner_LE.shape != (len(layers), layers[0].num_experts if layers else 0):
        raise ValueError(f"owner_LE shape {owner_LE.shape}: expected one row of owners per layer ({len(layers)})")
    sends, recvs, new_params, new_owners, moved = [], [], [], [], 0
    for layer, new_E in zip(layers, owner_LE):
        old_E, me = layer.placement.owner_E, dispatch.group_rank(layer.group)
        world = layer.placement.world_size
        if new_E.min() < 0 or new_E.max() >= world:
            raise ValueError(f"owner_LE has ranks outside [0, {world}): {new_E.tolist()}")
        if np.array_equal(old_E, new_E):
            continue
        experts, new_ids = layer.experts, np.flatnonzero(new_E == me).tolist()
        for name, param in experts.named_parameters():
            if param.grad is not None:
                raise ValueError(f"reshard_experts: {name} has a gradient; call after the step, with zero_grad()")
            keys = _state_tensors(param, optimizer)
            olds = [param.data] + [optimizer.state[param][k] for k in keys]
            news = [t.new_empty((len(new_ids), *t.shape[1:])) for t in olds]
            for row, e in enumerate(new_ids):
                if old_E[e] == me:
                    for old, new in zip(olds, news):
                        new[row].copy_(old[experts.row_of(e)])
                else:
                    recvs += [(int(old_E[e]), new[row], layer.group) for new in news]
            for e in np.flatnonzero((old_E == me) & (new_E != me)):
                sends += [(int(new_E[e]), old[experts.row_of(int(e))], layer.group) for old in olds]
            new_params.append((experts, name, param, keys, news))
        moved += int((old_E != new_E).sum())
        new_owners.append((layer, new_ids, new_E, world))
    groups = {id(g): g for *_, g in sends + recvs}
    for gid, group in groups.items():
        batched_p2p(
            [(peer, t) for peer, t, g in sends if id(g) == gid],
            [(peer, t) for peer, t, g in recvs if id(g) == gid],
            group,
        )
    for experts, name, old, keys, news in new_params:
        new = nn.Parameter(news[0], requires_grad=old.requires_grad)
        setattr(experts, name, new)
        if optimizer is not None:
            _replace_in_optimizer(optimizer, old, new, dict(zip(keys, news[1:])))
    for layer, new_ids, new_E, world in new_owners:
        layer.experts.expert_ids = new_ids
        layer.rebind(Placement.owners_only(new_E, world))
    return moved


def _replace_in_optimizer(optimizer: torch.optim.Optimizer, old: nn.Parameter, new: nn.Parameter, rows: dict) -> None:
    """`new` takes `old`'s place in its parameter group, with `old`'s state (per-expert tensors
    replaced by the moved `rows`, the rest — AdamW's step count — kept)."""
    for group in optimizer.param_groups:
        group["params"] = [new if p is old else p for p in group["params"]]
    if old in optimizer.state:
        optimizer.state[new] = {**optimizer.state.pop(old), **rows}
