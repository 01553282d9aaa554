"""A converted Hugging Face MoE model on gloo ranks: expert parallelism (and FasterMoE shadowing)
gives the single-process original's logits and gradients, each rank keeping its experts; the
export gathers them back; an expert count the group does not divide is refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from moeflow.core.parallel import ParallelLayout, all_reduce_gradients
from moeflow.hf import convert_moe_blocks, export_moe_blocks
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology

from .equivalence import ForcedCopies
from .hf_models import grads_by_original_name, tiny


def check_hf_expert_parallel(rank: int, world: int) -> None:
    # Fast network, slow GEMMs: shadowing the hot experts pays, so the planner copies.
    cm = CostModel(Topology.homogeneous(world, 1e12), gemm_flops_per_s=1e6)
    layout = ParallelLayout(ep_size=world)
    # Shadowing where it finds nothing worth copying on these balanced tiny batches, and a planner
    # that forces copies, so the materialized path is exercised too.
    for arch, strategy in (("qwen2_moe", "ep"), ("mixtral", "shadow"), ("olmoe", ForcedCopies(7, 0.5))):
        # Without the auxiliary loss: it is nonlinear in the batch, so each rank's (over its own
        # tokens, as in any data-parallel run) is not the global batch's.
        experts = {"num_local_experts": 8} if arch == "mixtral" else {"num_experts": 8}
        ref = tiny(arch, output_router_logits=False, **experts)
        model = copy.deepcopy(ref)
        convert_moe_blocks(model, group=dist.group.WORLD, strategy=strategy, cost_model=cm)
        assert model.model.layers[0].mlp.moe.experts.num_local == 8 // world
        ids_all = torch.randint(0, 64, (world, 12), generator=torch.Generator().manual_seed(3))
        out_ref = ref(ids_all, labels=ids_all)  # the single-process original on the global batch
        out_ref.loss.backward()
        out = model(ids_all[rank : rank + 1], labels=ids_all[rank : rank + 1])  # this rank's row
        out.loss.backward()
        all_reduce_gradients(model, layout)  # mean over the ranks' rows = the global batch's mean
        logits = [torch.empty_like(out.logits) for _ in range(world)]
        dist.all_gather(logits, out.logits.detach().contiguous())
        torch.testing.assert_close(torch.cat(logits), out_ref.logits, rtol=1e-5, atol=1e-5)
        want = dict(ref.named_parameters())
        for name, (ids, grad) in grads_by_original_name(model).items():
            expected = want[name].grad if ids is None else want[name].grad[ids]
            torch.testing.assert_close(
                grad, expected, rtol=1e-4, atol=1e-6, msg=lambda m, n=name, a=arch: f"{n} {a}: {m}"
            )
        copies = sum(int(m.mlp.moe.stats.placement.materialized_EW().sum()) for m in model.model.layers)
        assert copies > 0 or isinstance(strategy, str)
        export_moe_blocks(model)  # gathered from the owners
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match=f"not divisible by the expert-parallel group size {world}"):
        convert_moe_blocks(tiny("olmoe", num_experts=world + 1), group=dist.group.WORLD)
