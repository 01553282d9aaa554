"""`strategy="auto"`: one arbiter over every planner, priced with a cost model corrected online.

Each iteration every candidate planner (`ep`, `shadow`, `prophet`, `eplb`, `fssdp` by default) sees
the flow and proposes its placement — so the planners that plan ahead keep their histories — and
the arbiter prices every proposal on the flow the layer will run (the real one: the count exchange
has happened) with the shared cost model: the exchanges, the slowest device's expert compute and
the copies' sparse collectives (`prophet_model.placement_times`, the terms the planners use). It
runs the cheapest, and plain EP unless the cheapest is predicted `min_gain` faster: below the
token count where moving weights costs more than it saves, that is EP (the break-even guard).

Planned ahead. The arbiter itself plans ahead: after each call it picks, among the next placements
of the planners that plan ahead (and EP), the cheapest on the predicted flow (the mean of the last
3 flows it saw) with their copies priced as the block-wise prefetch hides them (Eq. 8 with
the measured share h), and offers it as `next_placement()`, which `core.prefetch.BlockPrefetch`
sends ahead. At the next call that planned placement competes on the real flow, its copies priced
as hidden, with every proposal for the current flow, copies on the critical path; if another wins,
the prefetched copies are drained and the winner's are sent then. The choice after a call is made
when the prefetch first asks for it (or at the next call): by then the planners' own searches
for their next placements have run on the planning thread (`planners.ahead`), off the layer's
critical path.

Online correction (`planners.auto_correction`). The layer times its forwards and backwards, and
within them the copies' (the wait for the copies, their gradient sums back), and sends them with the
next count exchange; the factors fitted on them (the copies sent now — out and back — and the copies
sent ahead apart from the rest) correct every price — those fitted on the layers the running
schedule ran (with `schedule="auto"` that arbiter then picks the schedule for the chosen
placement's plan). A current proposal equal to the placement the prefetch sent ahead runs on those
copies, and is priced as sent ahead.

Pricing less (`planners.auto_rest`). Pricing a proposal, and asking a planner for one, is on the
layer's critical path: a candidate that loses by more than `rest_margin`, or proposes the winner's
placement under another name (plain EP's on an even load), rests for 1, 2, 4, ... calls.

`AutoDecision` (`planner.last`) records each candidate's corrected price, the choice and the
model's current error; `MoEStats.strategy` names the planner chosen, per layer and step.

Shape suffixes: W devices (ranks of the expert-parallel group), E experts.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from moeflow.core.checks import finite_number, positive_int
from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import Placement, dispatch_counts
from moeflow.strategies.planners.ahead import searches_deferred
from moeflow.strategies.planners.auto_correction import Correction, Observation, OnlineCorrection, Terms
from moeflow.strategies.planners.auto_rest import calls_left, duplicates, update_rest, wake
from moeflow.strategies.planners.prophet_model import overlapped_copies, placement_times

CANDIDATES = ("ep", "shadow", "prophet", "eplb", "fssdp")


@dataclass(frozen=True)
class AutoOptions:
    """Options of `strategy="auto"` (`--set moe.strategy_options.<key>=...`)."""

    candidates: str = ",".join(CANDIDATES)
    """Comma list of the planners it arbitrates among (each with its default options)."""
    min_gain: float = 0.03
    """Leave plain EP only for a placement predicted at least this fraction faster."""
    window: int = 32
    """Forwards of each layer the online correction fits over."""
    half_life: float = 4.0
    """Forwards after which a measurement weighs half as much in the fit (`auto_correction`, "Recency")."""
    min_observations: int = 4
    """Forwards measured before the correction is used (s = 1 before)."""
    rest_margin: float = 0.1
    """A candidate priced more than this fraction above the winner rests (module docstring)."""
    max_rest: int = 8
    """Most calls a losing candidate rests before it is priced again (0: price every candidate every call)."""

    def __post_init__(self) -> None:
        names = self.names()
        unknown = [n for n in names if n not in CANDIDATES]
        if not names or unknown:
            raise ValueError(f"candidates={self.candidates!r}: expected a comma list of {list(CANDIDATES)}")
        finite_number("min_gain", self.min_gain, 0.0, 1.0)
        if self.min_gain >= 1.0:
            raise ValueError(f"min_gain={self.min_gain!r}: expected a fraction in [0, 1)")
        positive_int("window", self.window)
        finite_number("half_life", self.half_life, 0.0, low_open=True)
        positive_int("min_observations", self.min_observations)
        finite_number("rest_margin", self.rest_margin, 0.0)
        if int(self.max_rest) != self.max_rest or self.max_rest < 0:
            raise ValueError(f"max_rest={self.max_rest!r}: expected an integer >= 0")

    def names(self) -> list[str]:
        return [n.strip() for n in self.candidates.split(",") if n.strip()]


@dataclass
class AutoDecision:
    """One iteration's arbitration."""

    prices_s: dict[str, float]
    """Each priced candidate's corrected predicted time (forward + backward), plain EP included."""
    chosen: str
    """The planner whose placement ran."""
    correction: Correction
    """The factors the prices were corrected with."""
    predicted_s: list[float] = field(default_factory=list)
    """[EP's price, the chosen one's]: for the bench's predicted speedup."""
    resting: list[str] = field(default_factory=list)
    """Candidates not priced this call (they lost by more than `rest_margin` recently)."""

    @property
    def best_s(self) -> float:
        return self.predicted_s[-1]


def layer_terms(
    flow_WE: np.ndarray, placement: Placement, cost_model, shape: ExpertShape, node_of=None, hidden=None
) -> Terms:
    """The uncorrected terms of one forward + backward of `placement` on `flow_WE` (`placement_times`:
    3 expert computes of the slowest device, the 4 exchanges, the copies out and back). `hidden`:
    (T_nonMoE, h) when the copies are prefetched — with the part the model expects the prefetch to
    leave exposed (Eq. 8)."""
    plan_SED = dispatch_counts(np.rint(flow_WE).astype(np.int64), placement, node_of)
    t = placement_times(cost_model, plan_SED, placement.holders_EW, placement.owner_E, shape, hidden is not None)
    compute, exchange, copies = 3.0 * float(t["fec"]), float(t["a2a"]), float(t["trans"] + t["agg"])
    if hidden is None:
        return Terms(compute, exchange, copies, False)
    return Terms(compute, exchange, copies, True, float(overlapped_copies(t["trans"], t["agg"], t["fec"], *hidden)))


class AutoPlanner:
    """`strategy="auto"` (module docstring)."""

    needs_cost_model = True
    observes_time = True  # the layer sends its forward times with the count exchange
    plans_ahead = True  # `next_placement()`: the planned-ahead choice, for the block-wise prefetch

    def __init__(self, shape: ExpertShape, planners: dict, options: AutoOptions | None = None):
        self.shape = shape
        self.options = options or AutoOptions()
        self.planners = planners
        self.correction = OnlineCorrection(
            self.options.window, self.options.min_observations, half_life=self.options.half_life
        )
        self.last: AutoDecision | None = None
        self.chosen: str | None = None
        self._pending: Terms | None = None  # what was predicted for the forward + backward about to run
        self.history: deque[np.ndarray] = deque(maxlen=3)  # flows seen: the predicted flow's window
        self._prefetched = False
        self.nonmoe_forward_s = 0.0  # measured by the prefetch
        self.hidden_share = 0.0  # share of the prefetch windows that hid copies; 0 until measured
        self._planned: tuple[str, Placement] | None = None
        self._plan_after: tuple[Placement, object] | None = None  # the call to plan ahead from, not yet done
        self.rest: dict[str, list[int]] = {}  # name -> [calls it rests now, calls it rests after its next loss]
        self.wake_above: dict[str, float] = {}  # name -> EP's price that ends its rest on EP (`auto_rest.wake`)
        self.running_schedule: str | None = None
        """The schedule that ran the layer's last forward: placements are priced with the correction
        fitted on its layers (`price`)."""
        self.peers: list[AutoPlanner] = []
        """The model's `auto` planners (this one included), whose measurements the correction shares
        (`share_correction`); empty: this layer's own only."""

    def __getstate__(self) -> dict:
        """Checkpointed without its links to the other layers (`peers`): the resumed model keeps its
        own; its planned-ahead choice made."""
        self._resolve_planned()
        return {k: v for k, v in self.__dict__.items() if k != "peers"}

    def __setstate__(self, state: dict) -> None:
        self.running_schedule = None  # absent from checkpoints of before it
        self.wake_above = {}
        self.peers = []  # not checkpointed: the resumed model links its own (`share_correction`)
        self.__dict__.update(state)
        # Checkpointed before the correction had its own object, or before it timed backwards (its
        # observations forward-only): learn again.
        if not hasattr(state.get("correction"), "prior_weight"):
            self.correction = OnlineCorrection(
                self.options.window, self.options.min_observations, half_life=self.options.half_life
            )
            self._pending = None

    def observe_time(
        self,
        forward_s_W: np.ndarray,
        copies_s_W: np.ndarray | None = None,
        schedule: str | None = None,
        backward_s_W: np.ndarray | None = None,
        copies_backward_s_W: np.ndarray | None = None,
        compute_s_W: np.ndarray | None = None,
    ) -> None:
        """The previous forward's and backward's times on every rank (from the count exchange), of
        them the copies' (the wait for the copies, their gradient sums) and the forward's expert
        computes where timed, and the schedule that ran them: one observation (`auto_correction`),
        fitted with the other layers' (`peers`). The slowest rank's forward, backward and compute.
        The copies: sent now, the slowest rank's wait — they start right after the count exchange,
        all ranks together, and the receiver's wait is the layer's (a sender's isend returns once
        the kernel has the bytes: on the 2 × 1 testbed at Zipf 2, EPLB's one-way copies in layer 0
        read 6 ms on the rank that waited least, 23 ms on the slowest, 42 ms in the model); sent ahead,
        the wait of the rank that waited least — they are waited on where the block before left the
        ranks apart (`core.prefetch`), and a rank's wait while another still computes costs nothing.
        A backward timed 0 did not run (evaluation, or a forward without one): the forward alone is
        observed."""
        slowest = float(np.max(forward_s_W))
        pending, self._pending = self._pending, None
        self.running_schedule = schedule
        if pending is None or slowest <= 0:  # nothing predicted, or not timed (evaluation)
            return

        def copies_of(times_W: np.ndarray | None) -> float:
            if times_W is None:
                return math.nan
            return float(np.min(times_W) if pending.prefetched else np.max(times_W))

        backward = float(np.max(backward_s_W)) if backward_s_W is not None else 0.0
        if backward <= 0.0:
            backward, copies_backward_s_W = math.nan, None
        compute = float(np.max(compute_s_W)) if compute_s_W is not None else math.nan
        copies, copies_backward = copies_of(copies_s_W), copies_of(copies_backward_s_W)
        peers = [p.correction for p in self.peers]
        self.correction.observe(
            Observation(pending, schedule, slowest, copies, backward, copies_backward, compute), peers
        )

    def price(self, terms: Terms) -> float:
        """Corrected forward + backward time of a placement, the layer's fixed costs left out: with
        the correction fitted on the layers the running schedule ran (`auto_correction`, "Per
        schedule"; all layers' until it has enough)."""
        return self._correction().price(terms)

    def _correction(self) -> Correction:
        return self.correction.by_schedule.get(self.running_schedule, self.correction.pooled)

    def _priced(
        self, flow_WE: np.ndarray, placements: dict[str, Placement], cost_model, hidden=None, memo=None
    ) -> dict[str, tuple[Terms, float]]:
        """Each placement's terms and corrected price on `flow_WE` (`layer_terms`, `price`). The
        planners often propose the same placement (plain EP, most of all, on an even load): each
        distinct one is priced once — pricing is on the layer's critical path (`memo`: the prices
        already made on this flow with the same `hidden`)."""
        memo = {} if memo is None else memo
        out = {}
        for name, p in placements.items():
            key = p.owner_E.tobytes() + p.holders_EW.tobytes()
            if key not in memo:
                t = layer_terms(flow_WE, p, cost_model, self.shape, cost_model.topology.node_of, hidden)
                memo[key] = (t, self.price(t))
            out[name] = memo[key]
        return out

    # ---- the block-wise prefetch's side (`core.prefetch.BlockPrefetch` sets these) -----------------
    @property
    def prefetched(self) -> bool:
        return self._prefetched

    @prefetched.setter
    def prefetched(self, value: bool) -> None:
        self._prefetched = value
        for planner in self._ahead():
            planner.prefetched = value

    def _ahead(self) -> list:
        return [p for p in self.planners.values() if getattr(p, "plans_ahead", False)]

    def _hidden(self) -> tuple[float, float] | None:
        """(T_nonMoE, h) of Eq. 8 under the prefetch (None: copies are on the critical path)."""
        return (self.nonmoe_forward_s, self.hidden_share) if self._prefetched else None

    def next_placement(self) -> Placement | None:
        self._resolve_planned()
        return self._planned[1] if self._planned else None

    def _resolve_planned(self) -> None:
        """Make the planned-ahead choice of the last call, if not made yet. Deferred to the first
        `next_placement()` (the prefetch asks during the block before the layer's next call) so that
        the planners' searches for it have run on the planning thread meanwhile
        (`planners.ahead`); every rank asks at the same point of the same iteration."""
        if self._plan_after is not None:
            placement, cost_model = self._plan_after
            self._plan_after = None
            self._plan_ahead(placement, cost_model)

    def _plan_ahead(self, placement: Placement, cost_model) -> None:
        """The cheapest of the planned-ahead placements on the predicted flow (module docstring)."""
        self._planned = None
        if not self._prefetched or not self.history:
            return
        for planner in self._ahead():  # what the prefetch measured reaches the planners too
            planner.nonmoe_forward_s, planner.hidden_share = self.nonmoe_forward_s, self.hidden_share
        predicted = np.mean(np.stack(self.history), axis=0)
        options = {
            n: p.next_placement()
            for n, p in self.planners.items()
            if getattr(p, "plans_ahead", False) and calls_left(self.rest, n) == 0  # resting: not priced next call
        }
        options = {n: p for n, p in options.items() if p is not None and not p.is_owners_only()}
        if not options:
            return
        ep = Placement.owners_only(placement.owner_E, placement.world_size)
        ep_price = self._priced(predicted, {"ep": ep}, cost_model)["ep"][1]
        prices = {n: price for n, (_, price) in self._priced(predicted, options, cost_model, self._hidden()).items()}
        best = min(prices, key=prices.get)
        if prices[best] <= (1.0 - self.options.min_gain) * ep_price:
            self._planned = (best, options[best])

    def __call__(self, flow_WE: np.ndarray, placement: Placement, cost_model=None) -> Placement:
        if cost_model is None:
            raise ValueError("strategy='auto' needs cost_model= (a moeflow.perf.costmodel.CostModel)")
        self._resolve_planned()
        planned = (
            self._planned if self._planned and np.array_equal(self._planned[1].owner_E, placement.owner_E) else None
        )
        with searches_deferred() as searches:  # the planners' next searches wait until this one is priced
            ep = Placement.owners_only(placement.owner_E, placement.world_size)
            memo: dict = {}  # prices of the placements with their copies sent now
            ep_price = self._priced(flow_WE, {"ep": ep}, cost_model, memo=memo)["ep"][1]
            wake(self.rest, self.wake_above, ep_price)
            proposals = self._proposals(flow_WE, placement, cost_model)
            resting = [n for n in self.planners if calls_left(self.rest, n) > 0]
            proposals = {n: p for n, p in proposals.items() if n not in resting}
            proposals.setdefault("ep", ep)
            priced = {}
            if planned is not None:  # sent ahead: its copies hidden as far as the prefetch hides them
                name = f"{planned[0]}+prefetch"
                priced = self._priced(flow_WE, {name: planned[1]}, cost_model, self._hidden())
                # A current proposal equal to it runs on the copies sent ahead (the layer takes them):
                # the same price, and the tie goes to the name that says so (first).
                priced |= {n: priced[name] for n, p in proposals.items() if p == planned[1]}
                proposals = {name: planned[1], **proposals}
            unpriced = {n: p for n, p in proposals.items() if n not in priced}
            priced |= self._priced(flow_WE, unpriced, cost_model, memo=memo)
            priced = {n: priced[n] for n in proposals}
            terms = {name: t for name, (t, _) in priced.items()}
            prices = {name: price for name, (_, price) in priced.items()}
            best = min(prices, key=lambda name: (prices[name], name != "ep"))
            if prices[best] > (1.0 - self.options.min_gain) * prices["ep"]:
                best = "ep"
            as_ep = [n for n, p in proposals.items() if p == ep]
            same = duplicates(proposals, best, self.planners, self._prefetched, planned is not None)
            update_rest(self.rest, self.wake_above, prices, resting, as_ep, same, self.options)
            # First the searches whose plans the next call prices: `next_placement()` waits for those only.
            rests = {id(getattr(self.planners[n], "next_plan", None)) for n, (left, _) in self.rest.items() if left > 0}
            searches.sort(key=lambda plan: id(plan) in rests)
        self._pending = terms[best]
        self.chosen = best
        self.last = AutoDecision(prices, best, self._correction(), [prices["ep"], prices[best]], resting)
        self.history.append(np.asarray(flow_WE, dtype=np.float64))
        self._planned, self._plan_after = None, (placement, cost_model)
        return proposals[best]

    def _proposals(self, flow_WE: np.ndarray, placement: Placement, cost_model) -> dict[str, Placement]:
        """Each planner's placement for `flow_WE`. A planner that rests past the next call too is not
        asked: one that plans ahead only records the flow (`observe`: its history stays whole, no
        search — the call before it is priced again runs that), one that decides on the current flow
        alone (shadowing) is skipped."""
        out = {}
        for name, planner in self.planners.items():
            if calls_left(self.rest, name) > 1:
                if getattr(planner, "plans_ahead", False):
                    planner.observe(flow_WE)
                continue
            out[name] = planner(flow_WE, placement, cost_model)
        return out

    def model_error(self) -> float | None:
        """Mean relative error of the corrected forecasts of the layer's forward + backward, each made
        before it was measured, over the window (None: fewer than `min_observations`)."""
        return self.correction.model_error()


def share_correction(layers) -> list[AutoPlanner]:
    """Link the `strategy="auto"` planners of `layers` (one model's MoE layers, in order): the
    machine's factors are fitted on every layer's measurements, each layer with its own fixed costs
    and level, once a forward, by the last layer (`auto_correction`, "Layers"). Called where a model
    is built (`training.model`, `bench.blocks`, `hf.convert`), beside `share_schedule_choice`;
    returns the linked planners."""
    planners = [layer.planner for layer in layers if isinstance(layer.planner, AutoPlanner)]
    for planner in planners:
        planner.peers = planners if len(planners) > 1 else []
    return planners
