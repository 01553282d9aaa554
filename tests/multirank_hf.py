"""Converted Hugging Face MoE models on gloo ranks (one spawn per world size, every check inside):
each architecture under plain expert parallelism and under a copying strategy (FasterMoE
shadowing with skewed routers, or forced copies) gives the single-process original's logits and
every gradient, each rank keeping its experts; `auto` does too; the export gathers the experts
back from their owners; an expert count the group does not divide is refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from moeflow.core.parallel import ParallelLayout
from moeflow.hf import SUPPORTED, convert_moe_blocks, export_moe_blocks
from moeflow.model_step import all_reduce_gradients
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology

from .equivalence import ForcedCopies
from .hf_models import experts_key, grads_by_original_name, moe_blocks, tiny

EXPERTS = 8
CASES = (
    ("mixtral", "ep"),
    ("mixtral", "shadow"),
    ("qwen2_moe", "ep"),
    ("qwen2_moe", "shadow"),
    ("qwen3_moe", "shadow"),
    ("qwen3_moe", "auto"),
    ("olmoe", "ep"),
    ("olmoe", ForcedCopies(7, 0.5)),
    ("deepseek_v3", "ep"),
    ("deepseek_v3", ForcedCopies(8, 0.5)),
    ("deepseek_v2", ForcedCopies(9, 0.5)),
    ("glm4_moe", "ep"),
    ("glm4_moe", "shadow"),
    ("gpt_oss", "ep"),
    ("gpt_oss", ForcedCopies(10, 0.5)),
    ("llama4", "ep"),
    ("llama4", "shadow"),
)
"""(architecture, strategy): every architecture under EP or shadowing, plus forced copies and auto."""


def _skew(model) -> None:
    """Rows ±3v in every router: experts 0 and 1 (both on rank 0) take every token's first choice,
    so shadowing finds copies worth making."""
    v = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        for block in moe_blocks(model):
            router = getattr(block, SUPPORTED[type(block).__name__].router)
            router.weight[0], router.weight[1] = 3 * v, -3 * v


def _check_case(rank: int, world: int, arch: str, strategy, cost_model, layout) -> None:
    # Without the auxiliary loss: it is nonlinear in the batch, so each rank's (over its own
    # tokens, as in any data-parallel run) is not the global batch's.
    ref = tiny(arch, output_router_logits=False, **{experts_key(arch): EXPERTS})
    _skew(ref)
    model = copy.deepcopy(ref)
    convert_moe_blocks(model, group=dist.group.WORLD, strategy=strategy, cost_model=cost_model)
    moe = [block.moe for block in moe_blocks(model)]
    assert moe[0].experts.expert_ids == list(range(rank * EXPERTS // world, (rank + 1) * EXPERTS // world))
    ids_all = torch.randint(0, 64, (world, 12), generator=torch.Generator().manual_seed(3))
    out_ref = ref(ids_all, labels=ids_all)  # the single-process original on the global batch
    out_ref.loss.backward()
    out = model(ids_all[rank : rank + 1], labels=ids_all[rank : rank + 1])  # this rank's row
    out.loss.backward()
    all_reduce_gradients(model, layout)  # mean over the ranks' rows = the global batch's mean
    logits = [torch.empty_like(out.logits) for _ in range(world)]
    dist.all_gather(logits, out.logits.detach().contiguous())
    label = f"{arch} {strategy} W={world}"
    torch.testing.assert_close(torch.cat(logits), out_ref.logits, rtol=1e-5, atol=1e-5, msg=lambda m: f"{label}: {m}")
    want = dict(ref.named_parameters())
    for name, (ids, grad) in grads_by_original_name(model).items():
        expected = want[name].grad if ids is None else want[name].grad[ids]
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n} {label}: {m}")
    copies = sum(int(m.stats.placement.materialized_EW().sum()) for m in moe)
    if strategy == "shadow" or not isinstance(strategy, str):
        assert copies > 0, f"{label}: the planner made no copies, so the shadowed path went untested"
    assert export_moe_blocks(model) == 2  # gathered from the owners
    for name, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), f"{name} {label}"


def check_hf_expert_parallel(rank: int, world: int) -> None:
    # A fast network and slow GEMMs: copying the hot experts pays, so shadowing copies.
    cost_model = CostModel(Topology.homogeneous(world, 1e12), gemm_flops_per_s=1e6)
    layout = ParallelLayout(ep_size=world)
    for arch, strategy in CASES:
        _check_case(rank, world, arch, strategy, cost_model, layout)
    with pytest.raises(ValueError, match=f"{world + 1} experts are not divisible by the expert-parallel group size"):
        convert_moe_blocks(tiny("olmoe", num_experts=world + 1), group=dist.group.WORLD)
