"""`gate="hierarchical"`: FasterMoE's topology-aware gate (§4.3), and the per-node limit it needs.

Shape suffixes: T tokens on this rank, E experts, K top-k.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moeflow.core.checks import finite_number
from moeflow.core.registry import LayerContext
from moeflow.routing.gates import TopKGate
from moeflow.routing.routing import RoutingLayout, stable_topk


@dataclass(frozen=True)
class HierarchicalOptions:
    """Options of `gate="hierarchical"`."""

    cross_node_ratio: float | None = None
    """L/B: the share of a rank's k·B assignments that may go to another node; None: from the
    topology, per rank (`cross_node_ratios`)."""

    def __post_init__(self) -> None:
        if self.cross_node_ratio is not None:
            finite_number("cross_node_ratio", self.cross_node_ratio, low=0.0)


def cross_node_ratios(topology) -> list[float]:
    """FasterMoE §4.3's `W_net / (M · W_local)` for every device, from its own node (asymmetric
    trees give each node its own M and links; the public code reads node 0 and hard-codes 0.14).

    W_net is the bandwidth of the link that takes the node's traffic out (its uplink); W_local is
    the bottleneck of the routes to the node-mates. With one device per node (M = 1) there is no
    intra-node route: W_local is then the device's own link into its node, which all of its traffic
    crosses, so the tokens it may send across the network take as long on the uplink as its whole
    batch takes on its own link — the paper's rule ("taking the same time as local communication
    does") with the local transfer being the device's own. A single node has no remote expert: inf.
    """
    if topology.num_nodes < 2:
        return [math.inf] * topology.num_devices
    out = []
    for w in range(topology.num_devices):
        uplink = topology.node_uplink_bandwidth(w)
        mates = topology.nodes[topology.node_of[w]]
        if len(mates) > 1:
            w_local = min(topology.path_bandwidth(w, m) for m in mates if m != w)
        else:
            w_local = topology.device_link_bandwidth(w)
        out.append(uplink / (len(mates) * w_local))
    return out


class HierarchicalGate(TopKGate):
    """`gate="hierarchical"`: FasterMoE's topology-aware gate (§4.3).

    Rank w may send at most `L_w = ratio_w · B` of its B tokens across nodes, with
    `ratio_w = W_net / (M · W_local)` of its own node (`cross_node_ratios`). We bound *all* k
    choices (the public code bounds only the first): at most `floor(ratio_w · k · B)` of the
    rank's k·B assignments may target a remote expert; the remote assignments with the highest gate
    scores keep it, the others re-select among the local node's experts (best unused local expert,
    per token), and the combine weights are the softmax over the finally chosen logits.

    A node with fewer than k experts cannot take all of a token's choices: the choices that cannot
    be moved (a token's lowest-scored remote ones beyond the node's free experts) stay remote and
    count against the limit first. This changes routing: judge it by convergence, not by equality
    with `topk`.
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, cross_node_ratio: float | Sequence[float]) -> None:
        super().__init__(d_model, num_experts, top_k, normalize=True)
        ratios = [cross_node_ratio] if isinstance(cross_node_ratio, (int, float)) else list(cross_node_ratio)
        if not ratios or not all(isinstance(r, (int, float)) and r >= 0 for r in ratios):
            raise ValueError(f"cross_node_ratio={cross_node_ratio!r} must be >= 0 (one value, or one per rank)")
        self.cross_node_ratio = ratios

    def _ratio(self, rank: int) -> float:
        return self.cross_node_ratio[rank if len(self.cross_node_ratio) > 1 else 0]

    def _select(self, scores_TE: torch.Tensor, layout: RoutingLayout | None) -> tuple[torch.Tensor, int]:
        expert_TK, _ = super()._select(scores_TE, layout)
        if layout is None or math.isinf(self._ratio(layout.rank)) or expert_TK.numel() == 0:
            return expert_TK, 0
        local_E = layout.local_experts_E().to(scores_TE.device)
        remote_TK = ~local_E[expert_TK]
        limit = math.floor(self._ratio(layout.rank) * expert_TK.numel())
        n_remote = int(remote_TK.sum())
        if n_remote <= limit:
            return expert_TK, 0
        chosen_scores_TK = scores_TE.gather(1, expert_TK)
        # A token can move at most (free local experts) of its remote choices: its best ones keep
        # their expert when the node has too few (`movable`), and they use up the limit first.
        free_T = int(local_E.sum()) - (~remote_TK).sum(1)
        remote_rank_TK = torch.sort(
            torch.sort(torch.where(remote_TK, -chosen_scores_TK, math.inf), dim=1, stable=True).indices, dim=1
        ).indices  # 0 = the token's best remote choice
        stuck_TK = remote_TK & (remote_rank_TK < (remote_TK.sum(1) - free_T)[:, None])
        movable_TK = remote_TK & ~stuck_TK
        budget = max(0, limit - int(stuck_TK.sum()))
        # Keep the `budget` movable remote assignments with the highest scores (ties: earlier first).
        movable_scores = torch.where(movable_TK, chosen_scores_TK, -math.inf).flatten()
        keep = torch.zeros_like(movable_scores, dtype=torch.bool)
        keep[torch.sort(movable_scores, descending=True, stable=True).indices[:budget]] = True
        demoted_TK = movable_TK & ~keep.view_as(movable_TK)
        # Re-select: the j-th demoted choice of a token takes its j-th best local expert not
        # already chosen by a kept choice of that token.
        taken_TE = torch.zeros_like(scores_TE, dtype=torch.bool).scatter(1, expert_TK, ~demoted_TK)
        local_scores_TE = torch.where(local_E[None, :] & ~taken_TE, scores_TE, -math.inf)
        ranked_TE = stable_topk(local_scores_TE, self.top_k)
        slot_TK = torch.cumsum(demoted_TK.long(), dim=1) - 1
        replacement_TK = ranked_TE.gather(1, slot_TK.clamp(min=0))
        return torch.where(demoted_TK, replacement_TK, expert_TK), int(demoted_TK.sum())


def build_hierarchical(ctx: LayerContext, options: HierarchicalOptions) -> HierarchicalGate:
    """`gate="hierarchical"` by name: the per-rank ratios from the cost model's topology."""
    ratio = options.cross_node_ratio
    if ratio is None:
        if ctx.cost_model is None:
            raise ValueError(
                "gate='hierarchical' needs a cost model (its topology sets the cross-node limit) or "
                "gate_options={'cross_node_ratio': ...} (got cost_model=None)"
            )
        ratio = cross_node_ratios(ctx.cost_model.topology)
    return HierarchicalGate(ctx.d_model, ctx.num_experts, ctx.top_k, ratio)
