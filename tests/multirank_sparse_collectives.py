"""The sparse-collective engine (`core.sparse_collectives`) on gloo ranks: every copy of an expert
arrives equal to its owner's weights and every holder's gradient is summed into the owner's, with
the ranks as one node (copies straight from the owner), as 1 × 2 or 2 × 2 nodes (trees: one
transfer into each node, relays fanning out; experts held everywhere through the same trees on
gloo), for partial and full holder sets, bundles of several experts, and a rank that owns no
expert and holds no copy; and the block-wise prefetch sending the trees stage by stage (a
two-block model with copies planned ahead equals plain EP). The tree's results equal the
point-to-point ones exactly in forward and within float tolerance in backward (the sums run in
another order), and repeat bit for bit. The chunk pipeline (`core.copy_rounds`, Hecate §4.1) gives
the whole messages' copies and owners' gradients bit for bit for 2, 3 and 8 pieces, messages
narrower than the pieces included (on 2 × 2 nodes; on 2 ranks no tree has a second stage and the
messages go whole).

Shape suffixes: E experts, W ranks, J experts held by this rank, X the per-expert dims of a parameter (`SHAPES`)."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from moeflow.core.parallel import ParallelLayout
from moeflow.core.placement import Placement
from moeflow.core.sparse_collectives import _transfers, materialize
from moeflow.model_step import all_reduce_gradients
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.strategies.planners.base import PlanAheadPlanner
from moeflow.strategies.prefetch import BlockPrefetch

from .equivalence import TOL
from .multirank_prophet import TwoBlocks, _batch

SHAPES = {"w": (3, 4), "b": (5,)}
"""Per-expert parameter shapes (the X dims)."""
NARROW = {"w": (2,), "b": (1,)}
"""Per-expert shapes of a message 3 columns wide: narrower than 8 pieces (empty pieces)."""
CHUNKS = (2, 3, 8)


def _cases(world: int) -> list[Placement]:
    """Placements over `2·world` experts: partial sets within and across nodes, several experts of
    one owner with one holder set (a bundle), everything everywhere, and an owner map that leaves
    rank 1 without experts and (in the last case) without copies."""
    E = 2 * world
    ep = Placement.expert_parallel(E, world)
    out = []
    holders = np.zeros((E, world), dtype=bool)
    holders[0, world // 2 :] = True  # expert 0 (rank 0) on the other node's ranks
    holders[E - 1, 0] = True  # the last expert back to rank 0
    if world == 4:
        holders[2, [0, 2, 3]] = True  # rank 1's expert to its node-mate and both ranks of node 1
        holders[3, [0, 2, 3]] = True  # ... with expert 2: one bundle
        holders[5, :] = True  # rank 2's expert everywhere
    out.append(ep.with_holders(holders))
    out.append(ep.with_holders(np.ones((E, world), dtype=bool)))  # FasterMoE shadowing of all
    owner = np.arange(E) % world
    owner[owner == 1] = 0  # rank 1 owns nothing
    none = Placement.owners_only(owner, world)
    extra = np.zeros((E, world), dtype=bool)
    extra[:, 0] = True
    extra[0, world - 1] = True
    if world == 4:
        extra[1, 2:] = True
        extra[2, :] = True
    out.append(none.with_holders(extra))  # rank 1 holds no copy either (but expert 2 when world 4)
    if world == 4:
        extra[2, 1] = False
    out.append(none.with_holders(extra))
    return out


def _run(placement: Placement, node_of, weights_E: dict, grads_EW: dict, me: int, chunks: int = 1):
    """Held weights and the owner's gradients of the local rows under `node_of`."""
    owned = [int(e) for e in np.flatnonzero(placement.owner_E == me)]
    local = {n: w[owned].clone().requires_grad_() for n, w in weights_E.items()}
    held_J = np.flatnonzero(placement.holders_EW[:, me])
    held = materialize(local, placement, dist.group.WORLD, owned, held_J, node_of, chunks)
    loss = sum((held[n] * grads_EW[n][held_J, me]).sum() for n in held)
    loss.backward()
    return {n: h.detach() for n, h in held.items()}, {n: p.grad for n, p in local.items()}, owned, held_J


def check_sparse_collectives(rank: int, world: int) -> None:
    layouts = [None, [r * 2 // world for r in range(world)]]  # one node; 1 x 2 or 2 x 2
    inter_node_edges, pipelined = 0, 0
    for c, placement in enumerate(_cases(world)):
        E = placement.num_experts
        gen = torch.Generator().manual_seed(c)
        weights_E = {n: torch.randn((E, *s), generator=gen) for n, s in SHAPES.items()}
        grads_EW = {n: torch.randn((E, world, *s), generator=gen) for n, s in SHAPES.items()}
        results = []
        for node_of in layouts:
            held, grads, owned, held_J = _run(placement, node_of, weights_E, grads_EW, rank)
            again = _run(placement, node_of, weights_E, grads_EW, rank)
            for n in SHAPES:
                torch.testing.assert_close(held[n], weights_E[n][held_J], rtol=0, atol=0)
                assert torch.equal(grads[n], again[1][n]), f"case {c} {n}: not deterministic"
                expected = (
                    grads_EW[n]
                    * torch.from_numpy(placement.holders_EW).reshape(E, world, 1, *[1] * (len(SHAPES[n]) - 1))
                ).sum(1)
                torch.testing.assert_close(
                    grads[n], expected[owned], **TOL, msg=lambda m, c=c, n=n: f"case {c} {n}: {m}"
                )
            results.append((held, grads))
            plan = _transfers(placement, rank, node_of, "gloo")
            if node_of is not None:
                inter_node_edges += sum(
                    node_of[s] != node_of[d] for stage in plan.stages for _, s, d in stage if s == rank
                )
        for n in SHAPES:  # the trees give the point-to-point results
            assert torch.equal(results[0][0][n], results[1][0][n])
            torch.testing.assert_close(results[0][1][n], results[1][1][n], **TOL)
        pipelined += _check_chunks(placement, layouts[1], weights_E, grads_EW, rank, c)
    # Not vacuous: copies crossed nodes through the trees; each (bundle, node) entered once; on
    # 2 x 2 nodes relays forwarded pieces.
    total = torch.tensor([float(inter_node_edges), float(pipelined)])
    dist.all_reduce(total)
    assert total[0].item() > 0
    assert (total[1].item() > 0) == (world == 4)


def _check_chunks(placement: Placement, node_of, weights_E: dict, grads_EW: dict, rank: int, case: int) -> int:
    """The chunk pipeline's copies and owners' gradients equal the whole messages' bit for bit, for
    `weights_E` and for messages narrower than the pieces; 1 if this rank sent or received pieces."""
    E, world = placement.num_experts, len(node_of)
    gen = torch.Generator().manual_seed(100 + case)
    narrow_E = {n: torch.randn((E, *s), generator=gen) for n, s in NARROW.items()}
    narrow_EW = {n: torch.randn((E, world, *s), generator=gen) for n, s in NARROW.items()}
    for weights, grads in ((weights_E, grads_EW), (narrow_E, narrow_EW)):
        whole_held, whole_grads, *_ = _run(placement, node_of, weights, grads, rank)
        for chunks in CHUNKS:
            held, grads_c, *_ = _run(placement, node_of, weights, grads, rank, chunks)
            for n in weights:
                what = f"case {case} {n} chunks {chunks} shape {tuple(weights[n].shape)}"
                assert torch.equal(held[n], whole_held[n]), what
                assert torch.equal(grads_c[n], whole_grads[n]), what
    plan = _transfers(placement, rank, node_of, "gloo", CHUNKS[-1])
    assert plan.chunks in (1, CHUNKS[-1])
    if world == 2:  # 2 x 1 nodes: no relay forwards anything, the messages go whole
        assert plan.chunks == 1
    return int(plan.chunks > 1 and any(plan.stages))


class AheadCopies(PlanAheadPlanner):
    """Plans ahead (so the block-wise prefetch sends its copies) a pseudo-random set of copies per
    call, the same on every rank: half the (expert, rank) pairs."""

    name = "ahead_copies"

    def __init__(self, seed: int) -> None:
        super().__init__(window=1, background=False)
        self.seed, self.calls = seed, 0

    def search(self, flow_WE, placement, cost_model):
        self.calls += 1
        return _ahead, (placement, self.seed + self.calls)


def _ahead(placement: Placement, seed: int):
    rng = np.random.default_rng(seed)
    return placement.with_holders(rng.random(placement.holders_EW.shape) < 0.5), None


def check_prefetched_trees(rank: int, world: int) -> None:
    nodes = [list(range(world // 2)), list(range(world // 2, world))]
    cost_model = CostModel(Topology(nodes, [1e9, 1e10]), gemm_flops_per_s=1e7)
    layout = ParallelLayout(ep_size=world)
    models = {"ep": TwoBlocks(world, "ep", cost_model), "ahead": TwoBlocks(world, "ep", cost_model)}
    models["ahead"].moe1.planner, models["ahead"].moe2.planner = AheadCopies(1), AheadCopies(50)
    prefetch = BlockPrefetch([models["ahead"].moe1, models["ahead"].moe2])
    relayed = 0
    for it in range(4):
        x, g = _batch(rank, world, it)
        results = {}
        for name, model in models.items():
            xi = x.clone().requires_grad_()
            y = model(xi)
            ((y * g).sum() + model.aux_loss()).backward()
            all_reduce_gradients(model, layout)
            results[name] = (y.detach(), xi.grad, {n: p.grad.clone() for n, p in model.named_parameters()})
            model.zero_grad(set_to_none=True)
        for i in range(2):
            torch.testing.assert_close(results["ahead"][i], results["ep"][i], **TOL)
        for n, value in results["ep"][2].items():
            what = f"{n} it {it}"
            torch.testing.assert_close(results["ahead"][2][n], value, **TOL, msg=lambda m, w=what: f"{w}: {m}")
        plan = _transfers(models["ahead"].moe2.stats.placement, rank, cost_model.topology.node_of, "nccl")
        relayed += len(plan.stages[1])
    assert prefetch.steps == 4
    total = torch.tensor([float(relayed)])
    dist.all_reduce(total)
    assert total.item() > 0 or world == 2  # relays forwarded inside a node (2 x 2)
