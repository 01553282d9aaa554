"""Initialising a model built on the meta device, so that each rank materializes only what it keeps
and every layout is the same function as the one-process model with the same seed.

    with torch.device("meta"):
        model = MoEGPT(cfg.model, cfg.moe)        # shapes only: nothing allocated
    parallelize(model, layout)                     # keep this rank's experts (and slices), FSDP2 shards
    model.to_empty(device=device)                  # allocate only those
    init_weights(model, seed, model.init_module)   # fill them

Values are a function of (seed, parameter name, global expert id), never of the layout or of the
order of construction:

- an expert is drawn whole (FULL hidden size, `GroupedExperts.initial_expert`) from a generator
  seeded by (seed, its module's name, its global id); a rank draws only the experts it keeps (with
  FSDP2, only the rows of its shard) and keeps the hidden slice it holds under expert sharding;
- every other module with parameters or buffers is initialised by `reset(module)` (the model's
  rule; by default the module's `reset_parameters()`) on full-size CPU tensors, under torch's RNG
  seeded by (seed, its name), one module at a time; a rank then keeps its FSDP2 shard of each
  (`torch.distributed.tensor.distribute_tensor` without communication). The transient is one
  module's parameters.

Draws happen on the CPU in fp32 whatever the device, so CPU and CUDA runs start alike.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from moeflow.core.expert_sharding import hidden_axis
from moeflow.core.experts import GroupedExperts
from moeflow.core.parallel import local_rows


def _seed(seed: int, name: str, index: int = -1) -> int:
    """A 63-bit seed from (seed, a name, an index): the same on every rank and in every layout."""
    entropy = [int(seed), zlib.crc32(name.encode()), index + 1]
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0] >> 1)


def _reset_parameters(module: nn.Module) -> None:
    module.reset_parameters()


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, reset: Callable[[nn.Module], None] = _reset_parameters) -> None:
    """Fill every parameter and buffer of `model` (after `to_empty`) as the module docstring says."""
    experts = {id(m) for m in model.modules() if isinstance(m, GroupedExperts)}
    for name, module in model.named_modules():
        if id(module) in experts:
            _init_experts(module, name, seed)
            continue
        own = [(n, t) for n, t in module.named_parameters(recurse=False)]
        own += [(n, t) for n, t in module.named_buffers(recurse=False)]
        if own:
            _init_module(module, name, own, seed, reset)


def _init_experts(experts: GroupedExperts, name: str, seed: int) -> None:
    params = dict(experts.named_parameters(recurse=False))
    rows = local_rows(next(iter(params.values())))
    locals_ = {n: p.to_local() if isinstance(p, DTensor) else p for n, p in params.items()}
    for i, row in enumerate(rows):
        expert = experts.expert_ids[row]
        full = experts.initial_expert(torch.Generator().manual_seed(_seed(seed, name, expert)))
        for pname, local in locals_.items():
            value = full[pname]
            axis = hidden_axis(experts, pname)
            if axis is not None:  # this ESP member's hidden slice (core.expert_sharding)
                value = value.narrow(axis - 1, experts.hidden_offset, experts.d_hidden)
            local[i].copy_(value)


def _init_module(module: nn.Module, name: str, own: list, seed: int, reset: Callable[[nn.Module], None]) -> None:
    """`reset(module)` on full-size CPU stand-ins of its own tensors, then each rank's part copied in."""
    full = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in own}
    saved_params, saved_buffers = dict(module._parameters), dict(module._buffers)
    for n, t in own:
        if n in saved_params:
            module._parameters[n] = nn.Parameter(full[n], requires_grad=t.requires_grad)
        else:
            module._buffers[n] = full[n]
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_seed(seed, name))
            try:
                reset(module)
            except AttributeError as exc:
                raise TypeError(
                    f"{type(module).__name__} {name!r} has parameters or buffers but no reset_parameters(): "
                    f"it cannot be initialised after a meta-device build ({exc})"
                ) from None
        values = {n: (module._parameters[n] if n in saved_params else module._buffers[n]) for n, _ in own}
    finally:
        module._parameters.clear()
        module._parameters.update(saved_params)
        module._buffers.clear()
        module._buffers.update(saved_buffers)
    for n, t in own:
        value = values[n].detach()
        if isinstance(t, DTensor):
            shard = distribute_tensor(value, t.device_mesh, t.placements, src_data_rank=None).to_local()
            t.to_local().copy_(shard)
        else:
            t.copy_(value)
