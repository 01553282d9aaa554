"""Topology-aware routing in training on a 2-node cost model, several seeds: GShard vs
node-limited routing (DeepSeek-V3 §2.1.2) vs TA-MoE's loss and steering vs FasterMoE's
hierarchical gate. Same model, data and seed per seed; local gloo ranks play 2 nodes.

    .venv/bin/python benchmarks/node_limited_training.py --seeds 0 1 2 \\
        --out docs/results/2026-11-26-node-limited-routing.json

The ranks are `--nproc` local processes split into 2 nodes by a cost model written here (a
network of `--network-gbit` Gb/s between the nodes, PCIe 3.0 x16, 15.75 GB/s, inside each: the
FasterMoE "johnny" node's link, docs/performance.md), which prices TA-MoE's target, sets the
hierarchical gate's quota and gives node-limited routing its nodes. Nothing is emulated: step
times are not the network's; the measures are routing and convergence at equal steps —

- `cross_node_share`: share of the dispatched rows that go to a rank on the other node (mean
  over layers and steps; `first`/`last` 10 steps too);
- `remote_nodes_per_token`: other nodes a token's rows go to (rank 0's tokens), what a dispatch
  that sends a token once per node (DeepSeek-V3 §3.2.2) moves across nodes;
- validation loss at each evaluation (equal steps), and the load imbalance (max/mean).

Writes JSON with every run and, per variant, the mean and the spread (min, max, std) over seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

VARIANTS = {
    "gshard": [],
    "node_limited": ["moe.gate_options.node_limited=1"],
    "ta_moe": ["moe.balance=ta_moe"],
    "hierarchical": ["moe.gate=hierarchical"],
}
"""Variant → `--set` items on top of the base model (all token choice over softmax scores)."""

BASE = [
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=4",
    "model.seq_len=64",
    "model.d_ff=256",
    "moe.num_experts=16",
    "moe.top_k=4",
    "moe.d_hidden=32",
    "moe.balance_weight=0.01",
    "data.max_bytes=2000000",
    "train.global_batch_size=16",
    "train.eval_batches=4",
    "train.checkpoint_every=0",
    "train.keep_checkpoints=1",
    "optim.warmup_steps=10",
]
"""A fine-grained tiny MoE-GPT: 16 experts of width 32, 4 per token (4 experts per rank with 4 ranks)."""


def write_cost_model(path: Path, nproc: int, network_gbit: float) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from moeflow.perf.costmodel import CostModel
    from moeflow.perf.topology import Topology

    half = nproc // 2
    nodes = [list(range(half)), list(range(half, nproc))]
    pcie3 = 15.75e9  # PCIe 3.0 x16, bytes/s per direction (PCI-SIG)
    CostModel(Topology(nodes, [network_gbit * 1e9 / 8, pcie3]), gemm_flops_per_s=1e12).save(path)


def run(out: Path, cost_model: Path, steps: int, eval_every: int, seed: int, nproc: int, sets: list[str]) -> list[dict]:
    argv = [sys.executable, "-m", "moeflow.cli", "train", "--config", "configs/tiny.toml", "--out", str(out)]
    argv += ["--nproc", str(nproc), "--steps", str(steps), "--cost-model", str(cost_model)]
    for item in [*BASE, f"train.seed={seed}", f"train.eval_every={eval_every}", *sets]:
        argv += ["--set", item]
    subprocess.run(argv, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summarize(metrics: list[dict]) -> dict:
    share = np.array([m["cross_node_share"] for m in metrics])
    remote = np.array([m["remote_nodes_per_token"] for m in metrics])
    val = {m["step"]: m["val_loss"] for m in metrics if m.get("val_loss") is not None}
    return {
        "cross_node_share": float(share.mean()),
        "cross_node_share_first10": float(share[:10].mean()),
        "cross_node_share_last10": float(share[-10:].mean()),
        "remote_nodes_per_token": float(remote.mean()),
        "remote_nodes_per_token_last10": float(remote[-10:].mean()),
        "load_imbalance_last10": float(np.mean([m["load_imbalance"] for m in metrics[-10:]])),
        "train_loss_last10": float(np.mean([m["loss"] for m in metrics[-10:]])),
        "val_loss": val,
        "final_val_loss": val[max(val)],
    }


def spread(values: list[float]) -> dict:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--nproc", type=int, default=4, help="local ranks, split into 2 nodes (2 or 4)")
    parser.add_argument("--network-gbit", type=float, default=10.0, help="inter-node bandwidth, Gb/s")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", default="results/node_limited_training.json")
    args = parser.parse_args()
    if args.nproc not in (2, 4):
        raise SystemExit(f"--nproc={args.nproc}: 2 or 4 local ranks (2 nodes of 1 or 2)")
    result = {"args": vars(args), "base": BASE, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        cost_model = Path(tmp) / "two_nodes.json"
        write_cost_model(cost_model, args.nproc, args.network_gbit)
        result["cost_model"] = json.loads(cost_model.read_text())
        for seed in args.seeds:  # seed-major: a drifting machine load spreads over every variant alike
            for name in args.variants:
                metrics = run(Path(tmp) / f"{name}-{seed}", cost_model, args.steps, args.eval_every, seed, args.nproc,
                              VARIANTS[name])  # fmt: skip
                runs = result["variants"].setdefault(name, {"sets": VARIANTS[name], "runs": {}})["runs"]
                runs[seed] = summarize(metrics)
                print(f"seed {seed} {name:<13} {json.dumps({k: v for k, v in runs[seed].items() if k != 'val_loss'})}",
                      flush=True)  # fmt: skip
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(result, indent=2))
    keys = ("cross_node_share", "cross_node_share_last10", "remote_nodes_per_token", "final_val_loss",
            "load_imbalance_last10")  # fmt: skip
    print(f"{'variant':<14}" + "".join(f"{k:>26}" for k in keys))
    for name, v in result["variants"].items():
        v["summary"] = {k: spread([r[k] for r in v["runs"].values()]) for k in keys}
        stats = [v["summary"][k] for k in keys]
        cells = [f"{s['mean']:.3f} [{s['min']:.3f}-{s['max']:.3f}]" for s in stats]
        print(f"{name:<14}" + "".join(f"{c:>26}" for c in cells))
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
