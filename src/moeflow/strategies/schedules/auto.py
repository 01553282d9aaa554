"""`schedule="auto"`: every forward, the cheapest of the candidate schedules (`sync`, `pairwise`,
`pipeline`, ...) on the block that will run, corrected by what each was measured to take.

Each candidate prices this very block with its own `predict` (the layer's dispatch plan is global,
so every rank prices the same `StepLoad` the simulator prices), times its factor: an exponentially
weighted mean (weight `smoothing`) of its measured block time over its prediction on the forwards
it ran (`strategies.timing`). A candidate not measured yet takes the mean factor of those that
were. The first forwards run every candidate in turn, twice — the first round a warm-up, not
measured — and from then on the cheapest runs; a candidate replaces one listed before it (simpler:
`sync`, `pairwise`, then `pipeline`) only when priced `min_gain` below it. Factors change only when
the ranks agree their times, so every rank runs the same schedule.

Shape suffixes: S source ranks, E experts, W (destination) ranks, Z candidates.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from moeflow.core.checks import finite_number
from moeflow.core.exchange import ExchangeBlock
from moeflow.core.expert_shape import ExpertShape
from moeflow.strategies.schedules.base import PredictedBlock, Schedule, StepLoad
from moeflow.strategies.timing import Ratio, Sample

TRIAL_ROUNDS = 2
"""Rounds of every candidate before the first choice; the first is a warm-up (first calls allocate)."""


@dataclass(frozen=True)
class AutoScheduleOptions:
    """Options of `schedule="auto"` (`--set moe.schedule_options.<key>=...`)."""

    candidates: str = ""
    """Comma list of schedules to choose among, each with its default options; empty: every
    registered schedule. Those that do not run with the layer's dispatcher are left out."""
    min_gain: float = 0.03
    """A candidate replaces one listed before it only when priced at least this fraction lower."""
    smoothing: float = 0.3
    """Weight of a new measurement in a candidate's factor."""

    def __post_init__(self) -> None:
        names = self.names()
        if "auto" in names or len(set(names)) != len(names):
            raise ValueError(f"candidates={self.candidates!r}: expected a comma list of distinct schedule names")
        finite_number("min_gain", self.min_gain, 0.0, 1.0)
        if self.min_gain >= 1.0:
            raise ValueError(f"min_gain={self.min_gain!r}: expected a fraction in [0, 1)")
        finite_number("smoothing", self.smoothing, 0.0, 1.0, low_open=True)

    def names(self) -> list[str]:
        return [n.strip() for n in self.candidates.split(",") if n.strip()]


def preferred(prices_Z: np.ndarray, min_gain: float) -> np.ndarray:
    """Index of the candidate to run, over leading axis Z: in the candidates' order each replaces
    the choice so far only when priced at least `min_gain` below it (`min_gain=0`: the cheapest,
    ties to the first)."""
    prices_Z = np.asarray(prices_Z, dtype=np.float64)
    best = np.zeros(prices_Z.shape[1:], dtype=np.int64)
    for c in range(1, prices_Z.shape[0]):
        current = np.take_along_axis(prices_Z, best[None], axis=0)[0]
        best = np.where(prices_Z[c] < (1.0 - min_gain) * current, c, best)
    return best


class AutoSchedule(Schedule):
    """The cheapest schedule per forward (module docstring)."""

    observes_time = True

    def __init__(self, candidates: dict[str, Schedule], shape: ExpertShape, cost_model, options=None) -> None:
        self.options = options or AutoScheduleOptions()
        self.candidates = dict(candidates)
        self.shape, self.cost_model = shape, cost_model
        self.factors = {name: Ratio(self.options.smoothing) for name in self.candidates}
        self.pending: deque[tuple[str, float] | None] = deque(maxlen=64)  # (ran, predicted); None: warm-up
        self.calls = 0
        self.last: dict[str, float] = {}
        """Each candidate's corrected price at the last forward."""
        self._choice: str | None = None

    def check_dispatcher(self, dispatcher) -> None:
        """Keep the candidates that run with `dispatcher` (`sync` runs with any)."""
        super().check_dispatcher(dispatcher)
        self.candidates = {n: s for n, s in self.candidates.items() if s.runs_with(dispatcher)}

    def runs_with(self, dispatcher) -> bool:
        return any(s.runs_with(dispatcher) for s in self.candidates.values())

    def prices(self, predicted: dict[str, float]) -> dict[str, float]:
        """Each candidate's predicted time times its factor (module docstring)."""
        measured = [r.value for r in self.factors.values() if r.value is not None]
        level = float(np.mean(measured)) if measured else 1.0
        return {
            n: p * (level if self.factors[n].value is None else self.factors[n].value) for n, p in predicted.items()
        }

    def execute(self, block: ExchangeBlock) -> torch.Tensor:
        names = list(self.candidates)
        if block.group is None or len(names) == 1 or self.cost_model.topology.num_devices != len(block.send_WW):
            # One process, one candidate, or a cost model of another group (a resume on another
            # process count): nothing to price; the simplest candidate runs.
            self._choice = names[0]
            return self.candidates[names[0]].execute(block)
        node_of = block.node_of if block.node_of is not None else self.cost_model.topology.node_of
        step = StepLoad.of_plan(block.plan_SEW, self.shape, node_of)
        predicted = {
            n: float(s.predict(step, self.cost_model, block.dispatcher).total_s) for n, s in self.candidates.items()
        }
        return self.candidates[self.decide(predicted)].execute(block)

    def decide(self, predicted: dict[str, float]) -> str:
        """This forward's candidate, given each one's predicted time (module docstring)."""
        names = list(self.candidates)
        self.last = self.prices(predicted)
        if self.calls < TRIAL_ROUNDS * len(names):
            self._choice = names[self.calls % len(names)]
        else:
            self._choice = names[int(preferred(list(self.last.values()), self.options.min_gain))]
        warmup = self.calls < len(names)
        self.pending.append(None if warmup else (self._choice, predicted[self._choice]))
        self.calls += 1
        return self._choice

    def choice(self) -> str | None:
        return self._choice

    def state(self) -> dict:
        """The forwards seen (the trial rounds are behind a resumed run) and each candidate's factor."""
        return {"calls": self.calls, "factors": {n: r.value for n, r in self.factors.items()}}

    def load_state(self, state: dict) -> None:
        """A resume on the same candidates continues where the run stopped; other candidates (another
        dispatcher) start afresh."""
        if set(state["factors"]) != set(self.factors):
            return
        self.calls = int(state["calls"])
        for name, value in state["factors"].items():
            self.factors[name].value = value

    def observe_time(self, samples: list[Sample]) -> None:
        pending = list(self.pending)[-len(samples) :]
        self.pending.clear()
        for entry, sample in zip(pending, samples[-len(pending) :]):
            if entry is not None:
                self.factors[entry[0]].update(sample.block_s, entry[1])

    def predict(self, step: StepLoad, cost_model, dispatcher) -> PredictedBlock:
        """The simulator's price: per (iteration, layer) the `preferred` candidate as the model sees
        it (no measurement to correct it there)."""
        preds = [s.predict(step, cost_model, dispatcher) for s in self.candidates.values() if s.runs_with(dispatcher)]
        shape = np.broadcast_shapes(*(np.shape(p.total_s) for p in preds))

        def stacked(values) -> np.ndarray:
            return np.stack([np.broadcast_to(np.asarray(v, np.float64), shape) for v in values])

        terms = [stacked(values) for values in zip(*((p.total_s, p.compute_s, p.comm_s) for p in preds))]
        best = preferred(terms[0], self.options.min_gain)[None]
        return PredictedBlock(*(np.take_along_axis(values, best, axis=0)[0] for values in terms))
