"""`strategy="auto"`: the cheapest of the planners' placements under the cost model, corrected by
what the layer measures.

Every call each candidate planner proposes its placement for this call (one that plans ahead, the
placement it planned from the past flows), and each proposal is priced on the flow the layer will
run (the count exchange has happened) with the terms every planner uses — three expert computes of
the slowest device, four token exchanges, the copies out and back (FasterMoE Eq. 7, Pro-Prophet
Eq. 6: `prophet_model.price_terms`), from plain EP's terms and each proposal's changed experts
(`PlacementPricer.of_placements`; what does not depend on the flow, a plan's steps and copies, is
kept on the plan, so a plan that stands several calls pays only its dispatch). A proposal equal to
the placement the block-wise prefetch sent ahead has its copies priced as hidden by the window the
prefetch measured (Pro-Prophet Eq. 8). It runs the cheapest, and plain EP unless the cheapest is
predicted `min_gain` faster.

Correction. The layer measures each forward's expert computes, exposed exchanges and wait for
copies on the slowest rank (`strategies.timing`); each term's factor is an exponentially weighted
mean (weight `smoothing`) of measured over predicted, and a price is the sum of its terms times
their factors (copies sent ahead: Eq. 8's exposed part, as measured by the prefetch).

Planning off the critical path. The candidates that plan ahead share the process's one planning
thread (`planners.ahead`). Where their searches are small they all search every call; from
`TURNS_FROM` ranks × experts (`searches="auto"`; or always: `searches="turns"`) one of them per
call, in turn, starts its search for the next call while the others' plans stand (`Planner.record`),
so the thread does one search per layer call instead of one per candidate and the layer does not
wait for a queue of them. Plans that stand a few calls cost some of `auto`'s gain where the load
moves (simulated on FasterMoE's johnny: up to 4% on the SmartMoE trace and a drifting load), so
small layers keep every search. Shadowing decides on this call's flow, as FasterMoE does (§4.1).

Under the prefetch, `next_placement()` (asked during the block before the layer's next call) offers
the cheapest of the planned-ahead placements on the last flow, its copies priced as hidden, when it
is `min_gain` cheaper than plain EP there: that is the placement the prefetch sends ahead. Those
placements are priced on the planning thread behind the searches that make them (`_price_ahead`);
the question itself only applies the corrections. The call's own work is one pricer of its flow,
shared by shadowing's search (`Planner.on_pricer`) and the pricing of every proposal, and the
candidates' standing plans (`Planner.current`). Everything else is one job on the planning thread
once the call has returned (`_after_call`): the candidates record the flow and search
(`Planner.record`), so they do not compete with the call for the interpreter, and the layer does
not wait for their bookkeeping; their next plans are promises that readers wait for, and the next
call (or a checkpoint) waits for the job.

Shape suffixes: W devices (ranks of the expert-parallel group), E experts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from moeflow.core.checks import finite_number
from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import Placement
from moeflow.perf.everywhere_pricing import EverywherePricer
from moeflow.perf.placement_pricing import PlacementPricer, PlacementTerms
from moeflow.strategies.planners.ahead import PlanAhead
from moeflow.strategies.planners.base import Planner, PrefetchWindow
from moeflow.strategies.planners.prophet_model import overlapped_copies
from moeflow.strategies.timing import Ratio, Sample

CANDIDATES = ("ep", "shadow", "prophet", "eplb", "fssdp")
SEARCHES = ("auto", "all", "turns")
TURNS_FROM = 4096
"""Ranks × experts from which `searches="auto"` takes turns: at 64 × 256 the three searches and the
flows recorded take about 4 ms a call together, at 256 × 256 6–11 ms, against the 5 ms of a
layer's exchanges and experts `benchmarks/planner_scale.py` allows them (docs/speed.md)."""


@dataclass(frozen=True)
class AutoOptions:
    """Options of `strategy="auto"` (`--set moe.strategy_options.<key>=...`)."""

    candidates: str = ",".join(CANDIDATES)
    """Comma list of the planners it chooses among (each with its default options); `ep` always."""
    min_gain: float = 0.03
    """Leave plain EP only for a placement predicted at least this fraction faster."""
    smoothing: float = 0.3
    """Weight of a new measurement in each term's factor (module docstring, "Correction")."""
    searches: str = "auto"
    """The candidates that plan ahead: `all` search every call, `turns` one per call in turn (module
    docstring, "Planning off the critical path"); `auto`: in turns from `TURNS_FROM` ranks × experts."""

    def __post_init__(self) -> None:
        names = self.names()
        unknown = [n for n in names if n not in CANDIDATES]
        if not names or unknown or len(set(names)) != len(names):
            raise ValueError(f"candidates={self.candidates!r}: expected a comma list of {list(CANDIDATES)}")
        finite_number("min_gain", self.min_gain, 0.0, 1.0)
        if self.min_gain >= 1.0:
            raise ValueError(f"min_gain={self.min_gain!r}: expected a fraction in [0, 1)")
        finite_number("smoothing", self.smoothing, 0.0, 1.0, low_open=True)
        if self.searches not in SEARCHES:
            raise ValueError(f"searches={self.searches!r}: expected one of {list(SEARCHES)}")

    def names(self) -> list[str]:
        """The candidates, plain EP first."""
        names = [n.strip() for n in self.candidates.split(",") if n.strip()]
        return ["ep", *(n for n in names if n != "ep")]


class Terms(NamedTuple):
    """A placement's predicted time on a flow, term by term (seconds, uncorrected)."""

    compute: float
    """One forward expert compute of the slowest device (backward: twice)."""
    exchange: float
    """The forward's two token exchanges (backward: two more)."""
    copies: float
    """Copies out and their gradients back; sent ahead, the part Eq. 8 leaves exposed."""
    copies_forward: float
    """The copies out, sent now (what the forward waits for; 0 when sent ahead)."""


def layer_terms(
    flow_WE: np.ndarray,
    placement: Placement,
    cost_model,
    shape: ExpertShape,
    node_of=None,
    window: PrefetchWindow | None = None,
) -> Terms:
    """The terms of one forward + backward of `placement` on `flow_WE`; `window`: its copies were
    sent ahead by the prefetch, hidden as Eq. 8 with the measured window says."""
    pricer = PlacementPricer(np.rint(flow_WE), placement.owner_E, cost_model, shape, node_of)
    return _terms(pricer.placements([placement.holders_EW]), 0, window)


def _after_call(
    planners: dict, plans: dict, flow_WE: np.ndarray, cost_model, replanned: list, prefetch: bool, *call
) -> dict | None:
    """`auto`'s job on the planning thread after a call: each candidate that plans ahead records the
    flow and, in its turn, searches (`Planner.record`), settling the plan its readers wait for
    (`plans`: what `Planner.defer` returned); under the prefetch, the plans so made are priced for
    its question (`_price_ahead`). `call`: the call's (pricer, owners, priced proposals, proposals)."""
    placement = call[1]
    waiting = list(plans)  # the candidates whose plans readers still wait for
    try:
        while waiting:
            name = waiting[0]
            planners[name].record(flow_WE, placement, cost_model, name in replanned, plans[name])
            waiting.pop(0)
    except BaseException as error:  # the candidates after it never recorded: their readers learn why
        for name in waiting[1:]:
            if plans[name] is not None:
                plans[name][1].set_exception(error)
        raise
    return _price_ahead(planners, *call) if prefetch else None


def _price_ahead(planners: dict, pricer: PlacementPricer, placement: Placement, priced, proposals: list) -> dict:
    """The plans made ahead that the prefetch may send (other copies than the owners', the same
    owners) and plain EP, each with its terms `(PlacementTerms, row)` on the last call's flow, with
    that call's pricer: the proposals it priced (`priced`, in `proposals` order) are not priced
    again. Runs on the planning thread after the searches whose plans it reads (`Planner.planned`)."""
    seen = {p.holders_EW.tobytes(): (priced, c) for c, p in enumerate(proposals)}
    owners = Placement.owners_only(placement.owner_E, placement.world_size)
    wanted = {"ep": owners}
    for name, planner in planners.items():
        plan = planner.planned().result() if planner.plans_ahead else None
        p = None if plan is None else plan[0]
        if p is not None and not p.is_owners_only() and np.array_equal(p.owner_E, placement.owner_E):
            wanted[name] = p
    new = {p.holders_EW.tobytes(): p for p in wanted.values() if p.holders_EW.tobytes() not in seen}
    if new:
        more = pricer.of_placements(list(new.values()))
        seen = seen | {key: (more, c) for c, key in enumerate(new)}
    return {name: (p, seen[p.holders_EW.tobytes()]) for name, p in wanted.items()}


def _terms(terms: PlacementTerms, c: int, window: PrefetchWindow | None) -> Terms:
    """Candidate c's `Terms` (`layer_terms`)."""
    row = (float(terms.compute_s[c]), float(terms.a2a_s[c]), float(terms.trans_s[c]), float(terms.agg_s[c]))
    return _row_terms(terms, c, *row, window)


def _every_terms(terms: PlacementTerms, windows: list[PrefetchWindow | None]) -> list[Terms]:
    """Every candidate's `Terms` (window c: candidate c's), the arrays read once."""
    compute, a2a, trans, agg = (a.tolist() for a in (terms.compute_s, terms.a2a_s, terms.trans_s, terms.agg_s))
    return [_row_terms(terms, c, compute[c], a2a[c], trans[c], agg[c], w) for c, w in enumerate(windows)]


def _row_terms(terms, c, compute: float, a2a: float, trans: float, agg: float, window) -> Terms:
    """Candidate c's `Terms` from its row: the forward's two exchanges; its copies sent now, or sent
    ahead through `window` (`_hidden`)."""
    if window is None:
        return Terms(compute, 2 * a2a, trans + agg, trans)
    return _hidden(terms, c, compute, 2 * a2a, window)


def _hidden(terms: PlacementTerms, c: int, compute: float, exchange: float, window: PrefetchWindow) -> Terms:
    """Candidate c's `Terms` with its copies sent ahead by the prefetch (Eq. 8, the measured window)."""
    hidden = overlapped_copies(
        terms.trans_prefetched_s[c],
        terms.agg_prefetched_s[c],
        compute,
        window.nonmoe_forward_s,
        window.hidden_share,
        window.experts_hide,
    )
    return Terms(compute, exchange, float(hidden), 0.0)


@dataclass
class AutoDecision:
    """One call: each candidate's corrected price (forward + backward, seconds) and the choice."""

    prices_s: dict[str, float]
    chosen: str

    @property
    def predicted_s(self) -> list[float]:
        """[plain EP's price, the chosen one's]."""
        return [self.prices_s["ep"], self.prices_s[self.chosen]]

    @property
    def best_s(self) -> float:
        return self.prices_s[self.chosen]


class AutoPlanner(Planner):
    """`strategy="auto"` (module docstring)."""

    name = "auto"
    needs_cost_model = True
    plans_ahead = True
    observes_time = True

    def __init__(self, shape: ExpertShape, planners: dict[str, Planner], options: AutoOptions | None = None):
        self.shape = shape
        self.options = options or AutoOptions()
        self.planners = planners
        self.searching = [name for name, p in self.planners.items() if p.plans_ahead]
        """Candidates that search on the planning thread (every call, or one per call in turn)."""
        self.calls = 0
        self.replanned: list[str] = []
        """The candidates whose searches the last call started."""
        self.factors = {term: Ratio(self.options.smoothing) for term in ("compute", "exchange", "copies")}
        self.pending: deque[Terms] = deque(maxlen=64)  # the running placements' terms, not yet measured
        self.errors: deque[tuple[float, float]] = deque(maxlen=32)  # (forecast, measured) forward seconds
        self.prefetch: PrefetchWindow | None = None
        self.sent_ahead: Placement | None = None
        self._last_call: tuple | None = None  # (its pricer, owners, priced proposals, proposals)
        self._ahead = PlanAhead()  # the last call's `_after_call`, on the planning thread
        self.last: AutoDecision | None = None

    def factor(self, term: str) -> float:
        """The term's measured / predicted (1 until measured; 0 is a measurement: e.g. exchanges a
        schedule hides entirely)."""
        value = self.factors[term].value
        return 1.0 if value is None else value

    def price(self, t: Terms) -> float:
        """Corrected forward + backward time (module docstring)."""
        copies = t.copies if t.copies_forward == 0.0 else self.factor("copies") * t.copies
        return self.factor("compute") * 3 * t.compute + self.factor("exchange") * 2 * t.exchange + copies

    def __call__(self, flow_WE: np.ndarray, placement: Placement, cost_model=None) -> Placement:
        if cost_model is None:
            raise ValueError("strategy='auto' needs cost_model= (a moeflow.perf.costmodel.CostModel)")
        node_of = cost_model.topology.node_of
        # In turns: one candidate searches per call, the others' plans stand (every rank counts the
        # same calls and sees the same flow's shape, so every rank asks the same candidates).
        W, E = np.shape(flow_WE)
        turns = self.options.searches == "turns" or (self.options.searches == "auto" and W * E >= TURNS_FROM)
        turn = self.searching[self.calls % len(self.searching)] if self.searching else None
        self.replanned = [n for n in self.searching if n == turn or not turns]
        self.calls += 1
        # One pricer of this flow in whole tokens (a mean of replicas' flows rounded, as every planner
        # prices it): the planners that decide on it (shadowing) search on it, and every proposal is
        # priced on it (`PlacementPricer.of_placements`: the owners' terms once, then each proposal's
        # changed experts); all share the layer's owners.
        raw = np.asarray(flow_WE)
        counts = raw.dtype.kind in "iub"  # the count exchange's int64 (a caller's own flow may be fractional)
        # Whole counts as they are (the pricer's compiled sums read them so): a copy, which the job
        # after the call records too (captured now, as every input of the planning thread's work).
        flow = np.array(raw) if counts else np.rint(raw)
        pricer = EverywherePricer(flow, placement.owner_E, cost_model, self.shape, node_of, whole=True)
        self._settle()  # the last call's job: the candidates' windows and plans
        proposals = {
            name: planner.current(flow_WE, placement, cost_model)
            if planner.plans_ahead
            else planner.on_pricer(pricer, flow_WE, placement, cost_model)
            for name, planner in self.planners.items()
        }
        moved = [
            name
            for name, p in proposals.items()
            if p.owner_E is not placement.owner_E and not np.array_equal(p.owner_E, placement.owner_E)
        ]
        if moved:
            raise ValueError(f"strategy='auto': candidates {moved} proposed other owners than the layer's")
        priced = pricer.of_placements(list(proposals.values()))
        windows = [self.prefetch if p == self.sent_ahead else None for p in proposals.values()]
        terms = dict(zip(proposals, _every_terms(priced, windows)))
        prices = {name: self.price(t) for name, t in terms.items()}
        best = self._cheapest(prices)
        self.pending.append(terms[best])
        self.last, self.sent_ahead = AutoDecision(prices, best), None
        # The rest is off the layer's path, one job on the planning thread once this call's work is
        # done (there it would hold the interpreter's lock against the call's small array
        # operations): the candidates record the flow and search (`Planner.record`), then the plans
        # they made are priced for the prefetch's question (`next_placement`).
        self._last_call = (pricer, placement, priced, list(proposals.values()))
        # Each candidate's next plan: made by the job, readers wait for it (`Planner.defer`).
        plans = {n: p.defer() for n, p in self.planners.items() if p.plans_ahead}
        self._ahead = PlanAhead()
        job = (
            self.planners,
            plans,
            flow if counts else np.array(raw),
            cost_model,
            list(self.replanned),
            self.prefetch is not None,
        )
        self._ahead.submit(_after_call, *job, *self._last_call)
        return proposals[best]

    def _settle(self) -> None:
        """Wait for the last call's job (`_after_call`): the candidates are read only after it."""
        self._ahead.result()

    def __getstate__(self) -> dict:
        """Copies and checkpoints carry the candidates as the last call's job left them."""
        self._settle()
        return dict(self.__dict__)

    def _cheapest(self, prices: dict[str, float]) -> str:
        """The cheapest (ties: the first candidate), unless not `min_gain` cheaper than plain EP."""
        best = min(prices, key=prices.get)
        return best if prices[best] <= (1.0 - self.options.min_gain) * prices["ep"] else "ep"

    def choice(self) -> str | None:
        return None if self.last is None else self.last.chosen

    def next_placement(self) -> Placement | None:
        """The placement to send ahead (module docstring), or None."""
        if self.prefetch is None or self._last_call is None:
            return None
        # Priced on the planning thread (after the call's searches), or here if the prefetch came later.
        ahead = self._ahead.result()
        if ahead is None:
            ahead = _price_ahead(self.planners, *self._last_call)
        prices = {
            n: self.price(_terms(*terms, None if n == "ep" else self.prefetch)) for n, (_, terms) in ahead.items()
        }
        best = self._cheapest(prices)
        self.sent_ahead = None if best == "ep" else ahead[best][0]
        return self.sent_ahead

    def use_prefetch(self, window: PrefetchWindow | None) -> None:
        self._settle()
        self.prefetch = window
        for planner in self.planners.values():
            planner.use_prefetch(window)

    def observe_time(self, samples: list[Sample]) -> None:
        """Pair the measured forwards with the terms of the placements they ran (the latest ones:
        a forward the planner did not plan — another cluster's cost model — is none of them)."""
        pending = list(self.pending)[-len(samples) :]
        self.pending.clear()
        for t, s in zip(pending, samples[-len(pending) :]):
            forecast = self.factor("compute") * t.compute + self.factor("exchange") * t.exchange
            forecast += self.factor("copies") * t.copies_forward
            self.errors.append((forecast, s.compute_s + s.exchange_s + s.copies_s))
            self.factors["compute"].update(s.compute_s, t.compute)
            self.factors["exchange"].update(s.exchange_s, t.exchange)
            if t.copies_forward > 0.0:
                self.factors["copies"].update(s.copies_s, t.copies_forward)

    def model_error(self) -> float | None:
        """Mean relative error of the corrected forecasts of the forwards measured (None: none yet)."""
        if not self.errors:
            return None
        forecast, measured = np.asarray(self.errors).T
        return float(np.mean(np.abs(forecast - measured) / np.maximum(measured, 1e-12)))
