"""TA-MoE in training, per step: GShard's loss vs TA-MoE's loss with and without its selection
steering (and the steering with GShard's loss), over several seeds. Same model, data and seeds.

    .venv/bin/python benchmarks/ta_moe_training.py --seeds 0 1 2 3 4 --out results/ta_moe_training.json
    # the search behind the defaults (reuses the runs above that it shares):
    .venv/bin/python benchmarks/ta_moe_training.py --variants sweep --reuse --out results/ta_moe_training_sweep.json

4 processes on this machine priced as 2 nodes x 2 ranks with a slow inter-node link (≈ 25 MB/s
across nodes, ≈ 2.7 GB/s inside: the testbed's profiled values). No network emulation: the loss
per step does not depend on link speed, only the cost model's topology (TA-MoE's target) does.
The configs/tiny.toml model with 8 experts, balance weight 0.1 for every variant. Reports per
variant and seed: the final training loss (10-step mean), the validation loss at mid-run and at
the end, the mean cross-node share and load imbalance over the last 20 steps; and per variant
their mean ± std over seeds and the difference to GShard paired by seed (same seed = same
initialisation and data order; runs are deterministic). One seed's validation loss at 100 steps
spreads by about ±0.07 nat: compare means over 3 or more seeds. `--reuse` keeps complete run
folders, which is right only while the code and the defaults they ran with are unchanged.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from testbed_run import write_result
from training_runs import ROOT, aggregate, print_table, summarize, train

TA = ["moe.balance=ta_moe"]
STEER_GSHARD_LOSS = ["moe.balance_options.loss=gshard"]
LAMBDA_01 = [*TA, "moe.balance_options.smoothing=0.1"]  # the target before smoothing's default was 0.3


def _steer(rate: float, limit: float) -> list[str]:
    return [f"moe.balance_options.steer_rate={rate}", f"moe.balance_options.steer_limit={limit}"]


VARIANTS = {
    "gshard": ["moe.balance=gshard"],
    "ta_moe": TA,
    "ta_moe_loss_only": [*TA, "moe.balance_options.steer_rate=0"],
    "ta_moe_steer_gshard_loss": [*TA, *STEER_GSHARD_LOSS],
    "ta_moe_smoothing0.1": LAMBDA_01,
    "ta_moe_smoothing0.5": [*TA, "moe.balance_options.smoothing=0.5"],
    # What costs λ = 0.1 its convergence: the loss alone, the steering alone, the bound and rate.
    "smoothing0.1_loss_only": [*LAMBDA_01, "moe.balance_options.steer_rate=0"],
    "smoothing0.1_limit0.03": [*LAMBDA_01, "moe.balance_options.steer_limit=0.03"],
    "smoothing0.1_steer_gshard_loss": [*LAMBDA_01, *STEER_GSHARD_LOSS],
    "smoothing0.1_steer_gshard_loss_rate3e-3": [*LAMBDA_01, *STEER_GSHARD_LOSS, *_steer(0.003, 0.1)],
    "smoothing0.1_steer_gshard_loss_rate1e-2": [*LAMBDA_01, *STEER_GSHARD_LOSS, *_steer(0.01, 0.1)],
    "smoothing0.1_steer_gshard_loss_limit0.3": [*LAMBDA_01, *STEER_GSHARD_LOSS, *_steer(0.003, 0.3)],
    "smoothing0.1_steer_gshard_loss_limit1": [*LAMBDA_01, *STEER_GSHARD_LOSS, *_steer(0.01, 1.0)],
}
"""Variant name -> `--set` overrides on top of the common ones (`train`)."""

SWEEP = [
    "gshard",
    "ta_moe_smoothing0.1",
    "smoothing0.1_loss_only",
    "smoothing0.1_limit0.03",
    "smoothing0.1_steer_gshard_loss",
    "smoothing0.1_steer_gshard_loss_rate3e-3",
    "smoothing0.1_steer_gshard_loss_rate1e-2",
    "smoothing0.1_steer_gshard_loss_limit0.3",
    "smoothing0.1_steer_gshard_loss_limit1",
    "ta_moe",
    "ta_moe_smoothing0.5",
]
"""`--variants sweep`: the search behind the defaults (docstring)."""
DEFAULT_VARIANTS = ["gshard", "ta_moe", "ta_moe_loss_only", "ta_moe_steer_gshard_loss", "ta_moe_smoothing0.1"]


def ensure_cost_model(path: Path) -> Path:
    """2 nodes x 2 ranks, ≈ 25 MB/s between nodes and ≈ 2.7 GB/s inside (the testbed's profile)."""
    if not path.exists():
        from moeflow.perf.costmodel import CostModel
        from moeflow.perf.topology import Topology

        path.parent.mkdir(parents=True, exist_ok=True)
        CostModel(Topology([[0, 1], [2, 3]], [25e6, 2.7e9]), gemm_flops_per_s=2e10, backend="gloo").save(str(path))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=[*VARIANTS, "sweep"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--balance-weight", type=float, default=0.1, help="the same for every variant")
    parser.add_argument("--cost-model", default="results/ta_moe_2x2.json", help="created if missing")
    parser.add_argument("--runs", default="results/ta_moe_training", help="run folders, one per variant and seed")
    parser.add_argument("--reuse", action="store_true", help="keep complete runs already in --runs")
    parser.add_argument("--out", default="results/ta_moe_training.json")
    args = parser.parse_args()
    args.variants = list(dict.fromkeys(v for name in args.variants for v in (SWEEP if name == "sweep" else [name])))
    cost_model = ensure_cost_model(ROOT / args.cost_model)
    val_steps = [str(args.steps // 2), str(args.steps)]
    runs: dict[str, dict[str, dict]] = {}
    for name in args.variants:
        runs[name] = {}
        for seed in args.seeds:
            sets = [
                "moe.num_experts=8",
                f"moe.balance_weight={args.balance_weight}",
                f"train.seed={seed}",
                f"train.eval_every={args.steps // 2}",
                "train.checkpoint_every=0",
                *VARIANTS[name],
            ]
            path = train(ROOT / args.runs / f"{name}-s{seed}", sets, args.nproc, args.steps, cost_model, args.reuse)
            runs[name][str(seed)] = summarize([json.loads(line) for line in path.read_text().splitlines()])
    base = runs.get("gshard")
    result = {
        "steps": args.steps,
        "seeds": args.seeds,
        "balance_weight": args.balance_weight,
        "cost_model": args.cost_model,
        "variants": {
            name: {
                "sets": VARIANTS[name],
                "summary": aggregate(r, None if name == "gshard" else base, val_steps, "gshard"),
                "runs": r,
            }
            for name, r in runs.items()
        },
    }
    print_table(result["variants"], val_steps, "gshard")
    write_result(__file__, ROOT / args.out, result)  # with the command that produced it
    print(f"seeds {args.seeds}, {args.steps} steps; mean ± std over seeds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
