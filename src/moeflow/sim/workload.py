"""Command-line description of a simulated workload, shared by `moeflow simulate` and `moeflow
roofline`: the cluster, the trace, the expert, and the layer's axes by their registry names."""

from __future__ import annotations

from typing import Any

from moeflow.core.checks import did_you_mean
from moeflow.core.expert_shape import EXPERT_KINDS, ExpertShape
from moeflow.core.registry import LayerContext
from moeflow.layer import AXES
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology_presets import PRESETS
from moeflow.routing import BALANCES, GATES
from moeflow.sim.simulator import SimulatedLayer
from moeflow.sim.sweep import sweep_experts
from moeflow.sim.traces import SYNTHETIC, Trace, resolve_trace, synthetic_trace
from moeflow.strategies import DISPATCHERS, PLANNERS, SCHEDULES


def add_workload_arguments(parser: Any) -> None:
    """Arguments that describe a workload: cluster, trace, expert, the layer's axes."""
    parser.add_argument(
        "--cluster",
        default="johnny",
        help=f"topology preset ({', '.join(sorted(PRESETS))}) or a `moeflow profile` JSON",
    )
    parser.add_argument(
        "--trace",
        default="zipf",
        help="uniform | zipf | drift (synthetic), smartmoe (the real trace excerpt shipped with moeflow, "
        "docs/traces.md) or a trace .npz path; a trace of another size is folded/unfolded onto the cluster",
    )
    parser.add_argument(
        "--trace-iterations",
        default=None,
        metavar="START:STOP",
        help="a recorded trace: replay only these iterations (Python slice of its rows, e.g. 125: for the "
        "SmartMoE excerpt's held-out half)",
    )
    parser.add_argument("--iterations", type=int, default=100, help="synthetic: iterations")
    parser.add_argument("--layers", type=int, default=1, help="synthetic: MoE layers")
    parser.add_argument(
        "--experts", type=int, default=None, help="experts (synthetic default: 2 per device; a trace: rescale to this)"
    )
    parser.add_argument("--tokens-per-rank", type=int, default=4096, help="synthetic: tokens per rank")
    parser.add_argument("--top-k", type=int, default=2, help="synthetic: experts per token")
    parser.add_argument("--skew", type=float, default=1.2, help="zipf: exponent s")
    parser.add_argument("--seed", type=int, default=0, help="synthetic: RNG seed")
    parser.add_argument("--d-model", type=int, default=None, help="model dim (default: trace meta or 1024)")
    parser.add_argument("--d-hidden", type=int, default=None, help="expert hidden dim (default: trace meta or 4·d)")
    parser.add_argument("--expert", choices=sorted(EXPERT_KINDS), default=None, help="default: trace meta or ffn")
    parser.add_argument("--gate", default="topk", help=f"one of {', '.join(GATES.names())}")
    parser.add_argument("--balance", default="gshard", help=f"one of {', '.join(BALANCES.names())}")
    parser.add_argument("--strategy", default=None, help=f"comma list (default all: {','.join(PLANNERS.names())})")
    parser.add_argument(
        "--schedule",
        default=None,
        help=f"comma list of {','.join(SCHEDULES.names())} (default: every one that runs with --dispatch)",
    )
    parser.add_argument("--dispatch", default="a2a", help=f"one of {', '.join(DISPATCHERS.names())}")
    parser.add_argument(
        "--option",
        dest="options",
        action="append",
        default=[],
        metavar="AXIS.KEY=VALUE",
        help="an option of the component on an axis, e.g. --option schedule.group_size=2 (repeatable)",
    )
    parser.add_argument("--gemm-flops", type=float, default=None, help="override P, FLOP/s per device")
    parser.add_argument(
        "--nonmoe-ms", type=float, default=0.0, help="forward time of a block's dense part (ms; backward 2x)"
    )
    parser.add_argument(
        "--prefetch",
        action="store_true",
        help="Pro-Prophet block-wise prefetch: copies of planners that plan ahead hide behind the block before",
    )
    parser.add_argument(
        "--copy-chunks",
        type=int,
        default=1,
        metavar="N",
        help="price the copy trees as sent in N column pieces, a relay forwarding one while it receives the next "
        "(Hecate §4.1's chunk pipeline, moe.copy_chunks; 1: each stage whole)",
    )
    parser.add_argument(
        "--overlap-attention",
        action="store_true",
        help="Hecate §3.2/§4.2: copies of planners that plan ahead (FSSDP's spAG, spRS, re-gather) hide behind "
        "the attention alone (--nonmoe-ms forward, 2x backward); not with --prefetch",
    )


def trace_iterations(trace: Trace, text: str) -> Trace:
    """The rows `START:STOP` (a Python slice; either end may be left out) of a recorded trace."""
    start, colon, stop = text.partition(":")
    try:
        rows = slice(int(start) if start.strip() else None, int(stop) if stop.strip() else None) if colon else None
    except ValueError:
        rows = None
    if rows is None:
        raise ValueError(f"--trace-iterations={text!r}: expected START:STOP, e.g. 125: or 0:100")
    flow, steps = trace.flow_ILWE[rows], trace.steps_I[rows]
    if not len(steps):
        raise ValueError(f"--trace-iterations={text!r}: no iteration of the trace's {len(trace.steps_I)} in it")
    return Trace(flow, steps, dict(trace.meta, iterations=text))


def parse_axis_options(items: list[str]) -> dict[str, dict[str, str]]:
    """`["schedule.group_size=2"]` -> `{"schedule": {"group_size": "2"}}` (values are parsed by the
    component's options dataclass)."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        axis, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ValueError(f"--option {item!r}: expected AXIS.KEY=VALUE, e.g. schedule.group_size=2")
        if axis not in AXES:
            raise ValueError(f"--option {item!r}: unknown axis {axis!r}; valid: {list(AXES)}")
        out.setdefault(axis, {})[name] = value.strip()
    return out


def _names(text: str, registry, flag: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    for name in names:
        if name in BALANCES and registry is PLANNERS:
            raise ValueError(f"{flag}={name!r} is a balance term, not a strategy: use --balance {name}")
        if name not in registry:
            raise ValueError(
                f"{flag}={name!r}: unknown{did_you_mean(name, registry.names())}; valid: {registry.names()}"
            )
    return names


def workload_from_args(
    args: Any, cluster: str | None = None, fit_experts: bool = False
) -> tuple[Trace, CostModel, SimulatedLayer, list[str], list[str]]:
    """The workload the arguments describe, on `cluster` (default `--cluster`). `fit_experts`: a
    recorded trace whose experts are not a multiple of the cluster's devices is unfolded to the
    least common multiple (`sweep.sweep_experts`) instead of being refused."""
    cluster = args.cluster if cluster is None else cluster
    flag = "--cluster" if cluster == args.cluster else "--sweep"
    try:
        cost_model = CostModel.resolve(cluster, args.gemm_flops)
    except ValueError as exc:
        raise ValueError(f"{flag}={cluster!r}: {exc}") from None
    chunks = getattr(args, "copy_chunks", 1)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"--copy-chunks must be an integer >= 1, got {chunks!r}")
    cost_model = cost_model.with_copy_chunks(chunks)  # the planners choose on the prices the trees run at
    W = cost_model.topology.num_devices
    if args.trace in SYNTHETIC:
        experts = args.experts if args.experts is not None else 2 * W
        trace = synthetic_trace(
            args.trace,
            args.iterations,
            args.layers,
            W,
            experts,
            args.tokens_per_rank,
            args.top_k,
            skew=args.skew,
            seed=args.seed,
        )
    else:
        trace = resolve_trace(args.trace)
        experts = args.experts or (sweep_experts(trace.num_experts, W) if fit_experts else None)
        if trace.world_size != W or (experts and experts != trace.num_experts):
            trace = trace.rescale(W, experts)
        if args.trace_iterations:
            trace = trace_iterations(trace, args.trace_iterations)
    d_model = args.d_model or int(trace.meta.get("d_model") or 1024)
    d_hidden = args.d_hidden or int(trace.meta.get("d_hidden") or 4 * d_model)
    shape = ExpertShape(d_model, d_hidden, args.expert or trace.meta.get("expert") or "ffn")
    if args.prefetch and args.overlap_attention:
        raise ValueError("--prefetch with --overlap-attention: two models of the same copies; choose one")
    if not args.nonmoe_ms >= 0:
        raise ValueError(f"--nonmoe-ms={args.nonmoe_ms!r}: must be a time >= 0 (milliseconds)")
    for flag, value, registry in (("--gate", args.gate, GATES), ("--balance", args.balance, BALANCES)):
        if value not in registry:
            raise ValueError(
                f"{flag}={value!r}: unknown{did_you_mean(value, registry.names())}; valid: {registry.names()}"
            )
    layer = SimulatedLayer(
        shape,
        top_k=int(trace.meta.get("top_k", 2)),
        gate=args.gate,
        balance=args.balance,
        dispatch=args.dispatch,
        options=parse_axis_options(args.options),
        nonmoe_forward_s=args.nonmoe_ms / 1e3,
        prefetch=args.prefetch,
        overlap_attention=args.overlap_attention,
    )
    strategies = _names(args.strategy or ",".join(PLANNERS.names()), PLANNERS, "--strategy")
    schedules = _names(args.schedule or ",".join(_schedules_for(layer, trace, cost_model)), SCHEDULES, "--schedule")
    return trace, cost_model, layer, strategies, schedules


def _schedules_for(layer: SimulatedLayer, trace: Trace, cost_model: CostModel) -> list[str]:
    """Every schedule that runs with the layer's dispatcher (pairwise needs the plain all-to-all)."""
    ctx = LayerContext(trace.num_experts, layer.top_k, layer.shape, cost_model)
    dispatcher = DISPATCHERS.build(layer.dispatch, ctx, layer.options.get("dispatch"))
    return [
        s for s in SCHEDULES.names() if SCHEDULES.build(s, ctx, layer.options.get("schedule")).runs_with(dispatcher)
    ]
