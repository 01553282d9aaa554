"""One suite for every planner, simulated at paper scale: each strategy (and schedule) on the same
workloads, its speedup over plain EP, and the force-balanced ceiling beside it.

    .venv/bin/python benchmarks/strategy_suite.py --out results/strategy_suite.json

Workloads: Zipf(s) for s in {0, 0.8, 1.2, 1.6, 2.0} (each iteration's counts drawn afresh around one
distribution), the SmartMoE GPT trace replayed iteration by iteration (docs/traces.md), and a
drifting load (two hot experts with half the load, moving to the next experts every `--drift`
iterations). Strategies: ep, shadow, prophet (with the block-wise prefetch), eplb, fssdp (with the
prefetch) and auto (the arbiter over all of them; in the simulator its cost model is exact, so
there is nothing to correct). Schedules: sync and pairwise. The ceiling is plain EP on perfectly
even routing with the same tokens: `share_of_ceiling` = (T_ep − T) / (T_ep − T_ceiling), the part
of the possible gain a strategy reaches. The plot shows the speedup over EP per workload, one line
per strategy (sync), the ceiling dashed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from moeflow.core.expert_shape import ExpertShape
from moeflow.perf.costmodel import CostModel
from moeflow.perf.simulator import SimulatedLayer, simulate
from moeflow.perf.traces import Trace, resolve_trace, synthetic_trace

SKEWS = (0.0, 0.8, 1.2, 1.6, 2.0)
STRATEGIES = {  # label: (strategy, prefetch)
    "ep": ("ep", False),
    "shadow": ("shadow", False),
    "prophet+prefetch": ("prophet", True),
    "eplb": ("eplb", False),
    "fssdp+prefetch": ("fssdp", True),
    "auto+prefetch": ("auto", True),
}


def workloads(world: int, experts: int, tokens: int, iterations: int, drift: int) -> dict[str, Trace]:
    out = {f"zipf-{s:g}": synthetic_trace("zipf", iterations, 4, world, experts, tokens, 2, skew=s) for s in SKEWS}
    full = resolve_trace("smartmoe")
    n = min(iterations, full.flow_ILWE.shape[0])
    out["smartmoe"] = Trace(full.flow_ILWE[:n], full.steps_I[:n], dict(full.meta)).rescale(world, experts)
    out["drift"] = synthetic_trace("drift", iterations, 4, world, experts, tokens, 2, drift_period=drift)
    return out


def balanced(trace: Trace) -> Trace:
    """The same tokens per rank and layer, spread evenly over the experts: the force-balanced ceiling."""
    flow = trace.flow_ILWE
    E = flow.shape[-1]
    even = np.repeat(flow.sum(-1, keepdims=True) // E, E, axis=-1)
    even[..., 0] += flow.sum(-1) - even.sum(-1)
    return Trace(even, trace.steps_I, dict(trace.meta))


def run(cluster: str, trace: Trace, shape: ExpertShape, nonmoe_s: float) -> dict:
    cm = CostModel.from_preset(cluster)
    out = {}
    for label, (strategy, prefetch) in STRATEGIES.items():
        layer = SimulatedLayer(shape, top_k=2, nonmoe_forward_s=nonmoe_s, prefetch=prefetch)
        start = time.perf_counter()
        for r in simulate(trace, cm, layer, [strategy], ["sync", "pairwise"]):
            out[f"{label}:{r.schedule}"] = {
                "total_ms": 1e3 * float(r.total_I.mean()),
                "copies_per_layer": float(r.replicated_IL.mean()),
                "simulate_s": time.perf_counter() - start,
            }
    ceiling = simulate(balanced(trace), cm, SimulatedLayer(shape, top_k=2, nonmoe_forward_s=nonmoe_s), ["ep"], ["sync"])
    out["ceiling"] = {"total_ms": 1e3 * float(ceiling[0].total_I.mean())}
    ep, top = out["ep:sync"]["total_ms"], out["ceiling"]["total_ms"]
    for row in out.values():
        row["speedup_over_ep"] = ep / row["total_ms"]
        row["share_of_ceiling"] = (ep - row["total_ms"]) / (ep - top) if ep > top else None
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for label in STRATEGIES:
        ax.plot(
            names, [result["workloads"][w][f"{label}:sync"]["speedup_over_ep"] for w in names], marker="o", label=label
        )
    ax.plot(names, [result["workloads"][w]["ceiling"]["speedup_over_ep"] for w in names], "k--", label="ceiling")
    ax.set_ylabel("speedup over EP (sync)")
    ax.set_title(f"moeflow strategies, simulated on {result['cluster']}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/strategy_suite.json")
    parser.add_argument("--cluster", default="johnny")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--drift", type=int, default=10, help="iterations between moves of the hot experts")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--nonmoe-ms", type=float, default=2.0, help="dense forward of a block")
    args = parser.parse_args()
    cm = CostModel.from_preset(args.cluster)
    W = cm.topology.num_devices
    shape = ExpertShape(args.d_model, 4 * args.d_model, "ffn")
    tokens = 4096
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cluster": args.cluster,
        "devices": W,
        "experts": 2 * W,
        "model": {"d_model": args.d_model, "d_hidden": 4 * args.d_model, "top_k": 2, "tokens_per_rank": tokens},
        "nonmoe_forward_ms": args.nonmoe_ms,
        "workloads": {},
    }
    for name, trace in workloads(W, 2 * W, tokens, args.iterations, args.drift).items():
        result["workloads"][name] = run(args.cluster, trace, shape, 1e-3 * args.nonmoe_ms)
        print(name, {k: round(v["speedup_over_ep"], 2) for k, v in result["workloads"][name].items()}, flush=True)
    labels = [f"{label}:{s}" for label in STRATEGIES for s in ("sync", "pairwise")]
    speedups = {k: [result["workloads"][w][k]["speedup_over_ep"] for w in result["workloads"]] for k in labels}
    result["geomean_speedup_over_ep"] = {k: float(np.exp(np.mean(np.log(v)))) for k, v in speedups.items()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print("geomean speedup over EP:", {k: round(v, 2) for k, v in result["geomean_speedup_over_ep"].items()})
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
