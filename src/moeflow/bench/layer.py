"""Layer benchmark: forward+backward time of `MoELayer` next to its lower bound and Hugging Face's
`MixtralSparseMoeBlock` with identical weights.

The bound is the same expert FFN computed as perfectly balanced batched matmuls (`bmm` over
`[E, T·k/E, d]`): what the experts would cost if routing, permutation and combining were free and
the load were even. Timings use `torch.utils.benchmark.Timer` (warm-up, blocked autorange, median).

Shape suffixes: T tokens, D d_model, H d_hidden, E experts, C tokens per expert (T·k/E).
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils import benchmark

from moeflow.core.layer import MoELayer


@dataclass(frozen=True)
class LayerBenchConfig:
    tokens: int = 4096
    """T: tokens in one forward (batch × sequence) on this device."""
    d_model: int = 512
    d_hidden: int = 1024
    num_experts: int = 8
    top_k: int = 2
    dtype: str = "float32"
    """`float32` or `bfloat16` (parameters and activations)."""
    expert: str = "swiglu"
    """`swiglu` compares with Mixtral's block; `ffn` has no Hugging Face counterpart."""
    min_run_time_s: float = 2.0
    """Per measurement, for torch.utils.benchmark's blocked_autorange."""

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r} must be 'float32' or 'bfloat16'")
        for name in ("tokens", "d_model", "d_hidden", "num_experts", "top_k"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be <= num_experts={self.num_experts}")
        if self.expert not in ("ffn", "swiglu"):
            raise ValueError(f"expert={self.expert!r} must be 'ffn' or 'swiglu'")


def _time_fwd_bwd(fn, x: torch.Tensor, min_run_time_s: float) -> dict:
    def step():
        x.grad = None
        fn(x).float().square().mean().backward()

    timer = benchmark.Timer(stmt="step()", globals={"step": step}, num_threads=torch.get_num_threads())
    m = timer.blocked_autorange(min_run_time=min_run_time_s)
    return {"median_s": m.median, "iqr_s": m.iqr, "runs": len(m.times)}


def _balanced_bound(layer: MoELayer, cfg: LayerBenchConfig):
    """The experts' FFN on perfectly balanced `[E, C, D]` groups with the layer's own weights."""
    w = layer.experts.weights()
    per_expert = max(1, cfg.tokens * cfg.top_k // cfg.num_experts)

    def fn(x_TD):
        x_ECD = x_TD.repeat(cfg.top_k, 1)[: per_expert * cfg.num_experts].view(cfg.num_experts, per_expert, -1)
        if cfg.expert == "swiglu":
            hidden = F.silu(torch.bmm(x_ECD, w["w1"])) * torch.bmm(x_ECD, w["w3"])
            return torch.bmm(hidden, w["w2"])
        hidden = F.gelu(torch.baddbmm(w["b1"][:, None], x_ECD, w["w1"]))
        return torch.baddbmm(w["b2"][:, None], hidden, w["w2"])

    return fn


def mixtral_block_from(layer: MoELayer):
    """Hugging Face's `MixtralSparseMoeBlock` holding exactly `layer`'s gate and swiglu experts."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(
        hidden_size=layer.d_model,
        intermediate_size=layer.d_hidden,
        num_local_experts=layer.num_experts,
        num_experts_per_tok=layer.top_k,
        router_jitter_noise=0.0,
    )
    block = MixtralSparseMoeBlock(config)
    w = layer.experts.weights()
    with torch.no_grad():
        block.gate.weight.copy_(layer.gate.weight)
        # Mixtral stores [gate; up] rows as (out, in): gate_up_proj[e] = [w1[e]ᵀ; w3[e]ᵀ].
        block.experts.gate_up_proj.copy_(torch.cat([w["w1"], w["w3"]], dim=2).transpose(1, 2))
        block.experts.down_proj.copy_(w["w2"].transpose(1, 2))
    return block, getattr(config, "_experts_implementation", None) or "eager"


def run_layer_bench(cfg: LayerBenchConfig, compare_hf: bool = True, seed: int = 0) -> dict:
    """One configuration: moeflow, the balanced bound, and (if installed) Hugging Face."""
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(seed)
    layer = MoELayer(cfg.d_model, cfg.d_hidden, cfg.num_experts, top_k=cfg.top_k, expert=cfg.expert).to(dtype)
    x = torch.randn(cfg.tokens, cfg.d_model, dtype=dtype, requires_grad=True)
    result = {"config": asdict(cfg), "threads": torch.get_num_threads(), "torch": torch.__version__}
    result["moeflow"] = _time_fwd_bwd(layer, x, cfg.min_run_time_s)
    result["load_imbalance"] = layer.stats.load_imbalance
    result["bound"] = _time_fwd_bwd(_balanced_bound(layer, cfg), x, cfg.min_run_time_s)
    result["moeflow_over_bound"] = result["moeflow"]["median_s"] / result["bound"]["median_s"]
    if compare_hf and cfg.expert == "swiglu":
        try:
            block, impl = mixtral_block_from(layer)
        except ImportError:
            result["hf"] = None
        else:
            block = block.to(dtype)
            with torch.no_grad():
                ours, theirs = layer(x), block(x[None])[0]
            result["hf_max_abs_diff"] = float((ours.float() - theirs.float()).abs().max())
            result["hf"] = _time_fwd_bwd(lambda t: block(t[None]), x, cfg.min_run_time_s)
            result["hf"]["experts_implementation"] = impl
            result["hf_over_moeflow"] = result["hf"]["median_s"] / result["moeflow"]["median_s"]
    return result


def machine_info() -> dict:
    return {
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
    }


# ---- strategies on several ranks (FasterMoE §5: EP vs shadowing vs smart schedule vs both) -------


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
    variants: tuple[tuple[str, str], ...] = (
        ("ep", "sync"),
        ("shadow", "sync"),
        ("ep", "pairwise"),
        ("shadow", "pairwise"),
    )
    """(strategy, schedule) pairs to time."""
    group_size: int | None = None
    """Pairwise group size (None: from the topology)."""
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


def _trace_probabilities(path: str, iteration: int, world: int, num_experts: int) -> torch.Tensor:
    """Per-rank expert distribution `[W, E]` of one recorded iteration (layer 0), folded onto this
    group: source ranks and experts of the trace are summed in contiguous blocks."""
    from moeflow.perf.traces import load_trace

    flow = load_trace(path).flow_ILWE[iteration, 0].astype("float64")  # [W_trace, E_trace]
    w_t, e_t = flow.shape
    if w_t % world or e_t % num_experts:
        raise ValueError(
            f"trace {path}: {w_t} ranks x {e_t} experts cannot fold onto {world} ranks x {num_experts} experts"
        )
    folded = flow.reshape(world, w_t // world, num_experts, e_t // num_experts).sum((1, 3))
    return torch.as_tensor(folded / folded.sum(1, keepdims=True), dtype=torch.float32)


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _sum_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def run_strategy_bench(cfg: StrategyBenchConfig, cost_model) -> list[dict]:
    """Run on every rank of the initialized default group; returns rows (identical on all ranks)."""
    from moeflow.routing.sampled import SampledGate, zipf_probabilities

    world, rank = dist.get_world_size(), dist.get_rank()
    num_experts = cfg.experts_per_rank * world
    cases = [(f"zipf-{s:g}", zipf_probabilities(num_experts, s, cfg.seed)) for s in cfg.skews]
    if cfg.trace:
        cases.append(
            (f"trace@{cfg.trace_iteration}", _trace_probabilities(cfg.trace, cfg.trace_iteration, world, num_experts))
        )
    rows = []
    for routing_name, probs in cases:
        # Variants are interleaved iteration by iteration, so machine noise hits them alike.
        runs = []
        for strategy, schedule in cfg.variants:
            torch.manual_seed(cfg.seed)
            timer = PhaseTimer()
            layer = MoELayer(
                cfg.d_model,
                cfg.d_hidden,
                num_experts,
                top_k=cfg.top_k,
                expert=cfg.expert,
                gate=SampledGate(cfg.d_model, num_experts, cfg.top_k, probs, cfg.seed, rank),
                strategy=strategy,
                schedule=schedule,
                cost_model=cost_model,
                group_size=cfg.group_size,
                hooks=[timer] if schedule == "sync" else None,
            ).to_expert_parallel(dist.group.WORLD)
            runs.append({"layer": layer, "timer": timer, "times": [], "phases": [], "shadowed": [], "bytes": []})
        x = torch.randn(cfg.tokens_per_rank, cfg.d_model, generator=torch.Generator().manual_seed(rank))
        for it in range(cfg.warmup + cfg.iterations):
            for run, (_, schedule) in zip(runs, cfg.variants):
                layer = run["layer"]
                dist.barrier()
                start = time.perf_counter()
                layer(x).square().mean().backward()
                dist.barrier()
                elapsed = time.perf_counter() - start
                if it < cfg.warmup:
                    continue
                run["times"].append(_max_over_ranks(elapsed))
                if schedule == "sync":
                    run["phases"].append({k: _max_over_ranks(v) for k, v in run["timer"].phases().items()})
                planner_last = getattr(layer.planner, "last", None)
                run["shadowed"].append(len(planner_last.shadowed) if planner_last else 0)
                run["bytes"].append(_sum_over_ranks(float(layer.stats.bytes_sent.sum())))
        for run, (strategy, schedule) in zip(runs, cfg.variants):
            row = {
                "routing": routing_name,
                "strategy": strategy,
                "schedule": schedule,
                "median_s": float(np.median(run["times"])),
                "times_s": run["times"],
                "load_imbalance": run["layer"].stats.load_imbalance,
                "shadowed_mean": float(np.mean(run["shadowed"])),
                "dispatch_bytes_on_network": float(np.mean(run["bytes"])),
            }
            if run["phases"]:
                row["forward_a2a_s"] = float(np.median([p["a2a_s"] for p in run["phases"]]))
                row["forward_compute_s"] = float(np.median([p["compute_s"] for p in run["phases"]]))
            rows.append(row)
    _add_speedups(rows)
    return rows


def _add_speedups(rows: list[dict]) -> None:
    """Speedup over EP-sync of the same routing, and for pairwise the FasterMoE §5.5 bound
    `(comm + comp) / max(comm, comp)` from the sync run's phases (comm: 4 all-to-alls = 2x the
    forward's two; comp: forward + 2x backward)."""
    base = {r["routing"]: r for r in rows if (r["strategy"], r["schedule"]) == ("ep", "sync")}
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
                    if x["routing"] == r["routing"] and x["schedule"] == "sync" and x["strategy"] == r["strategy"]
                ),
                ref,
            )
            comm, comp = 2 * sync_ref["forward_a2a_s"], 3 * sync_ref["forward_compute_s"]
            bound = (comm + comp) / max(comm, comp)
            r["pairwise_bound"] = bound
            r["pairwise_speedup"] = sync_ref["median_s"] / r["median_s"]
            r["share_of_bound"] = r["pairwise_speedup"] / bound
