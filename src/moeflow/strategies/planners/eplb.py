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

`replicate_experts` is one sort (its greedy takes the largest loads per copy in descending order);
`pack_copies` keeps nodes and devices in heaps by load; every prefix of the copies is priced in
one pass (`perf.placement_pricing`). The copies, packing and choice are those of the loops that
scanned every expert, node and device and priced each prefix's whole plan (tested).

Shape suffixes: W devices (ranks of the expert-parallel group), E experts, N nodes.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moeflow.core.checks import finite_number, positive_int
from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import Placement, owners_alone
from moeflow.perf.placement_pricing import PlacementPricer
from moeflow.strategies.planners.base import PlanAheadPlanner
from moeflow.strategies.planners.prophet_model import Pricing, price_terms, prune_by_copies


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
    one with the largest load per copy so far (ties: lower id).

    The greedy takes, at every step, the largest of the experts' next loads per copy, and each
    expert's sequence load/1, load/2, ... decreases: so its choices are the `extra` largest values
    load_e / c (c ≥ 1: copy c of e serves load/c before it is added), in descending order, ties to
    the lower expert — one sort over the few values that can be among them. A value load_e / c is
    among them only if c ≤ load_e · (extra + E) / Σ load + 1 (the last value taken is at least
    Σ load / (extra + E))."""
    load = np.asarray(load_E, dtype=np.float64)
    E = load.size
    if extra <= 0 or E == 0:
        return []
    total = load.sum()
    bound = np.full(E, extra) if total <= 0 else np.ceil(load * (extra + E) / total).astype(np.int64) + 1
    per_E = np.minimum(np.maximum(bound, 1), extra)
    expert = np.repeat(np.arange(E), per_E)
    copy = np.arange(expert.size) - np.repeat(np.cumsum(per_E) - per_E, per_E) + 1
    value = load[expert] / copy
    order = np.lexsort((copy, expert, -value))[:extra]
    return expert[order].tolist()


def pack_copies(
    copies: Sequence[int], load_E: np.ndarray, owner_E: np.ndarray, world: int, slots: int, node_of=None
) -> list[tuple[int, int]]:
    """(expert, device) of each copy that fits, in `copies` order: each on the lightest node with a
    free slot and a device that does not hold the expert, then that node's lightest such device
    (EPLB's balanced packing of copies at load/count each, nodes first when there are several);
    device loads start from the owners' experts. Copies that fit nowhere are left out.

    Nodes and their devices sit in heaps by load (ties: the lower id); a copy pops the lightest
    entries until one can take it (stale entries and the expert's holders are skipped), so a copy
    costs O(log W) plus its expert's few holders, not a scan of every device."""
    load = np.asarray(load_E, dtype=np.float64)
    owner = np.asarray(owner_E, dtype=np.int64)
    node_W = np.zeros(world, dtype=np.int64) if node_of is None else np.asarray(node_of, dtype=np.int64)
    copies = np.asarray(list(copies), dtype=np.int64)
    count = np.bincount(copies, minlength=load.size) + 1
    share = load / count  # each copy and the owner serve load / count
    device_load = np.bincount(owner, weights=share, minlength=world)
    free = [slots] * world
    node = node_W.tolist()
    members: dict[int, list[int]] = {}
    for d, n in enumerate(node):
        members.setdefault(n, []).append(d)
    member_W = {n: np.array(ds) for n, ds in members.items()}
    # A node's load as the loop version sums it: over all its devices, in rank order.
    node_load = {n: float(device_load[member_W[n]].sum()) for n in members}
    node_free = {n: slots * len(ds) for n, ds in members.items()}
    nodes = [(node_load[n], n) for n in members if node_free[n]]
    heapq.heapify(nodes)
    devices = {n: [(float(device_load[d]), d) for d in ds if free[d]] for n, ds in members.items()}
    for heap in devices.values():
        heapq.heapify(heap)
    holds = [{int(o)} for o in owner.tolist()]
    held_by: list[list[int]] = [[] for _ in range(world)]  # the experts each device holds
    # Free slots on each expert's holders per node, at `expert * nodes + node` (int keys: no tuples
    # for the garbage collector to count).
    nodes_count = max(node) + 1 if node else 1
    held_free: dict[int, int] = {}
    for e, o in enumerate(owner.tolist()):
        held_by[o].append(e)
        key = e * nodes_count + node[o]
        held_free[key] = held_free.get(key, 0) + free[o]
    placed = []
    for e in copies.tolist():
        held = holds[e]
        n = _lightest_node(nodes, node_load, node_free, held_free, e * nodes_count)
        if n is None:
            continue
        heap, skipped = devices[n], []
        while True:  # the node's lightest device without the expert
            dl, d = heapq.heappop(heap)
            if dl != device_load[d] or not free[d]:
                continue  # stale
            if d in held:
                skipped.append((dl, d))
                continue
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        held.add(d)
        held_by[d].append(e)
        held_free[e * nodes_count + n] = held_free.get(e * nodes_count + n, 0) + free[d]
        free[d] -= 1
        for other in held_by[d]:  # one slot fewer on a holder of each expert it holds
            held_free[other * nodes_count + n] -= 1
        node_free[n] -= 1
        device_load[d] += share[e]
        node_load[n] = float(device_load[member_W[n]].sum())
        if free[d]:
            heapq.heappush(heap, (float(device_load[d]), d))
        if node_free[n]:
            heapq.heappush(nodes, (node_load[n], n))
        placed.append((int(e), d))
    return placed


def _lightest_node(nodes, node_load, node_free, held_free, key) -> int | None:
    """The lightest node (ties: the lower) with a free slot on a device that does not hold the
    expert (`held_free[key + node]`: the free slots on its holders there, kept as copies are placed)."""
    skipped, found = [], None
    while nodes:
        nl, n = nodes[0]
        if nl != node_load[n] or not node_free[n]:
            heapq.heappop(nodes)  # stale
            continue
        taken = held_free.get(key + n, 0)  # free slots on the expert's holders
        if node_free[n] > taken:
            found = n
            break
        skipped.append(heapq.heappop(nodes))
    for entry in skipped:
        heapq.heappush(nodes, entry)
    return found


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
    # Prefix k: the first k copies placed; step k gives its expert one more holder.
    holders = owners_alone(placement.owner_E, world)
    experts = np.array([e for e, _ in placed], dtype=np.int64)
    rows = np.zeros((len(placed), world), dtype=bool)
    for k, (e, d) in enumerate(placed):
        holders[e, d] = True
        rows[k] = holders[e]
    pricer = PlacementPricer(np.rint(flow), placement.owner_E, cost_model, shape, node_of, whole=True)
    predicted_s = pricer.cheapest_prefixes(
        experts, rows, lambda t: price_terms(t, cost_model, shape, pricing), *prune_by_copies(pricing)
    )
    best = int(np.argmin(predicted_s))
    if predicted_s[best] > (1.0 - min_gain) * predicted_s[0]:
        best = 0
    chosen = owners_alone(placement.owner_E, world)
    for e, d in placed[:best]:
        chosen[e, d] = True
    return Placement(placement.owner_E, chosen), predicted_s.tolist()


class EPLBPlanner(PlanAheadPlanner):
    """`strategy="eplb"`: iteration j runs on the placement planned from the iterations < j."""

    name = "eplb"

    def __init__(self, shape: ExpertShape, options: EPLBOptions | None = None, background: bool = True):
        self.shape = shape
        self.options = options or EPLBOptions()
        super().__init__(self.options.window, background)
        self.last: list[float] = []
        """The predicted times of the prefixes of the copies the running plan chose among (up to
        the last priced: `PlacementPricer.cheapest_prefixes`)."""

    def search(self, flow_WE: np.ndarray, placement: Placement, cost_model) -> tuple:
        o = self.options
        return eplb_plan, (flow_WE, placement, cost_model, self.shape, o.redundant_slots, self.pricing(), o.min_gain)
