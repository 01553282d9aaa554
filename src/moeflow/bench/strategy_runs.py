"""What the strategy benchmark (`moeflow.bench.strategies`) records of one timed variant, and the
row it reports: `PhaseTimer` (the forward's all-to-all and compute phases, sync schedules) and
`VariantRun` — per timed iteration the slowest rank's time, the copies beyond the owners and the
experts held everywhere (FasterMoE §4.1's shadowed experts), the load spread (Pro-Prophet Fig. 12's
balance metric), the cost model's speedup of the placement that ran over the owners alone and its
time for the flows and placements that ran (Pro-Prophet Eq. 6 over the shared cost model), the
dispatched bytes, the expert memory, what `auto` chose, and FSSDP's re-shardings (Hecate §4.3).
Kept apart from the benchmark's configuration, routing cases and loop, which never read a layer's
statistics. Every method that records is a collective: every rank calls it.

Shape suffixes: E experts, W ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from moeflow.bench.blocks import BenchBlocks
from moeflow.core.expert_shape import ExpertShape
from moeflow.core.hooks import MoEHook
from moeflow.core.placement import Placement
from moeflow.layer import MoELayer
from moeflow.model_step import maybe_reshard
from moeflow.strategies.planners.auto import AutoPlanner
from moeflow.strategies.planners.prophet_model import Pricing, price_placement

if TYPE_CHECKING:
    from moeflow.bench.strategies import Variant


class PhaseTimer(MoEHook):
    """Hook recording forward wall-clock times of dispatch, expert compute and combine (sync)."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}

    def _mark(self, point: str) -> None:
        self.marks[point] = time.perf_counter()

    def before_dispatch(self, layer, x):
        self._mark("before_dispatch")

    def after_dispatch(self, layer, x):
        self._mark("after_dispatch")

    def before_combine(self, layer, y):
        self._mark("before_combine")

    def after_combine(self, layer, y):
        self._mark("after_combine")

    def phases(self) -> dict[str, float]:
        m = self.marks
        return {
            "a2a_s": (m["after_dispatch"] - m["before_dispatch"]) + (m["after_combine"] - m["before_combine"]),
            "compute_s": m["before_combine"] - m["after_dispatch"],
        }


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _sum_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


@dataclass
class VariantRun:
    """One variant's model and what its timed iterations recorded."""

    variant: Variant
    model: BenchBlocks
    timer: PhaseTimer
    cost_model: object = None
    times: list[float] = field(default_factory=list)
    phases: list[dict[str, float]] = field(default_factory=list)
    shadowed: list[float] = field(default_factory=list)
    copies: list[float] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)
    model_predicted: list[float] = field(default_factory=list)
    load_std: list[float] = field(default_factory=list)
    bytes: list[float] = field(default_factory=list)
    memory: list[dict[str, float]] = field(default_factory=list)
    even: bool = False
    """This run routes perfectly evenly (the force-balanced ceiling)."""
    chosen: list[str] = field(default_factory=list)
    """The planner each layer ran, every timed iteration (`auto` chooses; the others are themselves)."""
    chosen_schedule: list[str] = field(default_factory=list)
    """The schedule each layer ran, every timed iteration (`schedule="auto"` chooses)."""
    reshards: list[tuple[int, float]] = field(default_factory=list)
    """(experts moved, seconds) of every re-sharding (FSSDP, `core.resharding`)."""

    def record(self, elapsed_s: float) -> None:
        """One timed iteration (collective: every rank calls it). Per layer, averaged over the blocks:
        copies beyond the owners, experts held everywhere (shadowed), the balance metric (Pro-Prophet
        Fig. 12), and the cost model's speedup of the placement that ran over the owners alone on
        the same flow; summed over the blocks, the cost model's time for the flows and placements
        the layers ran (its error against the measured time)."""
        self.times.append(_max_over_ranks(elapsed_s))
        if self.variant.schedule == "sync":
            self.phases.append({k: _max_over_ranks(v) for k, v in self.timer.phases().items()})
        layers = list(self.model.moe)
        placements = [layer.stats.placement for layer in layers]
        self.shadowed.append(np.mean([(p.materialized_EW().sum(1) == p.world_size - 1).sum() for p in placements]))
        self.copies.append(np.mean([p.materialized_EW().sum() for p in placements]))
        self.load_std.append(np.mean([layer.stats.load_std for layer in layers]))
        if self.cost_model is not None:
            prices = [
                (_layer_price(layer, self.cost_model, owners=True), _layer_price(layer, self.cost_model))
                for layer in layers
            ]
            self.predicted.append(np.mean([ep / ran for ep, ran in prices]))
            if self.variant.schedule == "sync":
                self.model_predicted.append(sum(ran for _, ran in prices))
        self.bytes.append(_sum_over_ranks(float(sum(layer.stats.bytes_sent.sum() for layer in layers))))
        self.memory.append({k: _max_over_ranks(v) for k, v in _expert_memory(layers).items()})
        self.chosen += [layer.stats.strategy for layer in layers]
        self.chosen_schedule += [layer.stats.schedule for layer in layers]

    def reshard(self, step: int) -> None:
        """Re-shard when the strategy is due (collective; outside the timed iteration, measured)."""
        start = time.perf_counter()
        moved = maybe_reshard(self.model, None, step)
        if moved is not None:
            self.reshards.append((moved, _max_over_ranks(time.perf_counter() - start)))

    def row(self, routing_name: str) -> dict:
        row = {
            "routing": routing_name,
            **self.variant._asdict(),
            "median_s": float(np.median(self.times)),
            "times_s": self.times,
            "load_imbalance": float(np.mean([layer.stats.load_imbalance for layer in self.model.moe])),
            "shadowed_mean": float(np.mean(self.shadowed)),
            "copies_mean": float(np.mean(self.copies)),
            "load_std_mean": float(np.mean(self.load_std)),
            "planner_predicted_speedup": float(np.mean(self.predicted)) if self.predicted else None,
            "model_predicted_s": float(np.median(self.model_predicted)) if self.model_predicted else None,
            "dispatch_bytes_on_network": float(np.mean(self.bytes)),
            **{k: float(np.max([m[k] for m in self.memory])) for k in self.memory[0]},
            "reshards": [{"moved": n, "seconds": t} for n, t in self.reshards],
            "chosen": {name: self.chosen.count(name) for name in sorted(set(self.chosen))},
            "chosen_schedule": {name: self.chosen_schedule.count(name) for name in sorted(set(self.chosen_schedule))},
        }
        if self.even:
            row["ceiling"] = True
        errors = [layer.planner.model_error() for layer in self.model.moe if isinstance(layer.planner, AutoPlanner)]
        if errors and None not in errors:  # `auto`: its corrected forecasts' error on the forwards it measured
            row["auto_model_error"] = float(np.mean(errors))
        if self.model.prefetch is not None:  # what the prefetch measured its windows to hide (layers > 0)
            row["prefetch_hidden_share"] = [float(h) for h in self.model.prefetch.hidden_share[1:]]
        if self.phases:
            row["forward_a2a_s"] = float(np.median([p["a2a_s"] for p in self.phases]))
            row["forward_compute_s"] = float(np.median([p["compute_s"] for p in self.phases]))
        return row


def _expert_memory(layers: list[MoELayer]) -> dict[str, float]:
    """This rank's expert memory, counted from the tensors: the owned experts' parameters, the AdamW
    state they would carry (2 moments of the same size; the benchmark has no optimizer), the held
    weights the planners materialized, and the peak of those at the forward/backward boundary: what
    is still allocated, plus the largest set a re-materializing layer gathers again in backward."""
    params = float(sum(p.numel() * p.element_size() for layer in layers for p in layer.experts.parameters()))
    built = [layer.stats.materialized_bytes for layer in layers]
    alive = [layer.stats.held_bytes for layer in layers]
    regathered = max([b - a for b, a in zip(built, alive)], default=0)
    return {
        "expert_param_bytes": params,
        "expert_adam_bytes": 2 * params,
        "materialized_bytes": float(sum(built)),
        "materialized_peak_bytes": float(sum(alive) + regathered),
    }


def _layer_price(layer: MoELayer, cost_model, owners: bool = False) -> float:
    """The cost model's forward + backward time of `layer`'s last step (Pro-Prophet Eq. 6 over the
    shared cost model: the terms every planner prices placements with); `owners`: of the owners
    alone on the same flow."""
    stats, placement = layer.stats, layer.stats.placement
    if owners:
        placement = Placement.owners_only(placement.owner_E, placement.world_size)
    shape = ExpertShape(layer.d_model, layer.d_hidden, layer.experts.kind)
    return price_placement(stats.flow.numpy(), placement, cost_model, shape, Pricing(), layer.node_of)
