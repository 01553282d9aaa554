"""Checks run inside tests/test_layer_multirank.py's spawn, under real gloo collectives: node-limited
routing and global-batch balance under expert parallelism, balance state replicated over the
ranks that hold the same experts, no work wasted (one gradient path per parameter), and DP × EP
layouts giving the global-mean gradients of the single-process layer."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moeflow import MoELayer
from moeflow.core.parallel import ParallelLayout, dense_parameters, expert_parameters
from moeflow.model_step import all_reduce_gradients
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.routing.balance import GShardBalance

from .equivalence import TOL, D, ForcedCopies, H, forward_backward, inputs


def check_node_limited(rank, world):
    """Node-limited routing (groups = the layout's nodes): every token's experts lie on at most M
    nodes, and copies and the pairwise schedule give plain EP's outputs and gradients."""
    node_of = [r // 2 for r in range(world)] if world > 2 else [0, 1]
    experts = 2 * world
    x = torch.randn(12, D, generator=torch.Generator().manual_seed(50 + rank))
    g = torch.randn(12, D, generator=torch.Generator().manual_seed(60 + rank))
    results = []
    for strategy, schedule in (("ep", "sync"), (ForcedCopies(41, 0.5), "sync"), ("ep", "pairwise")):
        torch.manual_seed(40)
        layer = MoELayer(
            D, H, experts, top_k=2, gate="sigmoid", gate_options={"node_limited": 1}, node_of=node_of,
            strategy=strategy, schedule=schedule, num_shared_experts=1, balance_weight=0.1,
        ).to_expert_parallel(dist.group.WORLD)  # fmt: skip
        results.append(forward_backward(layer, x, g, 0)[:3] + (layer,))
    layer = results[0][3]
    routing = layer.gate(x, None, layer._routing_layout(rank))
    node_E = torch.tensor(node_of)[torch.arange(experts) // 2]
    nodes_T = node_E[routing.expert_A.view(2, -1)].t()
    assert (nodes_T[:, 0] == nodes_T[:, 1]).all(), "a token's experts span two nodes"
    for *values, other in results[1:]:
        for name, got, want in zip(("output", "input grad", "aux loss"), values, results[0][:3]):
            torch.testing.assert_close(got, want, **TOL, msg=lambda m, n=name, o=other: f"{n} {o.axes}: {m}")
        for (name, p), (_, q) in zip(other.named_parameters(), layer.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, n=name, o=other: f"{n} {o.axes}: {m}")


def check_global_batch_balance(rank, world):
    """`gshard` with `global_batch` under DP × EP: f_e from every rank's choices (the EP group's
    count exchange, then the replicas' all-reduce), P_e from this rank's tokens."""
    layout = ParallelLayout(ep_size=world // 2)
    torch.manual_seed(70)
    full = MoELayer(D, H, 4 * layout.ep_size, top_k=2, balance_weight=1.0, balance_options={"global_batch": True})
    layer = copy.deepcopy(full).to_expert_parallel(layout.ep_group)
    layer.balance_group = layout.balance_group
    xs = [torch.randn(5 + r, D, generator=torch.Generator().manual_seed(80 + r)) for r in range(world)]
    layer(xs[rank])
    counts_E = sum(torch.bincount(full.gate(x).expert_A, minlength=full.num_experts) for x in xs)
    want = full.balance.loss(full.gate(xs[rank]), None, counts_E)
    torch.testing.assert_close(layer.aux_loss, want, **TOL)
    local = GShardBalance(full.num_experts).loss(full.gate(xs[rank]))
    assert not torch.allclose(want, local), "the global and the local frequencies coincide: nothing tested"


def check_balance_state_is_replicated(rank, world):
    """DP × EP with a stateful balance term (TA-MoE steering): the step's choices are summed over
    the data-parallel replicas, so the steering table moves identically on every rank and equals
    the value computed from all replicas' choices — what the checkpoint keeps once."""
    ep_size = world // 2
    layout = ParallelLayout(ep_size=ep_size)
    cost_model = CostModel(Topology([[r] for r in range(ep_size)] if ep_size > 1 else [0], 1e9), 1e12)
    torch.manual_seed(4)
    layer = MoELayer(
        D,
        H,
        2 * ep_size,
        top_k=2,
        balance="ta_moe",
        balance_weight=0.1,
        cost_model=cost_model,
        balance_options={"steer_rate": 0.05, "steer_limit": 0.5},
    ).to_expert_parallel(layout.ep_group)
    x = torch.randn(24, D, generator=torch.Generator().manual_seed(40 + rank))  # every rank its own tokens
    layer(x).square().mean().backward()
    choices = layer.stats.choices.double()  # global over this rank's EP group
    all_reduce_gradients(layer, layout)
    tables = [torch.empty_like(layer.balance.bias_WE) for _ in range(world)]
    dist.all_gather(tables, layer.balance.bias_WE)
    assert all(torch.equal(tbl, tables[0]) for tbl in tables), "steering tables differ between ranks"
    replicas = [torch.empty_like(choices) for _ in range(world)]
    dist.all_gather(replicas, choices)
    mean_WE = torch.stack(replicas[layout.ep_rank :: ep_size]).mean(0)  # this EP rank's replicas
    target = torch.as_tensor(layer.balance.target(24), dtype=torch.float64)
    expected = 0.05 * torch.sign(target * mean_WE.sum(1, keepdim=True) / 2 - mean_WE)
    torch.testing.assert_close(layer.balance.bias_WE.double(), expected)


def _consumers(output: torch.Tensor, param: torch.Tensor) -> int:
    """Edges of the autograd graph of `output` that end at `param`'s gradient accumulator."""
    seen, edges, stack = set(), 0, [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for nxt, _ in node.next_functions:
            if nxt is not None and getattr(nxt, "variable", None) is param:
                edges += 1
            stack.append(nxt)
    return edges


def check_no_wasted_work(rank, world):
    """Copies and the pairwise backward do the work of what moves, not of everything held:
    one expert shadowed leaves the owner's parameters with one gradient path (not a full-size
    zero gradient beside the owned experts'), and each pairwise step's backward fills a buffer of
    its own group's rows only (each sent row once over all steps, not once per step)."""

    def shadow_expert_0(flow_WE, placement, cost_model=None):
        extra_EW = np.zeros_like(placement.holders_EW)
        extra_EW[0] = True
        return placement.with_holders(extra_EW)

    torch.manual_seed(8)
    layer = MoELayer(D, H, 2 * world, top_k=2, strategy=shadow_expert_0).to_expert_parallel(dist.group.WORLD)
    y = layer(torch.randn(12, D, generator=torch.Generator().manual_seed(rank)))
    assert layer.stats.placement.materialized_EW().sum() == world - 1  # expert 0 copied to every other rank
    for name, param in layer.experts.named_parameters():
        assert _consumers(y, param) == 1, f"{name}: one gradient path per parameter"
    y.sum().backward()

    from moeflow.strategies.schedules import pairwise

    rows_by_step = []
    start_backward = pairwise._Exchange.start_backward

    def spy(self, grad_RD):
        start_backward(self, grad_RD)
        rows_by_step.append((self.bwd_tag % 4, self.out.shape[0]))

    pairwise._Exchange.start_backward = spy
    try:
        torch.manual_seed(9)
        layer = MoELayer(D, H, 2 * world, top_k=2, schedule="pairwise", schedule_options={"group_size": 1})
        layer.to_expert_parallel(dist.group.WORLD)
        x = torch.randn(10, D, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        layer(x).sum().backward()
    finally:
        pairwise._Exchange.start_backward = start_backward
    s_rows = [rows for kind, rows in rows_by_step if kind == pairwise._S_BWD]
    assert len(s_rows) == world and sum(s_rows) == 10 * 2  # every sent row once (10 tokens × k)


def check_layout(rank, world, ep_size):
    """DP × EP: gradients after all_reduce_gradients equal the single-process gradients of the
    mean loss over all ranks' tokens (each rank's loss is the mean over its own tokens)."""
    layout = ParallelLayout(ep_size=ep_size)
    dp_size = world // ep_size
    assert (layout.dp_size, layout.ep_rank, layout.dp_rank) == (dp_size, rank % ep_size, rank // ep_size)
    assert (layout.ep_group is None) == (ep_size == 1)
    assert (layout.expert_dp_group is None) == (dp_size == 1)
    per_rank = 2
    torch.manual_seed(3)
    full = MoELayer(D, H, per_rank * ep_size, top_k=2, balance_weight=0.0)
    ref, ep = copy.deepcopy(full), copy.deepcopy(full).to_expert_parallel(layout.ep_group)
    xs, _ = inputs(world, [6, 4, 8, 5][:world], 9)
    for r in range(world):
        ref(xs[r]).square().mean().div(world).backward()
    ep(xs[rank]).square().mean().backward()
    all_reduce_gradients(ep, layout)
    ref_params = dict(ref.named_parameters())
    for name, p in dense_parameters(ep):
        torch.testing.assert_close(p.grad, ref_params[name].grad, **TOL)
    lo = layout.ep_rank * per_rank
    for name, p in expert_parameters(ep):
        torch.testing.assert_close(p.grad, ref_params[name].grad[lo : lo + per_rank], **TOL)
    bad = 3 if ep_size > 1 else 0
    with pytest.raises(ValueError, match=f"num_experts={bad} must be a positive multiple of ep_size={ep_size}"):
        layout.validate_experts(bad)
