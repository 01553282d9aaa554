"""Strategy benchmark: one MoE layer per (routing skew × strategy × schedule) on the live process
group (several ranks, or the network testbed), with identical weights and routing — FasterMoE §5's
comparison of EP, shadowing, the smart schedule and both. What each timed variant records, and
its row, is `moeflow.bench.strategy_runs`.

    moeflow bench --nproc 4 --cost-model results/profile.json --skews 0 1.2 \\
        --variants ep:sync shadow:sync ep:pairwise shadow:pairwise ep:sync:hierarchical

Shape suffixes: I iterations (steps of a trace), L layers of a trace, B timed blocks (layers of the
benchmark model), W ranks, E experts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from moeflow.bench.blocks import BenchBlocks
from moeflow.bench.interleave import balanced_order
from moeflow.bench.strategy_runs import PhaseTimer, VariantRun
from moeflow.core.heap import HeapTrim
from moeflow.core.parallel import ParallelLayout
from moeflow.layer import MoELayer
from moeflow.routing.sampled import SampledGate, zipf_probabilities
from moeflow.sim.traces import Trace, resolve_trace, synthetic_trace


class Variant(NamedTuple):
    """One timed model: `strategy[/key=value...]:schedule[+prefetch][:dispatch[:wire_dtype]]` on the
    command line (`fssdp/rematerialize=true:sync+prefetch`: the strategy's options after slashes)."""

    strategy: str
    schedule: str
    dispatch: str = "a2a"
    wire_dtype: str | None = None
    """`MoELayer(dispatch_dtype=...)`: the dispatched rows' precision on the wire (None: compute dtype)."""
    prefetch: bool = False
    """Pro-Prophet §V block-wise prefetch over the model's MoE layers (`schedule` text `sync+prefetch`)."""
    options: tuple[tuple[str, str], ...] = ()
    """The strategy's options as (key, value) text pairs (parsed by its options dataclass)."""

    @classmethod
    def parse(cls, text: str) -> Variant:
        parts = text.split(":")
        if not 2 <= len(parts) <= 4 or not all(parts):
            raise ValueError(
                f"--variants {text!r}: expected strategy:schedule[+prefetch][:dispatch[:wire_dtype]], "
                f"e.g. ep:sync:hierarchical or prophet:sync+prefetch"
            )
        schedule, plus, extra = parts[1].partition("+")
        if plus and extra != "prefetch":
            raise ValueError(f"--variants {text!r}: the only schedule modifier is '+prefetch', got '+{extra}'")
        strategy, *pairs = parts[0].split("/")
        options = tuple(tuple(pair.partition("=")[::2]) for pair in pairs)
        if any(not key or not value for key, value in options):
            raise ValueError(f"--variants {text!r}: strategy options are key=value after '/', e.g. fssdp/window=3")
        return cls(strategy, schedule, *parts[2:4], prefetch=bool(plus), options=options)

    def __str__(self) -> str:
        schedule = self.schedule + ("+prefetch" if self.prefetch else "")
        strategy = "/".join([self.strategy, *(f"{k}={v}" for k, v in self.options)])
        parts = [strategy, schedule, self.dispatch, self.wire_dtype or ""]
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
    trace_replay: bool = False
    """Replay the trace's consecutive iterations, one per timed iteration, block b taking the trace's
    layer b mod L (so a planner that plans ahead meets real locality), from `trace_iteration` (negative:
    the last iterations that fit)."""
    drift_period: int = 0
    """Also a drifting load: two hot experts with half the load, moving to the next experts every
    this many iterations (`sim.traces.synthetic_trace("drift")`); 0: off."""
    ceiling: bool = False
    """Also time, beside every routing case, plain EP on perfectly even routing with the same tokens
    (`SampledGate(even=True)`): the force-balanced ceiling, and each row's `share_of_ceiling`."""
    blocks: int = 1
    """MoE layers per timed model, each followed by a dense residual part (`bench.blocks`); 1: one layer."""
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
    ep_size: int | None = None
    """Ranks that split the experts (None: all). Below the world size the layers run on the device
    mesh dp × ep (`core.parallel.ParallelLayout`, docs/parallel.md): every dp replica of an EP group
    routes its own tokens and plans with the others on their mean flow; the timed iteration is the
    layers' forward + backward (the replicas' gradient all-reduce is the optimizer step's)."""

    def __post_init__(self) -> None:
        for name in ("tokens_per_rank", "d_model", "d_hidden", "experts_per_rank", "top_k", "iterations", "blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.ep_size is not None and self.ep_size <= 0:
            raise ValueError(f"ep_size={self.ep_size} must be positive")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup} must be >= 0")
        if self.drift_period < 0:
            raise ValueError(f"drift_period={self.drift_period} must be >= 0 (0: no drifting case)")
        if any(s < 0 for s in self.skews):
            raise ValueError(f"skews={self.skews}: every skew must be >= 0")
        if self.trace_replay and not self.trace:
            raise ValueError("trace_replay=True needs a trace (--trace smartmoe or a .npz path)")
        for v in self.variants:
            if v.prefetch and self.blocks < 2:
                raise ValueError(f"variant {str(v)!r}: a prefetch needs a block before the layer (--blocks >= 2)")


def _trace_probabilities(trace: Trace, world: int, num_experts: int) -> torch.Tensor:
    """Per-rank expert distributions `[I, L, W, E]` of every iteration and layer of a trace, rescaled
    onto this group (`Trace.rescale`)."""
    flow = trace.rescale(world, num_experts).flow_ILWE.astype("float64")
    return torch.as_tensor(flow / flow.sum(-1, keepdims=True).clip(min=1), dtype=torch.float32)


def _routing_cases(cfg: StrategyBenchConfig, world: int, num_experts: int) -> list[tuple[str, torch.Tensor]]:
    """(name, probabilities `[I, B, W, E]`) per routing case: what block b's gate draws from at timed
    or warm-up iteration i (I = 1: the same every iteration). Zipf: each block its own random expert
    order (block 0's that of the single-layer benchmark); a trace: layer b mod L of one recorded
    iteration, or with `trace_replay` of consecutive ones."""
    cases = []
    for skew in cfg.skews:
        zipf_BE = torch.stack([zipf_probabilities(num_experts, skew, cfg.seed + b) for b in range(cfg.blocks)])
        cases.append((f"zipf-{skew:g}", zipf_BE[None, :, None, :].expand(1, -1, world, -1)))
    if cfg.trace:
        probs_ILWE = _trace_probabilities(resolve_trace(cfg.trace), world, num_experts)
        layers_B = [b % probs_ILWE.shape[1] for b in range(cfg.blocks)]
        if cfg.trace_replay:
            n, total = probs_ILWE.shape[0], cfg.warmup + cfg.iterations
            start = cfg.trace_iteration if cfg.trace_iteration >= 0 else max(0, n + cfg.trace_iteration + 1 - total)
            steps = [min(start + i, n - 1) for i in range(total)]
            cases.append((f"trace-replay@{start}", probs_ILWE[steps][:, layers_B]))
        else:
            cases.append((f"trace@{cfg.trace_iteration}", probs_ILWE[[cfg.trace_iteration]][:, layers_B]))
    if cfg.drift_period:
        total = cfg.warmup + cfg.iterations
        tokens, period = cfg.tokens_per_rank, cfg.drift_period
        drift = synthetic_trace("drift", total, cfg.blocks, world, num_experts, tokens, cfg.top_k, drift_period=period)
        cases.append((f"drift-{cfg.drift_period}", _trace_probabilities(drift, world, num_experts)))
    return cases


def _model(
    cfg: StrategyBenchConfig,
    layout: ParallelLayout,
    variant: Variant,
    probs_BWE: torch.Tensor,
    cost_model,
    timer,
    even: bool = False,
) -> BenchBlocks:
    """The variant's blocks on the layout's EP groups, with the benchmark's seeded weights and
    sampled routing (`even`: perfectly even routing instead; the timer on block 0's layer, sync
    schedules only). Each rank draws from its EP rank's row; dp replicas draw other tokens."""
    rank = layout.ep_rank
    num_experts = cfg.experts_per_rank * layout.ep_size
    layers = []
    for b in range(cfg.blocks):
        torch.manual_seed(cfg.seed + b)
        layer = MoELayer(
            cfg.d_model,
            cfg.d_hidden,
            num_experts,
            top_k=cfg.top_k,
            expert=cfg.expert,
            gate=SampledGate(
                cfg.d_model, num_experts, cfg.top_k, probs_BWE[b], cfg.seed + b + 7919 * layout.dp_rank, rank, even=even
            ),
            strategy=variant.strategy,
            strategy_options=dict(variant.options) or None,
            schedule=variant.schedule,
            dispatch=variant.dispatch,
            cost_model=cost_model,
            schedule_options=cfg.schedule_options if variant.schedule != "sync" else None,
            dispatch_dtype=variant.wire_dtype,
            hooks=[timer] if variant.schedule == "sync" and b == 0 else None,
        )
        layers.append(layer.to_expert_parallel(layout.ep_group, layout.expert_dp_group, layout.balance_group))
    if variant.prefetch and not layers[0].planner.plans_ahead:
        raise ValueError(
            f"variant {str(variant)!r}: strategy {variant.strategy!r} does not plan ahead; nothing to prefetch"
        )
    return BenchBlocks(layers, prefetch=variant.prefetch)


def run_strategy_bench(cfg: StrategyBenchConfig, cost_model, progress: bool = False) -> list[dict]:
    """Run on every rank of the initialized default group; returns rows (identical on all ranks).
    The variants are interleaved iteration by iteration in a Williams order (each runs after every
    other equally often: `moeflow.bench.interleave`), so machine noise hits them alike; with a
    replayed trace every variant meets the same routing at the same iteration. `progress`: rank 0
    shows a progress bar per routing case (tqdm, on stderr)."""
    from tqdm import tqdm

    rank = dist.get_rank()
    layout = ParallelLayout(ep_size=cfg.ep_size)
    ep = layout.ep_size
    rows = []
    for routing_name, probs_IBWE in _routing_cases(cfg, ep, cfg.experts_per_rank * ep):
        runs = []
        for variant in cfg.variants:
            timer = PhaseTimer()
            model = _model(cfg, layout, variant, probs_IBWE[0], cost_model, timer)
            runs.append(VariantRun(variant, model, timer, cost_model))
        if cfg.ceiling:  # interleaved with the others, so that it meets the same machine noise
            timer, ceiling = PhaseTimer(), Variant("ep", "sync")
            model = _model(cfg, layout, ceiling, probs_IBWE[0], cost_model, timer, even=True)
            runs.append(VariantRun(ceiling, model, timer, cost_model, even=True))
        # The input needs its gradient, as the first MoE layer's does in a model (embeddings and
        # attention before it): without one the first layer's backward skips half its exchanges.
        x = torch.randn(cfg.tokens_per_rank, cfg.d_model, generator=torch.Generator().manual_seed(rank))
        x.requires_grad_(True)
        heap = HeapTrim()
        iterations = tqdm(
            range(cfg.warmup + cfg.iterations),
            desc=f"bench {routing_name}",
            unit="it",
            disable=not progress or rank != 0,
            leave=False,
        )
        for it in iterations:
            for run in balanced_order(runs, it):
                if probs_IBWE.shape[0] > 1:
                    run.model.set_popularity(probs_IBWE[it], layout.ep_rank)
                dist.barrier()
                start = time.perf_counter()
                run.model(x).square().mean().backward()
                run.model.finish()
                dist.barrier()
                if it >= cfg.warmup:
                    run.record(time.perf_counter() - start)
                run.model.zero_grad(set_to_none=True)
                x.grad = None
                run.reshard(it + 1)
                heap.maybe_trim()  # outside the timed iteration
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
        if (r["strategy"], r["schedule"], r["dispatch"], r.get("wire_dtype"), r.get("prefetch", False))
        == ("ep", "sync", "a2a", None, False)
        and not r.get("ceiling")
    }
    ceilings = {r["routing"]: r["median_s"] for r in rows if r.get("ceiling")}
    for r in rows:
        ref = base.get(r["routing"])
        if ref is None:
            continue
        r["speedup_vs_ep"] = ref["median_s"] / r["median_s"]
        if r["routing"] in ceilings:  # the part of the possible gain reached: (T_ep − T) / (T_ep − T_even)
            gap = ref["median_s"] - ceilings[r["routing"]]
            r["share_of_ceiling"] = (ref["median_s"] - r["median_s"]) / gap if gap > 0 else None
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
