"""`moeflow bench`: forward+backward time of one MoE layer next to its balanced lower bound and
Hugging Face's Mixtral block (identical weights).

    moeflow bench --experts 32 --top-k 2 --dtype bfloat16 --json
"""

from __future__ import annotations

HELP = "time one MoE layer (forward+backward) against its lower bound and Hugging Face's Mixtral block"


def add_arguments(parser) -> None:
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per forward (default: %(default)s)")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--d-hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert", choices=("swiglu", "ffn"), default="swiglu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--min-run-time", type=float, default=2.0, help="seconds per measurement")
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face comparison")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args) -> int:
    import json

    from moeflow.bench import LayerBenchConfig, run_layer_bench

    cfg = LayerBenchConfig(
        tokens=args.tokens,
        d_model=args.d_model,
        d_hidden=args.d_hidden,
        num_experts=args.experts,
        top_k=args.top_k,
        dtype=args.dtype,
        expert=args.expert,
        min_run_time_s=args.min_run_time,
    )
    result = run_layer_bench(cfg, compare_hf=not args.no_hf)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"moeflow   {1e3 * result['moeflow']['median_s']:9.1f} ms  (load imbalance {result['load_imbalance']:.2f})")
    print(f"bound     {1e3 * result['bound']['median_s']:9.1f} ms  moeflow/bound = {result['moeflow_over_bound']:.2f}")
    if result.get("hf"):
        print(f"HF block  {1e3 * result['hf']['median_s']:9.1f} ms  HF/moeflow = {result['hf_over_moeflow']:.2f}")
    return 0
