"""Pro-Prophet (and the EPLB baseline, and the `auto` arbiter) on gloo ranks: a two-block model trained for several
iterations under skewed, changing routing equals plain EP — outputs, input gradients, every
parameter gradient and the optimizer step — without and with the block-wise prefetch (Algorithm 2),
including iterations where the prediction is wrong, copies on ranks that then receive none of the
expert's tokens, and a rank with zero tokens."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moeflow import MoELayer
from moeflow.core.parallel import ParallelLayout
from moeflow.core.placement import dispatch_counts
from moeflow.model_step import all_reduce_gradients
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.strategies import timing
from moeflow.strategies.prefetch import BlockPrefetch

from .equivalence import TOL, D, H

ITERATIONS = 6
HOT = [3, 3, 3, 1, 1, 0]
"""The expert most inputs of layer 1 prefer, per iteration: iteration 3 and 5 are mispredicted."""


class TwoBlocks(nn.Module):
    """MoE → dense → MoE, residual: two blocks, so layer 2's copies can be prefetched in block 1."""

    def __init__(self, world: int, strategy: str, cost_model, strategy_options=None, **schedule) -> None:
        super().__init__()
        torch.manual_seed(5)
        kw = dict(
            top_k=2,
            balance_weight=0.01,
            strategy=strategy,
            cost_model=cost_model,
            strategy_options=strategy_options,
            **schedule,
        )
        self.moe1 = MoELayer(D, H, 2 * world, **kw)
        self.mid = nn.Linear(D, D)
        self.moe2 = MoELayer(D, H, 2 * world, **kw)
        with torch.no_grad():  # routing follows the input's direction: HOT[i] decides who is hot
            self.moe1.gate.weight.copy_(torch.eye(2 * world, D) * 4.0)
            self.moe2.gate.weight.copy_(torch.eye(2 * world, D) * 4.0)
        for layer in (self.moe1, self.moe2):
            layer.to_expert_parallel(dist.group.WORLD)

    def forward(self, x):
        h = x + self.moe1(x)
        h = h + torch.tanh(self.mid(h))
        return h + self.moe2(h)

    def aux_loss(self):
        return self.moe1.aux_loss + self.moe2.aux_loss


def _batch(rank: int, world: int, it: int):
    """Inputs of iteration `it` on `rank`: most prefer expert HOT[it] (and its neighbour, top-2);
    rank 1 has no tokens in iteration 2."""
    tokens = 0 if (rank == 1 and it == 2) else 24 + 4 * rank
    gen = torch.Generator().manual_seed(1000 * it + rank)
    x = torch.randn(tokens, D, generator=gen) * 0.3
    x[:, HOT[it]] += 2.0
    x[:, (HOT[it] + 1) % (2 * world)] += 1.0
    g = torch.randn(tokens, D, generator=gen)
    return x, g


def _idle_copy(layer) -> bool:
    """Whether the last forward had a copy on a rank that computed none of that expert's tokens."""
    stats = layer.stats
    plan_SEW = dispatch_counts(stats.flow.numpy(), stats.placement, layer.node_of)
    computed_EW = plan_SEW.sum(0)
    return bool((stats.placement.materialized_EW() & (computed_EW == 0)).any())


def check_prophet_equals_ep(rank: int, world: int) -> None:
    timing.AGREE_EVERY = 2  # `auto` learns within the few forwards of this test
    # Slow compute, fast copies: replicating the hot expert pays, so the planner acts.
    cost_model = CostModel(Topology.homogeneous(world, 1e10), gemm_flops_per_s=1e7)
    layout = ParallelLayout(ep_size=world)
    models = {name: TwoBlocks(world, "ep" if name == "ep" else "prophet", cost_model) for name in ("ep", "p", "pf")}
    # EPLB balances devices, which these hot pairs leave nearly even: with no margin it still copies.
    models["eplb"] = TwoBlocks(world, "eplb", cost_model, {"min_gain": 0.0, "window": 1})
    models["auto"] = TwoBlocks(world, "auto", cost_model)
    models["autopf"] = TwoBlocks(world, "auto", cost_model, {"searches": "turns"})  # one search per call
    # The schedule arbiter: two rounds of its three candidates (the first a warm-up), then the cheapest.
    models["autos"] = TwoBlocks(world, "auto", cost_model, schedule="auto")
    BlockPrefetch([models["autopf"].moe1, models["autopf"].moe2])  # auto plans ahead too
    prefetch = BlockPrefetch([models["pf"].moe1, models["pf"].moe2])
    # Under `pairwise` (one exchange per step) the prefetch's marks run once per block: it sends
    # after the first piece arrived and waits once every piece is computed (`core.hooks`, "Pieces").
    models["pfp"] = TwoBlocks(world, "prophet", cost_model, schedule="pairwise")
    marks, mark_point = [], BlockPrefetch._forward_point
    prefetch_pairwise = BlockPrefetch([models["pfp"].moe1, models["pfp"].moe2])

    def counted(i: int, point: str) -> None:
        marks.append((i, point))
        mark_point(prefetch_pairwise, i, point)

    prefetch_pairwise._forward_point = counted
    optimizers = {name: torch.optim.Adam(m.parameters(), lr=1e-3) for name, m in models.items()}
    copies, idle, prefetched, prefetched_pairwise, eplb_copies, chosen, schedules = 0, 0, 0, 0, 0, set(), set()
    for it in range(ITERATIONS):
        x, g = _batch(rank, world, it)
        results = {}
        for name, model in models.items():
            optimizers[name].zero_grad()
            xi = x.clone().requires_grad_()
            y = model(xi)
            ((y * g).sum() + model.aux_loss()).backward()
            all_reduce_gradients(model, layout)
            results[name] = (y.detach(), xi.grad, {n: p.grad.clone() for n, p in model.named_parameters()})
            optimizers[name].step()
        for name in ("p", "pf", "pfp", "eplb", "auto", "autopf", "autos"):
            what = f"{name} iteration {it} rank {rank} placements {models[name].moe1.stats.placement}"
            torch.testing.assert_close(
                results[name][0], results["ep"][0], **TOL, msg=lambda m, w=what: f"output {w}: {m}"
            )
            torch.testing.assert_close(
                results[name][1], results["ep"][1], **TOL, msg=lambda m, w=what: f"x grad {w}: {m}"
            )
            for n, grad in results["ep"][2].items():
                torch.testing.assert_close(
                    results[name][2][n], grad, **TOL, msg=lambda m, n=n, w=what: f"{n} grad {w}: {m}"
                )
            for (n, p), q in zip(models["ep"].named_parameters(), models[name].parameters()):
                torch.testing.assert_close(q, p, **TOL, msg=lambda m, n=n, w=what: f"{n} after step, {w}: {m}")
            for layer in (models[name].moe1, models[name].moe2):
                copies += int(layer.stats.placement.materialized_EW().sum())
                idle += _idle_copy(layer)
        prefetched += int(not models["pf"].moe2.stats.placement.is_owners_only())
        prefetched_pairwise += int(not models["pfp"].moe2.stats.placement.is_owners_only())
        chosen |= {m.stats.strategy for m in (models["auto"].moe1, models["auto"].moe2, models["autopf"].moe2)}
        schedules |= {m.stats.schedule for m in (models["autos"].moe1, models["autos"].moe2)}
        eplb_copies += sum(
            int(m.stats.placement.materialized_EW().sum()) for m in (models["eplb"].moe1, models["eplb"].moe2)
        )
    points = ("start", "dispatched", "computed", "end")
    assert sorted(marks) == sorted((i, p) for i in (0, 1) for p in points for _ in range(ITERATIONS)), marks
    # Not vacuous: copies were made, some of them idle (mispredicted), and layer 2 was prefetched.
    assert copies > 0 and idle > 0, (copies, idle)
    assert prefetched > 0 and prefetched_pairwise > 0 and eplb_copies > 0
    # The arbiter left EP for a planner's copies, and learned from the timed forwards.
    assert chosen - {"ep"}, chosen
    assert {"sync", "pairwise", "pipeline"} <= schedules, schedules  # each ran, each equal to EP-sync
    assert prefetch.steps == ITERATIONS and 0.0 < prefetch.split_forward[0] < 1.0, prefetch.split_forward
    # What the prefetch measured to hide reached layer 2's planner (the same on every rank).
    share = torch.tensor([models["pf"].moe2.planner.prefetch.hidden_share], dtype=torch.float64)
    assert 0.0 <= float(share) <= 1.0 and float(share) == prefetch.hidden_share[1]
    # Two more forwards: the times of the six above agreed (every 2 forwards), every factor learned.
    x, g = _batch(rank, world, 0)
    for _ in range(2):
        (models["autos"](x) * g).sum().backward()
        (models["auto"](x) * g).sum().backward()
    schedule = models["autos"].moe1.schedule
    assert all(r.value is not None and r.value > 0.0 for r in schedule.factors.values()), schedule.factors
    planners = [m.planner for name in ("auto", "autos") for m in (models[name].moe1, models[name].moe2)]
    assert all(p.factors["compute"].value > 0.0 and p.factors["exchange"].value is not None for p in planners)
    assert any(p.factors["copies"].value is not None for p in planners)  # copies sent now were timed
    assert all(p.model_error() is not None for p in planners)
    # Every rank learned the same factors (the slowest rank's times, agreed), so decides alike.
    learned = torch.tensor(
        [r.value or 0.0 for p in planners for r in p.factors.values()] + [r.value for r in schedule.factors.values()],
        dtype=torch.float64,
    )
    agreed = learned.clone()
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    torch.testing.assert_close(agreed, learned, rtol=0, atol=0)
