"""FasterMoE dynamic shadowing (PPoPP'22 §4.1, Algorithm 1).

Every iteration and layer, from the global flow matrix that the count exchange already gave every
rank, pick experts to replicate on *all* ranks: their parameters travel (owner → every rank in
forward, gradients back to the owner in backward) instead of their tokens.

Cost of a shadow set S, priced by the shared `CostModel` with the functions the simulator uses
(`CostModel.sync_step_times`, `copies_time`), so profiled constants are used when present:

    T(S) = 3 · max_w comp(B'_w)  +  2 · (dispatch + combine)(tokens still sent)  +  copy(S)

- `3 · comp` and the four all-to-alls: FasterMoE Eq. 7 (forward + 2× backward compute; dispatch
  and combine in forward and backward), with B'_w the tokens rank w computes once S is shadowed.
- `copy(S)`: Eq. 8's parameter term `2·r·(2αH²)/W_net`: a broadcast of the shadowed parameters in
  forward and a reduce of their gradients in backward, one of each per owner, as the sparse
  collectives run them (`CostModel.copies_time`: pipelined ring, each link carries them once).
- Eq. 8 as printed drops the token all-to-all altogether, which would make shadowing look free
  under a uniform load; the public FastMoE policy keeps the token term at the new maximum load, as
  we do here. Eq. 9 / 10 are this comparison solved for one expert.

Candidates (Algorithm 1, generalised to several experts per rank): *experts* in descending received load —
the column sums of the flow, i.e. tokens received from all senders (summing rows instead, as the
public FastMoE v1 code did, gives per-sender counts that are equal under equal batches, so nothing
is ever shadowed). Every prefix of that order is priced at once (`perf.placement_pricing`: the
owners' terms once, then each candidate's change — its tokens kept on their sources, its copies —
as running sums over the order) up to the first whose copies alone cost more than the best priced
prefix (no later prefix can be chosen: copies only grow along the order), then:

- `search="prefix"` (default): the cheapest prefix. Algorithm 1 stops at the first expert that
  does not help, which misses two hot experts on two ranks: shadowing either alone leaves the other
  rank the slowest, so neither lowers the maximum, while the pair does (measured on the testbed's
  Zipf routing: greedy took nothing, the pair was predicted 3% faster). Pro-Prophet's planner
  searches the same way (its §IV-C locality-based greedy keeps going).
- `search="greedy"`: Algorithm 1 as published — accept while the predicted time drops.

Either way a shadow set is taken only if it is predicted at least `min_gain` (default 5%) faster
than plain EP: the model's error is of that order (`benchmarks/perf_model_accuracy.py`), and a
wrong "yes" costs more than a wrong "no" (on the 2 × 2 testbed under uniform routing, a predicted
2% gain from shadowing every expert ran at 0.70x the speed of EP).

Shape suffixes: W ranks, E experts, Z candidates (shadow sets: prefixes of the heaviest experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from moeflow.core.checks import finite_number, positive_int
from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import Placement
from moeflow.perf.everywhere_pricing import EverywherePricer
from moeflow.perf.placement_pricing import PlacementPricer
from moeflow.strategies.planners.base import Planner


@dataclass
class ShadowDecision:
    """What the planner saw: the candidates in load order, the predicted time of every prefix, and
    the chosen prefix."""

    shadowed: list[int]
    """The chosen experts: `candidates[:len(shadowed)]`."""
    candidates: list[int]
    """Experts with any tokens, in descending received load (at most `max_shadowed`)."""
    predicted_s: list[float]
    """predicted_s[i] = predicted layer time with the first i candidates shadowed (0: plain EP), up
    to the last prefix priced: those whose copies alone cost more than the best priced prefix are
    not priced (a prefix costs at least its copies, and they only grow along the order)."""

    @property
    def best_s(self) -> float:
        return self.predicted_s[len(self.shadowed)]


SEARCHES = ("prefix", "greedy")


@dataclass(frozen=True)
class ShadowOptions:
    """Options of `strategy="shadow"` (`--set moe.strategy_options.<key>=...`)."""

    search: Literal["prefix", "greedy"] = "prefix"
    """`prefix`: the cheapest prefix of the load order; `greedy`: Algorithm 1's stop rule."""
    min_gain: float = 0.05
    """Shadow only for a predicted gain of at least this fraction of plain EP's time."""
    max_shadowed: int | None = None
    """At most this many experts shadowed per layer (None: any number)."""

    def __post_init__(self) -> None:
        if self.search not in SEARCHES:
            raise ValueError(f"search={self.search!r}: expected one of {list(SEARCHES)}")
        finite_number("min_gain", self.min_gain, 0.0, 1.0)
        if self.min_gain >= 1.0:
            raise ValueError(f"min_gain={self.min_gain!r}: expected a fraction in [0, 1)")
        if self.max_shadowed is not None:
            positive_int("max_shadowed", self.max_shadowed, minimum=0)


@dataclass(frozen=True)
class ShadowGreedyOptions(ShadowOptions):
    """Options of `strategy="shadow_greedy"`: Algorithm 1 as published (stop rule, no margin)."""

    search: Literal["prefix", "greedy"] = "greedy"
    min_gain: float = 0.0


class ShadowPlanner(Planner):
    """`strategy="shadow"`: a pure function of (flow, owners, cost model) → Placement."""

    name = "shadow"
    needs_cost_model = True

    def __init__(self, shape: ExpertShape, options: ShadowOptions | None = None):
        self.shape = shape
        self.options = options or ShadowOptions()
        self.last: ShadowDecision | None = None

    def __call__(self, flow_WE: np.ndarray, placement: Placement, cost_model=None) -> Placement:
        return self.on_pricer(None, flow_WE, placement, cost_model)

    def on_pricer(self, pricer, flow_WE, placement: Placement, cost_model=None) -> Placement:
        """Decide on `pricer` (an `EverywherePricer` of this flow and owners, `Planner.on_pricer`;
        None: built here)."""
        if cost_model is None:
            raise ValueError("strategy='shadow' needs cost_model= (a moeflow.perf.costmodel.CostModel)")
        self.last = self.decide(flow_WE, placement, cost_model, pricer)
        return Placement.held_everywhere(placement.owner_E, placement.world_size, self.last.shadowed)

    def cost(self, flow_WE, owner_E, shadowed_ZE, cost_model) -> np.ndarray:
        """T(S) for boolean shadow masks `[..., E]` -> `[...]` seconds (module docstring)."""
        shadowed_ZE = np.asarray(shadowed_ZE, dtype=bool)
        flat_ZE = shadowed_ZE.reshape(-1, shadowed_ZE.shape[-1])
        world = cost_model.topology.num_devices
        owners_EW = np.eye(world, dtype=bool)[np.asarray(owner_E)]
        pricer = PlacementPricer(flow_WE, owner_E, cost_model, self.shape, cost_model.topology.node_of)
        terms = pricer.placements([owners_EW | mask[:, None] for mask in flat_ZE])
        return _shadow_time(terms).reshape(shadowed_ZE.shape[:-1])

    def decide(self, flow_WE: np.ndarray, placement: Placement, cost_model, pricer=None) -> ShadowDecision:
        """Algorithm 1 on `flow_WE` rounded to whole tokens (`pricer`: an `EverywherePricer` already
        built on them and the owners)."""
        owner_E = placement.owner_E
        if cost_model.topology.num_devices != placement.world_size:
            raise ValueError(
                f"cost model has {cost_model.topology.num_devices} devices, the expert-parallel group "
                f"{placement.world_size}"
            )
        if pricer is None:  # whole tokens, as the dispatch sends them (a mean of replicas' flows rounded)
            flow = np.rint(np.asarray(flow_WE, dtype=np.float64))
            pricer = EverywherePricer(flow, owner_E, cost_model, self.shape, cost_model.topology.node_of, whole=True)
        received_E = pricer.received_E  # column sums: tokens each expert receives from all senders
        order = np.argsort(-received_E, kind="stable")
        candidates = order[received_E[order] > 0][: self.options.max_shadowed]
        # Prefix i: the first i candidates shadowed (0: plain EP), each step one expert everywhere.
        everywhere = np.ones((candidates.size, placement.world_size), dtype=bool)
        predicted = pricer.cheapest_prefixes(candidates, everywhere, _shadow_time)
        if self.options.search == "prefix":
            chosen = int(np.argmin(predicted))  # the first of equal minima: fewest copies
        else:
            worse = np.flatnonzero(np.diff(predicted) >= 0)  # Algorithm 1 stops at the first
            chosen = int(worse[0]) if worse.size else len(candidates)
        if predicted[chosen] > (1.0 - self.options.min_gain) * predicted[0]:
            chosen = 0  # not worth the model's error
        candidates = candidates.tolist()
        return ShadowDecision(candidates[:chosen], candidates, predicted.tolist())


def _shadow_time(terms) -> np.ndarray:
    """T(S) of every candidate: 3 expert computes, 4 exchanges, copies out and back (Eq. 7 + copies)."""
    return 3 * terms.compute_s + 4 * terms.a2a_s + terms.trans_s + terms.agg_s
