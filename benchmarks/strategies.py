"""One suite for every planner and schedule, on the network testbed and simulated at paper scale:
each strategy × schedule on the same workloads, its speedup over plain EP, and the force-balanced
ceiling beside it.

    sudo .venv/bin/python benchmarks/strategies.py --out results/strategies.json             # both
    .venv/bin/python benchmarks/strategies.py --where simulator --out results/strategies-sim.json

Workloads: Zipf(s) for s in {0, 0.8, 1.2, 1.6, 2.0}, the SmartMoE GPT trace replayed iteration by
iteration (docs/traces.md), and a drifting load (two hot experts with half the load, moving to the
next experts every `--drift` iterations). Strategies: ep, shadow, prophet (with the block-wise
prefetch), eplb, fssdp (with the prefetch) and auto (the arbiter over all of them); schedules: sync,
pairwise and `auto` (the cheapest schedule per forward). The ceiling is plain EP on perfectly even
routing with the same tokens: `share_of_ceiling` = (T_ep − T) / (T_ep − T_ceiling), the part of the
possible gain a strategy reaches.

Testbed: `moeflow bench --suite` on 2 nodes × 2 ranks (or × 1: `--testbed-ranks-per-node 1`)
behind an emulated 800 Mbit/s link (network namespaces and tc, `scripts/testbed.py`; needs root),
with the testbed's own measured profile; every variant and the ceiling interleaved iteration by
iteration, after `--testbed-warmup` untimed ones. Reported beside each workload: the best single
strategy, `auto`'s distance to it, and `auto`'s corrected cost model's error on the layers it
timed (forward + backward, MAPE per layer, out of sample). Simulator: the same workloads at paper
scale on a cluster preset (its cost model is exact there, so `auto` has nothing to correct). Each
part writes its plot next to the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from moeflow.core.expert_shape import ExpertShape
from moeflow.perf.costmodel import CostModel
from moeflow.sim.simulator import SimulatedLayer, simulate
from moeflow.sim.traces import Trace, resolve_trace, synthetic_trace

SKEWS = (0.0, 0.8, 1.2, 1.6, 2.0)
SCHEDULES = ("sync", "pairwise", "auto")
STRATEGIES = {  # label: (strategy, prefetch)
    "ep": ("ep", False),
    "shadow": ("shadow", False),
    "prophet+prefetch": ("prophet", True),
    "eplb": ("eplb", False),
    "fssdp+prefetch": ("fssdp", True),
    "auto+prefetch": ("auto", True),
}


def workloads(world: int, experts: int, tokens: int, iterations: int, drift: int) -> dict[str, Trace]:
    out = {f"zipf-{s:g}": synthetic_trace("zipf", iterations, 4, world, experts, tokens, 2, skew=s) for s in SKEWS}
    full = resolve_trace("smartmoe")
    n = min(iterations, full.flow_ILWE.shape[0])
    out["smartmoe"] = Trace(full.flow_ILWE[:n], full.steps_I[:n], dict(full.meta)).rescale(world, experts)
    out["drift"] = synthetic_trace("drift", iterations, 4, world, experts, tokens, 2, drift_period=drift)
    return out


def run(cluster: str, trace: Trace, shape: ExpertShape, nonmoe_s: float, auto_options: dict | None = None) -> dict:
    cm = CostModel.from_preset(cluster)
    out = {}
    for label, (strategy, prefetch) in STRATEGIES.items():
        options = {"strategy": auto_options} if strategy == "auto" and auto_options else {}
        layer = SimulatedLayer(shape, top_k=2, nonmoe_forward_s=nonmoe_s, prefetch=prefetch, options=options)
        start = time.perf_counter()
        for r in simulate(trace, cm, layer, [strategy], list(SCHEDULES)):
            out[f"{label}:{r.schedule}"] = {
                "total_ms": 1e3 * float(r.total_I.mean()),
                "copies_per_layer": float(r.replicated_IL.mean()),
                "simulate_s": time.perf_counter() - start,
            }
    layer = SimulatedLayer(shape, top_k=2, nonmoe_forward_s=nonmoe_s)
    ceiling = simulate(trace.balanced(), cm, layer, ["ep"], ["sync"], ceiling=False)
    out["ceiling"] = {"total_ms": 1e3 * float(ceiling[0].total_I.mean())}
    ep, top = out["ep:sync"]["total_ms"], out["ceiling"]["total_ms"]
    for row in out.values():
        row["speedup_over_ep"] = ep / row["total_ms"]
        row["share_of_ceiling"] = (ep - row["total_ms"]) / (ep - top) if ep > top else None
    return out


def auto_options(args) -> dict[str, str]:
    """`--auto-options` as a dict (the values as `--set moe.strategy_options.KEY=VALUE` gives them)."""
    pairs = [item.partition("=") for item in args.auto_options.split(",") if item.strip()]
    bad = [key for key, eq, _ in pairs if not eq]
    if bad:
        raise SystemExit(f"--auto-options={args.auto_options!r}: expected KEY=VALUE,...")
    return {key.strip(): value.strip() for key, _, value in pairs}


def geomean(values) -> float:
    return float(np.exp(np.mean(np.log(values))))


def plot(lines: dict[str, list[float]], workloads: list[str], title: str, path: Path) -> None:
    """Speedup over EP per workload, one line per strategy, the ceiling dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for label, values in lines.items():
        style = {"color": "k", "linestyle": "--"} if label == "ceiling" else {"marker": "o"}
        ax.plot(workloads, values, label=label, **style)
    ax.set_ylabel("speedup over EP (sync)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def simulator_part(args) -> dict:
    cm = CostModel.from_preset(args.cluster)
    W = cm.topology.num_devices
    shape = ExpertShape(args.d_model, 4 * args.d_model, "ffn")
    tokens = 4096
    result = {
        "cluster": args.cluster,
        "devices": W,
        "experts": 2 * W,
        "model": {"d_model": args.d_model, "d_hidden": 4 * args.d_model, "top_k": 2, "tokens_per_rank": tokens},
        "nonmoe_forward_ms": args.nonmoe_ms,
        "workloads": {},
    }
    for name, trace in workloads(W, 2 * W, tokens, args.iterations, args.drift).items():
        result["workloads"][name] = run(args.cluster, trace, shape, 1e-3 * args.nonmoe_ms, auto_options(args))
        print(name, {k: round(v["speedup_over_ep"], 2) for k, v in result["workloads"][name].items()}, flush=True)
    labels = [f"{label}:{s}" for label in STRATEGIES for s in SCHEDULES]
    result["summary"] = summarize(
        {
            w: {k: row["speedup_over_ep"] for k, row in rows.items() if k != "ceiling"}
            for w, rows in result["workloads"].items()
        },
        labels,
    )
    names = list(result["workloads"])
    lines = {label: [result["workloads"][w][f"{label}:sync"]["speedup_over_ep"] for w in names] for label in STRATEGIES}
    lines["auto+prefetch:auto"] = [result["workloads"][w]["auto+prefetch:auto"]["speedup_over_ep"] for w in names]
    lines["ceiling"] = [result["workloads"][w]["ceiling"]["speedup_over_ep"] for w in names]
    plot(lines, names, f"moeflow strategies, simulated on {args.cluster}", Path(args.out).with_suffix(".sim.png"))
    return result


def summarize(speedups: dict[str, dict[str, float]], labels: list[str]) -> dict:
    """Per workload: the best single strategy (not auto) and auto's distance to it; over the suite:
    every label's geometric-mean speedup over EP."""
    auto = [k for k in labels if k.startswith("auto")]
    singles = [k for k in labels if not k.startswith("auto")]
    per = {}
    for w, row in speedups.items():
        best = max((k for k in singles if k in row), key=lambda k: row[k])
        per[w] = {"best_single": best, "best_single_speedup": row[best]}
        per[w].update({f"{k}_vs_best": row[k] / row[best] for k in auto if k in row})
    present = [k for k in labels if all(k in row for row in speedups.values())]
    return {
        "per_workload": per,
        "geomean_speedup_over_ep": {k: geomean([row[k] for row in speedups.values()]) for k in present},
    }


def _spread(times_s: list[float]) -> float:
    """Mean absolute deviation of the times from their median, over the median."""
    t = np.asarray(times_s, dtype=np.float64)
    median = float(np.median(t))
    return float(np.mean(np.abs(t - median)) / median) if median > 0 else 0.0


def auto_vs_best_interval(rows: list[dict], label, summary: dict) -> dict[str, list[float]]:
    """Per workload, a 90% interval of `auto`'s speedup over the best single strategy (median over
    median, `schedule=auto`): the timed iterations resampled together (they ran interleaved, so an
    iteration's noise hits every variant alike; `scipy.stats.bootstrap`, paired, percentile)."""
    from scipy.stats import bootstrap

    out = {}
    for workload, best in summary["per_workload"].items():
        times = {label(r): r["times_s"] for r in rows if r["routing"] == workload}
        auto = times.get("auto+prefetch:auto")
        if auto is None or len(auto) < 3:
            continue
        ci = bootstrap(
            (np.asarray(times[best["best_single"]]), np.asarray(auto)),
            lambda b, a, axis: np.median(b, axis=axis) / np.median(a, axis=axis),
            paired=True,
            vectorized=True,
            confidence_level=0.9,
            n_resamples=2000,
            method="percentile",
            random_state=0,
        ).confidence_interval
        out[workload] = [float(ci.low), float(ci.high)]
    return out


def testbed_part(args) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from testbed_run import ensure_profile, on_testbed

    rpn = args.testbed_ranks_per_node
    default_profile = "results/profile-testbed.json" if rpn == 2 else f"results/profile-testbed-2x{rpn}.json"
    profile = ensure_profile(Path(args.profile or default_profile), args.bandwidth_mbit, 2, rpn)
    raw = Path(args.out).with_suffix(".testbed.raw.json")
    bench = ["bench", "--suite", "--cost-model", str(profile), "--tokens", "2048", "--d-model", "256"]
    bench += ["--d-hidden", "1024", "--experts", "2", "--iterations", str(args.testbed_iterations)]
    bench += ["--warmup", str(args.testbed_warmup), "--drift", str(args.testbed_drift), "--out", str(raw)]
    on_testbed(bench, 2, rpn, args.bandwidth_mbit, timeout_s=3600)
    return testbed_summary(json.loads(raw.read_text())["rows"], args, profile)


def testbed_summary(rows: list[dict], args, profile) -> dict:
    """The testbed part's JSON from `moeflow bench --suite`'s rows (speedups, the per-workload
    summary, `auto`'s interval and choices, the plot)."""
    rpn = args.testbed_ranks_per_node

    def label(r: dict) -> str:
        if r.get("ceiling"):
            return "ceiling"
        return r["strategy"] + ("+prefetch" if r["prefetch"] else "") + ":" + r["schedule"]

    workloads_ = list(dict.fromkeys(r["routing"] for r in rows))
    speedups = {w: {label(r): r["speedup_vs_ep"] for r in rows if r["routing"] == w} for w in workloads_}
    labels = list(dict.fromkeys(label(r) for r in rows if not r.get("ceiling")))
    errors = [r["auto_model_error"] for r in rows if "auto_model_error" in r]
    spreads = [_spread(r["times_s"]) for r in rows if r["routing"].startswith("zipf") and r["strategy"] != "auto"]
    result = {
        "bandwidth_mbit": args.bandwidth_mbit,
        "nodes_x_ranks": [2, rpn],
        "profile": str(profile),
        "rows": rows,
        "speedup_over_ep": speedups,
        "summary": summarize(
            {w: {k: v for k, v in row.items() if k != "ceiling"} for w, row in speedups.items()}, labels
        ),
        "auto_model_mape": float(np.mean(errors)) if errors else None,
        # The MAPE's noise floor: the single strategies' iterations around their own median on the
        # stationary (Zipf) loads, where an iteration's time changes with noise only.
        "iteration_spread_single_zipf": float(np.mean(spreads)) if spreads else None,
        "chosen": {
            f"{r['routing']} {label(r)}": [r["chosen"], r["chosen_schedule"]] for r in rows if r["strategy"] == "auto"
        },
    }
    result["auto_vs_best_90ci"] = auto_vs_best_interval(rows, label, result["summary"])
    plot(
        {k: [speedups[w][k] for w in workloads_] for k in [*labels, "ceiling"]},
        workloads_,
        f"moeflow strategies on the 2x{rpn} testbed ({args.bandwidth_mbit:g} Mbit/s)",
        Path(args.out).with_suffix(".testbed.png"),
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/strategies.json")
    parser.add_argument("--where", choices=("both", "simulator", "testbed"), default="both")
    parser.add_argument("--cluster", default="johnny", help="simulator: cluster preset")
    parser.add_argument("--iterations", type=int, default=30, help="simulator: iterations per workload")
    parser.add_argument("--drift", type=int, default=10, help="simulator: iterations between moves of the hot experts")
    parser.add_argument("--d-model", type=int, default=1024, help="simulator")
    parser.add_argument("--nonmoe-ms", type=float, default=2.0, help="simulator: dense forward of a block")
    parser.add_argument(
        "--auto-options", default="", help="simulator: `auto`'s options as KEY=VALUE,... (e.g. searches=turns)"
    )
    parser.add_argument("--testbed-iterations", type=int, default=8, help="testbed: timed iterations per workload")
    parser.add_argument("--testbed-drift", type=int, default=4, help="testbed: iterations between moves")
    parser.add_argument(
        "--testbed-warmup",
        type=int,
        default=16,
        help="testbed: untimed iterations per variant (covers schedule=auto's trials: 2 x 3 candidates)",
    )
    parser.add_argument("--bandwidth-mbit", type=float, default=800.0, help="testbed: inter-node link")
    parser.add_argument(
        "--testbed-ranks-per-node",
        type=int,
        default=2,
        choices=(1, 2),
        help="testbed: 2 nodes x this many ranks (1: no rank shares a core on a 2-core machine)",
    )
    parser.add_argument(
        "--profile", default=None, help="testbed: its measured profile (default results/profile-testbed[-2xN].json)"
    )
    args = parser.parse_args()
    result = {"command": " ".join(["python", *sys.argv])}
    if args.where in ("both", "simulator"):
        result["simulator"] = simulator_part(args)
        print(
            "simulator geomean:",
            {k: round(v, 2) for k, v in result["simulator"]["summary"]["geomean_speedup_over_ep"].items()},
        )
    if args.where in ("both", "testbed"):
        result["testbed"] = testbed_part(args)
        print(
            "testbed geomean:",
            {k: round(v, 2) for k, v in result["testbed"]["summary"]["geomean_speedup_over_ep"].items()},
        )
        print("testbed auto model MAPE:", result["testbed"]["auto_model_mape"])
        spread = result["testbed"]["iteration_spread_single_zipf"]
        print("testbed iterations' spread (single strategies, Zipf):", spread)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
