"""`moeflow advise`: which strategy and schedule to train with, on a cluster, for a model and a load.

    moeflow advise                    # this machine (2 ranks, measured), the default model, Zipf s=1.2
    moeflow advise --nproc 4 --config configs/tiny.toml --trace runs/default/routing.npz
    moeflow advise --cluster johnny --trace smartmoe --set moe.num_experts=32 --json
    moeflow advise --cluster results/profile.json --zipf 1.6 --strategy ep,shadow,prophet

The cluster is a topology preset, a `moeflow profile` JSON or `this` (this machine with `--nproc`
ranks: the cost model `moeflow train` measures at start-up, from its cache when there is one). The
model is a `moeflow train` config (`--config`, `--set`). The load is a recorded `routing.npz`, the
shipped SmartMoE trace (`--trace smartmoe`) or Zipf-skewed routing (`--zipf S`). Every strategy ×
schedule is replayed through the cost model (`sim.advise`), ranked by predicted step time, and the
winner's exact `moeflow train` flags are printed. docs/advise.md.
"""

from __future__ import annotations

HELP = "rank strategy x schedule for a cluster, model and load; print the winner's `moeflow train` flags"


def add_arguments(parser) -> None:
    parser.add_argument(
        "--cluster",
        default="this",
        metavar="this|PRESET|PROFILE.json",
        help="'this' (default: this machine with --nproc ranks, measured or cached), a topology preset "
        "or a `moeflow profile` JSON",
    )
    parser.add_argument("--nproc", type=int, default=2, metavar="N", help="ranks of --cluster this (default 2)")
    parser.add_argument("--config", metavar="FILE.toml", help="the model: a `moeflow train` config (default: built-in)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a config value"
    )
    load = parser.add_mutually_exclusive_group()
    load.add_argument(
        "--trace", metavar="routing.npz|smartmoe", help="a recorded routing trace, or the shipped SmartMoE trace"
    )
    load.add_argument("--zipf", type=float, metavar="S", help="Zipf-skewed routing with exponent S (default 1.2)")
    parser.add_argument(
        "--iterations", type=int, default=50, help="iterations of the load (a trace's first N; default 50)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the Zipf load")
    parser.add_argument("--strategy", default=None, help="comma list of strategies (default: all)")
    parser.add_argument("--schedule", default=None, help="comma list of schedules (default: every one that runs)")
    parser.add_argument(
        "--nonmoe-ms",
        type=float,
        default=None,
        help="forward time of a block's dense part, ms (default: estimated from the cost model's GEMM fit)",
    )
    parser.add_argument("--top", type=int, default=None, metavar="N", help="show the N best (default: all)")
    parser.add_argument("--json", action="store_true", help="print the ranking as JSON")


def _dense_forward_s(cfg, cost_model, tokens_per_rank: int) -> float:
    """Forward time of one block's attention part on one rank, from the GEMM fit: QKV and output
    projections (8·d² FLOPs per token) and the attention products (4·seq·d)."""
    d, seq = cfg.model.d_model, cfg.model.seq_len
    flops = tokens_per_rank * (8 * d * d + 4 * seq * d)
    return float(cost_model.gemm_time(flops, calls=4))


def _names(text: str | None, registry, flag: str) -> list[str] | None:
    from moeflow.core.checks import did_you_mean

    if text is None:
        return None
    names = [s.strip() for s in text.split(",") if s.strip()]
    for name in names:
        if name not in registry:
            raise ValueError(
                f"{flag}={name!r}: unknown{did_you_mean(name, registry.names())}; valid: {registry.names()}"
            )
    return names


def _cluster(args):
    """(cost model, the `--cost-model` flag for the winner's command, a line about where it came from)."""
    from moeflow.perf.costmodel import CostModel

    if args.cluster == "this":
        from moeflow.profiling.startup import this_machine

        profile, report = this_machine(args.nproc)
        return CostModel.from_dict(profile), [], report
    try:
        cost_model = CostModel.resolve(args.cluster)
    except ValueError as exc:
        raise ValueError(f"--cluster={args.cluster!r}: {exc}") from None
    return cost_model, ["--cost-model", args.cluster], f"cluster {cost_model.name}"


def _load(args, cfg, W: int, tokens_per_rank: int, layers: int):
    from moeflow.sim.traces import Trace, resolve_trace, synthetic_trace

    E = cfg.moe.num_experts
    if args.trace:
        trace = resolve_trace(args.trace)
        if trace.flow.shape[0] > args.iterations:  # its first iterations: enough to rank, and quick
            trace = Trace(trace.flow[: args.iterations], trace.steps_I[: args.iterations], dict(trace.meta))
        if trace.world_size != W or trace.num_experts != E:
            trace = trace.rescale(W, E)
        return trace, f"trace {args.trace} ({trace.flow.shape[0]} iterations x {trace.flow.shape[1]} layers)"
    skew = 1.2 if args.zipf is None else args.zipf
    trace = synthetic_trace(
        "zipf", args.iterations, layers, W, E, tokens_per_rank, cfg.moe.top_k, skew=skew, seed=args.seed
    )
    return trace, f"Zipf s={skew:g} ({args.iterations} iterations x {layers} layers)"


def _runnable_schedules(layer, num_experts: int, cost_model) -> list[str]:
    """Every schedule that runs with the layer's dispatcher (pairwise needs the plain all-to-all)."""
    from moeflow.core.registry import LayerContext
    from moeflow.strategies import DISPATCHERS, SCHEDULES

    ctx = LayerContext(num_experts, layer.top_k, layer.shape, cost_model)
    dispatcher = DISPATCHERS.build(layer.dispatch, ctx)
    return [s for s in SCHEDULES.names() if SCHEDULES.build(s, ctx).runs_with(dispatcher)]


def winner_command(args, cfg_sets: list[str], cost_model_flag: list[str], W: int, strategy: str, schedule: str) -> str:
    """The exact `moeflow train` command of a candidate: the user's config and overrides, the
    cluster's process count and cost model, the strategy and schedule."""
    import shlex

    words = ["moeflow", "train"]
    if args.config:
        words += ["--config", args.config]
    words += ["--nproc", str(W)]
    for item in cfg_sets:
        key = item.partition("=")[0].strip()
        if key not in ("moe.strategy", "moe.schedule") and not key.startswith(
            ("moe.strategy_options", "moe.schedule_options")
        ):
            words += ["--set", item]
    words += cost_model_flag
    words += ["--set", f"moe.strategy={strategy}", "--set", f"moe.schedule={schedule}"]
    return shlex.join(words)


def run(args) -> int:
    import json
    import time

    from tqdm import tqdm

    from moeflow.core.expert_shape import ExpertShape
    from moeflow.sim.advise import advise, format_ranking
    from moeflow.sim.simulator import SimulatedLayer
    from moeflow.strategies import PLANNERS, SCHEDULES
    from moeflow.training.config_files import load_config
    from moeflow.training.model import is_moe_block

    if args.iterations < 1:
        raise ValueError(f"--iterations={args.iterations}: must be >= 1")
    if args.nonmoe_ms is not None and not args.nonmoe_ms >= 0:
        raise ValueError(f"--nonmoe-ms={args.nonmoe_ms!r}: must be a time >= 0 (milliseconds)")
    cfg = load_config(args.config, args.overrides)
    strategies = _names(args.strategy, PLANNERS, "--strategy") or PLANNERS.names()
    schedules = _names(args.schedule, SCHEDULES, "--schedule")
    cost_model, cost_model_flag, where = _cluster(args)
    W = cost_model.topology.num_devices
    if cfg.moe.num_experts % W:
        raise ValueError(
            f"moe.num_experts={cfg.moe.num_experts} cannot be split over the cluster's {W} devices "
            f"(--set moe.num_experts=N with N a multiple of {W})"
        )
    if cfg.train.global_batch_size % W:
        raise ValueError(f"train.global_batch_size={cfg.train.global_batch_size} is not divisible by the {W} devices")
    tokens_per_rank = cfg.train.global_batch_size // W * cfg.model.seq_len
    layers = sum(is_moe_block(i, cfg.model.moe_every) for i in range(cfg.model.n_layers))
    trace, load = _load(args, cfg, W, tokens_per_rank, layers)
    dense_s = args.nonmoe_ms / 1e3 if args.nonmoe_ms is not None else _dense_forward_s(cfg, cost_model, tokens_per_rank)
    layer = SimulatedLayer(
        ExpertShape(cfg.model.d_model, cfg.moe.d_hidden, cfg.moe.expert),
        top_k=int(trace.meta.get("top_k", cfg.moe.top_k)),
        gate=cfg.moe.gate,
        balance=cfg.moe.balance,
        dispatch=cfg.moe.dispatch,
        options={"gate": cfg.moe.gate_options, "balance": cfg.moe.balance_options},
        nonmoe_forward_s=dense_s,
    )
    schedules = schedules or _runnable_schedules(layer, cfg.moe.num_experts, cost_model)
    started = time.perf_counter()
    with tqdm(total=len(strategies) + 1, unit="strategy", desc="simulating", disable=args.json, leave=False) as bar:
        advice = advise(trace, cost_model, layer, strategies, schedules, progress=lambda label: bar.update(1))
    elapsed = time.perf_counter() - started
    best = advice.winner
    command = winner_command(args, args.overrides, cost_model_flag, W, best.strategy, best.schedule)
    header = {
        "cluster": args.cluster,
        "cost_model": cost_model.name,
        "devices": W,
        "model": {
            "moe_layers": layers,
            "num_experts": cfg.moe.num_experts,
            "top_k": cfg.moe.top_k,
            "d_model": cfg.model.d_model,
            "d_hidden": cfg.moe.d_hidden,
            "expert": cfg.moe.expert,
            "tokens_per_rank": tokens_per_rank,
            "dense_forward_s": dense_s,
        },
        "load": load,
        "simulation_s": elapsed,
    }
    if args.json:
        print(json.dumps({**header, **advice.to_dict(), "winner_command": command}, indent=2))
        return 0
    print(where)
    print(
        f"model: {layers} MoE layers, E={cfg.moe.num_experts}, top-{cfg.moe.top_k}, d={cfg.model.d_model}, "
        f"h={cfg.moe.d_hidden}, {tokens_per_rank} tokens per rank; dense part {1e3 * dense_s:.3f} ms forward per block"
        + (" (estimated)" if args.nonmoe_ms is None else "")
    )
    print(f"load: {load}, mean max/mean expert load {advice.load_imbalance:.2f}; {W} devices")
    print(format_ranking(advice, args.top))
    print(
        f"plain EP (sync) {1e3 * advice.ep_s:.3f} ms per step; force-balanced ceiling (EP on perfectly even routing) "
        f"{1e3 * advice.ceiling_s:.3f} ms; simulated in {elapsed:.1f} s"
    )
    print(f"winner: {best.strategy} / {best.schedule}, {best.speedup_vs_ep:.2f}x plain EP (predicted):")
    print(f"  {command}")
    return 0
