"""Pro-Prophet's compiled search steps (`strategies/planners/prophet_steps.py`) are the NumPy
version's (tests/reference_planners.py `search_steps`): the same steps and holder rows, ties
included, on hundreds of random flows (1 to 32 ranks, 1 to 4 experts per rank, silent ranks, equal
columns, fractional flows as a window's mean gives them, no node layout or any, non-contiguous ones
included, several `keep_out` and `balance_alpha`), on columns of more than 32 senders with few
and with many distinct values, on the shipped SmartMoE trace's flows and on a 64 x 256 Zipf load."""

from __future__ import annotations

import numpy as np
import pytest

from moeflow.core.placement import plain_ep_owners
from moeflow.sim.traces import resolve_trace, synthetic_trace
from moeflow.strategies.planners.prophet import ProphetOptions, _search_steps

from . import reference_planners as ref


def _nodes(rng, world: int) -> list[int] | None:
    """No layout, nodes of equal size, or any layout (shuffled: nodes need not be contiguous)."""
    kind = rng.integers(3)
    if kind == 0:
        return None
    if kind == 1:
        per = int(rng.choice([d for d in range(1, world + 1) if world % d == 0]))
        return (np.arange(world) // per).tolist()
    return rng.integers(0, max(1, world // 2), world).tolist()


def _flow(rng, world: int, experts: int) -> np.ndarray:
    """Counts with silent ranks, equal columns (ties between experts and senders), some large
    enough to split unevenly over several holders; a third fractional (a window's mean)."""
    flow = rng.integers(0, int(rng.choice([3, 40, 400])), (world, experts)).astype(float)
    flow[rng.random(world) < 0.2] = 0.0
    flow[:, rng.random(experts) < 0.3] = float(rng.integers(0, 40))
    if rng.random() < 0.2:
        flow[rng.random((world, experts)) < 0.5] = 0.0
    if rng.random() < 0.3:
        flow = flow + rng.choice([0.0, 0.5, rng.random()], (world, experts))
    return flow


def _owners(rng, world: int, experts: int) -> np.ndarray:
    return plain_ep_owners(experts, world) if rng.random() < 0.7 else rng.integers(0, world, experts)


def _same(flow: np.ndarray, owner_E: np.ndarray, node_of, options: ProphetOptions) -> int:
    tokens = np.rint(flow)
    steps, rows = _search_steps(flow, tokens, owner_E, node_of, options)
    expect_steps, expect_rows = ref.search_steps(flow, tokens, owner_E, node_of, options)
    assert steps == expect_steps
    assert rows.dtype == expect_rows.dtype and np.array_equal(rows, expect_rows)
    return len(steps)


@pytest.mark.parametrize("seed", range(4))
def test_random_flows(seed):
    rng = np.random.default_rng(seed)
    stepped = 0
    for _ in range(100):
        world = int(rng.integers(1, 33))
        experts = world * int(rng.integers(1, 5))
        options = ProphetOptions(
            keep_out=int(rng.choice([0, 0, 1, 2, 5])), balance_alpha=float(rng.choice([0.0, 0.05, 0.1, 0.5, 2.0]))
        )
        stepped += _same(_flow(rng, world, experts), _owners(rng, world, experts), _nodes(rng, world), options) > 0
    assert stepped > 50  # the cases are not all balanced from the start


@pytest.mark.parametrize("world", [40, 72, 136])
def test_many_senders(world):
    """Columns of more than 32 senders: few distinct values (sorted by counting) and many (merge
    sorted), around the `FEW` distinct values that choose between the two."""
    rng = np.random.default_rng(world)
    for values in (3, 60, 64, 65, 70, 1000):
        flow = rng.integers(1, values + 1, (world, world)).astype(float)
        if values == 1000:
            flow = flow + rng.random((world, world))  # every value distinct
        flow[rng.random(world) < 0.1] = 0.0
        owner_E = plain_ep_owners(world, world)
        options = ProphetOptions(keep_out=int(rng.choice([0, 3])), balance_alpha=0.02)
        assert _same(flow, owner_E, [None, (np.arange(world) // 8).tolist()][values % 2], options) > 0


def test_trace_flows():
    flow_ILWE = resolve_trace("smartmoe").flow_ILWE
    flows = flow_ILWE.reshape(-1, *flow_ILWE.shape[2:])
    W, E = flows.shape[1:]
    owner_E = plain_ep_owners(E, W)
    picks = np.linspace(0, flows.shape[0] - 1, 12).astype(int)
    for i, p in enumerate(picks):
        flow = flows[p].astype(float)
        if i % 3 == 2:  # a window's mean
            flow = flows[max(0, p - 2) : p + 1].mean(0)
        node_of = [None, (np.arange(W) // 4).tolist(), (np.arange(W) % 2).tolist()][i % 3]
        assert _same(flow, owner_E, node_of, ProphetOptions(keep_out=i % 2)) > 0


def test_zipf_64x256():
    flow = synthetic_trace("zipf", 2, 1, 64, 256, 2048, seed=0).flow_ILWE[:, 0].mean(0)
    assert _same(flow, plain_ep_owners(256, 64), (np.arange(64) // 8).tolist(), ProphetOptions()) > 10
