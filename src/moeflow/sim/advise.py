"""Which strategy and schedule to train with (`moeflow advise`): every strategy × schedule replayed
through the cost model on the user's load (`sim.simulator.simulate`), ranked by predicted step time,
each with its speedup over plain EP and its share of the force-balanced ceiling.

The ceiling is plain EP with the synchronous schedule on perfectly even routing — each rank's
assignments spread evenly over the experts (what `moeflow bench --ceiling` times with
`SampledGate(even=True)`): the step a perfect balancer would give without moving any expert. A
candidate's share of it is the part of the possible gain it reaches, `(T_ep − T) / (T_ep − T_even)`
(1 = as fast as perfectly balanced routing; above 1: faster, by overlap the ceiling does not have;
undefined when the routing is already even).

    advice = advise(trace, cost_model, layer, strategies, schedules)
    advice.candidates[0]          # the winner: fastest predicted step

Shape suffixes: I iterations, L layers, W ranks, E experts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from moeflow.perf.costmodel import CostModel
from moeflow.sim.simulator import Breakdown, SimulatedLayer, simulate
from moeflow.sim.traces import Trace

BASELINE = ("ep", "sync")
"""What speedups are measured against: plain expert parallelism, one exchange each way."""


@dataclass
class Candidate:
    """One strategy × schedule, as predicted."""

    strategy: str
    schedule: str
    step_s: float
    """Mean predicted time of one iteration (all MoE layers, forward and backward, with the dense
    part given as `SimulatedLayer.nonmoe_forward_s`)."""
    speedup_vs_ep: float
    """`T_ep / T` (EP with the synchronous schedule on the same load)."""
    share_of_ceiling: float | None
    """`(T_ep − T) / (T_ep − T_even)`; None when the load is already even (no gap to close)."""
    copies_per_layer: float
    """Mean expert copies beyond the owners per layer and iteration."""
    p95_s: float
    """95th percentile of the iteration times."""


@dataclass
class Advice:
    """The ranking (fastest first) and its references."""

    candidates: list[Candidate]
    ep_s: float
    """Predicted step of plain EP (sync) on the load."""
    ceiling_s: float
    """Predicted step of plain EP (sync) on perfectly even routing."""
    load_imbalance: float
    """Mean max/mean expert load of the load (per iteration and layer)."""

    @property
    def winner(self) -> Candidate:
        return self.candidates[0]

    def to_dict(self) -> dict:
        return {
            "ep_s": self.ep_s,
            "ceiling_s": self.ceiling_s,
            "load_imbalance": self.load_imbalance,
            "candidates": [asdict(c) for c in self.candidates],
        }


def even_trace(trace: Trace) -> Trace:
    """The same tokens per rank, spread evenly over the experts (remainders to the first experts):
    the force-balanced routing."""
    flow = trace.flow_ILWE
    E = flow.shape[-1]
    total_ILW1 = flow.sum(-1, keepdims=True)
    even = total_ILW1 // E + (np.arange(E) < total_ILW1 % E)
    return Trace(even, trace.steps_I.copy(), dict(trace.meta))


def _mean(r: Breakdown) -> float:
    return float(r.total_I.mean())


def advise(
    trace: Trace,
    cost_model: CostModel,
    layer: SimulatedLayer,
    strategies: Sequence[str],
    schedules: Sequence[str],
    progress: Callable[[str], None] | None = None,
) -> Advice:
    """Rank every (strategy, schedule) of the lists on `trace` (module docstring). `progress` is
    called with a label after each strategy and after the ceiling (for a progress bar: one call per
    strategy, plus one)."""
    W = cost_model.topology.num_devices
    if trace.world_size != W:
        trace = trace.rescale(W)
    say = progress or (lambda label: None)
    results: list[Breakdown] = []
    for name in strategies:
        results += simulate(trace, cost_model, layer, [name], schedules)
        say(name)
    baseline = next((r for r in results if (r.strategy, r.schedule) == BASELINE), None)
    if baseline is None:
        baseline = simulate(trace, cost_model, layer, [BASELINE[0]], [BASELINE[1]])[0]
    ceiling = simulate(even_trace(trace), cost_model, layer, [BASELINE[0]], [BASELINE[1]])[0]
    say("ceiling")
    ep_s, ceiling_s = _mean(baseline), _mean(ceiling)
    gap = ep_s - ceiling_s
    candidates = [
        Candidate(
            r.strategy,
            r.schedule,
            _mean(r),
            ep_s / _mean(r),
            (ep_s - _mean(r)) / gap if gap > 1e-12 * ep_s else None,
            float(r.replicated_IL.mean()),
            float(np.percentile(r.total_I, 95)),
        )
        for r in results
    ]
    candidates.sort(key=lambda c: (c.step_s, (c.strategy, c.schedule) != BASELINE))
    return Advice(candidates, ep_s, ceiling_s, float(trace.load_imbalance().mean()))


def format_ranking(advice: Advice, top: int | None = None) -> str:
    """The ranking as a fixed-width table (milliseconds)."""
    lines = [
        f"{'#':>3}  {'strategy':<14}{'schedule':<10}{'step ms':>9}{'p95 ms':>9}{'vs EP':>8}{'of ceiling':>12}"
        f"{'copies':>8}"
    ]
    for i, c in enumerate(advice.candidates[:top], 1):
        share = "-" if c.share_of_ceiling is None else f"{c.share_of_ceiling:.0%}"
        lines.append(
            f"{i:>3}  {c.strategy:<14}{c.schedule:<10}{1e3 * c.step_s:>9.3f}{1e3 * c.p95_s:>9.3f}"
            f"{c.speedup_vs_ep:>7.2f}x{share:>12}{c.copies_per_layer:>8.1f}"
        )
    return "\n".join(lines)
