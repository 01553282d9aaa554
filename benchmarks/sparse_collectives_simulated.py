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

`--dp` runs Hecate's own setting natively (`moeflow simulate --ep-size 8`, `sim.data_parallel`; §3
Eq. 2, §4.1, §4.2) on johnny and Hecate's clusters at 16 and 32 ranks, the trace's held-out half and
Zipf 1.2 and 2, with the dense part of each block priced as attention at sequence 2048 (Hecate's
GPT-MoE; `prophet_simulated.attention_forward_s`): the baselines (EP, shadowing, EPLB) with expert
parallelism inside each node of 8 and one replica of the experts per node (`--parallel-experts
replicate`), their gradient all-reduce exposed and hidden behind the backward (`--overlap-allreduce`);
FSSDP owning each expert once over all ranks (`--parallel-experts fsdp`) with its sparse collectives
behind the attention (`--overlap-attention`), also with re-materialization, with the copy trees in
8 pieces (`--copy-chunks 8`, Hecate §4.1's chunk pipeline) and without the overlap; and beside them
Pro-Prophet and `auto` on the whole mesh (one owner per expert, no all-reduce) with the block-wise
prefetch. It writes the JSON and, with `--md`, the markdown table of the results file.

    .venv/bin/python benchmarks/sparse_collectives_simulated.py --dp \
        --out docs/results/2026-11-27-hecate-setting-simulated.json --md results/hecate-setting-table.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from moeflow.sim.data_parallel import MeshLayout
from moeflow.sim.simulator import simulate as simulate_trace
from moeflow.sim.workload import add_workload_arguments, workload_from_args

sys.path.insert(0, str(Path(__file__).parent))
from prophet_simulated import attention_forward_s  # noqa: E402

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


DP_CLUSTERS = {"johnny": "32", "hecate_a@16": "64", "hecate_b@16": "64", "hecate_a": "64", "hecate_b": "64"}
DP_WORKLOADS = {
    "smartmoe": HELD_OUT,
    "zipf-1.2": ["--trace", "zipf", "--skew", "1.2", "--iterations", ZIPF_ITERATIONS, "--layers", "4"],
    "zipf-2": ["--trace", "zipf", "--skew", "2", "--iterations", ZIPF_ITERATIONS, "--layers", "4"],
}
EP_SIZE, SEQ = 8, 2048
CHUNKS = 8
"""FSSDP's copy trees also in this many pieces (`--copy-chunks`, Hecate §4.1's chunk pipeline)."""


def _row(r) -> dict:
    s = r.summary()
    out = {k: 1e3 * s[k] for k in ("total_s", "a2a_s", "other_comm_s", "exposed_comm_s")}
    out = {k.replace("_s", "_ms"): v for k, v in out.items()}
    out["expert_dp_ms"] = 1e3 * s.get("expert_dp_s", 0.0)
    out["expert_dp_exposed_ms"] = 1e3 * s.get("expert_dp_exposed_s", 0.0)
    out["replicated_experts_per_layer"] = s["replicated_experts_per_layer"]
    return out


def hecate_setting(cluster: str, workload: list[str], experts: str) -> dict:
    """Hecate's setting for one (cluster, workload), every row from `simulate` (module docstring)."""
    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    trace, cm, layer, _, _ = workload_from_args(
        parser.parse_args(["--cluster", cluster, *workload, "--experts", experts])
    )
    tokens_per_rank = float(trace.flow_ILWE.sum(-1).mean()) / layer.top_k
    nonmoe = attention_forward_s(cm, tokens_per_rank, SEQ, layer.shape.d_model)
    layer = replace(layer, nonmoe_forward_s=nonmoe)
    rows = {}
    for hidden in (False, True):
        layout = MeshLayout(EP_SIZE, "replicate", overlap_allreduce=hidden)
        for r in simulate_trace(trace, cm, layer, BASELINES, ["sync"], ceiling=False, layout=layout):
            rows[f"{r.strategy}/replicate{'/allreduce-hidden' if hidden else ''}"] = _row(r)
    fsdp = MeshLayout(EP_SIZE, "fsdp")
    attention = replace(layer, overlap_attention=True)
    for label, fssdp_layer, model in (
        ("fssdp/fsdp/overlap-attention", attention, cm),
        (
            "fssdp/fsdp/overlap-attention/rematerialize",
            replace(attention, options={"strategy": {"rematerialize": "true"}}),
            cm,
        ),
        (f"fssdp/fsdp/overlap-attention/chunks-{CHUNKS}", attention, cm.with_copy_chunks(CHUNKS)),
        ("fssdp/fsdp/no-overlap", layer, cm),
    ):
        (r,) = simulate_trace(trace, model, fssdp_layer, ["fssdp"], ["sync"], ceiling=False, layout=fsdp)
        rows[label] = _row(r)
    for r in simulate_trace(trace, cm, replace(layer, prefetch=True), ["prophet", "auto"], ["sync"], ceiling=False):
        rows[f"{r.strategy}/whole-mesh/prefetch"] = _row(r)
    best = {}
    for mode in ("replicate", "replicate/allreduce-hidden"):
        name = min(BASELINES, key=lambda b: rows[f"{b}/{mode}"]["total_ms"])
        best[mode] = {"strategy": name, "total_ms": rows[f"{name}/{mode}"]["total_ms"]}
    speedups = {
        f"{label} over best {mode}": best[mode]["total_ms"] / rows[label]["total_ms"]
        for label in (
            "fssdp/fsdp/overlap-attention",
            "fssdp/fsdp/overlap-attention/rematerialize",
            f"fssdp/fsdp/overlap-attention/chunks-{CHUNKS}",
            "prophet/whole-mesh/prefetch",
            "auto/whole-mesh/prefetch",
        )
        for mode in best
    }
    W = cm.topology.num_devices
    return {
        "cluster": cluster,
        "args": " ".join([*workload, "--experts", experts]),
        "dp": W // EP_SIZE,
        "ep": EP_SIZE,
        "num_experts": int(experts),
        "nonmoe_forward_ms": 1e3 * nonmoe,
        "rows": rows,
        "best_baseline": best,
        "speedups": speedups,
    }


def dp_table(doc: dict) -> str:
    """The results file's table (markdown)."""
    lines = [
        "| run | dp × ep | attention fwd ms | all-reduce ms | best baseline, all-reduce exposed | hidden | "
        f"fssdp ms | fssdp ÷ best, exposed | hidden | fssdp remat. ÷ best hidden | fssdp {CHUNKS} chunks ms | "
        "÷ best hidden | prophet+prefetch ms | ÷ best hidden | auto ms | ÷ best hidden |",
        "|---|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in doc["runs"].items():
        rows, best, sp = r["rows"], r["best_baseline"], r["speedups"]
        exp, hid = best["replicate"], best["replicate/allreduce-hidden"]
        ar = rows[f"{exp['strategy']}/replicate"]["expert_dp_ms"]
        f = "fssdp/fsdp/overlap-attention"
        lines.append(
            f"| {label} | {r['dp']} × {r['ep']} | {r['nonmoe_forward_ms']:.1f} | {ar:.0f} | "
            f"{exp['strategy']} {exp['total_ms']:.0f} | {hid['strategy']} {hid['total_ms']:.0f} | "
            f"{rows[f]['total_ms']:.0f} | {sp[f + ' over best replicate']:.2f} | "
            f"{sp[f + ' over best replicate/allreduce-hidden']:.2f} | "
            f"{sp[f + '/rematerialize over best replicate/allreduce-hidden']:.2f} | "
            f"{rows[f + f'/chunks-{CHUNKS}']['total_ms']:.0f} | "
            f"{sp[f + f'/chunks-{CHUNKS} over best replicate/allreduce-hidden']:.2f} | "
            f"{rows['prophet/whole-mesh/prefetch']['total_ms']:.0f} | "
            f"{sp['prophet/whole-mesh/prefetch over best replicate/allreduce-hidden']:.2f} | "
            f"{rows['auto/whole-mesh/prefetch']['total_ms']:.0f} | "
            f"{sp['auto/whole-mesh/prefetch over best replicate/allreduce-hidden']:.2f} |"
        )
    return "\n".join(lines)


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
    parser.add_argument("--md", default=None, help="--dp: also write the markdown table here")
    args = parser.parse_args()
    if args.dp:
        start = time.perf_counter()
        out = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "runs": {}}
        for cluster, experts in DP_CLUSTERS.items():
            for workload, workload_args in DP_WORKLOADS.items():
                label = f"{cluster}/{workload}"
                if args.only and label not in args.only:
                    continue
                r = out["runs"][label] = hecate_setting(cluster, workload_args, experts)
                sp = {k.replace("fssdp/fsdp/overlap-attention", "fssdp"): v for k, v in r["speedups"].items()}
                print(
                    f"{label:<24} fssdp/best {sp['fssdp over best replicate']:.3f} "
                    f"(all-reduce hidden {sp['fssdp over best replicate/allreduce-hidden']:.3f})",
                    flush=True,
                )
        out["seconds"] = time.perf_counter() - start
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        if args.md:
            Path(args.md).write_text(dp_table(out) + "\n")
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
