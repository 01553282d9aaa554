"""PNG plots of a run folder's metrics.jsonl (matplotlib, Agg backend: no display needed).

    write_plots("runs/default/metrics.jsonl", "runs/default")
    # -> loss.png, expert_load.png, rank_load.png, throughput.png

`expert_load.png` is one heatmap per MoE layer, steps on the x axis and experts on the y axis,
colour = share of the layer's assignments that went to the expert (FasterMoE Fig. 4 / Hecate
Fig. 3 show the same picture: a few hot experts, drifting over training). `rank_load.png` is its
companion: the load of each rank after the strategy's placement (what copies did to it).
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
    plt, (fig, axes) = _figure(nrows=L, figsize=(8, 1.2 + 0.35 * E * L + 0.5 * L), squeeze=False, sharex=True)
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
    axes[-1, 0].xaxis.get_major_locator().set_params(integer=True)
    axes[0, 0].set_title("Expert load (share of each layer's token assignments)")
    fig.colorbar(image, ax=axes[:, 0].tolist(), label="share")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_rank_load(records: list[dict[str, Any]], path: Path) -> Path | None:
    """Companion of `expert_load.png`: what the strategy did to the ranks. Top: the per-rank load
    imbalance (max/mean tokens computed per rank, mean over layers) with every expert on its owner
    only and after the placement that ran, and the expert copies made; below, one heatmap per MoE
    layer of each rank's share of the tokens it computed after placement."""
    rows = [r for r in records if r.get("rank_loads")]
    if not rows:
        return None
    # A run resumed on another process count: the heatmaps show the steps of the last layout.
    shape = np.shape(rows[-1]["rank_loads"])
    rows = [r for r in rows if np.shape(r["rank_loads"]) == shape]
    steps = np.array([r["step"] for r in rows])
    loads_SLW = np.array([r["rank_loads"] for r in rows], dtype=np.float64)
    shares_LWS = (loads_SLW / np.maximum(loads_SLW.sum(-1, keepdims=True), 1)).transpose(1, 2, 0)
    L, W, _ = shares_LWS.shape
    plt, (fig, axes) = _figure(
        nrows=L + 1, figsize=(8, 2.6 + 0.3 * W * L + 0.6 * L), squeeze=False, sharex=True, layout="constrained"
    )
    top = axes[0, 0]
    top.plot(steps, [r["rank_load_imbalance_owners"] for r in rows], color="tab:red", lw=1.2, label="owners only (EP)")
    top.plot(steps, [r["rank_load_imbalance"] for r in rows], color="tab:blue", lw=1.2, label="after placement")
    top.set_ylabel("max / mean\ntokens per rank")
    top.grid(alpha=0.3)
    copies = top.twinx()
    copies.bar(steps, [r.get("copies") or 0 for r in rows], color="tab:gray", alpha=0.3, width=1.0, label="copies")
    copies.set_ylabel("expert copies")
    copies.set_zorder(top.get_zorder() - 1)
    top.patch.set_visible(False)
    handles = top.get_legend_handles_labels()[0] + copies.get_legend_handles_labels()[0]
    top.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=3, fontsize=8, frameon=False)
    fig.suptitle("Per-rank load: owners only (plain EP) vs after the strategy's placement")
    # Diverging around the even share 1/W: white = balanced, red = a rank over its share, blue = under.
    spread = max(float(np.abs(shares_LWS - 1.0 / W).max()), 0.02)
    for layer in range(L):
        ax = axes[layer + 1, 0]
        image = ax.imshow(
            shares_LWS[layer],
            aspect="auto",
            origin="lower",
            cmap="coolwarm",
            vmin=1.0 / W - spread,
            vmax=1.0 / W + spread,
            extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, W - 0.5),
            interpolation="nearest",
        )
        ax.set_ylabel(f"MoE layer {layer}\nrank")
        ax.set_yticks(range(W))
    axes[-1, 0].set_xlabel("step")
    axes[-1, 0].xaxis.get_major_locator().set_params(integer=True)
    fig.colorbar(image, ax=axes[1:, 0].tolist(), label=f"share of the layer's tokens computed (even: 1/{W})")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_throughput(records: list[dict[str, Any]], path: Path) -> Path | None:
    points = [(r["step"], r["tokens_per_s"]) for r in records if r.get("tokens_per_s")]
    if not points:
        return None
    plt, (fig, ax) = _figure(figsize=(7, 3.5))
    steps, rates = (np.array(v, dtype=np.float64) for v in zip(*points))
    window = 10
    if len(rates) > 2 * window:  # a shared machine's noise: the raw line faint, a running median on top
        ax.plot(steps, rates, lw=0.8, color="tab:blue", alpha=0.35, label="each logged step")
        median = [np.median(rates[max(0, i - window + 1) : i + 1]) for i in range(len(rates))]
        ax.plot(steps, median, lw=1.6, color="tab:blue", label=f"median of the last {window}")
        ax.legend(fontsize=8, loc="lower right")
    else:
        ax.plot(steps, rates, lw=1, color="tab:blue")
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
        plot_rank_load(records, out_dir / "rank_load.png"),
        plot_throughput(records, out_dir / "throughput.png"),
    ]
    return [p for p in written if p is not None]
