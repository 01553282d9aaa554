"""`moeflow profile`: α-β fits of GEMM and collectives on the live backend (FSMoE §6.2).

    moeflow profile --nproc 2 --out results/profile.json          # local gloo ranks
    torchrun --nproc-per-node 4 -m moeflow.cli profile --out p.json  # the ranks torchrun gives
    python scripts/testbed.py --nodes 2 --ranks-per-node 2 --bandwidth-mbit 800 -- \\
        .venv/bin/moeflow profile --out results/profile-testbed.json
    moeflow profile --nproc 4 --ops chunk_forward,chunk_backward --chunk-esp-size 2  # FSMoE's chunk cost
The JSON loads with `CostModel.load` and `moeflow simulate --cluster FILE`.
"""

from __future__ import annotations

HELP = "measure GEMM and collective α-β fits on the live backend; write a cost-model JSON"


def add_arguments(parser):
    parser.add_argument("--nproc", type=int, default=None, help="local processes to start (not under torchrun)")
    parser.add_argument("--out", default=None, help="where to write the profile JSON")
    parser.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="auto: nccl when CUDA is available, else gloo",
    )
    parser.add_argument(
        "--ops",
        default=None,
        help="comma list of kinds (default: all): "
        "a2a,all_gather,reduce_scatter,all_reduce,broadcast,reduce,p2p_intra,p2p_inter,copies,gemm,elementwise,"
        "chunk_forward,chunk_backward",
    )
    parser.add_argument(
        "--chunk-layer",
        default=None,
        metavar="TOKENS,D_MODEL,D_HIDDEN",
        help="the MoE layer whose pipelined block chunk_forward/chunk_backward time (default 512,128,1024)",
    )
    parser.add_argument(
        "--chunk-esp-size",
        type=int,
        default=1,
        help="expert-sharding group size of that layer (FSMoE's layout: ranks of a node; 1: plain EP)",
    )
    parser.add_argument("--sizes", default=None, help="comma list of message sizes in bytes")
    parser.add_argument("--gemm-sizes", default=None, help="comma list of square GEMM sizes")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per size")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per size")
    parser.add_argument("--json", action="store_true", help="print the whole profile as JSON")


def _ints(text, name):
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected a comma-separated list of integers") from None


def run(args) -> int:
    import json
    import os
    from pathlib import Path

    import torch

    from moeflow.profiling.profiler import ProfileConfig, launch

    kw = {"repeats": args.repeats, "warmup": args.warmup}
    if args.ops:
        kw["ops"] = [o.strip() for o in args.ops.split(",") if o.strip()]
    if args.sizes:
        kw["comm_sizes_bytes"] = _ints(args.sizes, "--sizes")
    if args.gemm_sizes:
        kw["gemm_sizes"] = _ints(args.gemm_sizes, "--gemm-sizes")
    if args.chunk_layer:
        kw["chunk_layer"] = tuple(_ints(args.chunk_layer, "--chunk-layer"))
    kw["chunk_esp_size"] = args.chunk_esp_size
    config = ProfileConfig(**kw)
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("--backend='nccl': CUDA is not available on this machine")
    profile = launch(config, args.nproc, backend)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # under torchrun only rank 0 reports
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(profile, indent=2) + "\n")
    if args.json:
        print(json.dumps(profile, indent=2))
        return 0
    print(f"{profile['name']}: nodes {profile['nodes']}")
    print(f"{'op':<16}{'alpha (us)':>12}{'1/beta':>16}{'r2':>10}{'noise cv':>10}")
    for kind, fit in profile["fits"].items():
        inv = 1.0 / fit["beta_s_per_unit"] if fit["beta_s_per_unit"] > 0 else float("inf")
        noise = profile["measurements"][kind]["noise_cv"]
        if fit["unit"] == "chunk":  # β is the cost of one more chunk, not a rate
            rate, unit = 1e3 * fit["beta_s_per_unit"], "ms/chk"
        else:
            rate = inv * (1e-9 if fit["unit"] == "flop" else 1e-6)
            unit = "GFLOP/s" if fit["unit"] == "flop" else "MB/s"
        print(f"{kind:<16}{1e6 * fit['alpha_s']:>12.1f}{rate:>10.1f} {unit:<6}{fit['r2']:>9.4f}{noise:>10.3f}")
    if "pipeline_overlap" in profile:
        eta_f, eta_b = profile["pipeline_overlap"]
        print(f"pipeline overlap realised (eta): forward {eta_f:.2f}, backward {eta_b:.2f}")
    if args.out:
        print(f"wrote {args.out}")
    return 0
