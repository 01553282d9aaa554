"""Copy trees (`core.sparse_collectives`, Hecate §4.1) priced on the papers' clusters: `moeflow
simulate` on FasterMoE's johnny (2 × 8, the SmartMoE trace's held-out half, Zipf 1.2 and 2) and
on Hecate's clusters (`hecate_a`, `hecate_b`: 4 × 8 at 32 ranks, `NAME@16` at 16), every strategy
with the block-wise prefetch (Pro-Prophet §V; it changes only the planners that plan ahead), plus
johnny's trace without it (the copies shadowing and Pro-Prophet send on the critical path).

Run it once per code version and compare (deterministic: the simulator prices, nothing is timed):

    .venv/bin/python benchmarks/sparse_collectives_simulated.py --out results/after.json
    PYTHONPATH=/path/to/main/src .venv/bin/python benchmarks/sparse_collectives_simulated.py --out results/before.json
    .venv/bin/python benchmarks/sparse_collectives_simulated.py --report results/before.json results/after.json \
        --out docs/results/2026-11-26-sparse-collectives.json

Per run: each strategy's mean time per iteration, its copies per iteration (its other
communication minus EP's, which is the count exchange alone) and FSSDP's speedup over the best of
EP, shadowing and EPLB (the baselines Hecate compares with: FasterMoE, and expert rearrangement in
the manner of SmartMoE / FlexMoE).

`--dp` prices Hecate's own setting on its clusters (§3 Eq. 2, §4.1): the baselines with experts
replicated over data-parallel groups — expert parallelism inside each node (8 ranks), one replica
per node, every replica's ranks replaying their own rows of the trace (the iteration waits for the
slowest replica), then the ring all-reduce of every rank's expert gradients over its replicas, all
rings at once on the cluster's links (FasterMoE Eq. 2), exposed — against FSSDP over all the ranks
(one owner per expert, no all-reduce). Composed here from `simulate` on one node (`NAME@8`) and the
cost model; `moeflow simulate` itself has no data-parallel dimension.

    .venv/bin/python benchmarks/sparse_collectives_simulated.py --dp --out results/dp.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from moeflow.perf.costmodel import CostModel
from moeflow.sim.simulator import simulate as simulate_trace
from moeflow.sim.traces import Trace
from moeflow.sim.workload import add_workload_arguments, workload_from_args

STRATEGIES = "ep,shadow,eplb,prophet,fssdp,auto"
BASELINES = ("ep", "shadow", "eplb")
HELD_OUT = ["--trace", "smartmoe", "--trace-iterations", "125:"]
ZIPF_ITERATIONS = "40"


def _runs() -> dict[str, list[str]]:
    """Label -> `moeflow simulate` arguments."""
    runs = {"johnny/smartmoe/sync": ["--cluster", "johnny", *HELD_OUT]}
    clusters = {"johnny": ["--experts", "32"]}
    for name in ("hecate_a", "hecate_b"):
        clusters[f"{name}@16"] = ["--experts", "64"]
        clusters[name] = ["--experts", "64"]
    for cluster, extra in clusters.items():
        runs[f"{cluster}/smartmoe/prefetch"] = ["--cluster", cluster, *HELD_OUT, *extra, "--prefetch"]
        for skew in ("1.2", "2"):
            zipf = ["--trace", "zipf", "--skew", skew, "--iterations", ZIPF_ITERATIONS, "--layers", "4"]
            runs[f"{cluster}/zipf-{skew}/prefetch"] = ["--cluster", cluster, *zipf, *extra, "--prefetch"]
    return runs


def simulate(args: list[str]) -> dict:
    command = [sys.executable, "-m", "moeflow.cli", "simulate", *args, "--strategy", STRATEGIES]
    command += ["--schedule", "sync", "--json"]
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=dict(os.environ))
    doc = json.loads(out.stdout)
    rows = {r["strategy"]: r for r in doc["results"]}
    ep_other = rows["ep"]["other_comm_s"]
    result = {
        "args": " ".join(args),
        "world_size": doc["world_size"],
        "num_experts": doc["num_experts"],
        "strategies": {
            name: {
                "total_ms": 1e3 * r["total_s"],
                "copies_ms": 1e3 * (r["other_comm_s"] - ep_other),
                "replicated_experts_per_layer": r["replicated_experts_per_layer"],
            }
            for name, r in rows.items()
        },
    }
    best = min(rows[b]["total_s"] for b in BASELINES)
    result["fssdp_over_best_baseline"] = best / rows["fssdp"]["total_s"]
    result["prophet_over_best_baseline"] = best / rows["prophet"]["total_s"]
    return result


def expert_allreduce_s(cm: CostModel, ep: int, bytes_per_rank: float) -> float:
    """Ring all-reduce of every rank's expert gradients over its data-parallel replicas (ranks r,
    r + ep, r + 2·ep, ...), all `ep` rings at once: `2·(dp − 1)/dp` of the bytes on every hop, the
    busiest link's time plus the slowest hop's latency per ring step."""
    W = cm.topology.num_devices
    dp = W // ep
    flows_WW = np.zeros((W, W))
    hops = []
    for r in range(ep):
        ring = [r + k * ep for k in range(dp)]
        hops += list(zip(ring, ring[1:] + ring[:1]))
    for a, b in hops:
        flows_WW[a, b] += 2 * (dp - 1) / dp * bytes_per_rank
    latency = max(float(cm.topology.path_latency_WW[a, b]) for a, b in hops)
    return float(cm.link_time(flows_WW)) + 2 * (dp - 1) * latency


def data_parallel(run_args: list[str]) -> dict:
    """Hecate's setting for one run (module docstring, `--dp`)."""
    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    trace, cm, layer, _, _ = workload_from_args(parser.parse_args(run_args))
    W, node_of = cm.topology.num_devices, np.asarray(cm.topology.node_of)
    ep = int((node_of == node_of[0]).sum())
    cluster = run_args[run_args.index("--cluster") + 1].partition("@")[0]
    cm_node = CostModel.resolve(f"{cluster}@{ep}")
    replicas: dict[str, list[np.ndarray]] = {}
    for g in range(W // ep):
        meta = {**trace.meta, "world_size": ep}
        rows = Trace(trace.flow_ILWE[:, :, g * ep : (g + 1) * ep], trace.steps_I, meta)
        for r in simulate_trace(rows, cm_node, layer, ["ep", "shadow", "eplb", "prophet", "fssdp"], ["sync"]):
            replicas.setdefault(r.strategy, []).append(r.total_I)
    I, L, _, E = trace.flow_ILWE.shape
    allreduce = expert_allreduce_s(cm, ep, L * (E // ep) * layer.shape.param_bytes(cm.bytes_per_element))
    whole = simulate_trace(trace, cm, layer, ["fssdp"], ["sync"])[0]
    out = {
        "args": " ".join(run_args),
        "ep": ep,
        "dp": W // ep,
        "expert_allreduce_ms": 1e3 * allreduce,
        "fssdp_whole_mesh_ms": 1e3 * float(whole.total_I.mean()),
        "replicated_ms": {k: 1e3 * float(np.max(v, axis=0).mean()) + 1e3 * allreduce for k, v in replicas.items()},
        "replicated_without_allreduce_ms": {k: 1e3 * float(np.max(v, axis=0).mean()) for k, v in replicas.items()},
        # DDP at best hides the all-reduce behind the whole backward (two thirds of an iteration).
        "replicated_overlapped_ms": {
            k: 1e3 * float((np.max(v, axis=0) + np.maximum(0.0, allreduce - 2 / 3 * np.max(v, axis=0))).mean())
            for k, v in replicas.items()
        },
    }
    best = min(out["replicated_ms"][b] for b in BASELINES)
    out["fssdp_over_best_replicated_baseline"] = best / out["fssdp_whole_mesh_ms"]
    best_free = min(out["replicated_without_allreduce_ms"][b] for b in BASELINES)
    out["fssdp_over_best_replicated_baseline_without_allreduce"] = best_free / out["fssdp_whole_mesh_ms"]
    best_hidden = min(out["replicated_overlapped_ms"][b] for b in BASELINES)
    out["fssdp_over_best_replicated_baseline_overlapped"] = best_hidden / out["fssdp_whole_mesh_ms"]
    return out


def report(before: dict, after: dict) -> tuple[dict, str]:
    """Before/after side by side: the JSON and a markdown table."""
    lines = [
        "| run | strategy | before ms | after ms | after/before | copies before ms | copies after ms |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for label, a in after["runs"].items():
        b = before["runs"][label]
        for name, r in a["strategies"].items():
            q = b["strategies"][name]
            ratio = r["total_ms"] / q["total_ms"]
            lines.append(
                f"| {label} | {name} | {q['total_ms']:.1f} | {r['total_ms']:.1f} | {ratio:.3f} | "
                f"{q['copies_ms']:.1f} | {r['copies_ms']:.1f} |"
            )
    lines += ["", "| run | fssdp / best of EP, shadow, EPLB before | after | prophet / best before | after |"]
    lines += ["|---|---:|---:|---:|---:|"]
    for label, a in after["runs"].items():
        b = before["runs"][label]
        lines.append(
            f"| {label} | {b['fssdp_over_best_baseline']:.3f} | {a['fssdp_over_best_baseline']:.3f} | "
            f"{b['prophet_over_best_baseline']:.3f} | {a['prophet_over_best_baseline']:.3f} |"
        )
    return {"before": before, "after": after}, "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON to write")
    parser.add_argument("--only", nargs="*", help="run labels (default: all)")
    parser.add_argument("--report", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two runs' JSON")
    parser.add_argument("--dp", action="store_true", help="Hecate's setting: baselines with data-parallel replicas")
    args = parser.parse_args()
    if args.dp:
        runs = {k: v for k, v in _runs().items() if k.startswith("hecate") and (not args.only or k in args.only)}
        out = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "runs": {}}
        for label, run_args in runs.items():
            r = out["runs"][label] = data_parallel(run_args)
            print(
                f"{label:<32} allreduce {r['expert_allreduce_ms']:.1f} ms  fssdp/best replicated "
                f"{r['fssdp_over_best_replicated_baseline']:.3f} (hidden by backward "
                f"{r['fssdp_over_best_replicated_baseline_overlapped']:.3f}, without the all-reduce "
                f"{r['fssdp_over_best_replicated_baseline_without_allreduce']:.3f})"
            )
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
        return 0
    if args.report:
        before, after = (json.loads(Path(p).read_text()) for p in args.report)
        doc, table = report(before, after)
        Path(args.out).write_text(json.dumps(doc, indent=2))
        print(table)
        return 0
    start = time.perf_counter()
    runs = {k: v for k, v in _runs().items() if not args.only or k in args.only}
    out = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "strategies": STRATEGIES, "runs": {}}
    for label, run_args in runs.items():
        out["runs"][label] = simulate(run_args)
        r = out["runs"][label]
        print(
            f"{label:<32} fssdp/best {r['fssdp_over_best_baseline']:.3f}"
            f"  prophet/best {r['prophet_over_best_baseline']:.3f}"
        )
    out["seconds"] = time.perf_counter() - start
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
