"""The gate zoo (FSMoE §2.1's gate families): what each gate costs in the layer and what it does to
training, side by side.

1. Layer time: forward + backward of one MoELayer per gate (one process, identical shape and input,
   the gates interleaved repeat by repeat so machine noise hits them alike), as a ratio to `topk`.
2. Training: `moeflow train` on configs/tiny.toml (2 processes) per gate and seed, and top-k with
   the dispatched rows sent in bfloat16 (`moe.dispatch_dtype`, FSMoE's compression); validation loss
   at mid-run and at the end, throughput and load imbalance, mean ± std over seeds and the paired
   difference to `topk` (same seed = same initialisation and data order).

Expert choice and SoftMoE route over the whole batch on a rank, so in a causal decoder a token's
output depends on later tokens: their loss here is optimistic (the trainer warns), not comparable
with the token-choice gates'. SoftMoE gets `slots_per_expert` = k·T/E per rank: the same expert
rows as top-k.

    .venv/bin/python benchmarks/gate_zoo.py --seeds 0 1 2 --out results/gate_zoo.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from testbed_run import write_result
from training_runs import ROOT, aggregate, print_table, summarize, train

TOKENS_PER_RANK = 16 * 128 // 2  # configs/tiny.toml: global batch 16 × seq 128 over 2 processes
VARIANTS = {
    "topk": ["moe.gate=topk"],
    "switch": ["moe.gate=switch", "moe.top_k=1"],
    "noisy_topk": ["moe.gate=noisy_topk"],
    "sigmoid": ["moe.gate=sigmoid"],
    "xmoe": ["moe.gate=xmoe"],
    "expert_choice": ["moe.gate=expert_choice"],
    "soft": ["moe.gate=soft", f"moe.gate_options.slots_per_expert={2 * TOKENS_PER_RANK // 4}"],  # k·T/E
    "topk_bf16_wire": ["moe.gate=topk", "moe.dispatch_dtype=bfloat16"],
}
"""Training variant -> `--set` overrides (each gate with its default balance term)."""
GATES = [name for name in VARIANTS if name != "topk_bf16_wire"]
"""The gates timed in the layer."""


def layer_times(gates: list[str], tokens: int, d_model: int, d_hidden: int, experts: int, repeats: int) -> dict:
    """Median forward+backward seconds of one layer per gate, interleaved."""
    import torch

    from moeflow import MoELayer
    from moeflow.bench.interleave import balanced_order

    torch.manual_seed(0)
    x = torch.randn(tokens, d_model)
    layers = {}
    for gate in gates:
        top_k = 1 if gate == "switch" else 2
        options = {"slots_per_expert": top_k * tokens // experts} if gate == "soft" else None
        torch.manual_seed(0)
        layers[gate] = MoELayer(d_model, d_hidden, experts, top_k=top_k, gate=gate, gate_options=options)
    times: dict[str, list[float]] = {gate: [] for gate in gates}
    for it in range(repeats + 2):
        for gate in balanced_order(gates, it):
            layer = layers[gate]
            start = time.perf_counter()
            (layer(x).square().mean() + layer.aux_loss).backward()
            if it >= 2:
                times[gate].append(time.perf_counter() - start)
            layer.zero_grad(set_to_none=True)
    median = {gate: float(np.median(t)) for gate, t in times.items()}
    return {gate: {"median_s": m, "vs_topk": m / median["topk"]} for gate, m in median.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--layer-tokens", type=int, default=4096)
    parser.add_argument("--layer-repeats", type=int, default=20)
    parser.add_argument("--skip-training", action="store_true", help="layer times only")
    parser.add_argument("--runs", default="results/gate_zoo", help="run folders, one per gate and seed")
    parser.add_argument("--reuse", action="store_true", help="keep complete runs already in --runs")
    parser.add_argument("--out", default="results/gate_zoo.json")
    args = parser.parse_args()
    variants = list(dict.fromkeys(["topk", *args.variants]))  # topk: the baseline of both parts
    gates = [name for name in variants if name in GATES]
    layer = layer_times(gates, args.layer_tokens, 256, 1024, 8, args.layer_repeats)
    print(f"layer fwd+bwd, T={args.layer_tokens}, d=256, h=1024, E=8 (k=1 for switch):")
    for gate, r in layer.items():
        print(f"  {gate:<15}{1e3 * r['median_s']:9.1f} ms  {r['vs_topk']:6.2f}x topk", flush=True)
    result = {"layer": layer, "steps": args.steps, "seeds": args.seeds, "variants": {}}
    val_steps = [str(args.steps // 2), str(args.steps)]
    runs: dict[str, dict[str, dict]] = {}
    for name in [] if args.skip_training else variants:
        runs[name] = {}
        for seed in args.seeds:
            sets = [*VARIANTS[name], f"train.seed={seed}", f"train.eval_every={args.steps // 2}"]
            path = train(
                ROOT / args.runs / f"{name}-s{seed}",
                [*sets, "train.checkpoint_every=0"],
                args.nproc,
                args.steps,
                None,
                args.reuse,
            )
            runs[name][str(seed)] = summarize([json.loads(line) for line in path.read_text().splitlines()])
        base = None if name == "topk" else runs["topk"]
        summary = aggregate(runs[name], base, val_steps, "topk")
        result["variants"][name] = {"sets": VARIANTS[name], "summary": summary, "runs": runs[name]}
    if runs:
        print_table(result["variants"], val_steps, "topk")
    write_result(__file__, ROOT / args.out, result)  # with the command that produced it
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
