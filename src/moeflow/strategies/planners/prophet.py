"""Pro-Prophet (§IV): lightweight expert placement planned one iteration ahead from locality.

`prophet_search` is Algorithm 1 (§IV-C), a pure function of (flow, owners, cost model): starting
from plain EP, repeatedly take the heaviest device, replicate its heaviest expert onto the devices
that send that expert the most tokens, recompute every device's load with the dispatch plan the
layer runs (`core.placement.dispatch_counts`: a holder computes its own tokens, the others spread
over the holders of their node first), price the placement (`prophet_model`: Eq. 6, or Eq. 8 with
the block-wise scheduler hiding the copies), and stop once the load is balanced (Eq. 7:
``max(H) − min(H) < α·I/E``) or the heaviest device comes round again. It returns the *prefix* of
the steps that achieved the lowest predicted time.

A step changes one expert, so the search keeps its state per expert and re-prices only that one:
its column of the dispatch plan (as `core.placement.dispatch_entries` dispatches it) updates every
device's load (the experts no step changed stay on their owners, implicitly); a step reads its
expert's column of the flow and sorts only the senders without a copy. The steps are one compiled
loop (`prophet_steps`, numba: in NumPy the calls' overhead was most of the search at 1024 ranks),
the NumPy version's steps. The steps found, every prefix is priced in one pass from the owners'
terms and each step's change (`perf.placement_pricing`), the copies only as far as the bound needs
them. The steps, prices and choice are those of the loop that recomputed and priced the whole plan
at every step (tested against it on random and trace flows).

Two defects of the public implementation are fixed, each with a test: the number of transferred
experts ``s`` grows with every step (it is the length of the step list, not a counter that only
accepted steps move), and the returned placement is the best prefix (not the last one tried).

Generalisations, recorded: (1) with several experts per device, the device's heaviest expert whose
copies can still be extended (an *open* expert) is taken, and when the heaviest device has none the next
heaviest is relieved instead ("if i in Used: break" becomes "no device can be relieved"); (2)
n (`keep_out`, devices a selected expert is not sent to) counts among the devices that send the
expert tokens — a device that sends it nothing never receives it (Fig. 6b), so n = 0 is "every
sender"; (3) as for shadowing, a placement is taken only if predicted at least `min_gain` faster
than plain EP (the cost model's error is of that order). The number of receivers per step is the
fixed n, not the cheapest predicted one: a myopic choice leaves partial replica sets that later
steps cannot fix.

`ProphetPlanner` is the `strategy="prophet"` object: the placement of iteration j+1 is planned
from a prediction of its flow — the last iteration's (`predictor="last"`) or the mean of the last
`window` (`"mean"`) — every `plan_interval` iterations, on a background thread while the layer's
exchanges run (§V: Plan overlaps the all-to-all); the layer runs iteration j+1 on that placement
with its *real* flow, so a wrong prediction costs time, never correctness.

Shape suffixes: W devices (ranks of the expert-parallel group), E experts; S source ranks (W: the destination).
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
from moeflow.strategies.planners.prophet_model import (
    MODELS,
    Pricing,
    price_placement,  # noqa: F401 (part of this module's interface)
    price_terms,
    prune_by_copies,
)
from moeflow.strategies.planners.prophet_steps import search_steps

PREDICTORS = ("last", "mean")


@dataclass(frozen=True)
class ProphetOptions:
    """Options of `strategy="prophet"` (`--set moe.strategy_options.<key>=...`)."""

    predictor: Literal["last", "mean"] = "mean"
    """The next iteration's flow: the last one seen, or the mean of the last `window`."""
    window: int = 3
    """Iterations averaged by `predictor="mean"`."""
    plan_interval: int = 1
    """Re-plan every this many iterations (Pro-Prophet §IV-C: locality lets it run less often)."""
    keep_out: int = 0
    """Algorithm 1's n: devices a selected expert is not sent to, beyond those that send it nothing."""
    balance_alpha: float = 0.1
    """Eq. 7's α: the search stops once max(H) − min(H) < α·I/E."""
    min_gain: float = 0.05
    """Take a placement only if predicted at least this fraction faster than plain EP."""
    overlap: bool = False
    """Price copies as Eq. 8 (hidden by the block-wise scheduler, sent along the copy trees as it
    sends them). `moe.prefetch` turns it on, with the two values below measured."""
    nonmoe_forward_s: float = 0.0
    """T_FNEC of Eq. 8: forward time of the dense part of a block (backward: twice)."""
    hidden_share: float = 1.0
    """Share of Eq. 8's compute windows that hides copies (1: Eq. 8 as printed)."""
    experts_hide: bool = True
    """Eq. 8's windows hold the experts' compute too; False: the dense part alone (Hecate §3.2's
    overlap with the attention; the simulator's `--overlap-attention` sets it)."""
    model: Literal["links", "paper"] = "links"
    """`links`: the shared cost-model functions; `paper`: Eq. 1-8 as printed (mean bandwidth)."""

    def pricing(self) -> Pricing:
        return Pricing(self.overlap, self.nonmoe_forward_s, self.hidden_share, self.experts_hide, self.model)

    def __post_init__(self) -> None:
        if self.predictor not in PREDICTORS:
            raise ValueError(f"predictor={self.predictor!r}: expected one of {list(PREDICTORS)}")
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r}: expected one of {list(MODELS)}")
        positive_int("window", self.window)
        positive_int("plan_interval", self.plan_interval)
        positive_int("keep_out", self.keep_out, minimum=0)
        finite_number("balance_alpha", self.balance_alpha, low=0.0)
        finite_number("min_gain", self.min_gain, 0.0, 1.0)
        if self.min_gain >= 1.0:
            raise ValueError(f"min_gain={self.min_gain!r}: expected a fraction in [0, 1)")
        finite_number("nonmoe_forward_s", self.nonmoe_forward_s, low=0.0)
        finite_number("hidden_share", self.hidden_share, 0.0, 1.0)


@dataclass
class ProphetDecision:
    """What Algorithm 1 tried: one step per replicated expert, the predicted time after each."""

    steps: list[tuple[int, list[int]]]
    """(expert, devices it was sent to) in search order."""
    predicted_s: list[float]
    """predicted_s[i]: the layer's predicted time with the first i steps (0: plain EP), up to the
    last prefix priced (`PlacementPricer.cheapest_prefixes`: none past those whose copies alone
    cost more than the best)."""
    accepted: int
    """How many steps the returned placement applies (the best prefix; 0: plain EP)."""
    flow_WE: np.ndarray = field(repr=False)
    """The (predicted) flow the search ran on."""

    @property
    def best_s(self) -> float:
        return self.predicted_s[self.accepted]


def prophet_search(
    flow_WE: np.ndarray,
    placement: Placement,
    cost_model,
    shape: ExpertShape,
    options: ProphetOptions | None = None,
) -> tuple[Placement, ProphetDecision]:
    """Algorithm 1 (module docstring) on `flow_WE` from the owners of `placement`."""
    options = options or ProphetOptions()
    flow = np.asarray(flow_WE, dtype=np.float64)
    owner_E, W = placement.owner_E, placement.world_size
    if cost_model.topology.num_devices != W:
        raise ValueError(f"cost model has {cost_model.topology.num_devices} devices, the expert-parallel group {W}")
    node_of = cost_model.topology.node_of
    tokens = np.rint(flow)  # what the dispatch plan sends
    steps, rows = _search_steps(flow, tokens, owner_E, node_of, options)
    experts = np.array([e for e, _ in steps], dtype=np.int64)
    pricer = PlacementPricer(tokens, owner_E, cost_model, shape, node_of, whole=True)
    pricing = options.pricing()
    predicted = pricer.cheapest_prefixes(
        experts, rows, lambda t: price_terms(t, cost_model, shape, pricing), *prune_by_copies(pricing)
    )
    accepted = int(np.argmin(predicted))  # the best prefix (first of equal minima: fewest copies)
    if predicted[accepted] > (1.0 - options.min_gain) * predicted[0]:
        accepted = 0  # not worth the model's error
    holders = owners_alone(owner_E, W)
    for e, row in zip(experts[:accepted], rows[:accepted]):
        holders[e] = row
    decision = ProphetDecision(steps, predicted.tolist(), accepted, flow)
    return Placement(owner_E, holders), decision


def _search_steps(
    flow_WE: np.ndarray, tokens_WE: np.ndarray, owner_E: np.ndarray, node_of, options: ProphetOptions
) -> tuple[list[tuple[int, list[int]]], np.ndarray]:
    """Algorithm 1's steps: (expert, devices it is sent to) and the expert's holders after each
    (`rows`, `[Q, W]`), from the compiled loop (`prophet_steps.search_steps`).

    The state is kept per expert and updated for the one expert a step changes: its computed tokens
    per device (the dispatch plan's column, as `dispatch_entries` dispatches it; the owner's alone
    until a step changes it), hence every device's load H; its load on its owner; whether it still
    has senders without a copy ("open"). A step takes the heaviest device that owns an open expert
    (ties: the lower device), and on it the heaviest such expert (ties: the lower id) — what
    `_relief` of the loop version finds by scanning every device and expert. `tokens_WE`: the flow
    rounded to whole assignments (what the plan sends); its sums start the loads."""
    flow = np.ascontiguousarray(flow_WE, dtype=np.float64)
    W, E = tokens_WE.shape
    owner = np.ascontiguousarray(owner_E, dtype=np.int64)
    total_E = tokens_WE.sum(0).astype(np.int64)  # whole counts: exact
    start_W = np.bincount(owner, weights=total_E, minlength=W).astype(np.int64)  # every expert on its owner
    if node_of is None:
        node_W = np.zeros(W, dtype=np.int64)
    else:  # nodes numbered 0..N-1 (only which ranks share a node matters)
        node_W = np.unique(np.asarray(node_of), return_inverse=True)[1].astype(np.int64).reshape(-1)
        if node_W.shape != (W,):
            raise ValueError(f"node_of has {node_W.size} entries, expected one per rank ({W})")
    threshold = options.balance_alpha * flow_WE.sum() / E
    expert_Q, bounds, devices_T, rows = search_steps(
        flow, owner, total_E, start_W, node_W, int(node_W.max(initial=0)) + 1, options.keep_out, threshold
    )
    # The devices as references to W shared ints (an object array's items), not one new int per
    # copy sent: at 1024 ranks the steps send hundreds of thousands of copies.
    devices = np.arange(W).astype(object)[devices_T]
    ends = bounds.tolist()
    steps = [(e, devices[a:b].tolist()) for e, a, b in zip(expert_Q.tolist(), ends[:-1], ends[1:])]
    return steps, rows


class ProphetPlanner(PlanAheadPlanner):
    """`strategy="prophet"`: runs iteration j on the placement planned from iterations < j."""

    name = "prophet"

    def __init__(self, shape: ExpertShape, options: ProphetOptions | None = None, background: bool = True):
        self.shape = shape
        self.options = options or ProphetOptions()
        super().__init__(self.options.window, background)
        self.calls = 0

    def estimate(self) -> np.ndarray:
        """The next iteration's flow from the history (module docstring)."""
        if self.options.predictor == "last":
            return self.history[-1]
        return super().estimate()

    def search_options(self) -> ProphetOptions:
        """The options Algorithm 1 runs with: under the block-wise prefetch, copies priced as Eq. 8
        with the windows the prefetch measured — the non-MoE time (unless `nonmoe_forward_s` was
        given) and the share of the windows that really hid copies (0 until measured: a prefetch
        is trusted only once it has been seen to hide something)."""
        if self.prefetch is None:
            return self.options
        nonmoe = self.options.nonmoe_forward_s or self.prefetch.nonmoe_forward_s
        window = self.prefetch
        return replace(
            self.options,
            overlap=True,
            nonmoe_forward_s=nonmoe,
            hidden_share=window.hidden_share,
            experts_hide=window.experts_hide,
        )

    def observe(self, flow_WE: np.ndarray) -> None:
        super().observe(flow_WE)
        self.calls += 1

    def search(self, flow_WE: np.ndarray, placement: Placement, cost_model) -> tuple:
        return prophet_search, (flow_WE, placement, cost_model, self.shape, self.search_options())

    def plan_next(self, placement: Placement, cost_model, inline: bool = False) -> None:
        """Every `plan_interval` calls (Pro-Prophet §IV-C); between re-plans the last plan stands."""
        if (self.calls - 1) % self.options.plan_interval == 0:
            super().plan_next(placement, cost_model, inline)
        else:
            self.next_plan.set((self.running, self.last))
