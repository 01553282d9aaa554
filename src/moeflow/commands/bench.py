"""`moeflow bench`: time MoE layers.

One process: forward+backward of one layer against its balanced lower bound and Hugging Face's
Mixtral block (identical weights). Several ranks (`--nproc N`, or under torchrun / the network
testbed): one layer per (routing skew × strategy × schedule), identical weights and routing.

    moeflow bench --experts 32 --top-k 2 --dtype bfloat16 --json
    moeflow bench --nproc 4 --cost-model results/profile.json --skews 0 1.2 \\
        --variants ep:sync shadow:sync ep:pairwise shadow:pairwise
    moeflow bench --nproc 4 --cost-model results/profile.json --suite --out suite.json
    moeflow bench --nproc 4 --ep-size 2 --cost-model two_devices.json --variants ep:sync shadow:sync

`--suite`: every strategy and schedule on the same workloads — Zipf s ∈ {0, 0.8, 1.2, 1.6, 2.0},
the SmartMoE trace replayed iteration by iteration, a drifting load — with the force-balanced
ceiling timed beside each (flags given explicitly keep their values).
"""

from __future__ import annotations

HELP = "time MoE layers: one layer vs its bound and Hugging Face, or strategies on several ranks"

SUITE = {
    "skews": [0.0, 0.8, 1.2, 1.6, 2.0],
    "trace": "smartmoe",
    "trace_replay": True,
    "drift": 4,
    "ceiling": True,
    "blocks": 2,
    "variants": [
        "ep:sync",
        "ep:pairwise",
        "shadow:sync",
        "prophet:sync+prefetch",
        "eplb:sync",
        "fssdp:sync+prefetch",
        "auto:sync+prefetch",
        "auto:auto+prefetch",
    ],
}
"""What `--suite` sets (where the flag was left at its default)."""


def add_arguments(parser) -> None:
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per forward, per rank (default: %(default)s)")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--d-hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8, help="experts in the layer (several ranks: per rank)")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert", choices=("swiglu", "ffn"), default=None, help="default: swiglu (1 process), ffn")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--min-run-time", type=float, default=2.0, help="seconds per measurement (1 process)")
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face comparison")
    parser.add_argument(
        "--block",
        choices=("mixtral", "deepseek_v3"),
        default="mixtral",
        help="1 process: the block compared (deepseek_v3: group-limited sigmoid routing and a shared expert)",
    )
    parser.add_argument(
        "--hf-impl", choices=("grouped_mm", "batched_mm", "eager"), default="grouped_mm", help="HF experts (1 process)"
    )
    parser.add_argument(
        "--device", default="cpu", help="1 process: where the layer and its peers run, cpu or cuda (default: cpu)"
    )
    parser.add_argument("--nproc", type=int, default=None, help="local ranks for the strategy benchmark")
    parser.add_argument("--cost-model", default=None, help="preset name or profile JSON (planners need one)")
    parser.add_argument("--skews", type=float, nargs="+", default=[0.0, 0.8, 1.2, 1.6], help="Zipf exponents")
    parser.add_argument("--trace", default=None, help="also replay this routing trace: smartmoe or a .npz path")
    parser.add_argument(
        "--trace-replay",
        action="store_true",
        help="replay the trace's consecutive iterations, one per timed iteration (real locality), not one iteration",
    )
    parser.add_argument(
        "--blocks", type=int, default=1, help="MoE layers per timed model, each followed by a dense part (default 1)"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["ep:sync", "shadow:sync", "ep:pairwise", "shadow:pairwise"],
        help="layers to time, strategy:schedule[+prefetch][:dispatch[:wire dtype]] (default a2a, the compute "
        "dtype; e.g. ep:sync:hierarchical, ep:sync:a2a:bfloat16, prophet:sync+prefetch with --blocks 2)",
    )
    parser.add_argument(
        "--group-size", type=int, default=None, help="pairwise: schedule_options group_size (default: from topology)"
    )
    parser.add_argument(
        "--drift", type=int, default=0, help="also a drifting load: the hot experts move every N iterations (0: off)"
    )
    parser.add_argument(
        "--ceiling", action="store_true", help="also time plain EP on perfectly even routing (force-balanced ceiling)"
    )
    parser.add_argument("--suite", action="store_true", help="every strategy x schedule on the suite's workloads")
    parser.add_argument(
        "--ep-size",
        type=int,
        default=None,
        help="ranks that split the experts (default: all); fewer: data-parallel replicas on a dp x ep mesh "
        "(docs/parallel.md), --experts and --cost-model per EP group",
    )
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed iterations first (strategy benchmark; schedule=auto runs each candidate twice in its "
        "first forwards)",
    )
    parser.add_argument("--out", default=None, help="also write the result JSON here")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(defaults={key: parser.get_default(key) for key in SUITE})  # --suite keeps explicit flags


def _strategy_worker(cfg, cost_model_source):
    import torch.distributed as dist

    from moeflow.bench.strategies import run_strategy_bench
    from moeflow.core.launch import init_distributed
    from moeflow.perf.costmodel import CostModel

    init_distributed("cpu")
    try:
        cost_model = CostModel.resolve(cost_model_source) if cost_model_source else None
        ep = cfg.ep_size or dist.get_world_size()
        if cost_model is not None and cost_model.topology.num_devices != ep:
            raise ValueError(
                f"--cost-model {cost_model_source!r} describes {cost_model.topology.num_devices} devices, "
                f"but the expert-parallel groups have {ep} ranks"
            )
        return run_strategy_bench(cfg, cost_model, progress=True)
    finally:
        dist.destroy_process_group()


def _print_strategy_rows(rows: list[dict]) -> None:
    header = f"{'routing':<18}{'strategy':<15}{'schedule':<18}{'dispatch':<14}{'wire':<10}{'ms':>9}{'speedup':>9}"
    print(
        header
        + f"{'copies':>8}{'load std':>9}{'predicted':>10}{'model ms':>9}{'bound':>7}{'of bound':>9}{'ceiling':>9}"
    )
    for r in rows:
        bound = f"{r['pairwise_bound']:7.2f}{r['share_of_bound']:9.0%}" if "pairwise_bound" in r else f"{'':7}{'':9}"
        share = r.get("share_of_ceiling")  # with --ceiling: the part of EP's gap to even routing closed
        bound += f"{share:9.0%}" if share is not None else f"{'':9}"
        predicted, model = r["planner_predicted_speedup"], r.get("model_predicted_s")
        schedule = r["schedule"] + ("+prefetch" if r.get("prefetch") else "")
        strategy = r["strategy"] + (" (even)" if r.get("ceiling") else "")
        print(
            f"{r['routing']:<18}{strategy:<15}{schedule:<18}{r['dispatch']:<14}{r['wire_dtype'] or '-':<10}"
            f"{1e3 * r['median_s']:9.1f}{r.get('speedup_vs_ep', float('nan')):9.2f}{r.get('copies_mean', 0):8.1f}"
            f"{r.get('load_std_mean', 0):9.1f}{'' if predicted is None else f'{predicted:.2f}':>10}"
            f"{'' if model is None else f'{1e3 * model:.1f}':>9}{bound}"
        )


def _strategy_result(args, world: int, outer: bool) -> dict | None:
    """The strategy benchmark on `world` ranks (None on ranks other than 0 of an outer torchrun)."""
    import os

    from moeflow.bench.strategies import StrategyBenchConfig, Variant
    from moeflow.core.launch import launch_local

    if args.suite:
        for key, value in SUITE.items():
            if getattr(args, key) == args.defaults[key]:
                setattr(args, key, value)
    variants = tuple(Variant.parse(text) for text in args.variants)
    if any(v.strategy != "ep" for v in variants) and not args.cost_model:
        raise ValueError("--cost-model is required for planners other than ep (a preset name or a profile JSON)")
    cfg = StrategyBenchConfig(
        tokens_per_rank=args.tokens,
        d_model=args.d_model,
        d_hidden=args.d_hidden,
        experts_per_rank=args.experts,
        top_k=args.top_k,
        expert=args.expert or "ffn",
        skews=tuple(args.skews),
        trace=args.trace,
        trace_replay=args.trace_replay,
        drift_period=args.drift,
        ceiling=args.ceiling,
        blocks=args.blocks,
        variants=variants,
        schedule_options=None if args.group_size is None else {"group_size": args.group_size},
        iterations=args.iterations,
        warmup=args.warmup,
        ep_size=args.ep_size,
    )
    if outer:
        rows = _strategy_worker(cfg, args.cost_model)
        if int(os.environ["RANK"]) != 0:
            return None
    else:
        rows = launch_local(_strategy_worker, world, cfg, args.cost_model, name="moeflow-bench")[0]
    return {"config": cfg.__dict__ | {"variants": [str(v) for v in cfg.variants]}, "world_size": world, "rows": rows}


def _layer_result(args) -> dict:
    from moeflow.bench.layer import LayerBenchConfig, run_layer_bench
    from moeflow.bench.quiet import transformers_quiet

    cfg = LayerBenchConfig(
        tokens=args.tokens,
        d_model=args.d_model,
        d_hidden=args.d_hidden,
        num_experts=args.experts,
        top_k=args.top_k,
        dtype=args.dtype,
        expert=args.expert or "swiglu",
        min_run_time_s=args.min_run_time,
        block=args.block,
        hf_impl=args.hf_impl,
        device=args.device,
    )
    with transformers_quiet():
        return run_layer_bench(cfg, compare_hf=not args.no_hf, progress=True)


def run(args) -> int:
    import json

    from moeflow.core.launch import resolve_world_size

    world, outer = resolve_world_size(args.nproc)
    result = _strategy_result(args, world, outer) if world > 1 else _layer_result(args)
    if result is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    if args.json:
        print(json.dumps(result, indent=2))
    elif world > 1:
        _print_strategy_rows(result["rows"])
    else:
        print(
            f"moeflow   {1e3 * result['moeflow']['median_s']:9.1f} ms  (load imbalance {result['load_imbalance']:.2f})"
        )
        print(
            f"bound     {1e3 * result['bound']['median_s']:9.1f} ms  moeflow/bound = {result['moeflow_over_bound']:.2f}"
        )
        if result.get("hf"):
            print(f"HF block  {1e3 * result['hf']['median_s']:9.1f} ms  HF/moeflow = {result['hf_over_moeflow']:.2f}")
    return 0
