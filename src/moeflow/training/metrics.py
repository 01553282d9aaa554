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
    rank_loads_LW: list[list[int]] | None = None
    """Per layer: assignments each rank computed, after the strategy's placement (copies included)."""
    owner_loads_LW: list[list[int]] | None = None
    """Per layer: assignments each rank would have computed with every expert on its owner only (the
    load before placement: what plain EP computes)."""
    strategy_L: list[str] | None = None
    """Per layer: the planner whose placement ran (for `auto`: the one it chose this step)."""
    schedule_L: list[str] | None = None
    """Per layer: the schedule that ran (for `schedule="auto"`: the one it chose this step)."""


def placement_fields(stats: list[Any]) -> dict[str, Any]:
    """`StepResult` fields of what the strategy did, from each MoE layer's `MoEStats`: per-rank loads
    after placement and with owners only, and the planner and schedule that ran."""
    owners = []
    for s in stats:
        load_E = s.flow.sum(0).numpy()
        owners.append(np.bincount(s.placement.owner_E, weights=load_E, minlength=len(s.device_loads)).astype(int))
    return {
        "rank_loads_LW": [s.device_loads.tolist() for s in stats],
        "owner_loads_LW": [o.tolist() for o in owners],
        "strategy_L": [s.strategy for s in stats],
        "schedule_L": [s.schedule for s in stats],
    }


def max_over_mean(loads: Any) -> float:
    """max / mean of non-negative loads (1.0 = even; 1.0 when there is no load)."""
    loads = np.asarray(loads, dtype=np.float64)
    mean = loads.mean() if loads.size else 0.0
    return float(loads.max() / mean) if mean > 0 else 1.0


def metric_record(result: StepResult, tokens_per_s: float, val_loss: float | None) -> dict[str, Any]:
    rec = {
        "step": result.step,
        "loss": result.loss,
        "aux_loss": result.aux_loss,
        "total_loss": result.loss + result.aux_loss,
        "lr": result.lr,
        "grad_norm": result.grad_norm,
        "tokens_per_s": tokens_per_s,
        "load_imbalance": float(np.mean(result.imbalance_L)),  # the routing's: max/mean tokens per expert
        "load_imbalance_per_layer": result.imbalance_L,
        "device_load_std_per_layer": result.load_std_L,
        "expert_counts": result.counts_LE,
        "dropped": result.dropped,
        "cross_node_share": float(np.mean(result.cross_node_share_L or [0.0])),
        "extra_copies_per_layer": result.extra_copies_L,
        "redirected": result.redirected,
        "remote_nodes_per_token": float(np.mean(result.remote_nodes_per_token_L or [0.0])),
    }
    if result.rank_loads_LW is not None:
        after_L = [max_over_mean(w) for w in result.rank_loads_LW]
        before_L = [max_over_mean(w) for w in result.owner_loads_LW or result.rank_loads_LW]
        rec.update(
            rank_load_imbalance=float(np.mean(after_L)),
            rank_load_imbalance_owners=float(np.mean(before_L)),
            rank_load_imbalance_per_layer=after_L,
            rank_loads=result.rank_loads_LW,
            copies=int(sum(result.extra_copies_L or [])),
            strategy_per_layer=result.strategy_L,
            schedule_per_layer=result.schedule_L,
        )
    if result.skipped:
        rec["skipped"] = True
    if val_loss is not None:
        rec["val_loss"] = val_loss
    # json has no NaN/Infinity: non-finite values of skipped steps are written as null.
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}
