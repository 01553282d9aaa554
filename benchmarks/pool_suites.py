"""Pool several runs of the testbed suite (`benchmarks/strategies.py --where testbed`): per workload,
each variant's speedup over EP as the geometric mean over the runs, the best single strategy chosen
on the pooled speedups, and `auto`'s distance to it; beside it, what the measurement itself
resolves (docs/auto.md).

    .venv/bin/python benchmarks/pool_suites.py results/strategies-testbed-2x1{z,z2,aa,ab}.json \
        --out results/strategies-testbed-2x1-pooled.json

Why pool. One run's per-workload ratio `auto` / best single takes the best of six noisy medians:
the selection alone biases it down. At Zipf 0 every planner proposes plain EP's placement, so the
variants that ran it on `sync` without copies do the same work: each one's speedup over the best of
the others (`same_work`) is what a variant tied with the best single scores against it in one run
— the resolution of a per-workload comparison on this testbed. Pooling the runs shrinks both the
noise and the selection's bias.

Each run's speedups are over its own EP-sync (interleaved with it iteration by iteration), so runs
made on a busier or quieter machine pool as ratios. The replayed trace's workload is named after its
first iteration (`trace-replay@225`), which depends on the run's length: pooled by its prefix.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from strategies import geomean, summarize  # noqa: E402
from testbed_run import write_result  # noqa: E402

SAME_WORK_WORKLOAD = "zipf-0"
"""Where every planner proposes plain EP's placement (no skew: nothing to copy)."""
MARGIN = 0.97
"""`auto` within 3% of the best single strategy."""


def _workload(name: str) -> str:
    return name.split("@")[0]


def _label(row: dict) -> str:
    return row["strategy"] + ("+prefetch" if row["prefetch"] else "") + ":" + row["schedule"]


def same_work_ratios(testbed: dict) -> list[float]:
    """Each `sync` variant that made no copies at Zipf 0 (every one ran plain EP's placement), over
    the best of the others: what a tie with the best single measures in this run."""
    rows = [
        r
        for r in testbed["rows"]
        if r["routing"] == SAME_WORK_WORKLOAD and not r.get("ceiling") and r["schedule"] == "sync"
    ]
    speedup = np.array([r["speedup_vs_ep"] for r in rows if r["copies_mean"] == 0.0])
    if speedup.size < 2:
        return []
    return [float(s / np.delete(speedup, i).max()) for i, s in enumerate(speedup)]


def pool(testbeds: list[dict]) -> dict:
    """The pooled speedups, their summary (`strategies.summarize`), each run's own `auto` / best
    single, and the same-work ratios of every run."""
    runs = [{_workload(w): row for w, row in t["speedup_over_ep"].items()} for t in testbeds]
    workloads = [w for w in runs[0] if all(w in r for r in runs)]
    labels = [k for k in runs[0][workloads[0]] if k != "ceiling" and all(k in r[w] for r in runs for w in workloads)]
    pooled = {w: {k: geomean([r[w][k] for r in runs]) for k in labels} for w in workloads}
    per_run = [
        {_workload(w): v["auto+prefetch:auto_vs_best"] for w, v in t["summary"]["per_workload"].items()}
        for t in testbeds
    ]
    same = [same_work_ratios(t) for t in testbeds]
    flat = np.concatenate([s for s in same if s]) if any(same) else np.array([])
    return {
        "runs": len(testbeds),
        "workloads": workloads,
        "pooled_speedup_over_ep": pooled,
        "summary": summarize(pooled, labels),
        "per_run_auto_vs_best": {w: [r.get(w) for r in per_run] for w in workloads},
        "same_work": {
            "ratios_per_run": same,
            "share_below_margin": float(np.mean(flat < MARGIN)) if flat.size else None,
            "percentiles_10_50_90": np.percentile(flat, [10, 50, 90]).tolist() if flat.size else None,
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suites", nargs="+", help="JSON files written by benchmarks/strategies.py (testbed part)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    testbeds = []
    for path in args.suites:
        data = json.loads(Path(path).read_text())
        if "testbed" not in data:
            raise SystemExit(f"{path!r}: no testbed part (run benchmarks/strategies.py --where testbed)")
        testbeds.append(data["testbed"])
    result = {"suites": args.suites, **pool(testbeds)}
    summary = result["summary"]
    print("| workload | best single (pooled) | auto / best, pooled | each run |")
    print("|---|---|---|---|")
    for w in result["workloads"]:
        row = summary["per_workload"][w]
        runs = ", ".join(f"{x:.2f}" for x in result["per_run_auto_vs_best"][w] if x is not None)
        best = f"{row['best_single']} {row['best_single_speedup']:.2f}"
        print(f"| {w} | {best} | {row['auto+prefetch:auto_vs_best']:.3f} | {runs} |")
    geo = summary["geomean_speedup_over_ep"]
    best = max((k for k in geo if not k.startswith("auto")), key=geo.get)
    print(f"over the suite: auto {geo['auto+prefetch:auto']:.3f} / {best} {geo[best]:.3f}")
    same = result["same_work"]
    if same["share_below_margin"] is not None:
        p10, p50, p90 = same["percentiles_10_50_90"]
        print(
            f"same work at Zipf 0, one run: {100 * same['share_below_margin']:.0f}% below {MARGIN}; "
            f"10/50/90th percentiles {p10:.3f} / {p50:.3f} / {p90:.3f}"
        )
    if args.out:
        write_result(__file__, args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
