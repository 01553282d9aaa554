"""Forward+backward time and peak step memory of the MoE layer vs its balanced-bmm lower bound,
Hugging Face's MixtralSparseMoeBlock (swiglu) and Tutel's moe_layer (ffn), identical weights,
measured interleaved round by round (`moeflow.bench.layer`).

    .venv/bin/python benchmarks/layer.py --out results/layer.json
    .venv/bin/python benchmarks/layer.py --quick          # one small config, for a smoke run
    # ffn experts next to Tutel (built as in docs/performance.md) and a baseline tree:
    /work/tutel-venv/bin/python benchmarks/layer.py --expert ffn --dtype float32 --rounds 5 \
        --baseline-src /tmp/moeflow-base/src --out results/layer_tutel.json

Default grid: T=4096, d=512, h=1024, E in {8, 32}, k in {1, 2}, fp32 and bf16. Writes JSON;
prints a table (ratios are per round: median [min–max]).

Fine-grained experts (docs/architectures.md): DeepSeek-V3's block (group-limited sigmoid routing,
a shared expert) at E = 64, k = 6 and E = 256, k = 8 with narrow experts, beside transformers'
`DeepseekV3MoE` with the same weights (its default `grouped_mm` experts), one and two threads:

    .venv/bin/python benchmarks/layer.py --block deepseek_v3 --pairs 64:6 256:8 --d-model 512 \
        --d-hidden 128 --dtype float32 --threads 1 2 --rounds 3 --out results/layer_fine.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

from moeflow.bench.layer import LayerBenchConfig, machine_info, run_layer_bench

PEERS = ("bound", "hf", "tutel", "baseline")


def _row(r: dict) -> str:
    cfg = r["config"]
    cells = [
        f"{cfg['dtype'][:4]:<5}{cfg['tokens']:>6}{cfg['num_experts']:>4}{cfg['top_k']:>3}",
        f"{1e3 * r['moeflow']['median_s']:>9.1f}{r['moeflow']['peak_step_bytes'] / 2**20:>8.0f}",
    ]
    for peer in PEERS:
        ratio = r["ratios"].get(f"{peer}/moeflow")
        if ratio:
            mib = r[peer]["peak_step_bytes"] / 2**20
            cells.append(f"  {peer} {ratio['median']:.2f} [{ratio['min']:.2f}–{ratio['max']:.2f}] {mib:.0f}MiB")
    if r.get("tutel"):
        cells.append(f"  tutel pad {r['tutel']['padded_rows']}")
    return "".join(cells)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/layer.json")
    parser.add_argument("--quick", action="store_true", help="one small configuration")
    parser.add_argument("--min-run-time", type=float, default=2.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds per configuration")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--top-k", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--expert", default="swiglu", choices=["swiglu", "ffn"])
    parser.add_argument("--baseline-src", help="a moeflow source tree (folder holding moeflow/) timed alongside")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--d-hidden", type=int, default=1024)
    parser.add_argument("--block", default="mixtral", choices=["mixtral", "deepseek_v3"])
    parser.add_argument("--hf-impl", default="grouped_mm", choices=["grouped_mm", "batched_mm", "eager"])
    parser.add_argument("--pairs", nargs="+", default=None, help="E:k pairs instead of --experts x --top-k")
    parser.add_argument("--threads", type=int, nargs="+", default=None, help="torch threads (default: as set)")
    parser.add_argument("--no-tutel", action="store_true")
    parser.add_argument("--device", default="cpu", help="cpu or cuda: where every contender runs")
    args = parser.parse_args()
    pairs = [tuple(map(int, p.split(":"))) for p in args.pairs] if args.pairs else None
    if args.quick:
        grid = [
            LayerBenchConfig(
                tokens=512, d_model=64, d_hidden=128, num_experts=8, min_run_time_s=0.2, device=args.device
            )
        ]
    else:
        shapes = pairs or list(itertools.product(args.experts, args.top_k))
        grid = [
            LayerBenchConfig(
                tokens=t,
                d_model=args.d_model,
                d_hidden=args.d_hidden,
                num_experts=e,
                top_k=k,
                dtype=dt,
                expert=args.expert,
                min_run_time_s=args.min_run_time,
                rounds=args.rounds,
                block=args.block,
                hf_impl=args.hf_impl,
                device=args.device,
            )
            for dt, t, (e, k) in itertools.product(args.dtype, args.tokens, shapes)
        ]
    rows = []
    print(f"{'dtype':<5}{'T':>6}{'E':>4}{'k':>3}{'ms':>9}{'MiB':>8}  peer time/moeflow [spread] peak")
    for threads in args.threads or [torch.get_num_threads()]:
        torch.set_num_threads(threads)
        for cfg in grid:
            r = run_layer_bench(
                cfg, compare_hf=not args.no_hf, compare_tutel=not args.no_tutel, baseline_src=args.baseline_src
            )
            rows.append(r)
            print(f"{threads}t " + _row(r), flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": machine_info(), "results": rows}, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
