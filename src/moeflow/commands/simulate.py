"""`moeflow simulate`: replay routing traces through the cost model, per strategy and schedule.

moeflow simulate --cluster trevor --trace zipf --iterations 1000 --d-model 1024
moeflow simulate --cluster johnny --trace smartmoe --d-model 1024 --json
moeflow simulate --cluster results/profile.json --trace runs/demo/routing.npz
"""

from __future__ import annotations

HELP = "predict per-iteration time of a routing trace on a cluster, per strategy (table or --json)"


def add_arguments(parser):
    from moeflow.perf.simulator import add_workload_arguments

    add_workload_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print results as JSON")


def run(args) -> int:
    import json
    import time

    from moeflow.perf.simulator import format_table, simulate, workload_from_args

    trace, cost_model, model, strategies, schedules = workload_from_args(args)
    t0 = time.perf_counter()
    results = simulate(trace, cost_model, model, strategies, schedules, args.group_size)
    elapsed = time.perf_counter() - t0
    I, L, W, E = trace.flow.shape
    header = {
        "cluster": cost_model.name,
        "trace": args.trace,
        "iterations": I,
        "layers": L,
        "world_size": W,
        "num_experts": E,
        "d_model": model.d_model,
        "d_hidden": model.d_hidden,
        "mean_load_imbalance": float(trace.load_imbalance().mean()),
        "simulation_s": elapsed,
    }
    if args.json:
        print(json.dumps({**header, "results": [r.summary() for r in results]}, indent=2))
        return 0
    print(
        f"cluster {cost_model.name} ({W} devices), trace {args.trace}: {I} iterations x {L} layers, "
        f"E={E}, d={model.d_model}, h={model.d_hidden}, "
        f"mean max/mean load {header['mean_load_imbalance']:.2f}"
    )
    print(format_table(results))
    print(f"simulated in {elapsed:.2f} s")
    return 0
