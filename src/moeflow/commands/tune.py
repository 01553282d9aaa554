"""`moeflow tune`: FSMoE's pipeline degrees (§4, Algorithm 1) and gradient partition (§5) of a model.

moeflow tune --batch 4 --seq 1024 --d-model 4096 --d-hidden 14336 --gemms 3 --factor 2.4 --esp 8 \\
    --layers 2 --others-ms 1.3 --alpha-ms 0.2352 0.0549 0.5919 0.0688 0.3410 \\
    --beta-ms 1.854e-6 6.724e-7 5.685e-11 6.704e-7 3.495e-6 --json
moeflow tune ... --cost-model fsmoe_a --snap divisors
"""

from __future__ import annotations

HELP = "FSMoE pipeline degrees (forward, backward per MoE layer) and gradient partition (table or --json)"


def add_arguments(parser):
    sizes = (
        ("--batch", "B: samples per device"),
        ("--seq", "L: sequence length"),
        ("--d-model", "M: embedding size"),
        ("--d-hidden", "H: hidden size of an expert"),
        ("--gemms", "N: GEMMs of one expert (2 ffn, 3 Mixtral)"),
        ("--esp", "S: expert-sharding group size (devices of a node)"),
        ("--layers", "MoE layers"),
    )
    for flag, text in sizes:
        parser.add_argument(flag, type=int, required=True, help=text)
    parser.add_argument("--factor", type=float, required=True, help="F = top-k x capacity factor")
    parser.add_argument(
        "--others-ms",
        type=float,
        required=True,
        help="backward ms of a layer's gate and attention (with --esp > 1 the attention's all-gather and "
        "reduce-scatter of B*L*M elements are added from the fits)",
    )
    parser.add_argument("--cost-model", default=None, help="topology preset or `moeflow profile` JSON")
    order = "values in the order a2a ag gemm rs ar"
    parser.add_argument("--alpha-ms", type=float, nargs="+", default=None, help=f"start-up ms, {order}")
    parser.add_argument(
        "--beta-ms", type=float, nargs="+", default=None, help=f"ms per element (gemm: per multiply-add), {order}"
    )
    parser.add_argument("--snap", choices=("powers", "divisors"), default="powers", help="integer degrees")
    parser.add_argument("--chunk-dim", type=int, default=None, help="divisors: the chunked size (default B*L)")
    parser.add_argument(
        "--grad-elements", type=int, default=None, help="dense gradient elements per layer (default: attention / S)"
    )
    parser.add_argument(
        "--expert-alpha",
        choices=("once", "per_gemm"),
        default="once",
        help="α_exp: α_gemm once per chunk (published tool) or N times (FSMoE §4.1)",
    )
    parser.add_argument("--json", action="store_true", help="print results as JSON")


def _workload(args):
    from moeflow.core.checks import finite_number, positive_int
    from moeflow.perf.pipeline_inputs import PipelineWorkload

    for flag in ("batch", "seq", "d_model", "d_hidden", "gemms", "esp", "layers"):
        positive_int("--" + flag.replace("_", "-"), getattr(args, flag))
    finite_number("--factor", args.factor, 0.0, low_open=True)
    finite_number("--others-ms", args.others_ms, 0.0)
    for flag in ("d_hidden", "d_model"):
        if getattr(args, flag) % args.esp:
            raise ValueError(f"--esp={args.esp!r} must divide --{flag.replace('_', '-')}={getattr(args, flag)!r}")
    if args.grad_elements is not None:
        positive_int("--grad-elements", args.grad_elements)
    if args.chunk_dim is not None:
        positive_int("--chunk-dim", args.chunk_dim)
    return PipelineWorkload(
        args.batch,
        args.seq,
        args.d_model,
        args.d_hidden,
        args.gemms,
        args.factor,
        args.esp,
        args.layers,
        args.others_ms,
        args.grad_elements,
    )


def _fits(args, workload):
    from moeflow.perf.costmodel import CostModel
    from moeflow.perf.pipeline_inputs import FIT_ORDER, PipelineFits

    explicit = args.alpha_ms is not None or args.beta_ms is not None
    if (args.cost_model is not None) == explicit:
        given = f"--cost-model={args.cost_model!r}, --alpha-ms={args.alpha_ms!r}, --beta-ms={args.beta_ms!r}"
        raise ValueError(f"give either --cost-model or both --alpha-ms and --beta-ms ({given})")
    if args.cost_model is not None:
        try:
            return PipelineFits.from_cost_model(CostModel.resolve(args.cost_model), workload)
        except ValueError as exc:
            raise ValueError(f"--cost-model={args.cost_model!r}: {exc}") from None
    for flag, values in (("--alpha-ms", args.alpha_ms), ("--beta-ms", args.beta_ms)):
        if values is None or len(values) != len(FIT_ORDER):
            raise ValueError(f"{flag}={values!r}: expected {len(FIT_ORDER)} values ({' '.join(FIT_ORDER)})")
        for op, v in zip(FIT_ORDER, values):
            if not (v >= 0 and v < float("inf")):
                raise ValueError(f"{flag}={values!r}: the {op} value {v!r} must be a finite number >= 0")
    return PipelineFits(tuple(args.alpha_ms), tuple(args.beta_ms))


def run(args) -> int:
    import json

    from moeflow.perf.grad_partition import partition_gradients
    from moeflow.perf.pipeline_degree import plan_degrees

    workload = _workload(args)
    fits = _fits(args, workload)
    options = {"snap": args.snap, "chunk_dim": args.chunk_dim, "expert_alpha": args.expert_alpha}
    partition = partition_gradients(workload, fits, **options)
    plan = plan_degrees(workload, fits, partition.moe_gar_ms, **options)
    if args.json:
        out = {
            **plan.to_dict(),
            "fits": {
                "order": ["a2a", "ag", "gemm", "rs", "ar"],
                "alpha_ms": fits.alpha_ms,
                "beta_ms": fits.beta_ms,
                "chunk_ms": {"forward": fits.chunk_ms[0], "backward": fits.chunk_ms[1]},
                "overlap": {"forward": fits.overlap[0], "backward": fits.overlap[1]},
            },
            "fits_source": fits.source,
            "gradient_partition": partition.to_dict(),
        }
        print(json.dumps(out, indent=2))
        return 0
    w = workload
    print(
        f"B={w.batch} L={w.seq} M={w.d_model} H={w.d_hidden} N={w.gemms} F={w.factor:g} S={w.esp}, "
        f"{w.layers} MoE layers; fits: {fits.source}; degrees: {args.snap} {list(plan.candidates)}"
    )
    if any(fits.chunk_ms):
        print(f"measured cost of one more chunk: forward {fits.chunk_ms[0]:.2f} ms, backward {fits.chunk_ms[1]:.2f} ms")
    if fits.overlap != (1.0, 1.0):
        print(f"overlap the machine realises (eta): forward {fits.overlap[0]:.2f}, backward {fits.overlap[1]:.2f}")
    shown = plan.candidates[:16]
    if len(plan.candidates) > len(shown):
        print(f"(times at the first {len(shown)} of {len(plan.candidates)} degrees; all of them in --json)")
    header = f"{'pass':<9} {'layer':>5} {'degree':>6} {'case':>4} {'t_gar ms':>9} {'time ms':>8}  " + " ".join(
        f"{'r=' + str(r):>7}" for r in shown
    )
    print(header)
    rows = [("forward", "-", plan.forward)] + [("backward", str(i), b) for i, b in enumerate(plan.backward)]
    for name, layer, choice in rows:
        at = dict(choice.candidate_times_ms)
        cells = " ".join(f"{at[r]:7.2f}" for r in shown)
        print(
            f"{name:<9} {layer:>5} {choice.degree:>6} {choice.case:>4} {choice.t_gar_ms:9.2f} {choice.time_ms:8.2f}  "
            + cells
        )
    p = partition.to_dict()
    print(
        f"gradient: {p['total_bytes']} B; per layer {p['layer_bytes']} (hidden in dense parts "
        f"{p['dense_overlapped_bytes']}, in MoE pipelines {p['moe_overlapped_bytes']}, added to MoE pipelines "
        f"{p['moe_added_bytes']}), exposed after backward {p['exposed_bytes']} B"
    )
    return 0
