"""`strategy="eplb"`: DeepSeek's expert-parallel load balancer (EPLB, `eplb.py` of deepseek-ai/EPLB)
as a moeflow planner — a baseline for the others.

EPLB gives every rank `redundant_slots` extra expert slots. `replicate_experts` fills the W·r
extra slots one at a time, each with a copy of the expert whose load per copy is the largest;
`pack_copies` places the copies, heaviest (load per copy) first, on the lightest node that still
has a free slot and a device without that expert (hierarchical, when the ranks span several nodes
of equal size), then on that node's lightest such device; with one node, on the lightest device
(global policy). The load is a moving average: the mean of the last `window` iterations' global
flows, so the placement of iteration j is known before it runs (the block-wise prefetch can send
its copies ahead, as for Pro-Prophet and Hecate).

Adaptation to training, recorded: EPLB plans for inference, where a redundant expert is a
permanent replica. Here every expert keeps its owner (optimizer state) and a copy is materialized
from it and its gradient reduced back to it (`core.sparse_collectives`), as for every moeflow
planner, so a copy costs communication every iteration. Two known weaknesses are fixed: a rank
never holds two copies of one expert (EPLB's packing can put both on one GPU: a wasted slot); and
the cost of moving weights is priced for real — the copies are taken in EPLB's order and the prefix
with the lowest predicted time under the shared cost model is kept (none unless `min_gain` faster
than the owners alone); the published "migration cost" variant adds the same term to every
expert and so changes no decision.

Shape suffixes: W devices (ranks of the expert-parallel group), E experts, N nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moeflow.core.checks import finite_number, positive_int
from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import Placement
from moeflow.strategies.planners.base import PlanAheadPlanner
from moeflow.strategies.planners.prophet_model import Pricing, price_placement


@dataclass(frozen=True)
class EPLBOptions:
    """Options of `strategy="eplb"` (`--set moe.strategy_options.<key>=...`)."""

    redundant_slots: int = 1
    """Extra expert slots per rank (EPLB's redundant experts: W·r copies in all)."""
    window: int = 10
    """Iterations whose mean load EPLB balances for (its moving average)."""
    min_gain: float = 0.05
    """Take a placement only if predicted at least this fraction faster than the owners alone."""

    def __post_init__(self) -> None:
        positive_int("redundant_slots", self.redundant_slots, minimum=0)
        positive_int("window", self.window)
        finite_number("min_gain", self.min_gain, 0.0, 1.0)
        if self.min_gain >= 1.0:
            raise ValueError(f"min_gain={self.min_gain!r}: expected a fraction in [0, 1)")


def replicate_experts(load_E: np.ndarray, extra: int) -> list[int]:
    """EPLB's `replicate_experts`: the expert that gets each of `extra` copies, in order — each to the
    one with the largest load per copy so far (ties: lower id)."""
    load = np.asarray(load_E, dtype=np.float64)
    count = np.ones(load.size)
    order = []
    for _ in range(extra):
        e = int(np.argmax(load / count))
        order.append(e)
        count[e] += 1
    return order


def pack_copies(
    copies: Sequence[int], load_E: np.ndarray, owner_E: np.ndarray, world: int, slots: int, node_of=None
) -> list[tuple[int, int]]:
    """(expert, device) of each copy that fits, in `copies` order: each on the lightest node with a
    free slot and a device that does not hold the expert, then that node's lightest such device
    (EPLB's balanced packing of copies at load/count each, nodes first when there are several);
    device loads start from the owners' experts. Copies that fit nowhere are left out."""
    load = np.asarray(load_E, dtype=np.float64)
    owner = np.asarray(owner_E, dtype=np.int64)
    node_W = np.zeros(world, dtype=np.int64) if node_of is None else np.asarray(node_of, dtype=np.int64)
    count = np.bincount(np.asarray(list(copies), dtype=np.int64), minlength=load.size) + 1
    share = load / count  # each copy and the owner serve load / count
    holds = np.zeros((load.size, world), dtype=bool)
    holds[np.arange(load.size), owner] = True
    device_load = np.bincount(owner, weights=share, minlength=world)
    free = np.full(world, slots)
    placed = []
    for e in copies:
        open_W = ~holds[e] & (free > 0)
        if not open_W.any():
            continue
        nodes = np.unique(node_W[open_W])
        node_load = np.array([device_load[node_W == n].sum() for n in nodes])
        n = nodes[np.lexsort((nodes, node_load))[0]]
        devices = np.flatnonzero(open_W & (node_W == n))
        d = int(devices[np.lexsort((devices, device_load[devices]))[0]])
        holds[e, d], free[d] = True, free[d] - 1
        device_load[d] += share[e]
        placed.append((int(e), d))
    return placed


def eplb_plan(
    flow_WE: np.ndarray,
    placement: Placement,
    cost_model,
    shape: ExpertShape,
    redundant_slots: int,
    pricing: Pricing,
    min_gain: float,
) -> tuple[Placement, list[float]]:
    """EPLB's copies for `flow_WE` (`replicate_experts`, `pack_copies`) and the best-priced prefix
    of them (module docstring): none unless `min_gain` faster than the owners alone. Returns the
    placement and every prefix's predicted time. Pure: runs on the planning thread."""
    flow = np.asarray(flow_WE, dtype=np.float64)
    world, load_E = placement.world_size, flow.sum(0)
    node_of = cost_model.topology.node_of
    copies = replicate_experts(load_E, world * redundant_slots)
    placed = pack_copies(copies, load_E, placement.owner_E, world, redundant_slots, node_of)
    base = Placement.owners_only(placement.owner_E, world)
    candidates = [base]
    for e, d in placed:
        extra = candidates[-1].holders_EW.copy()
        extra[e, d] = True
        candidates.append(Placement(base.owner_E, extra))
    predicted_s = [price_placement(flow, c, cost_model, shape, pricing, node_of) for c in candidates]
    best = int(np.argmin(predicted_s))
    if predicted_s[best] > (1.0 - min_gain) * predicted_s[0]:
        best = 0
    return candidates[best], predicted_s


class EPLBPlanner(PlanAheadPlanner):
    """`strategy="eplb"`: iteration j runs on the placement planned from the iterations < j."""

    name = "eplb"

    def __init__(self, shape: ExpertShape, options: EPLBOptions | None = None, background: bool = True):
        self.shape = shape
        self.options = options or EPLBOptions()
        super().__init__(self.options.window, background)
        self.last: list[float] = []
        """The predicted times of the prefixes of the copies the running plan chose among."""

    def search(self, flow_WE: np.ndarray, placement: Placement, cost_model) -> tuple:
        o = self.options
        return eplb_plan, (flow_WE, placement, cost_model, self.shape, o.redundant_slots, self.pricing(), o.min_gain)
