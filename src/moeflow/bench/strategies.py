"""Strategy benchmark: one MoE layer per (routing skew × strategy × schedule) on the live process
group (several ranks, or the network testbed), with identical weights and routing — FasterMoE §5's
comparison of EP, shadowing, the smart schedule and both.

    moeflow bench --nproc 4 --cost-model results/profile.json --skews 0 1.2 \\
        --variants ep:sync shadow:sync ep:pairwise shadow:pairwise ep:sync:hierarchical
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from moeflow.bench.interleave import balanced_order
from moeflow.core.layer import MoELayer
from moeflow.perf.traces import resolve_trace
from moeflow.routing.sampled import SampledGate, zipf_probabilities


class Variant(NamedTuple):
    """One timed layer: `strategy:schedule[:dispatch[:wire_dtype]]` on the command line."""

    strategy: str
    schedule: str
    dispatch: str = "a2a"
    wire_dtype: str | None = None
    """`MoELayer(dispatch_dtype=...)`: the dispatched rows' precision on the wire (None: compute dtype)."""

    @classmethod
    def parse(cls, text: str) -> Variant:
        parts = text.split(":")
        if not 2 <= len(parts) <= 4 or not all(parts):
            raise ValueError(
                f"--variants {text!r}: expected strategy:schedule[:dispatch[:wire_dtype]], e.g. ep:sync:hierarchical"
            )
        return cls(*parts)

    def __str__(self) -> str:
        parts = [self.strategy, self.schedule, self.dispatch, self.wire_dtype or ""]
        while len(parts) > 2 and parts[-1] in ("", "a2a"):
            parts.pop()
        return ":".join(parts)


@dataclass(frozen=True)
class StrategyBenchConfig:
    """Iteration time of one MoE layer (forward + backward) on the live process group, for each
    routing skew and each (strategy, schedule) variant, with identical weights and routing."""

    tokens_per_rank: int = 2048
    d_model: int = 256
    d_hidden: int = 1024
    experts_per_rank: int = 2
    top_k: int = 2
    expert: str = "ffn"
    skews: tuple[float, ...] = (0.0, 0.8, 1.2, 1.6)
    """Zipf exponents of the synthetic routing (0 = uniform)."""
    trace: str | None = None
    """Optional routing trace (.npz): its per-rank expert distribution is replayed as one more case."""
    trace_iteration: int = -1
    """Which recorded iteration of the trace to replay (negative: from the end)."""
    variants: tuple[Variant, ...] = (
        Variant("ep", "sync"),
        Variant("shadow", "sync"),
        Variant("ep", "pairwise"),
        Variant("shadow", "pairwise"),
    )
    """The layers to time."""
    schedule_options: dict | None = None
    """Options of the schedules (e.g. `{"group_size": 1}` for pairwise; None: defaults)."""
    warmup: int = 3
    iterations: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("tokens_per_rank", "d_model", "d_hidden", "experts_per_rank", "top_k", "iterations"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if any(s < 0 for s in self.skews):
            raise ValueError(f"skews={self.skews}: every skew must be >= 0")


class PhaseTimer:
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


def _trace_probabilities(trace: str, iteration: int, world: int, num_experts: int) -> torch.Tensor:
    """Per-rank expert distribution `[W, E]` of one recorded iteration (layer 0) of a trace
    (`smartmoe` or a path), rescaled onto this group (`Trace.rescale`)."""
    flow = resolve_trace(trace).rescale(world, num_experts).flow_ILWE[iteration, 0].astype("float64")
    return torch.as_tensor(flow / flow.sum(1, keepdims=True), dtype=torch.float32)


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _sum_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def _layer(cfg: StrategyBenchConfig, variant: Variant, probs: torch.Tensor, cost_model, timer: PhaseTimer) -> MoELayer:
    """The variant's layer on the live group, with the benchmark's seeded weights and sampled routing."""
    torch.manual_seed(cfg.seed)
    num_experts = cfg.experts_per_rank * dist.get_world_size()
    return MoELayer(
        cfg.d_model,
        cfg.d_hidden,
        num_experts,
        top_k=cfg.top_k,
        expert=cfg.expert,
        gate=SampledGate(cfg.d_model, num_experts, cfg.top_k, probs, cfg.seed, dist.get_rank()),
        strategy=variant.strategy,
        schedule=variant.schedule,
        dispatch=variant.dispatch,
        cost_model=cost_model,
        schedule_options=cfg.schedule_options if variant.schedule != "sync" else None,
        dispatch_dtype=variant.wire_dtype,
        hooks=[timer] if variant.schedule == "sync" else None,
    ).to_expert_parallel(dist.group.WORLD)


@dataclass
class _Run:
    """One variant's layer and what its timed iterations recorded."""

    variant: Variant
    layer: MoELayer
    timer: PhaseTimer
    times: list[float] = field(default_factory=list)
    phases: list[dict[str, float]] = field(default_factory=list)
    shadowed: list[int] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)
    bytes: list[float] = field(default_factory=list)

    def record(self, elapsed_s: float) -> None:
        """One timed iteration (collective: every rank calls it)."""
        self.times.append(_max_over_ranks(elapsed_s))
        if self.variant.schedule == "sync":
            self.phases.append({k: _max_over_ranks(v) for k, v in self.timer.phases().items()})
        decision = getattr(self.layer.planner, "last", None)  # a shadow planner's ShadowDecision
        self.shadowed.append(len(decision.shadowed) if decision else 0)
        if decision:  # its predicted speedup over plain EP: the cost model's error made visible
            self.predicted.append(decision.predicted_s[0] / decision.best_s)
        self.bytes.append(_sum_over_ranks(float(self.layer.stats.bytes_sent.sum())))

    def row(self, routing_name: str) -> dict:
        row = {
            "routing": routing_name,
            **self.variant._asdict(),
            "median_s": float(np.median(self.times)),
            "times_s": self.times,
            "load_imbalance": self.layer.stats.load_imbalance,
            "shadowed_mean": float(np.mean(self.shadowed)),
            "planner_predicted_speedup": float(np.mean(self.predicted)) if self.predicted else None,
            "dispatch_bytes_on_network": float(np.mean(self.bytes)),
        }
        if self.phases:
            row["forward_a2a_s"] = float(np.median([p["a2a_s"] for p in self.phases]))
            row["forward_compute_s"] = float(np.median([p["compute_s"] for p in self.phases]))
        return row


def run_strategy_bench(cfg: StrategyBenchConfig, cost_model) -> list[dict]:
    """Run on every rank of the initialized default group; returns rows (identical on all ranks).
    The variants are interleaved iteration by iteration in a Williams order (each runs after every
    other equally often: `moeflow.bench.interleave`), so machine noise hits them alike."""
    world, rank = dist.get_world_size(), dist.get_rank()
    num_experts = cfg.experts_per_rank * world
    cases = [(f"zipf-{s:g}", zipf_probabilities(num_experts, s, cfg.seed)) for s in cfg.skews]
    if cfg.trace:
        cases.append(
            (f"trace@{cfg.trace_iteration}", _trace_probabilities(cfg.trace, cfg.trace_iteration, world, num_experts))
        )
    rows = []
    for routing_name, probs in cases:
        runs = []
        for variant in cfg.variants:
            timer = PhaseTimer()
            runs.append(_Run(variant, _layer(cfg, variant, probs, cost_model, timer), timer))
        x = torch.randn(cfg.tokens_per_rank, cfg.d_model, generator=torch.Generator().manual_seed(rank))
        for it in range(cfg.warmup + cfg.iterations):
            for run in balanced_order(runs, it):
                dist.barrier()
                start = time.perf_counter()
                run.layer(x).square().mean().backward()
                dist.barrier()
                if it >= cfg.warmup:
                    run.record(time.perf_counter() - start)
        rows += [run.row(routing_name) for run in runs]
    _add_speedups(rows)
    return rows


def _add_speedups(rows: list[dict]) -> None:
    """Speedup over EP-sync (plain all-to-all) of the same routing, and for pairwise the FasterMoE
    §5.5 bound `(comm + comp) / max(comm, comp)` from the sync run's phases (comm: 4 all-to-alls = 2x the
    forward's two; comp: forward + 2x backward)."""
    base = {
        r["routing"]: r
        for r in rows
        if (r["strategy"], r["schedule"], r["dispatch"], r.get("wire_dtype")) == ("ep", "sync", "a2a", None)
    }
    for r in rows:
        ref = base.get(r["routing"])
        if ref is None:
            continue
        r["speedup_vs_ep"] = ref["median_s"] / r["median_s"]
        if r["schedule"] == "pairwise" and "forward_a2a_s" in ref:
            sync_ref = next(
                (
                    x
                    for x in rows
                    if (x["routing"], x["strategy"], x["schedule"], x["dispatch"], x.get("wire_dtype"))
                    == (r["routing"], r["strategy"], "sync", r["dispatch"], r.get("wire_dtype"))
                ),
                ref,
            )
            comm, comp = 2 * sync_ref["forward_a2a_s"], 3 * sync_ref["forward_compute_s"]
            bound = (comm + comp) / max(comm, comp)
            r["pairwise_bound"] = bound
            r["pairwise_speedup"] = sync_ref["median_s"] / r["median_s"]
            r["share_of_bound"] = r["pairwise_speedup"] / bound
