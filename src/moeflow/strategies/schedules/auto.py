"""`schedule="auto"`: the schedule axis of the arbiter — every forward, the cheapest of the candidate
schedules (`sync`, `pairwise`, `pipeline`, ...) on the flow that will run, priced by each one's own
`predict` with the layer's cost model and corrected by what each was measured to take.

Pricing. The layer's dispatch plan is global (identical on every rank): from it the block's
`StepLoad` — rows every rank sends every rank, rows every rank computes per expert — is the one the
simulator prices, so each candidate's `predict(step, cost_model, dispatcher)` is its predicted
forward + backward time of this very block.

Correction. A schedule's overlap is what a cost model gets most wrong on a given machine (on CPUs the
transfers and the GEMMs share the cores: the model's overlap is not there). The candidates are timed
in rounds: in a round each runs one forward, in turn, the same order on every rank, each round in
the opposite direction of the one before (so that a drift of the machine's speed within a round —
the first iterations run slower — favours no candidate). The first `trials` rounds run every
candidate (the first of them a warm-up, left out); after them, every `retrial_every` forwards, a
re-trial round runs the schedule chosen and every candidate priced at most `retrial_band` above it
(those whose price a better measurement could bring below it; the others are not run again and
keep the factor of their last round). A round's forwards are timed: the block's forward wall time,
and its backward from the gradient reaching the block's outputs to the gradient leaving its sent
rows (an identity mark on each), or, when nothing before the block needs a gradient (a first layer
fed by data), to the end of the backward pass (an autograd engine callback; what runs after the
block's own nodes — the copies' gradient sums, the gate — is then timed with it): cheap, no
synchronisation. (A first layer's
backward used to go untimed: its factors were forward-only, and put `pipeline` 9–34% under
`pairwise` there while whole iterations measured it slower.) When a round has run (at the next
forward, its backwards done), the ranks take the maximum of each candidate's measured / predicted
over the group (one all-reduce of C numbers: the block ends with its slowest rank); of the last
`_ROUNDS` rounds, each candidate's factor `s_c` is the reference's median measured / predicted times
the median, over the rounds both ran, of the candidate's over the reference's (`round_factors`; the
reference: the candidate in most rounds, usually the running schedule). Per call, because the calls ran
different flows and placements; paired within rounds, because only forwards run side by side
compare: a slow spell of the machine moves every factor alike. (The factors used to be each
candidate's own median over its latest calls, agreed every 4 forwards: the running schedule's
from the last few forwards, the others' from the trials. A slow spell of the running schedule
was then priced against the others' older, faster times: in a 100-iteration Zipf 0 run on the
2 × 1 testbed `schedule=auto` left `pairwise` for `pipeline` after 8 forwards and ran it 192 of 200,
and a candidate timed in a slow spell stayed priced by it. Factors resting on the trials alone let
`pipeline`, chosen on them, run every timed iteration of a 2 × 1 testbed suite 10% slower than
`pairwise`: the re-trial rounds let a choice made on a few noisy trials be corrected.) Candidates
are priced `s_c · predict_c` (`prices`), in seconds of forward + backward. With `strategy="auto"`
too, the placement is chosen first, priced with the planner's online correction as fitted on the
layers the running schedule ran (compute, exchanges and copies apart; `planners.auto`), and this
arbiter then picks the schedule for the plan that results. (The placement used to be priced with
these block prices — one factor per schedule for the compute and the exchanges together: on the
2 × 1 testbed suite that lost 4–7% over the suite to the placement arbiter alone on `sync`, runs n
and o in docs/benchmarks.md.) Trials are 5 rounds (4 after the warm-up): on the 2 × 1 testbed a
forward's time scatters ±10%, and with 2 the choice followed the noise.

One schedule per model (`share_schedule_choice`). The trials time configurations where every layer
runs the same candidate (they run in lock-step: each layer is called once per iteration); a layer
choosing on its own would pick mixes that were never measured, and mixes measured slower than
either pure schedule (2 blocks, Zipf 0.8, 2 local gloo ranks: `sync` in layer 0 + `pairwise` in layer 1
0.499 s against 0.461 s for `pairwise` in both, although the blocks' own timings put the mix within 2%).
Layers linked by one `ScheduleBoard` choose together: each posts its corrected prices, and the
first layer of each forward picks for all the `preferred` candidate of the sum over the layers (the
other layers' prices from their last forward), and, when a re-trial round is due, its members.

Every rank computes the same choice: predictions come from global numbers, factors change only
when a round has run, after the all-reduce, and the layers post to the board in the same order.
`chosen` names the schedule that ran (per layer, in `MoEStats.schedule`); `last` records each
candidate's corrected price.

Shape suffixes: S source ranks, E experts, D destination ranks, W ranks, C candidates.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.distributed as dist

from moeflow.core.checks import finite_number, positive_int
from moeflow.core.expert_shape import ExpertShape
from moeflow.core.hooks import time_backward
from moeflow.strategies.schedules.base import ExchangeBlock, PredictedBlock, Schedule, StepLoad


@dataclass(frozen=True)
class AutoScheduleOptions:
    """Options of `schedule="auto"` (`--set moe.schedule_options.<key>=...`)."""

    candidates: str = ""
    """Comma list of schedules to choose among, each with its default options (names registered in
    `moeflow.strategies.SCHEDULES`); empty: every registered schedule. Those that do not run with
    the layer's dispatcher are left out."""
    trials: int = 5
    """Rounds of every candidate timed before the choice (the first a warm-up, left out)."""
    min_gain: float = 0.03
    """A candidate replaces one listed before it (simpler: `sync`, `pairwise`, then `pipeline`) only
    when its corrected price is at least this fraction lower (module docstring)."""
    retrial_every: int = 16
    """After the trials, a re-trial round every this many forwards (module docstring)."""
    retrial_band: float = 0.1
    """A re-trial round runs the schedule chosen and the candidates priced at most this fraction above it."""

    def __post_init__(self) -> None:
        names = self.names()
        if "auto" in names or len(set(names)) != len(names):
            raise ValueError(f"candidates={self.candidates!r}: expected a comma list of distinct schedule names")
        positive_int("trials", self.trials)
        positive_int("retrial_every", self.retrial_every)
        finite_number("min_gain", self.min_gain, 0.0, 1.0)
        finite_number("retrial_band", self.retrial_band, 0.0)
        if self.min_gain >= 1.0:
            raise ValueError(f"min_gain={self.min_gain!r}: expected a fraction in [0, 1)")

    def names(self) -> list[str]:
        return [n.strip() for n in self.candidates.split(",") if n.strip()]


@dataclass
class ScheduleDecision:
    """One forward's choice: each candidate's corrected price (seconds, forward + backward)."""

    prices: dict[str, float]
    chosen: str
    exploring: bool


def preferred(prices: dict[str, float], min_gain: float) -> str:
    """The candidate to run: in the candidates' order, each one replaces the choice so far only when
    priced at least `min_gain` below it (module docstring); `min_gain=0`: the cheapest, ties to the
    first."""
    names = list(prices)
    best = names[0]
    for name in names[1:]:
        if prices[name] < (1.0 - min_gain) * prices[best]:
            best = name
    return best


class ScheduleBoard:
    """The shared choice of the `AutoSchedule`s of one model (module docstring). Each forward (the
    layers' common call count) the first layer to decide decides for all — the `preferred` candidate
    of the corrected prices summed over the layers (its own on this forward's flow, the others' from
    their last forward), and the members of a re-trial round when one is due; the later layers run
    those decisions and post their prices for the next."""

    def __init__(self) -> None:
        self.prices: dict[int, dict[str, float]] = {}
        """The latest corrected prices of each member (by id)."""
        self.call: int | None = None
        self.decided: dict[str, object] = {}
        """What was decided for forward `call`, by kind ("choice", "round")."""

    def total(self, member: int, prices: dict[str, float]) -> dict[str, float]:
        """Each candidate's price summed over the members, `member`'s replaced by `prices`."""
        rows = {**self.prices, member: prices}.values()
        return {name: sum(row[name] for row in rows) for name in prices}

    def post(self, member: int, prices: dict[str, float]) -> None:
        self.prices[member] = prices

    def once(self, call: int, kind: str, decide):
        """What `decide()` returns, called by the first member to ask in forward `call`."""
        if self.call != call:
            self.call, self.decided = call, {}
        if kind not in self.decided:
            self.decided[kind] = decide()
        return self.decided[kind]


def share_schedule_choice(layers) -> ScheduleBoard | None:
    """Link the `schedule="auto"` arbiters of `layers` (one model's MoE layers) to one board: every
    layer then runs the same schedule. None if fewer than two arbitrate. Called where a model is
    built (`training.model`, `bench.blocks`); a model built otherwise can call it the same way."""
    arbiters = [layer.schedule for layer in layers if isinstance(layer.schedule, AutoSchedule)]
    if len(arbiters) < 2:
        return None
    names = [list(a.candidates) for a in arbiters]
    if any(n != names[0] for n in names):
        raise ValueError(f"schedule='auto' layers with different candidates {names}: one choice needs the same ones")
    board = ScheduleBoard()
    for arbiter in arbiters:
        arbiter.board = board
    return board


def step_load(plan_SED: np.ndarray, shape: ExpertShape, node_of) -> StepLoad:
    """The block's `StepLoad` from the layer's global dispatch plan `[S, E, D]` (rows source s sends
    destination d for expert e; the diagonal source = destination stays local)."""
    plan = np.asarray(plan_SED, dtype=np.float64)
    return StepLoad(plan.sum(1), plan.sum(0).T, shape, node_of)


_WINDOW = 32
"""Timed calls kept per candidate, for the stats (the newest)."""

_ROUNDS = 16
"""Rounds the factors are taken over (the newest)."""


def round_factors(rounds, names: list[str]) -> dict[str, float]:
    """Each candidate's factor from `rounds` (each: candidate -> measured / predicted of its call in
    that round): the reference's median ratio times the median over the rounds both ran of the
    candidate's ratio over the reference's (module docstring). The reference is the candidate in
    most rounds (ties: the first of `names`); candidates never in a round with it have none."""
    rounds = list(rounds)
    counts = {name: sum(name in r for r in rounds) for name in names}
    reference = max(names, key=lambda name: counts[name])
    if counts[reference] == 0:
        return {}
    level = float(np.median([r[reference] for r in rounds if reference in r]))
    factors = {}
    for name in names:
        relative = [r[name] / r[reference] for r in rounds if name in r and reference in r]
        if relative:
            factors[name] = level * float(np.median(relative))
    return factors


def retrial_members(prices: dict[str, float], chosen: str, band: float) -> list[str]:
    """The candidates of a re-trial round: `chosen` and those priced at most `band` above it, in the
    candidates' order; none when only `chosen` is."""
    members = [name for name, price in prices.items() if name == chosen or price <= (1.0 + band) * prices[chosen]]
    return members if len(members) > 1 else []


@dataclass
class _Timings:
    measured_s: deque = field(default_factory=lambda: deque(maxlen=_WINDOW))
    """[forward, backward or None] seconds of each timed call (backward filled when it ran)."""
    predicted_s: deque = field(default_factory=lambda: deque(maxlen=_WINDOW))
    factor: float | None = None
    """`s_c` (`round_factors`); None before the first round with the reference."""

    def medians(self) -> tuple[float, float]:
        """(measured forward + backward, predicted) medians over the timed calls whose backward ran
        (all, forward only, if none did: evaluation)."""
        pairs = list(zip(self.measured_s, self.predicted_s))
        whole = [(f + b, p) for (f, b), p in pairs if b is not None]
        pairs = whole or [(f, p) for (f, _), p in pairs]
        return float(np.median([m for m, _ in pairs])), float(np.median([p for _, p in pairs]))


@dataclass
class _Round:
    """A round in progress: its first call, its candidates in running order, and each one's timed
    call ([forward, backward or None] seconds, predicted seconds)."""

    index: int
    start: int
    order: list[str]
    timed: dict[str, tuple[list, float]] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.start + len(self.order)

    def ratios(self) -> dict[str, float]:
        """Each member's measured / predicted: forward + backward, or forward alone for every member
        when one's backward did not run (evaluation)."""
        whole = all(entry[1] is not None for entry, _ in self.timed.values())
        return {
            name: (entry[0] + (entry[1] if whole else 0.0)) / predicted_s
            for name, (entry, predicted_s) in self.timed.items()
            if predicted_s > 0
        }


class AutoSchedule(Schedule):
    """The arbiter over schedules (module docstring)."""

    def __init__(self, candidates: dict[str, Schedule], shape: ExpertShape, cost_model, options=None) -> None:
        self.options = options or AutoScheduleOptions()
        self.candidates = dict(candidates)
        self.shape, self.cost_model = shape, cost_model
        self.timings = {name: _Timings() for name in self.candidates}
        self.rounds: deque[dict[str, float]] = deque(maxlen=_ROUNDS)
        """Each completed round's agreed measured / predicted per candidate (`round_factors`)."""
        self.round: _Round | None = None
        self.rounds_started = 0
        self.calls = 0
        self.chosen: str | None = None
        self.last: ScheduleDecision | None = None
        self.board: ScheduleBoard | None = None
        """Shared with the model's other layers (`share_schedule_choice`); None: this layer chooses alone."""

    def runs_with(self, dispatcher) -> bool:
        return any(s.runs_with(dispatcher) for s in self.candidates.values())

    def check_dispatcher(self, dispatcher) -> None:
        """Keep the candidates that run with `dispatcher` (`sync` runs with any)."""
        super().check_dispatcher(dispatcher)
        self.candidates = {n: s for n, s in self.candidates.items() if s.runs_with(dispatcher)}
        self.timings = {n: self.timings[n] for n in self.candidates}

    def prices(self, predicted: dict[str, float]) -> dict[str, float]:
        """Each candidate's predicted price times its measured factor (1 before its first round)."""
        return {n: p * (self.timings[n].factor or 1.0) for n, p in predicted.items()}

    def predicted(self, plan_SED: np.ndarray, node_of, dispatcher) -> dict[str, float]:
        """Each candidate's model time (forward + backward) of the block of this dispatch plan
        (`node_of` None: the cost model's)."""
        node_of = node_of if node_of is not None else self.cost_model.topology.node_of
        step = step_load(np.asarray(plan_SED, dtype=np.float64), self.shape, node_of)
        return {n: float(s.predict(step, self.cost_model, dispatcher).total_s) for n, s in self.candidates.items()}

    def choose(self, predicted: dict[str, float]) -> ScheduleDecision:
        """The candidate of this call: the round's (trials, re-trials), else the `preferred` corrected
        price (of this layer, or summed over the board's layers). Starts a round when one is due."""
        prices = self.prices(predicted)
        totals = prices
        if self.board is not None:
            self.board.post(id(self), prices)
            totals = self.board.total(id(self), prices)
        if self.round is None:
            order = self._decide("round", lambda: self._round_due(totals))
            if order:
                self.round = _Round(self.rounds_started, self.calls, order)
                self.rounds_started += 1
        if self.round is not None:
            return ScheduleDecision(prices, self.round.order[self.calls - self.round.start], True)
        return ScheduleDecision(prices, self._decide("choice", lambda: preferred(totals, self.options.min_gain)), False)

    def _decide(self, kind: str, decide):
        """`decide()`, or for a layer on a board the decision its first layer made this forward."""
        return decide() if self.board is None else self.board.once(self.calls, kind, decide)

    def _round_due(self, totals: dict[str, float]) -> list[str]:
        """The order of the round starting at this call; empty when none does (module docstring)."""
        names, tried = list(self.candidates), self.options.trials * len(self.candidates)
        if self.calls < tried:
            members = names if self.calls % len(names) == 0 else []
        elif self.calls > tried and (self.calls - tried) % self.options.retrial_every == 0:
            members = retrial_members(totals, preferred(totals, self.options.min_gain), self.options.retrial_band)
        else:
            members = []
        return members if self.rounds_started % 2 == 0 else members[::-1]  # a drift within rounds cancels

    def execute(self, block: ExchangeBlock) -> torch.Tensor:
        if block.group is None or len(self.candidates) == 1:
            self.chosen = next(iter(self.candidates))
            return self.candidates[self.chosen].execute(block)
        if self.round is not None and self.calls >= self.round.end:  # its backwards have run
            self.finish_round(block.group)
        predicted = self.predicted(block.plan_SED, block.node_of, block.dispatcher)
        self.last = self.choose(predicted)
        self.chosen = self.last.chosen
        self.calls += 1
        if self.round is None:
            return self.candidates[self.chosen].execute(block)
        timing = self.timings[self.chosen]
        entry: list = [0.0, None]  # forward, backward seconds
        timing.measured_s.append(entry)
        timing.predicted_s.append(predicted[self.chosen])
        self.round.timed[self.chosen] = (entry, predicted[self.chosen])
        x_sent_AD, close = time_backward(block.x_sent_AD, lambda seconds: entry.__setitem__(1, seconds))
        started = time.perf_counter()
        out = self.candidates[self.chosen].execute(replace(block, x_sent_AD=x_sent_AD))
        entry[0] = time.perf_counter() - started
        return close(out)

    def finish_round(self, group) -> None:
        """Every rank the same round: the slowest rank's measured / predicted per member (one
        all-reduce; `group` None: this process's own); then the factors (`record_round`). The first
        trial round is a warm-up."""
        finished, self.round = self.round, None
        ratios = finished.ratios()
        if group is not None:
            names = list(self.candidates)
            ratio_C = torch.tensor([ratios.get(n, -1.0) for n in names], dtype=torch.float64)
            dist.all_reduce(ratio_C, op=dist.ReduceOp.MAX, group=group)
            ratios = {n: r for n, r in zip(names, ratio_C.tolist()) if r > 0}
        if finished.index > 0 or self.options.trials == 1:
            self.record_round(ratios)

    def record_round(self, ratios: dict[str, float]) -> None:
        """Add one agreed round (candidate -> measured / predicted) and set the factors from the rounds kept."""
        self.rounds.append(ratios)
        for name, factor in round_factors(self.rounds, list(self.candidates)).items():
            self.timings[name].factor = factor

    def predict(self, step: StepLoad, cost_model, dispatcher) -> PredictedBlock:
        """The simulator's price: the `preferred` candidate as the model sees it (no measurement to
        correct it there) — over `(iterations, layers)` one per iteration, on the sum over the layers
        (one schedule per model, as `share_schedule_choice` runs it); else one per element."""
        preds = [s.predict(step, cost_model, dispatcher) for s in self.candidates.values() if s.runs_with(dispatcher)]
        shape = np.broadcast_shapes(*(np.shape(p.total_s) for p in preds))
        total_C = np.stack([np.broadcast_to(p.total_s, shape) for p in preds])
        decided_C = total_C.sum(-1, keepdims=True) if len(shape) >= 2 else total_C
        best = np.zeros(decided_C.shape[1:], dtype=np.int64)
        for index in np.ndindex(best.shape):
            best[index] = preferred(dict(enumerate(decided_C[(slice(None), *index)].tolist())), self.options.min_gain)
        best = np.broadcast_to(best, shape)

        def pick(attr: str) -> np.ndarray:
            values_C = np.stack([np.broadcast_to(np.asarray(getattr(p, attr), np.float64), shape) for p in preds])
            return np.take_along_axis(values_C, best[None], axis=0)[0]

        return PredictedBlock(pick("total_s"), pick("compute_s"), pick("comm_s"))
