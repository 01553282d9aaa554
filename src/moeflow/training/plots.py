"""PNG plots of a run folder's metrics.jsonl (matplotlib, Agg backend: no display needed).

    write_plots("runs/default/metrics.jsonl", "runs/default")
    # -> loss.png, expert_load.png, throughput.png

`expert_load.png` is one heatmap per MoE layer, steps on the x axis and experts on the y axis,
colour = share of the layer's assignments that went to the expert (FasterMoE Fig. 4 / Hecate
Fig. 3 show the same picture: a few hot experts, drifting over training).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl; a torn last line (killed writer) is ignored."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _figure(**kwargs):
    import matplotlib

    matplotlib.use("Agg")  # files only; never try to open a window
    import matplotlib.pyplot as plt

    return plt, plt.subplots(**kwargs)


def plot_loss(records: list[dict[str, Any]], path: Path) -> Path:
    plt, (fig, ax) = _figure(figsize=(7, 4))
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if train:
        ax.plot(*zip(*train), label="train (cross-entropy)", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title("Loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def expert_shares(records: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """(steps [S], shares [L, E, S]): each expert's share of its layer's assignments per step."""
    rows = [r for r in records if r.get("expert_counts")]
    steps = np.array([r["step"] for r in rows])
    counts_SLE = np.array([r["expert_counts"] for r in rows], dtype=np.float64)
    totals_SL1 = np.maximum(counts_SLE.sum(-1, keepdims=True), 1)
    return steps, (counts_SLE / totals_SL1).transpose(1, 2, 0)


def plot_expert_load(records: list[dict[str, Any]], path: Path) -> Path | None:
    steps, shares_LES = expert_shares(records)
    if steps.size == 0:
        return None
    L, E, _ = shares_LES.shape
    plt, (fig, axes) = _figure(nrows=L, figsize=(8, 1.2 + 0.35 * E * L), squeeze=False)
    vmax = max(float(shares_LES.max()), 1e-9)
    for layer, ax in enumerate(axes[:, 0]):
        image = ax.imshow(
            shares_LES[layer],
            aspect="auto",
            origin="lower",
            cmap="viridis",
            vmin=0,
            vmax=vmax,
            extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, E - 0.5),
            interpolation="nearest",
        )
        ax.set_ylabel(f"MoE layer {layer}\nexpert")
        ax.set_yticks(range(E))
    axes[-1, 0].set_xlabel("step")
    axes[0, 0].set_title("Expert load (share of each layer's token assignments)")
    fig.colorbar(image, ax=axes[:, 0].tolist(), label="share")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_throughput(records: list[dict[str, Any]], path: Path) -> Path | None:
    points = [(r["step"], r["tokens_per_s"]) for r in records if r.get("tokens_per_s")]
    if not points:
        return None
    plt, (fig, ax) = _figure(figsize=(7, 3.5))
    ax.plot(*zip(*points), lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens / s (all ranks)")
    ax.set_title("Training throughput")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(metrics_path: str | Path, out_dir: str | Path) -> list[Path]:
    """Write the run's PNGs into `out_dir`; returns the files written."""
    out_dir = Path(out_dir)
    records = read_metrics(metrics_path)
    written = [
        plot_loss(records, out_dir / "loss.png"),
        plot_expert_load(records, out_dir / "expert_load.png"),
        plot_throughput(records, out_dir / "throughput.png"),
    ]
    return [p for p in written if p is not None]
