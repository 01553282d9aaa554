"""The central invariant: expert parallelism over 2 and 4 gloo ranks gives the outputs, input
gradients, parameter gradients, aux losses and stats of the single-process layer holding all
experts (same weights) — for every gate, every expert kind, dropless and with capacity, and with
today's architectures' features on (shared experts, group- and node-limited routing, routed
scaling, router bias, softmax after top-k, scaled inputs, the clamped SwiGLU, sequence-wise and
global-batch balance) under plain EP, copies and the pairwise schedule."""

from __future__ import annotations

import copy
import itertools
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moeflow import MoELayer
from moeflow.core.parallel import dense_parameters
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology

from .equivalence import TOL, D, ForcedCopies, H, forward_backward, inputs
from .multirank_fsmoe import check_hierarchical_dispatch, check_wire_compression
from .multirank_layer_layouts import (
    check_balance_state_is_replicated,
    check_global_batch_balance,
    check_layout,
    check_no_wasted_work,
    check_node_limited,
)


def _check_config(
    rank,
    world,
    group,
    group_ranks,
    *,
    gate,
    expert,
    capacity,
    experts_per_rank,
    tokens,
    seed,
    strategy="ep",
    node_of=None,
    schedule="sync",
    group_size=None,
    gate_options=None,
    top_k=None,
    **layer_kwargs,
):
    """EP over `group` (ranks `group_ranks`) against a local single-process reference."""
    num_experts = experts_per_rank * len(group_ranks)
    top_k = top_k or (1 if gate == "switch" else 2)

    def build(**axes):  # the same seed: the same weights, whatever the axes
        torch.manual_seed(seed)
        return MoELayer(
            D,
            H,
            num_experts,
            top_k=top_k,
            gate=gate,
            expert=expert,
            capacity_factor=capacity,
            balance_weight=0.1,
            z_loss_weight=0.01,
            gate_options=gate_options,
            **layer_kwargs,
            **axes,
        )

    ref = build()
    options = {"group_size": group_size} if group_size else None
    ep = build(strategy=strategy, schedule=schedule, schedule_options=options, node_of=node_of)
    ep.to_expert_parallel(group)
    me = group_ranks.index(rank)
    xs, gs = inputs(len(group_ranks), tokens, seed + 1)

    ref_out = [forward_backward(ref, xs[r], gs[r], 100 + r) for r in range(len(group_ranks))]
    y, x_grad, aux, stats = forward_backward(ep, xs[me], gs[me], 100 + me)
    what = (
        f"gate={gate} expert={expert} capacity={capacity} E/rank={experts_per_rank} rank={rank} "
        f"strategy={strategy} placement={stats.placement} schedule={schedule} group_size={group_size} "
        f"gate_options={gate_options} {layer_kwargs}"
    )
    torch.testing.assert_close(y, ref_out[me][0], **TOL, msg=lambda m: f"output {what}: {m}")
    torch.testing.assert_close(x_grad, ref_out[me][1], **TOL, msg=lambda m: f"input grad {what}: {m}")
    torch.testing.assert_close(aux, ref_out[me][2], **TOL, msg=lambda m: f"aux loss {what}: {m}")
    assert stats.dropped == ref_out[me][3].dropped, what
    if stats.placement.is_owners_only():
        owner_of = np.arange(num_experts) // experts_per_rank
        expected = [int(ref_out[me][3].flow[0, owner_of == d].sum()) * D * 4 * (d != me) for d in range(world)]
        assert stats.bytes_sent.tolist() == expected, what
    ref_flow = torch.cat([o[3].flow for o in ref_out])
    assert torch.equal(stats.flow, ref_flow), f"flow {what}"
    lo = me * experts_per_rank
    if stats.placement.is_owners_only():
        per_rank_loads = ref_flow.view(len(group_ranks), -1, experts_per_rank).sum((0, 2))
        assert torch.equal(stats.device_loads, per_rank_loads)
    assert int(stats.device_loads.sum()) == int(ref_flow.sum())
    ref_params = dict(ref.named_parameters())
    for name, p in dense_parameters(ep):  # gate, shared experts: each rank holds its tokens' share
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        torch.testing.assert_close(grad, ref_params[name].grad, **TOL, msg=lambda m, n=name: f"{n} grad {what}: {m}")
    for name, p in ep.experts.named_parameters():
        ref_grad = dict(ref.experts.named_parameters())[name].grad[lo : lo + experts_per_rank]
        torch.testing.assert_close(p.grad, ref_grad, **TOL, msg=lambda m, n=name: f"experts.{n} grad {what}: {m}")


def _check_shadow_strategy(rank, world):
    """strategy="shadow" with a real cost model on skewed routing: the planner shadows the hot
    expert, and outputs, gradients and the optimizer step equal plain EP's."""
    cost_model = CostModel(Topology.homogeneous(world, 1e8), gemm_flops_per_s=1e8)
    torch.manual_seed(11)
    full = MoELayer(D, H, 2 * world, top_k=2, balance_weight=0.1)
    with torch.no_grad():
        full.gate.weight[3] += 2.0  # expert 3 becomes hot for inputs with positive features
    ep = copy.deepcopy(full).to_expert_parallel(dist.group.WORLD)
    shadow = MoELayer(D, H, 2 * world, top_k=2, balance_weight=0.1, strategy="shadow", cost_model=cost_model)
    shadow.load_state_dict(full.state_dict())
    shadow.to_expert_parallel(dist.group.WORLD)
    x = torch.rand(64, D, generator=torch.Generator().manual_seed(rank)) + 0.5
    g = torch.randn(64, D, generator=torch.Generator().manual_seed(100 + rank))
    optimizers = [torch.optim.Adam(m.parameters(), lr=0.1) for m in (ep, shadow)]
    for step in range(2):
        outs = []
        for layer, opt in zip((ep, shadow), optimizers):
            opt.zero_grad()
            xi = x.clone().requires_grad_()
            y = layer(xi)
            ((y * g).sum() + layer.aux_loss).backward()
            outs.append((y.detach(), xi.grad))
            opt.step()
        torch.testing.assert_close(outs[1][0], outs[0][0], **TOL)
        torch.testing.assert_close(outs[1][1], outs[0][1], **TOL)
        assert 3 in shadow.planner.last.shadowed, shadow.planner.last
        assert shadow.stats.placement.holders_EW[3].all()
        sent = torch.stack([shadow.stats.bytes_sent.sum(), ep.stats.bytes_sent.sum()])
        dist.all_reduce(sent)
        assert sent[0] < sent[1], f"bytes on the network: shadow {sent[0]}, ep {sent[1]}"
        for (name, p_ep), p_sh in zip(ep.named_parameters(), shadow.parameters()):
            torch.testing.assert_close(p_sh, p_ep, **TOL, msg=lambda m, n=name, s=step: f"{n} after step {s}: {m}")


def _equivalence_body(rank, world):
    for ep_size in (world, 2, 1) if world == 4 else (world, 1):
        check_layout(rank, world, ep_size)
    check_balance_state_is_replicated(rank, world)
    check_no_wasted_work(rank, world)
    check_wire_compression(rank, world)
    check_hierarchical_dispatch(rank, world)
    group = dist.group.WORLD
    ranks = list(range(world))
    uneven = [5, 0, 9, 3][:world] if world == 4 else [7, 0]  # a rank that sends nothing
    configs = list(itertools.product(["topk", "switch", "noisy_topk"], ["ffn", "swiglu"], [None, 1.0], [1, 2]))
    # The gate zoo (FSMoE §2.1): each routing function under EP equals the single-process layer on
    # each rank's own tokens; expert choice sizes its picks by the capacity factor, slots never drop.
    configs += itertools.product(["sigmoid", "xmoe", "expert_choice"], ["ffn", "swiglu"], [None, 1.5], [1, 2])
    configs += itertools.product(["soft"], ["ffn", "swiglu"], [None], [1, 2])
    for i, (gate, expert, capacity, per_rank) in enumerate(configs):
        tokens = uneven if i % 4 == 0 else [6 + 3 * r for r in ranks]
        _check_config(
            rank,
            world,
            group,
            ranks,
            gate=gate,
            expert=expert,
            capacity=capacity,
            experts_per_rank=per_rank,
            tokens=tokens,
            seed=10 * i,
            gate_options={"slots_per_expert": per_rank} if gate == "soft" else None,
        )

    # Placements with copies (the shadowing / Pro-Prophet / Hecate execution path): forced sets,
    # everything everywhere, with and without a node layout, dropless and with capacity. Node
    # layouts that span nodes send everywhere-copies through the two-level tree, even and uneven.
    layouts = [[r // 2 for r in ranks], [min(r, 1) for r in ranks]]
    strategies = [ForcedCopies(1, 0.3), ForcedCopies(2, 1.0), ForcedCopies(3, 0.5)]
    cases = itertools.product(strategies, ["ffn", "swiglu"], [None, 1.0], [1, 2])
    for i, (strategy, expert, capacity, per_rank) in enumerate(cases):
        _check_config(
            rank,
            world,
            group,
            ranks,
            gate="topk",
            expert=expert,
            capacity=capacity,
            experts_per_rank=per_rank,
            tokens=uneven if i % 3 == 0 else [8] * world,
            seed=500 + i,
            strategy=strategy,
            node_of=layouts[i // 2 % 2] if i % 2 else None,
        )

    # Planners work on the flow of any gate: copies under expert choice and slots, sync and pairwise.
    for i, (gate, schedule) in enumerate([("expert_choice", "sync"), ("soft", "pairwise"), ("xmoe", "pairwise")]):
        _check_config(
            rank,
            world,
            group,
            ranks,
            gate=gate,
            expert="ffn",
            capacity=None,
            experts_per_rank=2,
            tokens=uneven,
            seed=600 + i,
            strategy=ForcedCopies(20 + i, 0.5),
            node_of=layouts[i % 2],
            schedule=schedule,
        )

    _check_shadow_strategy(rank, world)
    _check_architectures(rank, world, uneven, layouts)
    check_node_limited(rank, world)
    check_global_batch_balance(rank, world)

    # Hierarchical gate: each rank's cross-node assignments never exceed L (all k choices).
    spec = [[r for r in ranks if r // 2 == n] for n in range(max(1, world // 2))] if world > 2 else [[0], [1]]
    cost_model = CostModel(Topology(spec, [1e9, 4e9]), gemm_flops_per_s=1e9)
    torch.manual_seed(21)
    layer = MoELayer(D, H, 2 * world, top_k=2, gate="hierarchical", cost_model=cost_model)
    layer.to_expert_parallel(group)
    tokens = 40
    layer(torch.randn(tokens, D, generator=torch.Generator().manual_seed(rank)))
    node_of = cost_model.topology.node_of
    remote_E = torch.tensor([node_of[e // 2] != node_of[rank] for e in range(2 * world)])
    limit = math.floor(layer.gate.cross_node_ratio[rank] * 2 * tokens)
    assert int(layer.stats.flow[rank][remote_E].sum()) <= limit
    assert layer.stats.redirected >= 0

    # FasterMoE smart schedule: every group size, alone and with copies, dropless and capacity,
    # uneven tokens and a rank with none.
    sizes = [g for g in (1, 2, 4) if world % g == 0]
    cases = itertools.product(sizes, [None, ForcedCopies(7, 0.4), ForcedCopies(8, 1.0)], [None, 1.0])
    for i, (group_size, strategy, capacity) in enumerate(cases):
        _check_config(
            rank,
            world,
            group,
            ranks,
            gate="topk",
            expert="swiglu" if i % 2 else "ffn",
            capacity=capacity,
            experts_per_rank=1 + i % 2,
            tokens=uneven if i % 3 == 0 else [9] * world,
            seed=700 + i,
            strategy=strategy or "ep",
            node_of=layouts[i // 2 % 2] if i % 2 else None,
            schedule="pairwise",
            group_size=group_size if i % 4 else None,
        )

    # An expert that receives nothing: route everything to expert 0 by a huge gate bias.
    torch.manual_seed(5)
    full = MoELayer(D, H, 2 * world, top_k=1, gate="switch")
    with torch.no_grad():
        full.gate.weight.zero_()
        full.gate.weight[0] = 10.0
    ep = copy.deepcopy(full).to_expert_parallel(group)
    x = torch.rand(4, D) + 0.1
    y = ep(x)
    assert ep.stats.expert_counts.tolist() == [4 * world] + [0] * (2 * world - 1)
    torch.testing.assert_close(y, full(x), **TOL)
    y.sum().backward()
    if rank != 0:
        assert all(float(p.grad.abs().sum()) == 0.0 for p in ep.experts.parameters())

    # bf16 runs end to end and stays close to fp32.
    torch.manual_seed(6)
    full = MoELayer(D, H, 2 * world, top_k=2)
    ep = copy.deepcopy(full).to_expert_parallel(group)
    x = torch.randn(8, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16 = ep(x)
    assert y16.dtype == torch.float32
    torch.testing.assert_close(y16, full(x), rtol=0.05, atol=0.05)


def _check_architectures(rank, world, uneven, layouts):
    """Today's architectures' features (docs/architectures.md) keep every rank equal to one process
    under plain EP, forced copies (the shadowing / Hecate path) and the pairwise schedule."""
    ranks = list(range(world))
    per_rank = 2
    n_group = world  # E = 2·W experts in W groups of 2
    deepseek = dict(
        gate="sigmoid",
        gate_options={"n_group": n_group, "topk_group": max(1, n_group // 2), "normalize": True,
                      "scaling_factor": 2.5, "bias": True},
        num_shared_experts=1,
        expert="swiglu",
        balance="sequence",
    )  # fmt: skip
    gpt_oss = dict(
        gate="topk",
        gate_options={"softmax_after_topk": True, "bias": True},
        expert="clamped_swiglu",
        expert_options={"limit": 0.5},
    )
    llama4 = dict(gate="sigmoid", top_k=1, gate_options={"scale_inputs": True}, num_shared_experts=1, expert="swiglu")
    v2 = dict(gate="topk", gate_options={"n_group": n_group, "topk_group": 1, "group_score_topn": 1},
              num_shared_experts=2, shared_d_hidden=24, expert="ffn", capacity=1.0)  # fmt: skip
    runs = [
        (deepseek, "ep", "sync"),
        (deepseek, ForcedCopies(31, 0.5), "sync"),
        (deepseek, ForcedCopies(32, 1.0), "pairwise"),
        (gpt_oss, "ep", "pairwise"),
        (gpt_oss, ForcedCopies(33, 0.5), "sync"),
        (llama4, ForcedCopies(34, 0.5), "sync"),
        (v2, ForcedCopies(35, 0.4), "pairwise"),
    ]
    for i, (arch, strategy, schedule) in enumerate(runs):
        kwargs = dict(arch)
        _check_config(
            rank,
            world,
            dist.group.WORLD,
            ranks,
            gate=kwargs.pop("gate"),
            expert=kwargs.pop("expert"),
            capacity=kwargs.pop("capacity", None),
            experts_per_rank=per_rank,
            tokens=uneven if i % 3 == 0 else [8] * world,
            seed=800 + i,
            strategy=strategy,
            schedule=schedule,
            node_of=layouts[i % 2] if not isinstance(strategy, str) else None,
            **kwargs,
        )


@pytest.mark.multirank
@pytest.mark.spawned(body=_equivalence_body)
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_single_process(world, shared_spawns):
    """Also: DP × EP layouts (all ep sizes dividing world) give the global-mean gradients."""
    shared_spawns.run(_equivalence_body, world)
