"""Forward+backward time of the MoE layer vs its balanced-bmm lower bound and Hugging Face's
MixtralSparseMoeBlock with identical weights (the core runtime benchmark; `moeflow.bench.layer`).

    .venv/bin/python benchmarks/layer.py --out results/layer.json
    .venv/bin/python benchmarks/layer.py --quick          # one small config, for a smoke run

Grid: T=4096, d=512, h=1024, E in {8, 32}, k in {1, 2}, fp32 and bf16. Writes JSON; prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

from moeflow.bench.layer import LayerBenchConfig, machine_info, run_layer_bench


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/layer.json")
    parser.add_argument("--quick", action="store_true", help="one small configuration")
    parser.add_argument("--min-run-time", type=float, default=2.0, help="seconds per measurement")
    args = parser.parse_args()
    if args.quick:
        grid = [LayerBenchConfig(tokens=512, d_model=64, d_hidden=128, num_experts=8, min_run_time_s=0.2)]
    else:
        grid = [
            LayerBenchConfig(num_experts=e, top_k=k, dtype=dt, min_run_time_s=args.min_run_time)
            for dt, e, k in itertools.product(["float32", "bfloat16"], [8, 32], [1, 2])
        ]
    rows = []
    print(f"{'dtype':<9}{'E':>4}{'k':>3}{'moeflow ms':>12}{'bound ms':>10}{'/bound':>8}{'HF ms':>10}{'HF/ours':>9}")
    for cfg in grid:
        r = run_layer_bench(cfg)
        rows.append(r)
        hf = r.get("hf")
        print(
            f"{cfg.dtype:<9}{cfg.num_experts:>4}{cfg.top_k:>3}{1e3 * r['moeflow']['median_s']:>12.1f}"
            f"{1e3 * r['bound']['median_s']:>10.1f}{r['moeflow_over_bound']:>8.2f}"
            + (f"{1e3 * hf['median_s']:>10.1f}{r['hf_over_moeflow']:>9.2f}" if hf else f"{'-':>10}{'-':>9}"),
            flush=True,
        )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": machine_info(), "results": rows}, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
