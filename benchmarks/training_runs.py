"""Shared by the multi-seed training benchmarks (ta_moe_training.py, gate_zoo.py): run one
`moeflow train`, summarize its metrics, aggregate seeds (mean ± std, and paired differences to a
baseline variant: same seed = same initialisation and data order; runs are deterministic).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def train(out: Path, sets: list[str], nproc: int, steps: int, cost_model: Path | None, reuse: bool) -> Path:
    """`moeflow train --config configs/tiny.toml` with `--set` overrides into `out`; returns its
    metrics.jsonl (kept as is with `reuse` when the run is already complete)."""
    metrics = out / "metrics.jsonl"
    if reuse and metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
        return metrics
    argv = [str(Path(sys.executable).parent / "moeflow"), "train", "--config", "configs/tiny.toml"]
    argv += ["--nproc", str(nproc), "--steps", str(steps), "--out", str(out)]
    if cost_model is not None:
        argv += ["--cost-model", str(cost_model)]
    for s in sets:
        argv += ["--set", s]
    print(f"[{out.name}] {' '.join(argv[1:])}", flush=True)
    done = subprocess.run(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"{out.name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return metrics


def summarize(metrics: list[dict]) -> dict:
    """One run: final loss (10-step mean), val loss at every eval, last-20-step means."""
    loss = np.array([m["loss"] for m in metrics])
    share = np.array([m["cross_node_share"] for m in metrics])
    imbalance = np.array([m["load_imbalance"] for m in metrics])
    grad_norm = np.array([m["grad_norm"] for m in metrics])
    val = {str(m["step"]): m["val_loss"] for m in metrics if m.get("val_loss") is not None}
    return {
        "final_loss": float(loss[-10:].mean()),
        "val_loss": val,
        "cross_node_share": float(share[-20:].mean()),
        "load_imbalance": float(imbalance[-20:].mean()),
        "grad_norm": float(np.nanmean(grad_norm)),
        "tokens_per_s": float(np.median([m["tokens_per_s"] for m in metrics[5:]] or [np.nan])),
        "aux_loss_final": float(metrics[-1]["aux_loss"]),
        "loss_curve": loss.round(4).tolist(),
        "cross_node_share_curve": share.round(4).tolist(),
    }


def mean_std(values: list[float]) -> dict:
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if a.size > 1 else 0.0, "n": int(a.size)}


def aggregate(runs: dict[str, dict], base: dict[str, dict] | None, val_steps: list[str], base_name: str) -> dict:
    """Mean ± std over seeds; `vs_<base_name>`: the same for the per-seed difference to the base."""
    keys = ["final_loss", "cross_node_share", "load_imbalance", "grad_norm", "tokens_per_s"]
    columns = {k: [r[k] for r in runs.values()] for k in keys}
    for s in val_steps:
        columns[f"val_loss@{s}"] = [r["val_loss"][s] for r in runs.values()]
    out = {k: mean_std(v) for k, v in columns.items()}
    if base is not None:
        shared = [seed for seed in runs if seed in base]
        diffs = {"final_loss": [runs[s]["final_loss"] - base[s]["final_loss"] for s in shared]}
        for step in val_steps:
            diffs[f"val_loss@{step}"] = [runs[s]["val_loss"][step] - base[s]["val_loss"][step] for s in shared]
        out[f"vs_{base_name}"] = {k: mean_std(v) for k, v in diffs.items()}
    return out


def cell(stats: dict, key: str, digits: int = 3) -> str:
    """`mean ± std` of one aggregated column."""
    return f"{stats[key]['mean']:.{digits}f} ± {stats[key]['std']:.{digits}f}"


def print_table(variants: dict[str, dict], val_steps: list[str], base_name: str) -> None:
    """One row per variant (`{name: {"summary": aggregate(...)}}`): mean ± std over seeds, and the
    paired differences to the base variant."""
    a, b = val_steps
    w = max(len(name) for name in variants) + 2
    print(
        f"\n{'variant':<{w}}{'final loss':>16}{'val@' + a:>16}{'val@' + b:>16}{'Δfinal vs ' + base_name:>20}"
        f"{'Δval@' + b + ' vs ' + base_name:>20}{'cross-node':>16}{'imbalance':>14}{'tok/s':>9}"
    )
    for name, v in variants.items():
        s = v["summary"]
        delta = s.get(f"vs_{base_name}")
        d_final = cell(delta, "final_loss") if delta else "-"
        d_val = cell(delta, f"val_loss@{b}") if delta else "-"
        print(
            f"{name:<{w}}{cell(s, 'final_loss'):>16}{cell(s, f'val_loss@{a}'):>16}{cell(s, f'val_loss@{b}'):>16}"
            f"{d_final:>20}{d_val:>20}{cell(s, 'cross_node_share'):>16}{cell(s, 'load_imbalance', 2):>14}"
            f"{s['tokens_per_s']['mean']:>9.0f}"
        )
