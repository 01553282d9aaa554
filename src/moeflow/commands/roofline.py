"""`moeflow roofline`: DDL-Roofline (FasterMoE §3.3) of a workload, PNG + JSON.

moeflow roofline --cluster johnny --trace zipf --d-model 1024 --out results/roofline
moeflow roofline --cluster results/profile.json --trace uniform --measured results/perf_model_accuracy.json
"""

from __future__ import annotations

HELP = "DDL-Roofline (R_CC vs achieved FLOP/s) of a workload per strategy; writes PNG and JSON"


def add_arguments(parser):
    from moeflow.sim.workload import add_workload_arguments

    add_workload_arguments(parser)
    parser.add_argument("--out", default="results/roofline", help="directory for roofline.png and roofline.json")
    parser.add_argument("--measured", default=None, help="JSON with measured points (see docs/performance.md)")
    parser.add_argument("--json", action="store_true", help="print the points as JSON")


def run(args) -> int:
    import json
    from dataclasses import asdict

    from tqdm import tqdm

    from moeflow.sim import roofline
    from moeflow.sim.simulator import simulate
    from moeflow.sim.workload import workload_from_args

    trace, cost_model, layer, strategies, schedules = workload_from_args(args)
    results = []
    for name in tqdm(strategies, unit="strategy", desc="simulating", disable=args.json, leave=False):
        results += simulate(trace, cost_model, layer, [name], schedules)
    points = roofline.points_from_simulation(results, layer.shape, cost_model.topology.num_devices)
    if args.measured:
        points += roofline.load_measured(args.measured)
    peak = cost_model.gemm_flops_per_s
    paths = roofline.write(points, peak, args.out, title=f"DDL-Roofline: {cost_model.name}, {args.trace}")
    if args.json:
        print(json.dumps({"peak_flops_per_s": peak, "points": [asdict(p) for p in points], "files": paths}, indent=2))
        return 0
    print(f"P = {peak / 1e12:.2f} TFLOP/s per device")
    print(f"{'point':<28}{'R_CC':>8}{'P̄ (TFLOP/s)':>14}{'of P':>8}")
    for p in points:
        print(
            f"{p.label:<28}{p.r_cc:>8.3f}{p.throughput_flops_per_s / 1e12:>14.3f}"
            f"{p.throughput_flops_per_s / peak:>8.1%}"
        )
    print(f"wrote {paths['png']} and {paths['json']}")
    return 0
