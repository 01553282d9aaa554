"""Expert sharding (ESP, FSMoE §3) under real gloo collectives (run inside tests/test_esp.py's
spawn): DP × EP × ESP layouts give the single-process layer's outputs, input gradients, every
parameter gradient (the hidden slice of it) and one AdamW step — under `sync`, and under the
pipelined (forward and backward degrees differing, and `degree="auto"`, which the ESP members agree
on) and pairwise schedules."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from moeflow import MoELayer
from moeflow.core.expert_sharding import to_expert_sharding
from moeflow.core.parallel import ParallelLayout, dense_parameters, expert_parameters
from moeflow.model_step import all_reduce_gradients
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.strategies.schedules.pipeline_pricing import agree_over_esp

from .equivalence import TOL, D, H

HIDDEN_AXIS = {"w1": 2, "w3": 2, "b1": 1, "w2": 1}


def _expected_slice(name: str, full: torch.Tensor, layout: ParallelLayout, per_rank: int) -> torch.Tensor:
    rows = full[layout.ep_rank * per_rank : (layout.ep_rank + 1) * per_rank]
    key = name.rsplit(".", 1)[-1]
    if key in HIDDEN_AXIS:
        width = H // layout.esp_size
        rows = rows.narrow(HIDDEN_AXIS[key], layout.esp_rank * width, width)
    return rows


def check_layout(
    rank: int,
    world: int,
    ep_size: int,
    esp_size: int,
    expert: str,
    seed: int,
    schedule: str = "sync",
    options=None,
    cost_model=None,
) -> None:
    layout = ParallelLayout(ep_size=ep_size, esp_size=esp_size, d_hidden=H)
    num_experts = 2 * ep_size
    per_rank = num_experts // ep_size
    torch.manual_seed(seed)
    ref = MoELayer(
        D, H, num_experts, top_k=2, expert=expert, schedule=schedule, schedule_options=options, cost_model=cost_model
    )
    with torch.no_grad():  # non-zero biases, so that b1/b2 slicing is visible
        for name, p in ref.experts.named_parameters():
            if name.startswith("b"):
                p.normal_()
    sharded = copy.deepcopy(ref)
    sharded.to_expert_parallel(layout.ep_group)
    to_expert_sharding(sharded, layout.esp_group)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = [5, 0, 9, 3][:world] if world == 4 else [7, 4]
    xs = [torch.randn(n, D, generator=gen) for n in tokens]
    gs = [torch.randn(n, D, generator=gen) for n in tokens]

    # Reference: every rank's tokens through the single-process layer, loss = mean over ranks.
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x_refs = [x.clone().requires_grad_() for x in xs]
    y_refs = [ref(x) for x in x_refs]
    sum((y * g).sum() for y, g in zip(y_refs, gs)).div(world).backward()

    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    x = xs[rank].clone().requires_grad_()
    y = sharded(x)
    (y * gs[rank]).sum().backward()
    all_reduce_gradients(sharded, layout)

    torch.testing.assert_close(y, y_refs[rank].detach(), **TOL)
    torch.testing.assert_close(x.grad, x_refs[rank].grad * world, **TOL)  # its rank's loss, not the mean
    ref_params = dict(ref.named_parameters())
    for name, p in dense_parameters(sharded):
        torch.testing.assert_close(p.grad, ref_params[name].grad, **TOL)
    expert_names = [n for n, _ in expert_parameters(sharded)]
    assert expert_names, "no expert parameters"
    for name, p in expert_parameters(sharded):
        expected = _expected_slice(name, ref_params[name].grad, layout, per_rank)
        torch.testing.assert_close(p.grad, expected, **TOL, msg=f"{name} grad")
    ref_opt.step()
    opt.step()
    for name, p in expert_parameters(sharded):
        expected = _expected_slice(name, ref_params[name].detach(), layout, per_rank)
        torch.testing.assert_close(p.detach(), expected, **TOL, msg=f"{name} after AdamW")


def check_esp_members_agree_on_the_degree(ep_size: int) -> None:
    """Each member priced its own expert-parallel group's flow; the slowest member's choice per pass
    is taken by all (else the chunks' all-gathers pair up wrongly and the group hangs)."""
    layout = ParallelLayout(ep_size=ep_size, esp_size=2, d_hidden=H)
    m = layout.esp_rank
    mine = [SimpleNamespace(degree=1 + 3 * m, time_ms=10.0 + m), SimpleNamespace(degree=8 - 6 * m, time_ms=5.0 - m)]
    assert agree_over_esp(mine, layout.esp_group) == [4, 8]
    assert agree_over_esp(mine, None) == [mine[0].degree, mine[1].degree]


def check_bad_input(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match="esp_size=2 must divide d_hidden=7"):
        ParallelLayout(ep_size=1, esp_size=2, d_hidden=7)
    with pytest.raises(ValueError, match="esp_size=2 must divide the node size 3"):
        ParallelLayout(ep_size=1, esp_size=2, node_size=3)
    with pytest.raises(ValueError, match="esp_size=0"):
        ParallelLayout(ep_size=1, esp_size=0)
    with pytest.raises(ValueError, match=r"ep_size=1 · esp_size=3 does not divide world_size=\d"):
        ParallelLayout(ep_size=1, esp_size=3)


def esp_body(rank: int, world: int) -> None:
    layouts = [(1, 2)] if world == 2 else [(2, 2), (4, 1), (1, 2), (1, 4)]
    for i, (ep_size, esp_size) in enumerate(layouts):
        for expert in ("ffn", "swiglu"):
            check_layout(rank, world, ep_size, esp_size, expert, seed=10 + i)
    # The other schedules over sharded experts: each chunk's experts run over the ESP group.
    ep_size = world // 2
    check_layout(rank, world, ep_size, 2, "ffn", 20, "pipeline", {"forward_degree": 2, "backward_degree": 3})
    check_layout(rank, world, ep_size, 2, "swiglu", 21, "pairwise")
    check_esp_members_agree_on_the_degree(ep_size)
    if ep_size > 1:  # Algorithm 1 on each expert-parallel group's flow, then the ESP group agrees
        cost_model = CostModel(Topology.homogeneous(ep_size, 1e8), gemm_flops_per_s=1e9)
        check_layout(rank, world, ep_size, 2, "ffn", 22, "pipeline", {"degree": "auto"}, cost_model)
    check_bad_input(rank, world)
