"""FasterMoE's speedups predicted on its own clusters (johnny, trevor presets) next to the paper's.

    .venv/bin/python benchmarks/fastermoe_simulated.py --out results/fastermoe_simulated.json

johnny (16 V100, 2 nodes, IB degraded to 50 Gb/s) replays the real 16-rank, 32-expert SmartMoE
GPT trace from ../shared/traces when present (else Zipf routing); trevor (64 V100, 16 nodes) replays
Zipf routing. Per-iteration speedup over synchronous EP of shadowing (moeflow's planner, and
Algorithm 1's stop rule as `shadow_alg1`), the smart schedule and both,
as the mean and the maximum over iterations (FasterMoE Fig. 13 reports "up to").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from moeflow.perf.costmodel import CostModel
from moeflow.perf.simulator import ModelConfig, simulate
from moeflow.perf.traces import load_trace, synthetic_trace

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "smartmoe-gpt-16ranks-32experts.npz"
# FasterMoE §5.6 / Fig. 13 (speedup over FastMoE's synchronous EP).
PAPER = {"johnny": {"shadow": 1.95, "pairwise": 1.40, "both": 2.20}, "trevor": {"shadow": 4.74, "both": 5.72}}
VARIANTS = {
    "shadow": ("shadow", "sync"),
    "shadow_alg1": ("shadow_greedy", "sync"),  # the paper's Algorithm 1 stop rule, no margin
    "pairwise": ("ep", "pairwise"),
    "both": ("shadow", "pairwise"),
}


def run_cluster(name: str, trace, model: ModelConfig, group_size: int) -> dict:
    cm = CostModel.from_preset(name)
    results = {
        (r.strategy, r.schedule): r
        for r in simulate(
            trace, cm, model, ["ep", "shadow", "shadow_greedy"], ["sync", "pairwise"], pairwise_group_size=group_size
        )
    }
    base = results["ep", "sync"].total_I
    out = {"iterations": int(trace.flow_ILWE.shape[0]), "layers": int(trace.flow_ILWE.shape[1])}
    for label, key in VARIANTS.items():
        speedup = base / results[key].total_I
        paper = PAPER[name].get(label.removesuffix("_alg1"))
        out[label] = {"mean": float(speedup.mean()), "max": float(speedup.max()), "paper_up_to": paper}
    out["shadowed_experts_per_layer"] = float(results["shadow", "sync"].replicated_IL.mean() / (trace.world_size - 1))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/fastermoe_simulated.json")
    parser.add_argument("--iterations", type=int, default=30, help="trace iterations replayed (evenly spaced)")
    args = parser.parse_args()
    model = ModelConfig(d_model=1024, d_hidden=4096)  # FasterMoE's GPT-MoE experts (h = 4d)
    if TRACE.is_file():
        full = load_trace(TRACE)
        keep = np.linspace(0, full.flow_ILWE.shape[0] - 1, args.iterations).astype(int)
        johnny_trace = type(full)(full.flow_ILWE[keep], full.steps_I[keep], dict(full.meta))
        johnny_source = f"SmartMoE GPT trace ({TRACE.name}), {args.iterations} iterations x 24 layers"
    else:
        johnny_trace = synthetic_trace("zipf", args.iterations, 4, 16, 32, 4096, skew=1.2)
        johnny_source = "Zipf s=1.2 (SmartMoE trace not found)"
    trevor_trace = synthetic_trace("zipf", args.iterations, 4, 64, 64, 2048, skew=1.2)
    result = {
        "model": {"d_model": model.d_model, "d_hidden": model.d_hidden},
        "johnny": run_cluster("johnny", johnny_trace, model, group_size=8) | {"trace": johnny_source},
        "trevor": run_cluster("trevor", trevor_trace, model, group_size=4) | {"trace": "Zipf s=1.2, 64 experts"},
    }
    print(f"{'cluster':<8}{'variant':<12}{'mean':>7}{'max':>7}{'paper (up to)':>15}")
    for cluster in ("johnny", "trevor"):
        for label in VARIANTS:
            v = result[cluster][label]
            paper = f"{v['paper_up_to']:.2f}" if v["paper_up_to"] else "-"
            print(f"{cluster:<8}{label:<12}{v['mean']:7.2f}{v['max']:7.2f}{paper:>15}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
