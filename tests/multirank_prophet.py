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
from moeflow.core.parallel import ParallelLayout, all_reduce_gradients
from moeflow.core.placement import dispatch_counts
from moeflow.core.prefetch import BlockPrefetch
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.strategies.planners.auto import share_correction
from moeflow.strategies.schedules.auto import share_schedule_choice

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
    plan_SED = dispatch_counts(stats.flow.numpy(), stats.placement, layer.node_of)
    computed_EW = plan_SED.sum(0)
    return bool((stats.placement.materialized_EW() & (computed_EW == 0)).any())


def check_prophet_equals_ep(rank: int, world: int) -> None:
    # Slow compute, fast copies: replicating the hot expert pays, so the planner acts.
    cost_model = CostModel(Topology.homogeneous(world, 1e10), gemm_flops_per_s=1e7)
    layout = ParallelLayout(ep_size=world)
    models = {name: TwoBlocks(world, "ep" if name == "ep" else "prophet", cost_model) for name in ("ep", "p", "pf")}
    # EPLB balances devices, which these hot pairs leave nearly even: with no margin it still copies.
    models["eplb"] = TwoBlocks(world, "eplb", cost_model, {"min_gain": 0.0, "window": 1})
    models["auto"] = TwoBlocks(world, "auto", cost_model)
    models["autopf"] = TwoBlocks(world, "auto", cost_model)
    # The schedule arbiter: each candidate tried once, then the cheapest corrected price per forward
    # and, from the 5th forward, a re-trial round of all three.
    models["autos"] = TwoBlocks(
        world,
        "auto",
        cost_model,
        schedule="auto",
        schedule_options={"trials": 1, "retrial_every": 1, "retrial_band": 9.0},
    )
    assert share_schedule_choice([models["autos"].moe1, models["autos"].moe2]) is not None  # one schedule
    for name in ("auto", "autopf", "autos"):  # one machine correction over both layers
        assert len(share_correction([models[name].moe1, models[name].moe2])) == 2
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
    borrowed, lend_to_second = [], models["pf"].moe2.times.borrow  # directions of the waits lent to layer 2
    models["pf"].moe2.times.borrow = lambda s, backward: (borrowed.append(backward), lend_to_second(s, backward))
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
        if it >= 2:  # past the trials (1 forward of each of 2 candidates): both layers run the board's choice
            assert models["autos"].moe1.stats.schedule == models["autos"].moe2.stats.schedule, it
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
    assert {"sync", "pairwise"} <= schedules, schedules  # both ran, each equal to EP-sync
    assert all(t.factor is not None for t in models["autos"].moe1.schedule.timings.values())
    assert len(models["auto"].moe1.planner.correction.observations) == ITERATIONS - 1
    # Each forward's copies timed apart, and the schedule that ran it named (`auto_correction`).
    observed = models["autos"].moe1.planner.correction.observations
    assert all(o.measured_copies >= 0.0 for o in observed) and {o.schedule for o in observed} == schedules
    # ... and its backward, of it the copies' gradient sums (`core.layer_times`).
    layers = [layer for m in ("auto", "autos") for layer in (models[m].moe1, models[m].moe2)]
    observed = [o for layer in layers for o in layer.planner.correction.observations]
    assert all(o.measured_backward > 0.0 and o.measured_compute > 0.0 for o in observed)
    sent_now = [o for o in observed if o.predicted.copies > 0.0 and not o.predicted.prefetched]
    assert sent_now and all(o.measured_copies_backward > 0.0 for o in sent_now)
    # Copies sent ahead: the waits on them in the block before counted as layer 2's, their gradients' too.
    assert set(borrowed) == {False, True}, borrowed
    assert prefetch.steps == ITERATIONS and 0.0 < prefetch.split_forward[0] < 1.0, prefetch.split_forward
    # What the prefetch measured to hide reached layer 2's planner (the same on every rank).
    share = torch.tensor([models["pf"].moe2.planner.hidden_share], dtype=torch.float64)
    assert 0.0 <= float(share) <= 1.0 and float(share) == prefetch.hidden_share[1]
    agreed = share.clone()
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    assert float(agreed) == float(share)
    # A first layer fed by data (rows needing no gradient) still times its backward: to the end of
    # the backward pass (the autograd engine's callback), not never.
    x, g = _batch(rank, world, 0)
    (models["autos"](x) * g).sum().backward()
    first = models["autos"].moe1
    forward_s, backward_s = first.schedule.timings[first.stats.schedule].measured_s[-1]
    assert backward_s is not None and backward_s > 0.0, (forward_s, backward_s)
    # The trial round (forwards 0-2), then a re-trial round (forwards 4-6), agreed at the next forward.
    (models["autos"](x) * g).sum().backward()
    assert [sorted(r) for r in first.schedule.rounds] == [["pairwise", "pipeline", "sync"]] * 2, first.schedule.rounds
    assert first.times.backward_s > 0.0  # the layer's own, for `strategy="auto"`
