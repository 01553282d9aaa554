"""What one training step reports (`StepResult`) and its `metrics.jsonl` record (docs/training.md).

Shape suffixes: L MoE layers, W ranks, E experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class StepResult:
    """What one optimizer step did (losses are global means over all ranks)."""

    step: int
    loss: float
    aux_loss: float
    lr: float
    grad_norm: float
    skipped: bool
    counts_LE: list[list[int]]
    imbalance_L: list[float]
    dropped: int
    flow_LWE: np.ndarray | None = None
    load_std_L: list[float] | None = None
    """Per layer: standard deviation of the assignments each rank computed (Pro-Prophet Fig. 12)."""
    cross_node_share_L: list[float] | None = None
    """Per layer: global share of assignments dispatched across nodes (0 without a topology)."""
    extra_copies_L: list[int] | None = None
    """Per layer: expert copies materialized beyond their owners (shadowing)."""
    redirected: int = 0
    """Assignments the hierarchical gate moved to a local expert, on this rank."""
    remote_nodes_per_token_L: list[float] | None = None
    """Per layer: other nodes a token's rows go to, mean over this rank's tokens (`MoEStats`)."""


def metric_record(result: StepResult, tokens_per_s: float, val_loss: float | None) -> dict[str, Any]:
    rec = {
        "step": result.step,
        "loss": result.loss,
        "aux_loss": result.aux_loss,
        "total_loss": result.loss + result.aux_loss,
        "lr": result.lr,
        "grad_norm": result.grad_norm,
        "tokens_per_s": tokens_per_s,
        "load_imbalance": float(np.mean(result.imbalance_L)),
        "load_imbalance_per_layer": result.imbalance_L,
        "device_load_std_per_layer": result.load_std_L,
        "expert_counts": result.counts_LE,
        "dropped": result.dropped,
        "cross_node_share": float(np.mean(result.cross_node_share_L or [0.0])),
        "extra_copies_per_layer": result.extra_copies_L,
        "redirected": result.redirected,
        "remote_nodes_per_token": float(np.mean(result.remote_nodes_per_token_L or [0.0])),
    }
    if result.skipped:
        rec["skipped"] = True
    if val_loss is not None:
        rec["val_loss"] = val_loss
    # json has no NaN/Infinity: non-finite values of skipped steps are written as null.
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}
