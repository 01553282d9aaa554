"""`moeflow simulate`: replay routing traces through the cost model, per strategy and schedule.

moeflow simulate --cluster trevor --trace zipf --iterations 1000 --d-model 1024
moeflow simulate --cluster johnny --trace smartmoe --strategy ep,shadow --balance ta_moe --json
moeflow simulate --cluster results/profile.json --trace runs/demo/routing.npz --schedule pairwise \
    --option schedule.group_size=1
moeflow simulate --cluster fsmoe_a --trace zipf --strategy ep --schedule sync --degrees 1,2,4,8,auto
moeflow simulate --cluster johnny --trace smartmoe --trace-iterations 125: --progress
moeflow simulate --cluster hecate_b --trace smartmoe --strategy fssdp,eplb --copy-chunks 4
moeflow simulate --trace smartmoe --sweep johnny,johnny@64,hecate_a,trevor --out results/sweep.json
moeflow simulate --cluster hecate_a --trace zipf --ep-size 8 --strategy ep,shadow,eplb --overlap-allreduce
moeflow simulate --cluster hecate_a --trace zipf --ep-size 8 --parallel-experts fsdp --strategy fssdp \
    --overlap-attention --nonmoe-ms 3
"""

from __future__ import annotations

HELP = "predict per-iteration time of a routing trace on a cluster, per strategy (table or --json)"


def add_arguments(parser):
    from moeflow.sim.workload import add_workload_arguments

    add_workload_arguments(parser)
    parser.add_argument(
        "--ep-size",
        type=int,
        default=None,
        help="ranks of one expert-parallel group (parallel.ep_size; default: every rank): consecutive blocks, "
        "the experts replicated over the world/ep-size groups (docs/speed.md, 'Data-parallel replicas')",
    )
    parser.add_argument(
        "--parallel-experts",
        choices=("replicate", "fsdp"),
        default="replicate",
        help="parallel.experts: replicas whole, gradients all-reduced over them (replicate), or sharded: "
        "fssdp owns each expert once over all ranks, other strategies as FSDP2 shards them over dp (fsdp)",
    )
    parser.add_argument(
        "--overlap-allreduce",
        action="store_true",
        help="hide the experts' gradient all-reduce (reduce-scatter) over the replicas behind the backward, as DDP",
    )
    parser.add_argument(
        "--degrees",
        default=None,
        help="also the pipelined schedule at each of these degrees (comma list of integers and 'auto', "
        "e.g. 1,2,4,8,auto): one row per strategy and degree, schedule 'pipe/r=R' ('pipe/auto')",
    )
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument("--progress", action="store_true", help="a progress bar over the replay (stderr)")
    parser.add_argument(
        "--sweep",
        default=None,
        metavar="CLUSTERS",
        help="price the trace on each of these clusters (comma list of presets, NAME@DEVICES for a preset's "
        "link classes at another size, or profile JSONs) instead of --cluster; writes --out and a plot beside it",
    )
    parser.add_argument(
        "--out", default="results/simulate-sweep.json", help="--sweep: the JSON (the plot: same name, .png)"
    )


def mesh_layout(args, world: int, num_experts: int):
    """The `MeshLayout` of `--ep-size`, `--parallel-experts` and `--overlap-allreduce`, checked
    against the cluster and the experts before any work."""
    from moeflow.sim.data_parallel import MeshLayout

    layout = MeshLayout(args.ep_size, args.parallel_experts, args.overlap_allreduce)
    layout.group_size(world, num_experts)
    return layout


def degree_sweep(trace, cost_model, layer, strategies, degrees: str, layout=None) -> list:
    """`simulate` of `schedule="pipeline"` at every degree of the comma list `degrees` (the layer's
    other schedule options kept), each result's schedule renamed `pipe/r=R` or `pipe/auto`."""
    from dataclasses import replace

    from moeflow.sim.simulator import simulate

    out = []
    for item in [d.strip() for d in degrees.split(",") if d.strip()]:
        if item != "auto" and not (item.isdigit() and int(item) >= 1):
            raise ValueError(f"--degrees: {item!r} is not an integer >= 1 nor 'auto'")
        options = {**layer.options, "schedule": {**layer.options.get("schedule", {}), "degree": item}}
        for r in simulate(trace, cost_model, replace(layer, options=options), strategies, ["pipeline"], layout=layout):
            r.schedule = "pipe/auto" if item == "auto" else f"pipe/r={item}"
            out.append(r)
    return out


def _simulate(args, cluster: str | None = None, fit_experts: bool = False) -> tuple[dict, list]:
    """One workload simulated (`run`, `--sweep`): its header and results."""
    import time

    from moeflow.sim.simulator import simulate
    from moeflow.sim.workload import workload_from_args

    trace, cost_model, layer, strategies, schedules = workload_from_args(args, cluster, fit_experts)
    layout = mesh_layout(args, cost_model.topology.num_devices, trace.num_experts)
    t0 = time.perf_counter()
    results = simulate(trace, cost_model, layer, strategies, schedules, progress=args.progress, layout=layout)
    if args.degrees:
        try:
            results += degree_sweep(trace, cost_model, layer, strategies, args.degrees, layout)
        except ValueError as exc:
            raise SystemExit(f"moeflow simulate: error: {exc}") from None
    elapsed = time.perf_counter() - t0
    I, L, W, E = trace.flow.shape
    header = {
        "cluster": cost_model.name,
        "trace": args.trace,
        "iterations": I,
        "layers": L,
        "world_size": W,
        "num_experts": E,
        "d_model": layer.shape.d_model,
        "d_hidden": layer.shape.d_hidden,
        "expert": layer.shape.kind,
        "gate": layer.gate,
        "balance": layer.balance,
        "dispatch": layer.dispatch,
        "options": {axis: dict(o) for axis, o in layer.options.items()},
        "ep_size": layout.group_size(W, E),
        "parallel_experts": layout.experts,
        "overlap_allreduce": layout.overlap_allreduce,
        "prefetch": layer.prefetch,
        "copy_chunks": cost_model.copy_chunks,
        "overlap_attention": layer.overlap_attention,
        "nonmoe_forward_s": layer.nonmoe_forward_s,
        "mean_load_imbalance": float(trace.load_imbalance().mean()),
        "simulation_s": elapsed,
    }
    if args.trace_iterations:
        header["trace_iterations"] = args.trace_iterations
    return header, results


def run(args) -> int:
    import json
    import sys
    from pathlib import Path

    from moeflow.sim.simulator import format_table
    from moeflow.sim.sweep import plot_sweep, sweep

    if args.sweep:
        clusters = [c.strip() for c in args.sweep.split(",") if c.strip()]
        if not clusters:
            raise ValueError(f"--sweep={args.sweep!r}: expected a comma list of clusters")
        document = sweep(clusters, lambda cluster: _simulate(args, cluster, fit_experts=True))
        document["command"] = " ".join(["moeflow", *sys.argv[1:]])
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(document, indent=2) + "\n")
        plot = plot_sweep(
            document, out.with_suffix(".png"), f"trace {args.trace}: speedup over plain EP, same schedule"
        )
        for cluster, entry in document["clusters"].items():
            size = f"{entry['world_size']} x {entry['num_experts']}"
            print(f"{cluster} ({size}): simulated in {entry['simulation_s']:.2f} s")
        print(f"wrote {out} and {plot}")
        return 0
    header, results = _simulate(args)
    if args.json:
        print(json.dumps({**header, "results": [r.summary() for r in results]}, indent=2))
        return 0
    W, I, L, E = header["world_size"], header["iterations"], header["layers"], header["num_experts"]
    print(
        f"cluster {header['cluster']} ({W} devices), trace {args.trace}: {I} iterations x {L} layers, "
        f"E={E}, d={header['d_model']}, h={header['d_hidden']}, gate {header['gate']}, balance {header['balance']}, "
        f"mean max/mean load {header['mean_load_imbalance']:.2f}"
    )
    print(format_table(results))
    print(f"simulated in {header['simulation_s']:.2f} s")
    return 0
