"""Pro-Prophet's speedups predicted on its own clusters (`prophet_*` presets) and FasterMoE's johnny,
next to the paper's (Pro-Prophet §VI: 1.36-2.66x over DeepSpeed-MoE, 1.01-1.50x over FasterMoE).

    .venv/bin/python benchmarks/prophet_simulated.py --out results/prophet_simulated.json

Each cluster replays the SmartMoE GPT trace excerpt that ships with the package (docs/traces.md)
iteration by iteration, so the planner sees only the past: the recorded iterations are 10 training
steps apart, so `prophet` plans from a load 10 steps old (Pro-Prophet plans from the last step's —
a harder test here). Zipf(1.2) routing (each iteration's counts drawn afresh around one
distribution) is the second workload. Per iteration and all four layers: plain EP (DeepSpeed-MoE's
placement), FasterMoE shadowing (moeflow's planner), `prophet` without the block-wise prefetch
(Eq. 6) and with it (Eq. 8; the dense part of a block is priced as attention's GEMMs, below). The
expert is Pro-Prophet's MoE-GPT FFN (d = 1024, h = 4d, top-2).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from moeflow.core.expert_shape import ExpertShape
from moeflow.perf.costmodel import CostModel
from moeflow.sim.simulator import SimulatedLayer, simulate
from moeflow.sim.traces import Trace, resolve_trace, synthetic_trace

PAPER = {"over_ep": (1.36, 2.66), "over_fastermoe": (1.01, 1.50)}
CLUSTERS = ("prophet_hpwnv", "prophet_hpnv", "prophet_lpwnv", "johnny")
D_MODEL, SEQ = 1024, 1024


def attention_forward_s(cost_model: CostModel, tokens_per_rank: int, seq: int = SEQ, d_model: int = D_MODEL) -> float:
    """The dense part of a block (T_FNEC of Eq. 8): attention's four d×d projections (8·d² FLOPs per
    token) and its score and value products (4·seq·d per token) at the device's GEMM rate."""
    flops = (8 * d_model**2 + 4 * seq * d_model) * tokens_per_rank
    return float(cost_model.gemm_time(flops))


def run(cluster: str, trace: Trace, tokens_per_rank: int) -> dict:
    cm = CostModel.from_preset(cluster)
    shape = ExpertShape(D_MODEL, 4 * D_MODEL, "ffn")
    nonmoe = attention_forward_s(cm, tokens_per_rank)
    out: dict = {"devices": cm.topology.num_devices, "nonmoe_forward_ms": 1e3 * nonmoe}
    totals = {}
    for prefetch in (False, True):
        layer = SimulatedLayer(shape, top_k=2, nonmoe_forward_s=nonmoe, prefetch=prefetch)
        start = time.perf_counter()
        for r in simulate(trace, cm, layer, ["ep", "shadow", "prophet"], ["sync"]):
            if prefetch and r.strategy != "prophet":
                continue
            label = "prophet+prefetch" if prefetch else r.strategy
            totals[label] = r.total_I
            out[label] = {
                "total_ms": 1e3 * float(r.total_I.mean()),
                "copies_per_layer": float(r.replicated_IL.mean()),
                "other_comm_ms": 1e3 * float(r.other_comm_I.mean()),
            }
        out[f"simulate_s{'_prefetch' if prefetch else ''}"] = time.perf_counter() - start
    for label in ("shadow", "prophet", "prophet+prefetch"):
        over_ep = totals["ep"] / totals[label]
        out[label]["speedup_over_ep"] = float(over_ep.mean())
        if label != "shadow":
            out[label]["speedup_over_shadow"] = float((totals["shadow"] / totals[label]).mean())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/prophet_simulated.json")
    parser.add_argument("--iterations", type=int, default=60, help="consecutive trace iterations replayed")
    args = parser.parse_args()
    full = resolve_trace("smartmoe")
    n = min(args.iterations, full.flow_ILWE.shape[0])
    smartmoe = Trace(full.flow_ILWE[:n], full.steps_I[:n], dict(full.meta))
    tokens = int(full.meta["tokens_per_rank"])
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": {"d_model": D_MODEL, "d_hidden": 4 * D_MODEL, "top_k": 2, "seq_len_for_attention": SEQ},
        "paper": PAPER,
        "smartmoe": {},
        "zipf-1.2": {},
    }
    for cluster in CLUSTERS:
        W = CostModel.from_preset(cluster).topology.num_devices
        zipf = synthetic_trace("zipf", n, 4, W, 2 * W, tokens, 2, skew=1.2)
        result["smartmoe"][cluster] = run(cluster, smartmoe, tokens)
        result["zipf-1.2"][cluster] = run(cluster, zipf, tokens)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(
        f"{'workload':<10}{'cluster':<15}{'shadow/EP':>10}{'prophet/EP':>11}{'+prefetch/EP':>13}"
        f"{'prophet/shadow':>15}{'+prefetch/shadow':>17}"
    )
    for workload in ("smartmoe", "zipf-1.2"):
        for cluster, r in result[workload].items():
            print(
                f"{workload:<10}{cluster:<15}{r['shadow']['speedup_over_ep']:>10.2f}"
                f"{r['prophet']['speedup_over_ep']:>11.2f}{r['prophet+prefetch']['speedup_over_ep']:>13.2f}"
                f"{r['prophet']['speedup_over_shadow']:>15.2f}{r['prophet+prefetch']['speedup_over_shadow']:>17.2f}"
            )
    print(f"paper: {PAPER}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
