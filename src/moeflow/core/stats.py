"""`MoEStats`: what the last forward of a `MoELayer` did, derived from the count exchange (no extra
collective).

Shape suffixes: W ranks of the expert-parallel group, E experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moeflow.core.placement import Placement, cross_node_share


@dataclass
class MoEStats:
    """What the last forward did."""

    flow: torch.Tensor
    """int64 `[W, E]`, global: assignments rank w sent to expert e (after capacity drops)."""
    choices: torch.Tensor
    """int64 `[W, E]`, global: expert choices of rank w before capacity drops (= `flow` when dropless)."""
    device_loads: torch.Tensor
    """int64 `[W]`: assignments each rank computed."""
    dropped: int
    """Assignments dropped by capacity on this rank."""
    bytes_sent: torch.Tensor
    """int64 `[W]`: bytes of this rank's rows destined to each peer in the dispatch exchange, in the
    wire dtype (0 to itself: local rows never touch the network; the combine sends the same amount
    back). A hierarchical exchange carries them in two stages; this counts each row once."""
    placement: Placement
    """Where every expert was materialized."""
    redirected: int = 0
    """Assignments a topology-aware gate redirected from a remote to a local expert (this rank)."""
    cross_node_share: float = 0.0
    """Global share of the dispatched rows that travel to a rank on another node, by the dispatch
    plan (rows served by a local copy do not cross); 0 without a node layout."""
    remote_nodes_per_token: float = 0.0
    """Mean over this rank's tokens of the other nodes its rows go to: what a dispatch that sends a
    token once to each node holding its experts (DeepSeek-V3 §3.2.2: across nodes once, then inside
    the node) moves across nodes, per token; node-limited routing bounds it by M. 0 without a node
    layout or for slot rows."""
    strategy: str = "ep"
    """The planner whose placement ran (for `strategy="auto"`: the one it chose this step)."""
    schedule: str = "sync"
    """The schedule that ran (for `schedule="auto"`: the one it chose this step)."""
    materialized_bytes: int = 0
    """Bytes of the held-weight tensors this rank computed with when a planner materialized copies
    (owned rows and copies, `[J, ...]` per parameter), counted from the tensors when built."""
    held_bytes: int = 0
    """Of `materialized_bytes`, what is still allocated after the forward: 0 with re-materialization,
    which frees them until this layer's backward (`core.rematerialize`)."""

    @classmethod
    def of_forward(
        cls,
        flow_WE: np.ndarray,
        choices_WE: np.ndarray,
        plan_SEW: np.ndarray,
        send_splits: Sequence[int],
        me: int,
        row_bytes: int,
        node_of: Sequence[int] | None,
        remote_nodes_per_token: float | torch.Tensor = 0.0,
        **named,
    ) -> MoEStats:
        """The stats of a forward from its global flow, choices and dispatch plan `[S, E, W]`, this
        rank's send splits (rows per destination) and the bytes of a row on the wire;
        `remote_nodes_per_token` as the layer counted it (a device tensor, read here); `named`: the
        remaining fields as they are."""
        rows_W = np.array(send_splits, dtype=np.int64)  # numpy: a few small ops, each cheaper than torch's
        rows_W[me] = 0
        return cls(
            flow=torch.from_numpy(flow_WE),
            choices=torch.from_numpy(choices_WE),
            device_loads=torch.from_numpy(plan_SEW.sum((0, 1))),
            bytes_sent=torch.from_numpy(rows_W * row_bytes),
            cross_node_share=0.0 if node_of is None else cross_node_share(plan_SEW.sum(1), node_of),
            remote_nodes_per_token=float(remote_nodes_per_token),
            **named,
        )

    @property
    def expert_counts(self) -> torch.Tensor:
        """int64 `[E]`, global: assignments each expert received from all ranks."""
        return self.flow.sum(0)

    @property
    def load_std(self) -> float:
        """Standard deviation of the assignments each rank computed (`device_loads`): Pro-Prophet
        Fig. 12's balance metric, which unlike `load_imbalance` sees what copies did to the loads."""
        return float(self.device_loads.double().std(unbiased=False))

    @property
    def load_imbalance(self) -> float:
        """max / mean expert load (1.0 = perfectly balanced)."""
        counts = self.expert_counts.double()
        mean = counts.mean().item()
        return counts.max().item() / mean if mean > 0 else 1.0
