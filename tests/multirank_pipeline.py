"""`schedule="pipeline"` (FSMoE's pipelined block) on gloo ranks equals `schedule="sync"`: outputs,
input gradients, every parameter gradient and an optimizer step, for degrees 1–4 and one larger
than some pieces, forward degree ≠ backward degree, a rank with zero tokens and skewed routing
(run by tests/test_pipeline_schedule.py, one spawn per world size)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from moeflow import MoELayer
from moeflow.core.parallel import ParallelLayout
from moeflow.model_step import all_reduce_gradients
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.strategies.prefetch import BlockPrefetch

from .equivalence import TOL, D, H, forward_backward, inputs
from .multirank_prophet import TwoBlocks, _batch


def _layer(world: int, schedule: str, options=None, seed: int = 3) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(D, H, 2 * world, top_k=2, schedule=schedule, schedule_options=options)
    layer.to_expert_parallel(dist.group.WORLD)
    return layer


def _skew(layer: MoELayer) -> None:
    """Most tokens prefer expert 0 (held by rank 0): skewed pieces."""
    with torch.no_grad():
        layer.gate.weight[0] += 3.0


def check_pipeline_equals_sync(rank: int, world: int) -> None:
    uneven = [5, 0, 9, 3][:world] if world == 4 else [7, 0]
    cases = [
        (dict(degree=1), [6] * world, False),
        (dict(degree=2), [6] * world, False),
        (dict(degree=3), uneven, False),
        (dict(degree=4), [6] * world, True),
        (dict(degree=16), uneven, True),  # larger than some pieces (and zero-row pieces)
        (dict(forward_degree=3, backward_degree=2), uneven, True),
        (dict(forward_degree=2, backward_degree=5), [8] * world, False),
    ]
    for i, (options, tokens, skew) in enumerate(cases):
        xs, gs = inputs(world, tokens, seed=100 + i)
        results = []
        for schedule, opts in (("sync", None), ("pipeline", options)):
            layer = _layer(world, schedule, opts)
            if skew:
                _skew(layer)
            y, gx, _, stats = forward_backward(layer, xs[rank], gs[rank], noise_seed=i)
            grads = {n: p.grad.clone() if p.grad is not None else None for n, p in layer.named_parameters()}
            results.append((y, gx, grads, layer))
        (y0, gx0, g0, _), (y1, gx1, g1, pipe) = results
        torch.testing.assert_close(y1, y0, **TOL, msg=lambda m, o=options: f"{o}: outputs {m}")
        torch.testing.assert_close(gx1, gx0, **TOL, msg=lambda m, o=options: f"{o}: input grads {m}")
        assert g0.keys() == g1.keys()
        for name in g0:
            if g0[name] is None:
                assert g1[name] is None or not g1[name].any(), (options, name)
            else:
                torch.testing.assert_close(g1[name], g0[name], **TOL, msg=lambda m, o=options, n=name: f"{o} {n}: {m}")
        fwd = options.get("forward_degree", options.get("degree"))
        assert pipe.schedule.degrees[0] == fwd and pipe.stats.schedule.startswith("pipeline")

    # An optimizer step after two iterations: identical parameters.
    xs, gs = inputs(world, uneven, seed=7)
    trained = []
    for schedule, opts in (("sync", None), ("pipeline", dict(forward_degree=3, backward_degree=2))):
        layer = _layer(world, schedule, opts)
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        for it in range(2):
            opt.zero_grad()
            forward_backward(layer, xs[rank] * (1 + it), gs[rank], noise_seed=it)
            opt.step()
        trained.append(copy.deepcopy(layer.state_dict()))
    for name in trained[0]:
        torch.testing.assert_close(trained[1][name], trained[0][name], **TOL, msg=lambda m, n=name: f"step {n}: {m}")

    # Evaluation (no autograd) runs the forward loop alone.
    layer_s, layer_p = _layer(world, "sync"), _layer(world, "pipeline", dict(degree=3))
    with torch.no_grad():
        torch.testing.assert_close(layer_p(xs[rank]), layer_s(xs[rank]), **TOL)

    check_prefetch(rank, world)

    with pytest.raises(ValueError, match="schedule='pipeline'.*dispatch='a2a' only"):
        MoELayer(D, H, 2 * world, schedule="pipeline", dispatch="hierarchical")


def check_prefetch(rank: int, world: int) -> None:
    """Pro-Prophet's copies with the block-wise prefetch (its hooks at the block's points) under the
    pipeline (degree 3 forward, 2 backward) train as plain EP with `sync`: three Adam steps."""
    cost_model = CostModel(Topology.homogeneous(world, 1e10), gemm_flops_per_s=1e7)
    layout = ParallelLayout(ep_size=world)
    opts = {"forward_degree": 3, "backward_degree": 2}
    models = {
        "ep": TwoBlocks(world, "ep", cost_model),
        "pf": TwoBlocks(world, "prophet", cost_model, schedule="pipeline", schedule_options=opts),
    }
    BlockPrefetch([models["pf"].moe1, models["pf"].moe2])
    optimizers = {name: torch.optim.Adam(m.parameters(), lr=1e-3) for name, m in models.items()}
    copies = 0
    for it in range(4):
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
        (y0, gx0, g0), (y1, gx1, g1) = results["ep"], results["pf"]
        torch.testing.assert_close(y1, y0, **TOL)
        torch.testing.assert_close(gx1, gx0, **TOL)
        for n in g0:
            torch.testing.assert_close(g1[n], g0[n], **TOL, msg=lambda m, n=n: f"prefetch {n}: {m}")
        copies += int(not models["pf"].moe2.stats.placement.is_owners_only())
    for (n, p), q in zip(models["ep"].named_parameters(), models["pf"].parameters()):
        torch.testing.assert_close(q, p, **TOL, msg=lambda m, n=n: f"prefetch {n} after steps: {m}")
    assert copies > 0  # not vacuous: the planner made copies that the pipeline computed with
