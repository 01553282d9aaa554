"""FSMoE part 1's transports under real collectives (run inside tests/test_layer_multirank.py's
spawn): hierarchical all-to-all equals plain all-to-all bit for bit, and bf16 on the wire equals
the single process with the same rounding."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist

from moeflow import MoELayer
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology

from .equivalence import TOL, D, ForcedCopies, H, forward_backward, inputs


def check_hierarchical_dispatch(rank, world):
    """dispatch="hierarchical" equals dispatch="a2a" bit for bit (fp32): node layouts contiguous,
    interleaved and degenerate, uneven tokens and a rank with none, capacity, copies of experts
    (forced and planned by the shadow planner); the combine and the backward go the same way back.
    Unequal nodes and the pairwise schedule are refused."""
    layouts = [[0, 0, 1, 1], [0, 1, 1, 0], [0, 1, 0, 1], [0, 0, 0, 0]] if world == 4 else [[0, 1], [0, 0]]
    uneven = [5, 0, 9, 3][:world] if world == 4 else [7, 0]
    cases = itertools.product(layouts, ["ep", ForcedCopies(3, 0.4)], [None, 1.0])
    for i, (node_of, strategy, capacity) in enumerate(cases):
        outs = []
        for dispatch in ("a2a", "hierarchical"):
            torch.manual_seed(40 + i)
            layer = MoELayer(
                D,
                H,
                2 * world,
                top_k=2,
                capacity_factor=capacity,
                strategy=strategy,
                dispatch=dispatch,
                node_of=node_of,
            ).to_expert_parallel(dist.group.WORLD)
            xs, gs = inputs(world, uneven if i % 2 else [6] * world, 90 + i)
            y, x_grad, _, stats = forward_backward(layer, xs[rank], gs[rank], 1)
            outs.append((y, x_grad, [p.grad.clone() for p in layer.parameters()], stats.flow))
        what = f"node_of={node_of} strategy={strategy} capacity={capacity}"
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), what
        assert all(torch.equal(a, b) for a, b in zip(outs[0][2], outs[1][2])), what
    # The shadow planner with a two-node cost model and the hierarchical transport.
    if world == 4:
        cost_model = CostModel(Topology([[0, 1], [2, 3]], [1e8, 1e10]), gemm_flops_per_s=1e8)
        outs = []
        for dispatch in ("a2a", "hierarchical"):
            torch.manual_seed(7)
            layer = MoELayer(D, H, 8, top_k=2, strategy="shadow", dispatch=dispatch, cost_model=cost_model)
            with torch.no_grad():
                layer.gate.weight[3] += 2.0
            layer.to_expert_parallel(dist.group.WORLD)
            x = torch.rand(32, D, generator=torch.Generator().manual_seed(rank)) + 0.5
            outs.append(forward_backward(layer, x, torch.ones(32, D), 2))
            assert layer.stats.placement.materialized_EW().any()
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        with pytest.raises(ValueError, match=r"nodes of equal size; node_of=\[0, 0, 0, 1\] has \[3, 1\]"):
            layer = MoELayer(D, H, 8, dispatch="hierarchical", node_of=[0, 0, 0, 1]).to_expert_parallel(
                dist.group.WORLD
            )
            layer(torch.randn(4, D))
    with pytest.raises(ValueError, match="schedule='pairwise'.*dispatch='a2a' only"):
        MoELayer(D, H, 2 * world, schedule="pairwise", dispatch="hierarchical")


def check_wire_compression(rank, world):
    """dispatch_dtype="bfloat16": the rows and the gradients cross the network in bf16 (half the
    bytes), EP with it equals the single process with it exactly (both round the same rows), and
    both stay within 2% of the fp32 layer's scale — with the sync and the pairwise schedule."""
    from moeflow.core import dispatch as dispatch_module

    sent_dtypes = []
    exchange = dispatch_module._exchange

    def spy(x, send_splits, recv_splits, group):
        sent_dtypes.append(x.dtype)
        return exchange(x, send_splits, recv_splits, group)

    dispatch_module._exchange = spy
    try:
        for schedule in ("sync", "pairwise"):
            torch.manual_seed(31)
            plain = MoELayer(D, H, 2 * world, top_k=2, schedule=schedule)
            wire = MoELayer(D, H, 2 * world, top_k=2, schedule=schedule, dispatch_dtype="bfloat16")
            wire.load_state_dict(plain.state_dict())
            ref = copy.deepcopy(wire)  # single process, same rounding
            for layer in (plain, wire):
                layer.to_expert_parallel(dist.group.WORLD)
            xs, gs = inputs(world, [7] * world, 77)
            outs = [forward_backward(layer, xs[rank], gs[rank], 5) for layer in (plain, wire)]
            ref_out = [forward_backward(ref, xs[r], gs[r], 5) for r in range(world)][rank]
            torch.testing.assert_close(outs[1][0], ref_out[0], **TOL)  # EP == one process, exactly
            torch.testing.assert_close(outs[1][1], ref_out[1], **TOL)
            scale = float(outs[0][0].abs().max())
            torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=0.02 * scale)
            torch.testing.assert_close(outs[1][1], outs[0][1], rtol=0, atol=0.02 * float(outs[0][1].abs().max()))
            assert torch.equal(wire.stats.bytes_sent * 2, plain.stats.bytes_sent)
    finally:
        dispatch_module._exchange = exchange
    assert torch.bfloat16 in sent_dtypes and torch.float32 in sent_dtypes  # forward and backward, both runs
