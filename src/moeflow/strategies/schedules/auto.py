"""`schedule="auto"`: the schedule axis of the arbiter — every forward, the cheapest of the candidate
schedules (`sync`, `pairwise`, `pipeline`, ...) on the flow that will run, priced by each one's own
`predict` with the layer's cost model and corrected by what each was measured to take.

Pricing. The layer's dispatch plan is global (identical on every rank): from it the block's
`StepLoad` — rows every rank sends every rank, rows every rank computes per expert — is the one the
simulator prices, so each candidate's `predict(step, cost_model, dispatcher)` is its predicted
forward + backward time of this very block.

Correction. A schedule's overlap is what a cost model gets most wrong on a given machine (on CPUs the
transfers and the GEMMs share the cores: the model's overlap is not there). The first `trials`
forwards of each candidate are run in turn (round robin, the same order on every rank, each round
in the opposite direction of the one before, so that a drift of the machine's speed over the trials
— the first iterations run slower — favours no candidate) and timed: the block's forward wall time,
and its backward from the gradient reaching the block's outputs to the gradient leaving its sent
rows (an identity mark on each), or, when nothing before the block needs a gradient (a first layer
fed by data), to the end of the backward pass (an autograd engine callback; what runs after the
block's own nodes — the copies' gradient sums, the gate — is then timed with it): cheap, no
synchronisation. (A first layer's backward used to go untimed: its factors were forward-only, and
put `pipeline` 9–34% under `pairwise` there while whole iterations measured it slower.) At
agreement points — when the trials end, then every `agree_every` forwards — the ranks take the
maximum of their timings over the group (one all-reduce of C numbers: the block ends with its
slowest rank) and set each candidate's factor `s_c`, the median over its timed calls of measured /
predicted (per call: the calls ran different flows and placements, and a ratio of medians over
them mixes those). Agreement points used to be the `2^k`-th forwards: on the 2 × 1 testbed suite
(16 warm-up iterations, 10 timed) the last one fell before the timed iterations, and `pipeline`,
chosen on its trials, ran all of them 10% slower than `pairwise` with nothing to correct it (the
factors rested on the trials alone). Candidates are then
priced `s_c · predict_c` (`prices`), in seconds of forward + backward. With `strategy="auto"` too,
the placement is chosen first, priced with the planner's online correction as fitted on the layers
the running schedule ran (compute, exchanges and copies apart; `planners.auto`), and this arbiter
then picks the schedule for the plan that results. (The placement used to be priced with these
block prices — one factor per schedule for the compute and the exchanges together: on the 2 × 1
testbed suite that lost 4–7% over the suite to the placement arbiter alone on `sync`, runs n and o
in docs/benchmarks.md.) Trials are 5 forwards per candidate (4 after the warm-up): on the 2 × 1
testbed a forward's time scatters ±10%, and with 2 the choice followed the noise.

One schedule per model (`share_schedule_choice`). The trials time configurations where every layer
runs the same candidate (they run in lock-step: each layer is called once per iteration); a layer
choosing on its own would pick mixes that were never measured, and mixes measured slower than
either pure schedule (2 blocks, Zipf 0.8, 2 local gloo ranks: `sync` in layer 0 + `pairwise` in layer 1
0.499 s against 0.461 s for `pairwise` in both, although the blocks' own timings put the mix within 2%).
Layers linked by one `ScheduleBoard` choose together: each posts its corrected prices, and the
first layer of each forward picks for all the `preferred` candidate of the sum over the layers (the
other layers' prices from their last forward).

Every rank computes the same choice: predictions come from global numbers, factors change only
at agreement points, after the all-reduce, and the layers post to the board in the same order.
`chosen` names the schedule that ran (per layer, in `MoEStats.schedule`); `last` records each
candidate's corrected price.

Shape suffixes: S source ranks, E experts, D destination ranks, W ranks, C candidates.
"""

from __future__ import annotations

import math
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
    """Forwards each candidate is timed before the correction decides (the first is a warm-up)."""
    min_gain: float = 0.03
    """A candidate replaces one listed before it (simpler: `sync`, `pairwise`, then `pipeline`) only
    when its corrected price is at least this fraction lower (module docstring)."""
    agree_every: int = 4
    """After the trials, the factors are agreed (one all-reduce of C numbers) every this many forwards."""

    def __post_init__(self) -> None:
        names = self.names()
        if "auto" in names or len(set(names)) != len(names):
            raise ValueError(f"candidates={self.candidates!r}: expected a comma list of distinct schedule names")
        positive_int("trials", self.trials)
        positive_int("agree_every", self.agree_every)
        finite_number("min_gain", self.min_gain, 0.0, 1.0)
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
    layers' common call count) the first layer to choose decides for all: the `preferred` candidate
    of the corrected prices summed over the layers — its own on this forward's flow, the others'
    from their last forward; the later layers run that choice and post their prices for the next."""

    def __init__(self, min_gain: float) -> None:
        self.min_gain = min_gain
        self.prices: dict[int, dict[str, float]] = {}
        """The latest corrected prices of each member (by id)."""
        self.decided: tuple[int, str] | None = None
        """(call, candidate): the choice of the forward with that call count."""

    def total(self, member: int, prices: dict[str, float]) -> dict[str, float]:
        """Each candidate's price summed over the members, `member`'s replaced by `prices`."""
        rows = {**self.prices, member: prices}.values()
        return {name: sum(row[name] for row in rows) for name in prices}

    def post(self, member: int, prices: dict[str, float]) -> None:
        self.prices[member] = prices

    def choose(self, member: int, prices: dict[str, float], call: int) -> str:
        """Post `member`'s prices; the candidate every member runs in forward `call`."""
        self.post(member, prices)
        if self.decided is None or self.decided[0] != call:
            self.decided = (call, preferred(self.total(member, prices), self.min_gain))
        return self.decided[1]


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
    board = ScheduleBoard(arbiters[0].options.min_gain)
    for arbiter in arbiters:
        arbiter.board = board
    return board


def step_load(plan_SED: np.ndarray, shape: ExpertShape, node_of) -> StepLoad:
    """The block's `StepLoad` from the layer's global dispatch plan `[S, E, D]` (rows source s sends
    destination d for expert e; the diagonal source = destination stays local)."""
    plan = np.asarray(plan_SED, dtype=np.float64)
    return StepLoad(plan.sum(1), plan.sum(0).T, shape, node_of)


_WINDOW = 32
"""Timings kept per candidate (the newest)."""


@dataclass
class _Timings:
    measured_s: deque = field(default_factory=lambda: deque(maxlen=_WINDOW))
    """[forward, backward or None] seconds of each timed call (backward filled when it ran)."""
    predicted_s: deque = field(default_factory=lambda: deque(maxlen=_WINDOW))
    factor: float | None = None

    def medians(self) -> tuple[float, float]:
        """(measured forward + backward, predicted) medians over the calls of `_pairs`."""
        pairs = self._pairs()
        return float(np.median([m for m, _ in pairs])), float(np.median([p for _, p in pairs]))

    def ratio(self) -> float:
        """The median of measured / predicted over the same calls as `medians` (NaN: none predicted)."""
        ratios = [m / p for m, p in self._pairs() if p > 0]
        return float(np.median(ratios)) if ratios else math.nan

    def _pairs(self) -> list[tuple[float, float]]:
        """(measured forward + backward, predicted) of the calls whose backward ran (all calls,
        forward only, if none did: evaluation), the first call (a warm-up) left out."""
        pairs = list(zip(self.measured_s, self.predicted_s))
        if len(pairs) > 1 and len(pairs) < _WINDOW:
            pairs = pairs[1:]
        whole = [(f + b, p) for (f, b), p in pairs if b is not None]
        return whole or [(f, p) for (f, _), p in pairs]


class AutoSchedule(Schedule):
    """The arbiter over schedules (module docstring)."""

    def __init__(self, candidates: dict[str, Schedule], shape: ExpertShape, cost_model, options=None) -> None:
        self.options = options or AutoScheduleOptions()
        self.candidates = dict(candidates)
        self.shape, self.cost_model = shape, cost_model
        self.timings = {name: _Timings() for name in self.candidates}
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
        """Each candidate's predicted price times its measured factor (1 before the first agreement)."""
        return {n: p * (self.timings[n].factor or 1.0) for n, p in predicted.items()}

    def predicted(self, plan_SED: np.ndarray, node_of, dispatcher) -> dict[str, float]:
        """Each candidate's model time (forward + backward) of the block of this dispatch plan
        (`node_of` None: the cost model's)."""
        node_of = node_of if node_of is not None else self.cost_model.topology.node_of
        step = step_load(np.asarray(plan_SED, dtype=np.float64), self.shape, node_of)
        return {n: float(s.predict(step, self.cost_model, dispatcher).total_s) for n, s in self.candidates.items()}

    def choose(self, predicted: dict[str, float]) -> ScheduleDecision:
        """Pure given the state: round robin during the trials, else the `preferred` corrected price
        (of this layer, or summed over the board's layers)."""
        names = list(self.candidates)
        prices = self.prices(predicted)
        if self.calls < self.options.trials * len(names):
            if self.board is not None:
                self.board.post(id(self), prices)
            turn, position = divmod(self.calls, len(names))  # rounds alternate direction: a drift cancels
            return ScheduleDecision(prices, names[position if turn % 2 == 0 else -1 - position], True)
        if self.board is not None:
            return ScheduleDecision(prices, self.board.choose(id(self), prices, self.calls), False)
        return ScheduleDecision(prices, preferred(prices, self.options.min_gain), False)

    def execute(self, block: ExchangeBlock) -> torch.Tensor:
        if block.group is None or len(self.candidates) == 1:
            self.chosen = next(iter(self.candidates))
            return self.candidates[self.chosen].execute(block)
        predicted = self.predicted(block.plan_SED, block.node_of, block.dispatcher)
        self.last = self.choose(predicted)
        self.chosen = self.last.chosen
        timing = self.timings[self.chosen]
        entry: list = [0.0, None]  # forward, backward seconds
        timing.measured_s.append(entry)
        timing.predicted_s.append(predicted[self.chosen])
        x_sent_AD, close = time_backward(block.x_sent_AD, lambda seconds: entry.__setitem__(1, seconds))
        started = time.perf_counter()
        out = self.candidates[self.chosen].execute(replace(block, x_sent_AD=x_sent_AD))
        entry[0] = time.perf_counter() - started
        self.calls += 1
        if self._agreement_point():
            self._agree(block.group)
            if self.board is not None:  # the layers before this one choose next with the new factors
                self.board.post(id(self), self.prices(predicted))
        return close(out)

    def _agreement_point(self) -> bool:
        tried = self.options.trials * len(self.candidates)
        return self.calls >= tried and (self.calls - tried) % self.options.agree_every == 0

    def _agree(self, group) -> None:
        """Every rank the same factors: the slowest rank's median measured / predicted per candidate
        (NaN, none predicted: the factor stays)."""
        names = list(self.candidates)
        ratio_C = torch.tensor([self.timings[n].ratio() for n in names], dtype=torch.float64)
        dist.all_reduce(ratio_C, op=dist.ReduceOp.MAX, group=group)
        for name, ratio in zip(names, ratio_C.tolist()):
            if math.isfinite(ratio):
                self.timings[name].factor = ratio

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
