"""Hecate's FSSDP on gloo ranks: a two-block model trained with AdamW under skewed, changing routing,
across two re-shardings (Algorithm 2, then one that leaves rank 1 without any expert of layer 1),
equals plain EP after every step — outputs, input gradients, dense gradients, and per global expert
id the gradients, the weights and both Adam moments — without and with the block-wise prefetch,
with and without re-materialization, including a rank with zero tokens."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from moeflow.core.parallel import ParallelLayout
from moeflow.core.resharding import reshard_experts
from moeflow.model_step import all_reduce_gradients, maybe_reshard
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.strategies.prefetch import BlockPrefetch

from .equivalence import TOL
from .multirank_prophet import TwoBlocks, _batch

ITERATIONS = 6
VARIANTS = {"f": {}, "fp": {}, "fr": {"rematerialize": True}}
"""fssdp; fssdp with the block-wise prefetch; fssdp re-materializing its copies for backward."""


def _per_expert(layer, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full `[E, ...]` tensors from every rank's owned rows (each expert has one owner)."""
    out = {}
    for name, t in tensors.items():
        full = t.new_zeros((layer.num_experts, *t.shape[1:]))
        if layer.experts.expert_ids:
            full[torch.tensor(layer.experts.expert_ids)] = t
        dist.all_reduce(full)
        out[name] = full
    return out


def _expert_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Weights, gradients and Adam moments of every expert, keyed by layer, kind and global row."""
    state = {}
    for lname, layer in (("moe1", model.moe1), ("moe2", model.moe2)):
        for pname, p in layer.experts.named_parameters():
            entries = {"w": p.detach(), "g": p.grad}
            entries.update({k: v for k, v in optimizer.state.get(p, {}).items() if k.startswith("exp_avg")})
            state.update({f"{lname}.{pname}.{k}": v for k, v in _per_expert(layer, entries).items()})
    return state


def check_fssdp_equals_ep(rank: int, world: int) -> None:
    cost_model = CostModel(Topology.homogeneous(world, 1e10), gemm_flops_per_s=1e7)
    layout = ParallelLayout(ep_size=world)
    models = {"ep": TwoBlocks(world, "ep", cost_model)}
    for name, options in VARIANTS.items():
        models[name] = TwoBlocks(world, "fssdp", cost_model, {"reshard_interval": 2, **options})
    prefetch = BlockPrefetch([models["fp"].moe1, models["fp"].moe2])
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-2) for name, m in models.items()}
    copies, moved, empty = 0, 0, False
    for it in range(ITERATIONS):
        x, g = _batch(rank, world, it)
        results = {}
        for name, model in models.items():
            xi = x.clone().requires_grad_()
            y = model(xi)
            ((y * g).sum() + model.aux_loss()).backward()
            all_reduce_gradients(model, layout)
            dense = {n: p.grad.clone() for n, p in model.named_parameters() if ".experts." not in n}
            optimizers[name].step()
            results[name] = (y.detach(), xi.grad, dense, _expert_state(model, optimizers[name]))
            optimizers[name].zero_grad(set_to_none=True)
            if name != "ep" and it == 3:  # rank 1 left without any expert of layer 1
                pairs = [r for r in range(2, world) for _ in range(2)]
                owners = np.array([[0, 0, *pairs, 0, 0], [1, 1, 1, 1, *pairs]], dtype=np.int64)
                moved += reshard_experts([model.moe1, model.moe2], owners, optimizers[name])
                empty |= model.moe1.experts.num_local == 0
            elif name != "ep":
                moved += maybe_reshard(model, optimizers[name], it + 1) or 0
        for name in VARIANTS:
            what = f"{name} iteration {it} rank {rank} owners {models[name].moe1.placement.owner_E.tolist()}"
            for i, part in enumerate(("output", "x grad")):
                torch.testing.assert_close(
                    results[name][i], results["ep"][i], **TOL, msg=lambda m, w=what, p=part: f"{p} {w}: {m}"
                )
            for key in (2, 3):
                for n, value in results["ep"][key].items():
                    torch.testing.assert_close(
                        results[name][key][n], value, **TOL, msg=lambda m, n=n, w=what: f"{n} {w}: {m}"
                    )
            for layer in (models[name].moe1, models[name].moe2):
                copies += int(layer.stats.placement.materialized_EW().sum())
                if not layer.stats.placement.is_owners_only():  # freed after forward only when re-materializing
                    assert (layer.stats.held_bytes == 0) == (name == "fr"), (name, layer.stats.held_bytes)
    # Not vacuous: copies were made, shards moved, and a rank held no expert of layer 1.
    assert copies > 0 and moved > 0, (copies, moved)
    flags = torch.tensor([float(empty)])
    dist.all_reduce(flags)
    assert flags.item() >= 1.0
    assert prefetch.steps == ITERATIONS
