"""Topology-aware routing in training on the network testbed: GShard loss vs TA-MoE's loss vs
FasterMoE's hierarchical gate (FasterMoE §4.3, TA-MoE §4). Same model, data, seed.

    sudo .venv/bin/python benchmarks/topology_training.py --steps 200 --out results/topology_training.json

2 "nodes" x 2 ranks, shaped inter-node link; the configs/tiny.toml model with 8 experts. Reports per
variant: loss vs steps and vs training time, step time, cross-node share and bytes per step, and the
time and steps each needs to reach the loss all of them reach (a 10-step rolling mean).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from testbed_run import ROOT, ensure_profile, on_testbed

VARIANTS = {
    "gshard": [],
    "ta_moe": ["moe.balance=ta_moe"],
    "hierarchical": ["moe.gate=hierarchical"],
}


def rolling(x: np.ndarray, window: int = 10) -> np.ndarray:
    return np.convolve(x, np.ones(window) / window, mode="valid")


def summarize(metrics: list[dict], d_model: int, layers: int, top_k: int, tokens_per_step: int) -> dict:
    loss = np.array([m["loss"] for m in metrics])
    time_s = np.array([m["train_time_s"] for m in metrics])
    share = np.array([m["cross_node_share"] for m in metrics])
    # Cross-node bytes of one step: every assignment crossing nodes travels in 4 all-to-alls
    # (dispatch and combine, forward and backward) as d fp32 values, in every MoE layer.
    cross_bytes = share * tokens_per_step * top_k * d_model * 4 * 4 * layers
    return {
        "loss": loss.tolist(),
        "train_time_s": time_s.tolist(),
        "step_time_s": float(np.median(np.diff(time_s))),
        "cross_node_share": float(share.mean()),
        "cross_node_MB_per_step": float(cross_bytes.mean() / 1e6),
        "final_loss_rolling": float(rolling(loss)[-1]),
        "val_loss": [m["val_loss"] for m in metrics if m.get("val_loss") is not None],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--bandwidth-mbit", type=float, default=800.0)
    parser.add_argument("--profile", default=None, help="default: results/profile-testbed-<bandwidth>mbit.json")
    parser.add_argument("--balance-weight", type=float, default=0.1, help="aux-loss weight, the same for every variant")
    parser.add_argument("--out", default="results/topology_training.json")
    args = parser.parse_args()
    profile_path = args.profile or f"results/profile-testbed-{args.bandwidth_mbit:g}mbit.json"
    profile = ensure_profile(ROOT / profile_path, args.bandwidth_mbit)
    runs = ROOT / "results" / "topology_training"
    d_model, layers, top_k, tokens_per_step = 128, 4, 2, 16 * 128  # configs/tiny.toml
    result = {
        "steps": args.steps,
        "bandwidth_mbit": args.bandwidth_mbit,
        "balance_weight": args.balance_weight,
        "variants": {},
    }
    for name, sets in VARIANTS.items():
        out = runs / name
        argv = [
            "train",
            "--config",
            "configs/tiny.toml",
            "--out",
            str(out),
            "--steps",
            str(args.steps),
            "--cost-model",
            str(profile),
            "--set",
            "moe.num_experts=8",
            "--set",
            "train.checkpoint_every=0",
        ]
        for s in sets:
            argv += ["--set", s]
        on_testbed(argv, bandwidth_mbit=args.bandwidth_mbit)
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        result["variants"][name] = summarize(metrics, d_model, layers, top_k, tokens_per_step)
    # Time and steps to the loss every variant reaches (the worst final rolling loss).
    target = max(v["final_loss_rolling"] for v in result["variants"].values())
    result["target_loss"] = target
    for v in result["variants"].values():
        smooth = rolling(np.array(v["loss"]))
        first = int(np.argmax(smooth <= target))
        v["steps_to_target"] = first + 10
        v["time_to_target_s"] = v["train_time_s"][first + 9]
    base = result["variants"]["gshard"]
    print(f"{'variant':<14}{'step ms':>9}{'cross-node':>11}{'MB/step':>9}{'steps→L':>9}{'time→L s':>10}{'speedup':>9}")
    for name, v in result["variants"].items():
        speedup = base["time_to_target_s"] / v["time_to_target_s"]
        print(
            f"{name:<14}{1e3 * v['step_time_s']:9.1f}{v['cross_node_share']:11.3f}{v['cross_node_MB_per_step']:9.2f}"
            f"{v['steps_to_target']:9d}{v['time_to_target_s']:10.1f}{speedup:9.2f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"target loss {target:.3f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
