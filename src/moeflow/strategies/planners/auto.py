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
`window` flows it saw) with their copies priced as the block-wise prefetch hides them (Eq. 8 with
the measured share h), and offers it as `next_placement()`, which `core.prefetch.BlockPrefetch`
sends ahead. At the next call that planned placement competes on the real flow, its copies priced
as hidden, with every proposal for the current flow, copies on the critical path; if another wins,
the prefetched copies are drained and the winner's are sent then. The choice after a call is made
when the prefetch first asks for it (or at the next call): by then the planners' own searches
for their next placements have run on the planning thread (`planners.ahead`), off the layer's
critical path.

Online correction. A planner's cost model misprices a machine systematically (on the 2 × 1 testbed
the shadow planner needed a 5% margin for it). The layer times its own forward on every rank and
sends that time with the next count exchange (one more row of the all-gather it runs anyway, no
extra synchronisation), so every rank sees every rank's time and corrects identically. The
arbiter pairs the slowest rank's forward time with what it had predicted for that forward —
compute `fec`, exchanges `a2a/2` (two of the four) and copies `trans` (the copies out) — and fits
measured ≈ s_comp·compute + s_comm·exchanges + s_copy·copies + c (non-negative least squares,
`scipy.optimize.nnls`, over the last `window` forwards; c: the layer's fixed cost, gate and sort).
The copies get their own factor: they run on other collectives than the exchanges (point-to-point,
broadcasts), and a fit that lumped them with the exchanges learnt, from a placement whose copies
cost 3× the model, that EP's exchanges cost 3× too — and kept choosing the copies. A term that no
forward of the window exercised (no copies since EP alone ran) keeps its last factor. Candidates
are then priced with the factors (backward as 2× compute and the other half of the traffic). Until
`min_observations` forwards are in, every factor is 1.

Error. `model_error()` is out of sample: each forward's corrected prediction, made before it ran
(the factors as they were), against what it then measured.

Pricing less. Pricing a proposal (its terms, and its block under every schedule with
`schedule="auto"`) is on the layer's critical path: about 2 ms per distinct placement at 16 devices
(a profile of `benchmarks/planner_overhead.py`, FasterMoE's johnny cluster). A candidate whose price
came out more than `rest_margin` above the winner's rests: it is not priced (nor run) for the next
1, 2, 4, ... calls (doubling each time it loses again, at most `max_rest`), then priced again; a
candidate within the margin or winning is priced every call. Its planner is still called every
iteration (its history stays whole). Plain EP, the guard's reference, is always priced. Every rank
rests the same candidates: the prices are global numbers. The planning thread runs the searches of
the candidates priced at the next call first, so the planned-ahead choice (`next_placement()`) does
not wait for the resting ones.

`AutoDecision` (`planner.last`) records each candidate's corrected price, the choice and the
model's current error; `MoEStats.strategy` names the planner chosen, per layer and step.

Shape suffixes: W devices (ranks of the expert-parallel group), E experts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from scipy.optimize import nnls

from moeflow.core.checks import finite_number, positive_int
from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import Placement, dispatch_counts
from moeflow.strategies.planners.ahead import searches_deferred
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
    """Forwards the online correction fits over."""
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
    scales: tuple[float, float, float, float]
    """(s_comp, s_comm, s_copy, c) of the correction in use."""
    predicted_s: list[float] = field(default_factory=list)
    """[EP's price, the chosen one's]: for the bench's predicted speedup."""
    resting: list[str] = field(default_factory=list)
    """Candidates not priced this call (they lost by more than `rest_margin` recently)."""

    @property
    def best_s(self) -> float:
        return self.predicted_s[-1]


class LayerTerms(NamedTuple):
    """One forward + backward of a layer under a placement, uncorrected (seconds)."""

    compute: float
    """3 expert computes of the slowest device."""
    exchange: float
    """The 4 token exchanges."""
    copies: float
    """The copies out and back (as far as the prefetch does not hide them)."""
    plan_SED: np.ndarray
    """The dispatch plan the terms were priced on."""


def layer_terms(
    flow_WE: np.ndarray, placement: Placement, cost_model, shape: ExpertShape, node_of=None, hidden=None
) -> LayerTerms:
    """The terms of `placement` on `flow_WE` (`placement_times`). `hidden`: (T_nonMoE, h) when the
    copies are prefetched — priced as sent ahead and hidden (Eq. 8)."""
    plan_SED = dispatch_counts(np.rint(flow_WE).astype(np.int64), placement, node_of)
    t = placement_times(cost_model, plan_SED, placement.holders_EW, placement.owner_E, shape, hidden is not None)
    copies = t["trans"] + t["agg"] if hidden is None else overlapped_copies(t["trans"], t["agg"], t["fec"], *hidden)
    return LayerTerms(3.0 * t["fec"], float(t["a2a"]), float(copies), plan_SED)


class PendingForward(NamedTuple):
    """What was predicted for the forward about to run, to pair with its measured time."""

    compute: float
    """Its share of the expert compute (one of three), uncorrected."""
    exchange: float
    """Its share of the exchanges (half), uncorrected."""
    copies: float
    """Its share of the copies (the copies out: half), uncorrected."""
    forecast: float | None
    """Its corrected forward time (None: fewer than `min_observations` forwards seen)."""


def fit_correction(observations, previous=(1.0, 1.0, 1.0)) -> tuple[float, float, float, float]:
    """(s_comp, s_comm, s_copy, c) ≥ 0 with measured ≈ s_comp·compute + s_comm·exchange +
    s_copy·copies + c, least squares over the (compute, exchange, copies, measured) forwards; a term
    that is zero in every forward keeps its `previous` factor (module docstring)."""
    obs = np.asarray(list(observations), dtype=np.float64)
    terms, measured = obs[:, :3], obs[:, 3]
    seen = np.flatnonzero(np.any(terms != 0.0, axis=0))
    coef, _ = nnls(np.column_stack([terms[:, seen], np.ones(len(obs))]), measured)
    factors = np.asarray(previous, dtype=np.float64).copy()
    factors[seen] = coef[:-1]
    return (*map(float, factors), float(coef[-1]))


class AutoPlanner:
    """`strategy="auto"` (module docstring)."""

    needs_cost_model = True
    observes_time = True  # the layer sends its forward times with the count exchange
    plans_ahead = True  # `next_placement()`: the planned-ahead choice, for the block-wise prefetch

    def __init__(self, shape: ExpertShape, planners: dict, options: AutoOptions | None = None):
        self.shape = shape
        self.options = options or AutoOptions()
        self.planners = planners
        self.observations: deque[tuple[float, float, float, float]] = deque(maxlen=self.options.window)
        self.scales = (1.0, 1.0, 1.0, 0.0)
        self.last: AutoDecision | None = None
        self.chosen: str | None = None
        self._pending: PendingForward | None = None
        self.forecasts: deque[tuple[float, float]] = deque(maxlen=self.options.window)  # (forecast, measured)
        self.history: deque[np.ndarray] = deque(maxlen=3)  # flows seen: the predicted flow's window
        self._prefetched = False
        self.nonmoe_forward_s = 0.0  # measured by the prefetch
        self.hidden_share = 0.0  # share of the prefetch windows that hid copies; 0 until measured
        self._planned: tuple[str, Placement] | None = None
        self._plan_after: tuple[Placement, object] | None = None  # the call to plan ahead from, not yet done
        self.rest: dict[str, list[int]] = {}  # name -> [calls it rests now, calls it rests after its next loss]
        self.block_prices: Callable[[np.ndarray], dict[str, float]] | None = None
        """Set by the layer when its schedule is chosen too (`schedule="auto"`): the corrected block
        time of a dispatch plan under each schedule, so placement and schedule are chosen jointly."""

    def __getstate__(self) -> dict:
        """Checkpointed without the layer's `block_prices` link (the resumed layer sets its own), its
        planned-ahead choice made."""
        self._resolve_planned()
        return {k: v for k, v in self.__dict__.items() if k != "block_prices"}

    def observe_time(self, forward_s_W: np.ndarray) -> None:
        """The previous forward's time on every rank (from the count exchange): one observation."""
        slowest = float(np.max(forward_s_W))
        pending, self._pending = self._pending, None
        if pending is None or slowest <= 0:  # nothing predicted, or not timed (evaluation)
            return
        self.observations.append((*pending[:3], slowest))
        if pending.forecast is not None:
            self.forecasts.append((pending.forecast, slowest))
        if len(self.observations) >= self.options.min_observations:
            self.scales = fit_correction(self.observations, self.scales[:3])

    def _fitted(self, compute: float, exchange: float, copies: float) -> float:
        s_comp, s_comm, s_copy, c = self.scales
        return s_comp * compute + s_comm * exchange + s_copy * copies + c

    def price(self, terms: LayerTerms) -> float:
        """Corrected forward + backward time of a placement. With `block_prices` (the layer runs
        `schedule="auto"`): the cheapest schedule's corrected block time, plus the copies."""
        s_comp, s_comm, s_copy, _ = self.scales
        block_prices = getattr(self, "block_prices", None)  # absent on a planner unpickled on its own
        if block_prices is not None:
            return min(block_prices(terms.plan_SED).values()) + s_copy * terms.copies
        return s_comp * terms.compute + s_comm * terms.exchange + s_copy * terms.copies

    def _priced(
        self, flow_WE: np.ndarray, placements: dict[str, Placement], cost_model, hidden=None
    ) -> dict[str, tuple[LayerTerms, float]]:
        """Each placement's terms and corrected price on `flow_WE` (`layer_terms`, `price`). The
        planners often propose the same placement (plain EP, most of all, on an even load): each
        distinct one is priced once — pricing is on the layer's critical path."""
        memo: dict[bytes, tuple[LayerTerms, float]] = {}
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
            if getattr(p, "plans_ahead", False) and self.rest.get(n, [0, 0])[0] == 0  # resting: not priced next call
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
            proposals = {name: planner(flow_WE, placement, cost_model) for name, planner in self.planners.items()}
            proposals.setdefault("ep", Placement.owners_only(placement.owner_E, placement.world_size))
            resting = [n for n in proposals if n != "ep" and self.rest.get(n, [0, 0])[0] > 0]
            proposals = {n: p for n, p in proposals.items() if n not in resting}
            priced = self._priced(flow_WE, proposals, cost_model)
            if planned is not None:  # sent ahead: its copies hidden as far as the prefetch hides them
                name = f"{planned[0]}+prefetch"
                proposals[name] = planned[1]
                priced |= self._priced(flow_WE, {name: planned[1]}, cost_model, self._hidden())
            terms = {name: t for name, (t, _) in priced.items()}
            prices = {name: price for name, (_, price) in priced.items()}
            best = min(prices, key=lambda name: (prices[name], name != "ep"))
            if prices[best] > (1.0 - self.options.min_gain) * prices["ep"]:
                best = "ep"
            self._update_rest(prices, resting, [n for n, p in proposals.items() if p.is_owners_only()])
            # First the searches whose plans the next call prices: `next_placement()` waits for those only.
            rests = {id(getattr(self.planners[n], "next_plan", None)) for n, (left, _) in self.rest.items() if left > 0}
            searches.sort(key=lambda plan: id(plan) in rests)
        chosen = terms[best]
        # Forward share: one expert compute of three; the dispatch and combine (half the exchanges),
        # the copies out (about half the copies' traffic).
        shares = (chosen.compute / 3.0, chosen.exchange / 2.0, chosen.copies / 2.0)
        fitted = len(self.observations) >= self.options.min_observations
        self._pending = PendingForward(*shares, self._fitted(*shares) if fitted else None)
        self.chosen = best
        self.last = AutoDecision(prices, best, self.scales, [prices["ep"], prices[best]], resting)
        self.history.append(np.asarray(flow_WE, dtype=np.float64))
        self._planned, self._plan_after = None, (placement, cost_model)
        return proposals[best]

    def _update_rest(self, prices: dict[str, float], resting: list[str], as_ep: list[str]) -> None:
        """Count down the resting candidates; rest those priced above the winner by more than
        `rest_margin` (1, 2, 4, ... calls, at most `max_rest`); a candidate within the margin is
        priced every call again (module docstring). Not rested for it: those that proposed plain EP's
        placement (`as_ep`: free to price, and a planner without history yet proposes that)."""
        for name in resting:
            self.rest[name][0] -= 1
        if self.options.max_rest == 0:
            return
        limit = (1.0 + self.options.rest_margin) * min(prices.values())
        best_of: dict[str, float] = {}  # a planner's best price: its proposal, or its prefetched plan
        for name, price in prices.items():
            base = name.removesuffix("+prefetch")
            if base in self.planners and name not in as_ep:
                best_of[base] = min(price, best_of.get(base, price))
        for name, price in best_of.items():
            state = self.rest.setdefault(name, [0, 1])
            if price > limit:
                state[0], state[1] = state[1], min(2 * state[1], self.options.max_rest)
            else:
                state[:] = [0, 1]

    def model_error(self) -> float | None:
        """Mean relative error of the corrected forward predictions, each made before its forward ran,
        over the window (None: fewer than `min_observations`)."""
        if len(self.forecasts) < self.options.min_observations:
            return None
        forecast, measured = np.asarray(self.forecasts).T
        return float(np.mean(np.abs(forecast - measured) / measured))
