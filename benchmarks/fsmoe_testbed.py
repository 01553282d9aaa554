"""FSMoE part 2 on the network testbed: training iteration time of the sync, pairwise and pipelined
schedules (fixed r = 2, 4 and the optimiser's r) under expert sharding, with and without FSMoE's
gradient partitioning, next to the cost model's prediction (FSMoE §3–§5).

    sudo .venv/bin/python benchmarks/fsmoe_testbed.py --out results/fsmoe_testbed.json

2 nodes x 2 ranks, `parallel.esp_size=2`: each node is one ESP group (its two ranks hold the same experts,
half the hidden dimension each) and the two expert-parallel groups (ESP index 0 and 1) run their
all-to-alls across the shaped inter-node link at the same time. Every variant is one `moeflow train`
run (configs/tiny.toml with 4 experts and `moe.d_hidden=1024`, 2048 tokens per step); the step time
is the median of the steps after `--skip` (the first steps warm up; `degree=auto` chooses at the
first forward). Variants run in a Williams order over `--rounds` rounds.

Cost model: the optimiser prices the expert-parallel group (2 ranks, one per node), so it needs a
2-device model. It is derived from the testbed's own profiles (`moeflow profile` on 2 x 1 and 2 x 2,
results/profile-testbed-2x1.json and results/profile-testbed.json, made first if absent): the 2 x 1
profile's link and collectives with the link's bandwidth halved (the two EP groups share each node's
link), the 2 x 2 profile's GEMM rate (4 ranks on 2 cores), and the cost of one more pipeline chunk
measured on the 2 x 2 testbed with this very layout (`moeflow profile --ops chunk_forward,chunk_backward
--chunk-esp-size 2`, results/profile-testbed-chunks-esp2.json; `moeflow.profiling.chunk_profile`: a layer
of this shape, 512 tokens per rank, d_model 128, d_hidden 1024, at degrees 1, 2, 4, 8), with the
share of the pipeline's overlap the testbed realises (`pipeline_overlap`, η). Written next to the
result. `--esp-size 1` prices with the 2 x 2 profile itself (its chunk fit is plain EP).

Prediction per variant: the schedules' own `predict` (FSMoE Eq. 1 and the §4.2 case formulas for the
pipeline) of one MoE block under the measured routing's average (uniform) load, times the MoE layers;
the dense part is not in the model, so the predicted iteration is that plus one constant, the sync
run's measured time minus its predicted MoE time (a one-parameter calibration, stated in the JSON).
Overlap bound: the MoE blocks' time cannot drop below max(comm, compute) per pass, i.e. at most
min(comm, compute) per pass (predicted) can be hidden; "reached" is the measured saving over sync
divided by that hideable time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moeflow.bench.interleave import balanced_order  # noqa: E402
from testbed_run import ROOT, ensure_profile, on_testbed, user_command  # noqa: E402

SCHEDULES = {
    "sync": ["moe.schedule=sync"],
    "pairwise": ["moe.schedule=pairwise"],
    "pipeline_r1": ["moe.schedule=pipeline", "moe.schedule_options.degree=1"],
    "pipeline_r2": ["moe.schedule=pipeline", "moe.schedule_options.degree=2"],
    "pipeline_r4": ["moe.schedule=pipeline", "moe.schedule_options.degree=4"],
    "pipeline_auto": ["moe.schedule=pipeline", "moe.schedule_options.degree=auto"],
}
GRAD_SYNC = ("after_backward", "fsmoe")
LAYERS, D_MODEL, D_HIDDEN, EXPERTS, TOP_K, SEQ, BATCH = 4, 128, 1024, 4, 2, 128, 16
SHAPE = [
    f"model.n_layers={LAYERS}",
    f"model.d_model={D_MODEL}",
    f"model.seq_len={SEQ}",
    f"moe.num_experts={EXPERTS}",
    f"moe.top_k={TOP_K}",
    f"moe.d_hidden={D_HIDDEN}",
    f"train.global_batch_size={BATCH}",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "train.log_every=1",
]


def derived_cost_model(p2x1: Path, p2x2: Path, chunks: Path, out: Path) -> Path:
    """The EP group's 2-device model (module docstring)."""
    a, b = json.loads(p2x1.read_text()), json.loads(p2x2.read_text())
    chunk_profile = json.loads(chunks.read_text())
    for kind, fit in chunk_profile["fits"].items():
        if kind.startswith("chunk_"):
            a["fits"][kind] = fit
    a["pipeline_overlap"] = chunk_profile.get("pipeline_overlap", [1.0, 1.0])
    a["name"] = "fsmoe-testbed-ep-group"
    a["topology"]["level_bandwidth_bytes_per_s"] = [0.5 * x for x in a["topology"]["level_bandwidth_bytes_per_s"]]
    for op in ("a2a", "p2p_inter"):
        if op in a["fits"]:
            a["fits"][op]["beta_s_per_unit"] *= 2.0
    a["fits"]["gemm"] = b["fits"]["gemm"]
    a["gemm_flops_per_s"] = b["gemm_flops_per_s"]
    a["derived_from"] = {
        "link_and_collectives": str(p2x1),
        "gemm": str(p2x2),
        "chunk_forward, chunk_backward, pipeline_overlap": str(chunks),
        "note": "link bandwidth halved: both EP groups cross each node's link at once",
    }
    out.write_text(json.dumps(a, indent=2) + "\n")
    return out


def predictions(cost_model_path: Path, counts_LE: np.ndarray | None = None, esp: int = 2) -> dict:
    """Per schedule variant: predicted MoE time of one iteration (all layers, forward + backward),
    its compute and communication, the pipeline's degrees and FSMoE case per layer. `counts_LE`:
    the rows per expert per layer that the run's EP group 0 routed (`expert_counts` of
    metrics.jsonl, averaged over the timed steps); None: uniform routing."""
    from moeflow.core.expert_shape import ExpertShape
    from moeflow.perf.costmodel import CostModel
    from moeflow.perf.pipeline_degree import case_at, find_degree
    from moeflow.perf.pipeline_inputs import chunk_cost_ms
    from moeflow.strategies.dispatchers import A2ADispatcher
    from moeflow.strategies.schedules.base import StepLoad
    from moeflow.strategies.schedules.pairwise import PairwiseSchedule
    from moeflow.strategies.schedules.pipeline import PipelineOptions, PipelineSchedule
    from moeflow.strategies.schedules.pipeline_pricing import pass_models, scalar_model
    from moeflow.strategies.schedules.sync import SyncSchedule

    cm = CostModel.load(cost_model_path)
    W = 4 // esp  # the EP group: 4 / esp ranks over the 2 nodes
    per = EXPERTS // W
    node_of = [w * 2 // W for w in range(W)]
    rows = BATCH * SEQ // 4 * TOP_K  # rows each ESP member dispatches
    if counts_LE is None:
        counts_LE = np.full((LAYERS, EXPERTS), W * rows / EXPERTS)
    disp = A2ADispatcher()
    schedules = {
        "sync": SyncSchedule(),
        "pairwise": PairwiseSchedule(),
        "pipeline_r1": PipelineSchedule(PipelineOptions(degree=1)),
        "pipeline_r2": PipelineSchedule(PipelineOptions(degree=2)),
        "pipeline_r4": PipelineSchedule(PipelineOptions(degree=4)),
        "pipeline_auto": PipelineSchedule(PipelineOptions(degree="auto"), cost_model=cm),
    }
    out = {name: {"moe_s": 0.0, "compute_s": 0.0, "comm_s": 0.0} for name in schedules}
    hide = bound = 0.0
    layers = []
    for counts in np.asarray(counts_LE, dtype=np.float64):
        # each source sends a destination's experts their share of its rows (both sources alike);
        # ESP: a member computes both members' rows on half the hidden dimension, priced as its EP
        # group's rows on all of it
        load_W = np.array([counts[w * per : (w + 1) * per].sum() for w in range(W)])
        send = np.tile(load_W / W, (W, 1))
        computed = np.zeros((W, EXPERTS))
        for w in range(W):
            computed[w, w * per : (w + 1) * per] = counts[w * per : (w + 1) * per]
        step = StepLoad(send, computed, ExpertShape(D_MODEL, D_HIDDEN, "ffn"), node_of)
        fwd, bwd = (scalar_model(m) for m in pass_models(step, cm, disp))
        auto = [find_degree(m, 0.0, (1, 2, 4, 8)) for m in (fwd, bwd)]
        degrees = {
            "pipeline_r1": (1, 1),
            "pipeline_r2": (2, 2),
            "pipeline_r4": (4, 4),
            "pipeline_auto": (auto[0].degree, auto[1].degree),
        }
        for name, sched in schedules.items():
            p = sched.predict(step, cm, disp)
            out[name]["moe_s"] += float(np.asarray(p.total_s))
            out[name]["compute_s"] += float(np.asarray(p.compute_s))
            out[name]["comm_s"] += float(np.asarray(p.comm_s))
            if name in degrees:
                rf, rb = degrees[name]
                out[name].setdefault("degrees", []).append([rf, rb])
                out[name].setdefault("cases", []).append([int(case_at(fwd, rf, 0.0)), int(case_at(bwd, rb, 0.0))])
        # overlap bound per pass: max(comm, compute) instead of their sum (comm = dispatch + combine)
        a2a = fwd.alpha_ms[0] + fwd.volume_ms[0]
        chunk_f, chunk_b = chunk_cost_ms(cm)  # what chunking adds is no work to hide
        exp_f = fwd.alpha_ms[3] + fwd.volume_ms[3] - chunk_f
        exp_b = bwd.alpha_ms[3] + bwd.volume_ms[3] - chunk_b
        hide += min(2 * a2a, exp_f) + min(2 * a2a, exp_b)
        bound += max(2 * a2a, exp_f) + max(2 * a2a, exp_b)
        layers.append(
            {
                "a2a_ms": a2a,
                "experts_forward_ms": exp_f,
                "experts_backward_ms": exp_b,
                "optimiser": [d.to_dict() for d in auto],
            }
        )
    return {
        "variants": out,
        "layers": layers,
        "hideable_s": hide / 1e3,
        "overlap_bound_moe_s": bound / 1e3,
    }


def mean_counts(run_dir: Path, skip: int) -> np.ndarray:
    """EP group 0's rows per expert per layer, averaged over the timed steps of a run."""
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return np.mean([m["expert_counts"] for m in metrics[skip + 1 :]], axis=0)


def run_variant(
    name: str, grad_sync: str, cost_model: Path, steps: int, bandwidth: float, out: Path, esp: int = 2
) -> list[float]:
    shutil.rmtree(out, ignore_errors=True)
    argv = ["train", "--config", "configs/tiny.toml", "--out", str(out), "--steps", str(steps)]
    argv += ["--cost-model", str(cost_model)]
    for s in [*SHAPE, f"parallel.esp_size={esp}", *SCHEDULES[name], f"train.grad_sync={grad_sync}"]:
        argv += ["--set", s]
    on_testbed(argv, bandwidth_mbit=bandwidth, timeout_s=600)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    t = [m["train_time_s"] for m in metrics]
    return list(np.diff(t))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/fsmoe_testbed.json")
    parser.add_argument("--bandwidth-mbit", type=float, default=800.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--skip", type=int, default=4, help="step intervals dropped at the start of a run")
    parser.add_argument("--esp-size", type=int, default=2, choices=(1, 2), help="1: plain EP over the 4 ranks")
    parser.add_argument("--grad-sync", nargs="+", default=list(GRAD_SYNC), choices=GRAD_SYNC)
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--predict-only", action="store_true", help="print the uniform-routing prediction")
    parser.add_argument("--resummarize", action="store_true", help="recompute --out from its .raw.json and runs")
    args = parser.parse_args()
    results = ROOT / "results"
    runs = results / ("fsmoe_testbed_runs" if args.esp_size == 2 else f"fsmoe_testbed_runs_esp{args.esp_size}")
    p2x1 = ensure_profile(results / "profile-testbed-2x1.json", args.bandwidth_mbit, 2, 1)
    p2x2 = ensure_profile(results / "profile-testbed.json", args.bandwidth_mbit, 2, 2)
    # esp 2: the EP group is one rank per node (derived model); esp 1: all 4 ranks (the 2 x 2 profile)
    cm = p2x2
    if args.esp_size == 2:
        chunk_options = ("--ops", "chunk_forward,chunk_backward", "--chunk-esp-size", "2")
        chunks = ensure_profile(
            results / "profile-testbed-chunks-esp2.json", args.bandwidth_mbit, 2, 2, options=chunk_options
        )
        cm = derived_cost_model(p2x1, p2x2, chunks, Path(args.out).with_suffix(".costmodel.json"))
    if args.predict_only:
        print(json.dumps(predictions(cm, esp=args.esp_size), indent=2))
        return 0
    variants = [(s, g) for g in args.grad_sync for s in args.schedules]
    raw = Path(args.out).with_suffix(".raw.json")
    if args.resummarize:
        steps = json.loads(raw.read_text())
    else:
        steps = {f"{s}/{g}": [] for s, g in variants}
        for rnd in range(args.rounds):
            for s, g in balanced_order(variants, rnd):
                dt = run_variant(s, g, cm, args.steps, args.bandwidth_mbit, runs / f"{s}-{g}", args.esp_size)
                steps[f"{s}/{g}"].append(dt)
                raw.write_text(json.dumps(steps, indent=1))
                print(f"round {rnd} {s}/{g}: median {1e3 * statistics.median(dt[args.skip :]):.1f} ms", flush=True)
    # the routing of each variant's last run (same seed and data in every round)
    pred = {f"{s}/{g}": predictions(cm, mean_counts(runs / f"{s}-{g}", args.skip), args.esp_size) for s, g in variants}
    args.cost_model_path = cm
    command = user_command(__file__)
    if args.resummarize and Path(args.out).is_file():  # keep the command that measured
        command = json.loads(Path(args.out).read_text()).get("command", command)
    result = {"command": command, **summarize(steps, pred, args)}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"wrote {args.out}")
    return 0


def r2(pred: list[float], meas: list[float]) -> float | None:
    y, f = np.asarray(meas), np.asarray(pred)
    ss = float(((y - y.mean()) ** 2).sum())
    return None if ss == 0 or len(y) < 2 else 1.0 - float(((y - f) ** 2).sum()) / ss


def summarize(steps: dict, pred: dict, args) -> dict:
    rows = {}
    for key, runs in steps.items():
        per_run = [statistics.median(r[args.skip :]) for r in runs]
        rows[key] = {
            "median_s": statistics.median(per_run),
            "min_s": min(per_run),
            "max_s": max(per_run),
            "per_run_median_s": per_run,
        }
    out = {
        "bandwidth_mbit": args.bandwidth_mbit,
        "rounds": len(next(iter(steps.values()))),
        "steps": args.steps,
        "skip": args.skip,
        "shape": [*SHAPE, f"parallel.esp_size={args.esp_size}"],
        "cost_model": str(args.cost_model_path),
        "grad_sync": {},
    }
    for g in args.grad_sync:
        base = rows[f"sync/{g}"]["median_s"]
        sync_pred = pred[f"sync/{g}"]
        dense = base - sync_pred["variants"]["sync"]["moe_s"]  # calibration: the unmodelled dense part
        table = {}
        for s in args.schedules:
            p = pred[f"{s}/{g}"]["variants"][s]
            table[s] = {
                **rows[f"{s}/{g}"],
                "vs_sync": base / rows[f"{s}/{g}"]["median_s"],
                "predicted_moe_s": p["moe_s"],
                "predicted_moe_compute_s": p["compute_s"],
                "predicted_moe_comm_s": p["comm_s"],
                "predicted_iteration_s": dense + p["moe_s"],
                **({"degrees_per_layer": p["degrees"], "cases_per_layer": p["cases"]} if "degrees" in p else {}),
            }
            table[s]["predicted_vs_sync"] = base / table[s]["predicted_iteration_s"]
        fixed_names = [s for s in args.schedules if s.startswith("pipeline_r")]  # every fixed degree run
        fixed = min(table[s]["median_s"] for s in fixed_names)
        best_pipe = min(table[s]["median_s"] for s in [*fixed_names, "pipeline_auto"] if s in table)
        hideable = sync_pred["hideable_s"]
        out["grad_sync"][g] = {
            "variants": table,
            "dense_calibration_s": dense,
            "predicted_moe_sync_s": sync_pred["variants"]["sync"]["moe_s"],
            "hideable_s": hideable,
            "overlap_bound_iteration_s": base - hideable,
            "fixed_degrees_compared": fixed_names,
            "auto_vs_best_fixed": table["pipeline_auto"]["median_s"] / fixed if "pipeline_auto" in table else None,
            "overlap_reached_best_pipeline": (base - best_pipe) / hideable,
            "overlap_reached_auto": (base - table["pipeline_auto"]["median_s"]) / hideable
            if "pipeline_auto" in table
            else None,
            "r2_iteration": r2(
                [t["predicted_iteration_s"] for t in table.values()], [t["median_s"] for t in table.values()]
            ),
        }
    out["prediction"] = pred
    allp = [t for block in out["grad_sync"].values() for t in block["variants"].values()]
    out["r2_iteration_all"] = r2([t["predicted_iteration_s"] for t in allp], [t["median_s"] for t in allp])
    by_case: dict[str, list] = {}
    for t in allp:
        cases = sorted({c for layer in t.get("cases_per_layer", []) for c in layer})
        key = "unpipelined (sync, pairwise)" if not cases else "pipeline, cases " + ",".join(map(str, cases))
        by_case.setdefault(key, []).append(t)
    out["r2_by_case"] = {
        c: {
            "n": len(ts),
            "r2": r2([t["predicted_iteration_s"] for t in ts], [t["median_s"] for t in ts]),
            "mean_abs_relative_error": float(
                np.mean([abs(t["predicted_iteration_s"] / t["median_s"] - 1) for t in ts])
            ),
        }
        for c, ts in by_case.items()
    }
    return out


def print_table(result: dict) -> None:
    for g, block in result["grad_sync"].items():
        print(
            f"grad_sync={g}: auto / best fixed {block['auto_vs_best_fixed']}, "
            f"overlap reached {block['overlap_reached_best_pipeline']:.2f}, R² {block['r2_iteration']}"
        )
        for s, t in block["variants"].items():
            print(
                f"  {s:<14}{1e3 * t['median_s']:8.1f} ms [{1e3 * t['min_s']:.1f}–{1e3 * t['max_s']:.1f}]"
                f"  {t['vs_sync']:.3f}x  predicted {1e3 * t['predicted_iteration_s']:.1f} ms"
                f" (MoE {1e3 * t['predicted_moe_s']:.1f})"
                f"  {t.get('degrees_per_layer', '')} {t.get('cases_per_layer', '')}"
            )


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except subprocess.CalledProcessError as exc:
        print(f"a testbed run failed: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
