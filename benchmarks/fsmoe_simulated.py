"""FSMoE part 2 on the paper's testbeds (presets fsmoe_a, fsmoe_b), predicted: the pipelined MoE
layer at a fixed degree r ∈ {1, 2, 4, 8} for both passes (Tutel / PipeMoE-style) against FSMoE's
optimiser (Algorithm 1, forward and backward degrees chosen separately), over FSMoE Table 4's
layer configurations.

    .venv/bin/python benchmarks/fsmoe_simulated.py --out results/fsmoe_simulated.json

Model: FSMoE's performance model (§4.1 Eq. 1, cases of §4.2; `moeflow.perf.pipeline_degree`, as
`moeflow tune`) with the preset's link and GEMM rates, ESP = MP = the GPUs of a node (8 on A, 4 on
B, FSMoE §6.1), one MoE layer. Grid (Table 4): B ∈ {1, 2, 4}, L ∈ {512, 1024, 2048} (A) /
{256, 512, 1024} (B), M ∈ {1024, 2048, 4096}, H/M ∈ {2, 3, 4}, F = k·f with k = 2 and f ∈
{1, 2, 4} (f = * is not modelled), ffn-type simple (2 GEMMs) or Mixtral (3): 486 cases per
testbed (N_heads only shapes attention, which this comparison leaves out).

Compared: the layer's forward + backward time (t_gar = 0) at each fixed r against the optimiser's
degrees, and against the best fixed r per case (an oracle Tutel-style tuner: one degree for both
passes). "With the gradient": the same plus the layer's dense gradient all-reduce — after the
backward for a fixed r, partitioned into the MoE pipeline by FSMoE §5 for the optimiser (the
dense part's own overlap, `others_ms`, taken as 0). FSMoE's published 1.18× / 1.22× over Tutel
(Table 5) also include ESP/all-to-all overlap across nodes, its kernels and measured effects
that a prediction of the schedule and degree cannot contain.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from moeflow.perf.costmodel import CostModel
from moeflow.perf.grad_partition import partition_gradients
from moeflow.perf.pipeline_degree import case_at, find_degree, pass_model, priced_time
from moeflow.perf.pipeline_inputs import PipelineFits, PipelineWorkload

FIXED = (1, 2, 4, 8)
PUBLISHED = {"fsmoe_a": 1.18, "fsmoe_b": 1.22}  # FSMoE Table 5, FSMoE over Tutel (w/ PipeMoE)
ESP = {"fsmoe_a": 8, "fsmoe_b": 4}
GRID = {
    "batch": (1, 2, 4),
    "seq": {"fsmoe_a": (512, 1024, 2048), "fsmoe_b": (256, 512, 1024)},
    "d_model": (1024, 2048, 4096),
    "hscale": (2, 3, 4),
    "f": (1, 2, 4),
    "ffn": {"simple": 2, "mixtral": 3},
}
TINY = {
    "batch": (1,),
    "seq": {"fsmoe_a": (512,), "fsmoe_b": (256,)},
    "d_model": (1024, 4096),
    "hscale": (4,),
    "f": (2,),
    "ffn": {"simple": 2},
}


def cases(preset: str, grid: dict):
    for B, L, M, hs, f, (ffn, N) in itertools.product(
        grid["batch"], grid["seq"][preset], grid["d_model"], grid["hscale"], grid["f"], grid["ffn"].items()
    ):
        name = f"B{B}-L{L}-M{M}-H{hs}M-f{f}-{ffn}"
        yield name, PipelineWorkload(B, L, M, hs * M, N, 2.0 * f, ESP[preset], 1, 0.0)


def one_case(name: str, wl: PipelineWorkload, cm: CostModel, gradient: bool) -> dict:
    fits = PipelineFits.from_cost_model(cm, wl)
    fwd, bwd = pass_model(wl, fits, False), pass_model(wl, fits, True)
    r = np.asarray(FIXED, dtype=np.float64)
    fixed_ms = priced_time(fwd, r, 0.0) + priced_time(bwd, r, 0.0)
    fixed_case = [[int(c) for c in case_at(m, r, 0.0)] for m in (fwd, bwd)]
    cf, cb = find_degree(fwd, 0.0, FIXED), find_degree(bwd, 0.0, FIXED)
    row = {
        "case": name,
        "fixed_ms": {str(d): float(t) for d, t in zip(FIXED, fixed_ms)},
        "fixed_cases": {str(d): [fixed_case[0][i], fixed_case[1][i]] for i, d in enumerate(FIXED)},
        "optimiser": {
            "forward_degree": cf.degree,
            "backward_degree": cb.degree,
            "forward_case": cf.case,
            "backward_case": cb.case,
            "ms": cf.time_ms + cb.time_ms,
        },
        "best_fixed_degree": int(FIXED[int(np.argmin(fixed_ms))]),
        "best_fixed_ms": float(fixed_ms.min()),
    }
    if gradient:
        ar = float(fits.ar_time_ms(wl.grad_elements))
        part = partition_gradients(wl, fits, "powers")
        row["gradient"] = {
            "grad_elements": wl.grad_elements,
            "all_reduce_ms": ar,
            "fixed_ms": {str(d): float(t) + ar for d, t in zip(FIXED, fixed_ms)},
            "best_fixed_ms": float(fixed_ms.min()) + ar,
            "optimiser_ms": cf.time_ms + part.objective_ms,
            "exposed_elements": part.exposed_elements,
        }
    return row


def summarize(rows: list[dict], preset: str, gradient: bool) -> dict:
    def geo(xs: list[float]) -> float:
        return float(np.exp(np.mean(np.log(xs))))

    pairs = [(r["optimiser"]["forward_degree"], r["optimiser"]["backward_degree"]) for r in rows]
    out = {
        "cases": len(rows),
        "published_speedup_over_tutel": PUBLISHED[preset],
        "speedup_over_fixed": {
            str(d): {
                "mean": statistics.fmean(r["fixed_ms"][str(d)] / r["optimiser"]["ms"] for r in rows),
                "geomean": geo([r["fixed_ms"][str(d)] / r["optimiser"]["ms"] for r in rows]),
                "min": min(r["fixed_ms"][str(d)] / r["optimiser"]["ms"] for r in rows),
                "max": max(r["fixed_ms"][str(d)] / r["optimiser"]["ms"] for r in rows),
            }
            for d in FIXED
        },
        "speedup_over_best_fixed": {
            "mean": statistics.fmean(r["best_fixed_ms"] / r["optimiser"]["ms"] for r in rows),
            "max": max(r["best_fixed_ms"] / r["optimiser"]["ms"] for r in rows),
        },
        "split_degrees_share": statistics.fmean(
            r["optimiser"]["forward_degree"] != r["optimiser"]["backward_degree"] for r in rows
        ),
        "optimiser_degrees": dict(sorted(Counter(f"{a}/{b}" for a, b in pairs).items())),
        "optimiser_cases": {str(c): sum(1 for r in rows if r["optimiser"]["forward_case"] == c) for c in (1, 2, 3, 4)},
    }
    if gradient:
        g = [r["gradient"] for r in rows]
        out["with_gradient"] = {
            "speedup_over_fixed": {
                str(d): statistics.fmean(x["fixed_ms"][str(d)] / x["optimiser_ms"] for x in g) for d in FIXED
            },
            "speedup_over_best_fixed": statistics.fmean(x["best_fixed_ms"] / x["optimiser_ms"] for x in g),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/fsmoe_simulated.json")
    parser.add_argument("--presets", nargs="+", default=["fsmoe_a", "fsmoe_b"], choices=sorted(ESP))
    parser.add_argument("--tiny", action="store_true", help="a 2-case grid per preset (tests)")
    parser.add_argument("--no-gradient", action="store_true", help="skip the gradient-partitioning comparison")
    args = parser.parse_args(argv)
    grid = TINY if args.tiny else GRID
    gradient = not args.no_gradient
    t0 = time.perf_counter()
    result: dict = {
        "command": " ".join(["python benchmarks/fsmoe_simulated.py", *(sys.argv[1:] if argv is None else argv)]),
        "fixed_degrees": list(FIXED),
        "model": "FSMoE §4.1 Eq. 1 / §4.2 cases (moeflow.perf.pipeline_degree), one MoE layer; "
        "t_gar = 0 except under 'gradient'",
        "presets": {},
    }
    for preset in args.presets:
        cm = CostModel.from_preset(preset)
        rows = [one_case(name, wl, cm, gradient) for name, wl in cases(preset, grid)]
        result["presets"][preset] = {
            "esp": ESP[preset],
            "devices": cm.topology.num_devices,
            "summary": summarize(rows, preset, gradient),
            "rows": rows,
        }
    result["elapsed_s"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{'preset':<9}{'cases':>6}"
        + "".join(f"{'vs r=' + str(d):>9}" for d in FIXED)
        + f"{'vs best':>9}{'split':>7}{'FSMoE':>7}"
    )
    for preset, p in result["presets"].items():
        s = p["summary"]
        print(
            f"{preset:<9}{s['cases']:>6}"
            + "".join(f"{s['speedup_over_fixed'][str(d)]['mean']:9.3f}" for d in FIXED)
            + f"{s['speedup_over_best_fixed']['mean']:9.3f}{s['split_degrees_share']:7.2f}"
            + f"{s['published_speedup_over_tutel']:7.2f}"
        )
        if gradient:
            w = s["with_gradient"]
            print(
                f"{'  + grad':<9}{'':>6}"
                + "".join(f"{w['speedup_over_fixed'][str(d)]:9.3f}" for d in FIXED)
                + f"{w['speedup_over_best_fixed']:9.3f}"
            )
    print(f"wrote {args.out} in {result['elapsed_s']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
