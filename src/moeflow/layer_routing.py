"""The routing side of a MoE layer: `LayerRouting`, a base class of `moeflow.layer.MoELayer`, kept
apart from the step sequence because it is where the `gate` and `balance` axes meet the layer's
process groups and cost model.

It runs the gate with the balance term's selection bias (the aux-free bias of DeepSeek-V3 §2.1.2,
TA-MoE's steering) and what a topology-aware gate may know of the cluster (`RoutingLayout`);
prices `aux_loss` — the weighted balance term, over the global batch's expert choices where the
term asks for them (one all-reduce of E integers), plus the router z-loss; and hands the balance
term the step's expert choices once per optimizer step (`update_balance`), the same on every rank.
A topology-aware term (TA-MoE §4.1-4.2) acts only with its loss on and the cost model describing this
group (`cluster_mismatch` False); otherwise it runs in its topology-free form.

It reads from the layer: `gate`, `balance`, `balance_weight`, `z_loss_weight`, `check_finite`,
`cluster_mismatch`, `placement`, `node_of`, `experts`, `balance_group`, `aux_loss`, and the
choices `LayerStats._record` accumulates (`_choices_WE`, `_forwards`); it keeps the routing layout of the
layer's owners in `_layout`, which the layer clears when it binds new owners.

Shape suffixes: T tokens on this rank, D d_model, E experts, W ranks in the expert-parallel group.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from moeflow.routing.balance import router_z_loss
from moeflow.routing.gates import Routing, RoutingLayout


class LayerRouting:
    """Routing, the auxiliary loss and the balance update of `MoELayer` (module docstring)."""

    def _balance_active(self) -> bool:
        """A topology-aware balance term (TA-MoE: bias and state belong to its loss term and to the
        cluster) acts only with its loss on and the cluster known."""
        return not self.balance.topology_aware or (self.balance_weight > 0 and not self.cluster_mismatch)

    def _route(self, x_TD: torch.Tensor, me: int, sequence_length: int | None) -> Routing:
        """Gate (with the balance term's selection bias): the routing of this rank's tokens."""
        rank = None if self.cluster_mismatch else me  # None: topology-aware terms without a topology
        bias_E = self.balance.selection_bias(rank) if self._balance_active() else None
        routing = self.gate(x_TD, bias_E, self._routing_layout(me))
        routing.sequence_length = sequence_length
        if self.check_finite and not torch.isfinite(routing.logits_TE).all():
            raise ValueError("MoELayer routing scores contain NaN or Inf (check_finite=True)")
        return routing

    def _routing_layout(self, me: int) -> RoutingLayout | None:
        """What a topology-aware gate may know; None where the cost model describes another group.
        Built once per binding of the owners (`MoELayer._bind` clears it): the owners, the nodes and
        the group change only there, and a forward would otherwise build the same one again."""
        if self.cluster_mismatch:
            return None
        layout = self._layout
        if layout is None or layout.rank != me:
            world = self.placement.world_size
            node_of = tuple(self.node_of) if self.node_of is not None else (0,) * world
            layout = self._layout = RoutingLayout(me, torch.from_numpy(self.placement.owner_E), node_of)
        return layout

    def _balance_counts(self, choices_WE: np.ndarray) -> torch.Tensor | None:
        """A global-batch balance term's expert choices: summed over the EP group (the count exchange
        has them), then over `balance_group` (one all-reduce of E integers); None for other terms."""
        if not self.balance_weight or not self.balance.global_counts:
            return None
        counts_E = torch.from_numpy(choices_WE.sum(0)).to(self.experts.w2.device)  # nccl reduces CUDA tensors
        if self.balance_group is not None:
            dist.all_reduce(counts_E, group=self.balance_group)
        return counts_E

    def _aux(self, routing: Routing, me: int, counts_E: torch.Tensor | None) -> torch.Tensor:
        """`aux_loss`: the weighted balance term (over the global batch's choices `counts_E` where it
        asks for them: `_balance_counts`) and z-loss."""
        rank = None if self.cluster_mismatch else me
        if not self.balance_weight:
            aux = routing.logits_TE.sum() * 0.0
        else:
            aux = self.balance_weight * self.balance.loss(routing, rank, counts_E)
        if self.z_loss_weight:
            aux = aux + self.z_loss_weight * router_z_loss(routing.logits_TE)
        return aux

    @torch.no_grad()
    def update_balance(self, group: dist.ProcessGroup | None = None) -> None:
        """Hand the balance term the expert choices of the training forwards since the last call —
        the mean per forward (per micro-step under gradient accumulation), summed over the ranks
        holding the same experts (`group`, default `balance_group`: data-parallel replicas × ESP
        members) and divided by them — so that its state (aux-free bias, TA-MoE steering) moves once
        per step and identically on every rank. `all_reduce_gradients` calls it; call it yourself
        once per step if you do not use that."""
        if self._choices_WE is None:
            return
        group = self.balance_group if group is None else group
        choices_WE = self._choices_WE / self._forwards
        self._choices_WE, self._forwards = None, 0
        if group is not None and dist.get_world_size(group) > 1:
            choices_WE = choices_WE.to(self.aux_loss.device)  # nccl reduces CUDA tensors
            dist.all_reduce(choices_WE, group=group)
            choices_WE = choices_WE / dist.get_world_size(group)
        if self._balance_active():
            self.balance.observe(choices_WE)
