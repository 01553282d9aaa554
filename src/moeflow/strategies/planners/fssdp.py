"""`strategy="fssdp"`: Hecate's Fully Sharded Sparse Data Parallelism (§3-4) as a planner.

Every expert has one owner (its shard: parameters and optimizer state, one global copy); each
iteration the planner materializes experts where the estimated load needs them (Algorithm 1,
`hecate.sparse_materialization`), the layer's sparse collectives copy them owner → holders
(SparseAllGather) and sum their gradients back (SparseReduceScatter), and the dispatch plan sends
a token to its own device if it holds the expert, else to a holder on its node, else across nodes
(§4.4, `core.placement.dispatch_counts`). The load is the mean of the last `window` iterations
(w = 5), so the placement of iteration j is known before it runs: with `moe.prefetch` the copies
travel during the dense compute before the layer (`strategies.prefetch.BlockPrefetch`, shared with
Pro-Prophet). Every `reshard_interval` iterations `core.resharding` moves whole shards between
devices (Algorithm 2, `hecate.heterogeneous_sharding`).

Deviations, recorded: (1) of Algorithm 1's plan, experts in load order, the planner takes the
prefix with the lowest predicted time under the shared cost model (copies priced as hidden by the
share the prefetch measured, Eq. 8 with h), and none unless it is predicted `min_gain` faster than
the owners alone — as every moeflow planner. Hecate trusts t to keep copies off the critical path;
on gloo over CPUs the prefetch hides copies but frees no time (docs/pro-prophet.md), so an unpriced
plan would be paid in full. (2) By default (`overlap="priced"`) every expert is a candidate (t = E,
bounded by the memory m) and the price decides; Eq. 1's t (`overlap="eq1"`, from the non-MoE time
the prefetch measures) is offered but is 0-2 experts at realistic sizes — on `hecate_a`, a 33 MB
expert over 100 Gb/s takes 2.7 ms, about one attention forward — which turns the strategy into
plain EP where copies on the critical path still pay (`moeflow simulate`, docs/hecate.md). (3) The
calibration (§4.2, after the gate) re-runs Algorithm 1 on the real flow with the memory left and
accepts the result only if predicted faster with all its copies on the critical path (under the
prefetch a changed placement is materialized again, synchronously).

The prefixes of deviation (1) are priced in one pass: the owners' terms, then each copied expert's
change (`perf.placement_pricing`).

Shape suffixes: W devices (ranks of the expert-parallel group), E experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from moeflow.core.checks import finite_number, positive_int
from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import Placement, owners_alone
from moeflow.perf.placement_pricing import PlacementPricer
from moeflow.strategies.planners.base import PlanAheadPlanner
from moeflow.strategies.planners.hecate import heterogeneous_sharding, overlap_degree, sparse_materialization
from moeflow.strategies.planners.prophet_model import Pricing, price_placement, price_terms, prune_by_copies

OVERLAPS = ("priced", "eq1")


@dataclass(frozen=True)
class FSSDPOptions:
    """Options of `strategy="fssdp"` (`--set moe.strategy_options.<key>=...`)."""

    window: int = 5
    """Iterations whose mean load estimates the next (Hecate: w = 5)."""
    overlap: Literal["priced", "eq1"] = "priced"
    """t, the candidate experts: `priced`: all (the cost model picks how many, deviation 2); `eq1`:
    Hecate's Eq. 1 from the non-MoE time (measured by `moe.prefetch`, or `nonmoe_forward_s`; all
    experts until measured)."""
    overlap_degree: int | None = None
    """t given explicitly (overrides `overlap`)."""
    memory_experts: int | None = None
    """m: copies of other devices' experts one device may hold; None: one shard's worth (E/W)."""
    memory_bytes: float | None = None
    """m from a byte budget instead (floor of budget / one expert's parameter bytes)."""
    calibrate: bool = False
    """Re-run Algorithm 1 after the gate on the real flow (module docstring, deviation 3)."""
    reshard_interval: int = 100
    """Re-shard all MoE layers every this many optimizer steps (Algorithm 2; 0: never)."""
    rematerialize: bool = False
    """Free the copies after their forward use and gather them again for backward (memory mode)."""
    min_gain: float = 0.05
    """Take a placement only if predicted at least this fraction faster than the owners alone."""
    nonmoe_forward_s: float = 0.0
    """T_nonMoE of Eq. 1 if known (0: what the prefetch measures)."""

    def __post_init__(self) -> None:
        positive_int("window", self.window)
        if self.overlap not in OVERLAPS:
            raise ValueError(f"overlap={self.overlap!r}: expected one of {list(OVERLAPS)}")
        if self.overlap_degree is not None:
            positive_int("overlap_degree", self.overlap_degree, minimum=0)
        if self.memory_experts is not None:
            positive_int("memory_experts", self.memory_experts, minimum=0)
        if self.memory_bytes is not None:
            finite_number("memory_bytes", self.memory_bytes, low=0.0)
        if self.memory_experts is not None and self.memory_bytes is not None:
            raise ValueError(
                f"memory_experts={self.memory_experts} and memory_bytes={self.memory_bytes}: give one of them"
            )
        positive_int("reshard_interval", self.reshard_interval, minimum=0)
        finite_number("min_gain", self.min_gain, 0.0, 1.0)
        if self.min_gain >= 1.0:
            raise ValueError(f"min_gain={self.min_gain!r}: expected a fraction in [0, 1)")
        finite_number("nonmoe_forward_s", self.nonmoe_forward_s, low=0.0)


@dataclass
class FSSDPDecision:
    """What the planner decided for one iteration."""

    overlap: int
    """t used."""
    memory: int
    """m used."""
    predicted_s: list[float]
    """predicted_s[i]: the layer's predicted time with the first i experts' copies (0: owners), up
    to the last prefix priced (`PlacementPricer.cheapest_prefixes`)."""
    accepted: int
    """How many experts' copies the placement applies."""
    calibrated: bool = False
    """The calibration replaced the planned placement."""
    load_E: np.ndarray = field(default=None, repr=False)
    """The estimated load the plan ran on."""

    @property
    def best_s(self) -> float:
        return self.predicted_s[self.accepted]


class FSSDPPlanner(PlanAheadPlanner):
    """`strategy="fssdp"`: iteration j runs on the placement planned from iterations < j."""

    name = "fssdp"
    reshards_owners = True

    def __init__(self, shape: ExpertShape, options: FSSDPOptions | None = None, background: bool = True):
        self.shape = shape
        self.options = options or FSSDPOptions()
        super().__init__(self.options.window, background)
        self.rematerializes = self.options.rematerialize
        self.reshard_interval = self.options.reshard_interval
        self.last: FSSDPDecision | None = None

    # ---- the numbers Algorithm 1 runs with ---------------------------------------------------------
    def degrees(self, cost_model, num_experts: int, world: int) -> tuple[int, int]:
        """(t, m) for this cluster and expert size (options, Eq. 1)."""
        o = self.options
        size = self.shape.param_bytes(cost_model.bytes_per_element)
        if o.memory_experts is not None:
            memory = o.memory_experts
        elif o.memory_bytes is not None:
            memory = int(o.memory_bytes // size)
        else:
            memory = num_experts // world
        nonmoe = o.nonmoe_forward_s or (self.prefetch.nonmoe_forward_s if self.prefetch else 0.0)
        if o.overlap_degree is not None:
            overlap = o.overlap_degree
        elif o.overlap == "eq1" and nonmoe > 0:
            slowest = max(float(cost_model.p2p_time(size, i, j)) for i in range(world) for j in range(world) if i != j)
            overlap = overlap_degree(nonmoe, slowest, num_experts)
        else:
            overlap = num_experts
        return overlap, memory

    def pricing(self) -> Pricing:
        """How copies are priced: hidden by the measured share under the prefetch, else in full."""
        pricing = super().pricing()
        if pricing.overlap and self.options.nonmoe_forward_s:
            return replace(pricing, nonmoe_forward_s=self.options.nonmoe_forward_s)
        return pricing

    # ---- planning ------------------------------------------------------------------------------------
    def search(self, flow_WE: np.ndarray, placement: Placement, cost_model) -> tuple:
        degrees = self.degrees(cost_model, placement.num_experts, placement.world_size)
        return fssdp_plan, (flow_WE, placement, cost_model, self.shape, *degrees, self.pricing(), self.options.min_gain)

    def adjust(self, flow_WE: np.ndarray, planned: Placement, cost_model) -> Placement:
        """§4.2's calibration on the real flow (module docstring, deviation 3), when on."""
        if not self.options.calibrate:
            return planned
        flow = np.asarray(flow_WE, dtype=np.float64)
        world, num_experts = planned.world_size, planned.num_experts
        overlap, memory = self.degrees(cost_model, num_experts, world)
        used_W = planned.materialized_EW().sum(0)
        left, node_of = int(max(0, memory - used_W.max(initial=0))), cost_model.topology.node_of
        extra = sparse_materialization(flow.sum(0), planned.owner_E, world, node_of, overlap, left)
        candidate = planned.with_holders(extra)
        if candidate == planned:
            return planned
        now = price_placement(flow, planned, cost_model, self.shape, self.pricing(), node_of)
        if price_placement(flow, candidate, cost_model, self.shape, Pricing(), node_of) < now:
            if self.last is not None:
                self.last.calibrated = True
            return candidate
        return planned

    def owners_changed(self, placement: Placement, cost_model) -> None:
        """The shards moved (`core.resharding`): plan the next iteration on the new owners."""
        if not self.history:
            self.next_plan.set(None)
            return
        search, inputs = self.search(self.estimate(), placement, cost_model)
        self.next_plan.set(search(*inputs))

    def expert_load(self) -> np.ndarray | None:
        """Estimated tokens per expert `[E]` (the window's mean), for Algorithm 2; None if unseen."""
        return self.estimate().sum(0) if self.history else None


def fssdp_plan(
    flow_WE: np.ndarray,
    placement: Placement,
    cost_model,
    shape: ExpertShape,
    overlap: int,
    memory: int,
    pricing: Pricing,
    min_gain: float,
) -> tuple[Placement, FSSDPDecision]:
    """Algorithm 1 on `flow_WE` with overlap degree t = `overlap` and memory m = `memory`, then the
    best-priced prefix of its copies, heaviest expert first (module docstring, deviation 1): none
    unless `min_gain` faster than the owners alone. Pure: runs on the planning thread."""
    flow = np.asarray(flow_WE, dtype=np.float64)
    world = placement.world_size
    load_E, node_of = flow.sum(0), cost_model.topology.node_of
    holders = sparse_materialization(load_E, placement.owner_E, world, node_of, overlap, memory)
    order = np.argsort(-load_E, kind="stable")
    copied = order[holders[order].sum(1) > 1]
    # Prefix k: the first k copied experts with their copies (`perf.placement_pricing`).
    pricer = PlacementPricer(np.rint(flow), placement.owner_E, cost_model, shape, node_of, whole=True)
    predicted = pricer.cheapest_prefixes(
        copied, holders[copied], lambda t: price_terms(t, cost_model, shape, pricing), *prune_by_copies(pricing)
    )
    best = int(np.argmin(predicted))
    if predicted[best] > (1.0 - min_gain) * predicted[0]:
        best = 0
    chosen = owners_alone(placement.owner_E, world)
    chosen[copied[:best]] = holders[copied[:best]]
    decision = FSSDPDecision(overlap, memory, predicted.tolist(), best, load_E=load_E)
    return Placement(placement.owner_E, chosen), decision


def plan_resharding(planners, cost_model, world: int, node_of, step: int) -> np.ndarray | None:
    """Algorithm 2 (`hecate.heterogeneous_sharding`) over the FSSDP planners of a model's MoE
    layers after optimizer step `step` → owner_LE, or None when not due (`reshard_interval`) or
    some layer has seen no load yet. The same on every rank: the loads are global flows."""
    if not planners:
        return None
    interval = planners[0].reshard_interval
    loads = [p.expert_load() for p in planners]
    if interval == 0 or step % interval or any(load is None for load in loads):
        return None
    num_experts = loads[0].size
    overlap = min(p.degrees(cost_model, num_experts, world)[0] for p in planners)
    return heterogeneous_sharding(np.stack(loads), overlap, world, node_of)


def resharding_time(cost_model, old_LE: np.ndarray, new_LE: np.ndarray, expert_bytes: float) -> float:
    """Predicted time of `core.resharding.reshard_experts`: every moved expert's parameters and
    its two Adam moments (3 × `expert_bytes`) old owner → new owner, in one batched exchange."""
    W = cost_model.topology.num_devices
    bytes_WW = np.zeros((W, W))
    moved = np.asarray(old_LE) != np.asarray(new_LE)
    np.add.at(bytes_WW, (np.asarray(old_LE)[moved], np.asarray(new_LE)[moved]), 3.0 * expert_bytes)
    return float(cost_model.a2a_time(bytes_WW)) if moved.any() else 0.0
