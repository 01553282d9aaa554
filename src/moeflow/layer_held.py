"""The experts a MoE layer computes in one forward: `HeldExperts`, a base class of
`moeflow.layer.MoELayer`, kept apart from the step sequence because it is where the planners'
copies become weights and leave again.

A rank computes the experts it holds this iteration (`Placement.holders_EW[:, me]`): its own, and
the copies its planner placed on it — FasterMoE §4.1's shadowed experts, Hecate §3's sparse
all-gather along §4.1's topology-aware copy trees, Pro-Prophet's Trans. This class gathers those
weights (`core.sparse_collectives.materialize`; a hook may supply them: the block-wise prefetch of
Pro-Prophet §V through `MoEHook.wrap_copies`), builds the compute the schedule runs on received rows
(`MoEHook.wrap_compute`; over the ESP group when experts are sharded, FSMoE §3; `selective`
activation checkpointing), and after the combine frees the copies and gathers them again for
backward where the planner re-materializes (`core.rematerialize`, Hecate §4.2).

It reads from the layer: `experts`, `hooks`, `group`, `esp_group`, `node_of`, `copy_chunks`, `planner`,
`recompute`, and writes `held_bytes`.

Shape suffixes: D d_model, R rows received by this rank, S source ranks, J experts held (computed) by
this rank this iteration, T tokens on this rank.
"""

from __future__ import annotations

import numpy as np
import torch

from moeflow.core import dispatch
from moeflow.core.expert_sharding import sharded_compute
from moeflow.core.placement import Placement
from moeflow.core.rematerialize import release_held
from moeflow.core.sparse_collectives import materialize


class HeldExperts:
    """The held experts' weights, compute and release of `MoELayer` (module docstring)."""

    def _compute_held(self, placement: Placement, me: int):
        """(`compute(x_RD, counts_SJ)` for the schedule: the experts this rank holds (owned, or
        materialized by the planner's copies) on rows received source-major; their weights, for
        `_release_copies` — passed along, not kept on the module, whose attribute writes cost)."""
        held_J = np.flatnonzero(placement.holders_EW[:, me])
        weights_J = self._held_weights(placement, held_J)

        def compute(x_recv_RD: torch.Tensor, counts_SJ: np.ndarray) -> torch.Tensor:
            if held_J.size == 0:  # a rank that owns none of this layer's experts (Hecate §4.3)
                return torch.zeros_like(x_recv_RD)
            # Rows arrive (source, expert)-major; experts want them (expert, source)-major.
            return dispatch.run_expert_major(
                lambda x_RD, counts_J: self._run_experts(x_RD, counts_J, weights_J), x_recv_RD, counts_SJ
            )

        for hook in reversed(self.hooks):  # the first hook's wrapper outermost
            compute = hook.wrap_compute(self, compute)
        return compute, weights_J

    def _run_experts(self, x_RD: torch.Tensor, counts_J: list[int], weights_J) -> torch.Tensor:
        """The held experts on rows grouped by expert; over the ESP group when sharded (FSMoE §3)."""
        experts = self.experts
        if self.recompute == "selective" and torch.is_grad_enabled():
            experts = self._experts_recomputed
        if self.esp_group is None and not self.hooks and experts is self.experts:
            # Without hooks the outputs go on through moeflow's own exchange and combine only, whose
            # backwards (a gather, a transport, a product) hand back dense gradients.
            return experts(x_RD, counts_J, weights_J, dense_grad=True)
        if self.esp_group is None:
            return experts(x_RD, counts_J, weights_J)
        return sharded_compute(experts, x_RD, counts_J, self.esp_group, weights_J)

    def _experts_recomputed(self, x_RD: torch.Tensor, counts_J: list[int], weights_J) -> torch.Tensor:
        """`selective` activation checkpointing: the experts' FFN keeps only its input rows (and
        the weights it was given) for backward, and runs again there — local GEMMs, no collective."""
        return torch.utils.checkpoint.checkpoint(self.experts, x_RD, counts_J, weights_J, use_reentrant=False)

    def _held_weights(self, placement: Placement, held_J: np.ndarray) -> dict[str, torch.Tensor] | None:
        """Weights of the experts this rank computes, in `held_J` order (None: exactly its own).

        With copies anywhere in the group every rank joins the sparse all-gather, so that all ranks
        build the same autograd graph and meet in the same order in backward. Hooks may supply them
        (`wrap_copies`: the block-wise prefetch's copies already in flight, Pro-Prophet §V).
        """
        if placement.is_owners_only():
            return None
        gather = self._gather
        for hook in reversed(self.hooks):  # the first hook's wrapper outermost
            gather = hook.wrap_copies(self, gather)
        return gather(placement, held_J)

    def _gather(self, placement: Placement, held_J: np.ndarray) -> dict[str, torch.Tensor]:
        """The sparse all-gather of `placement`'s held weights (owned rows and copies, `held_J` order)."""
        weights = self.experts.weights()
        experts = self.experts
        return materialize(weights, placement, self.group, experts.expert_ids, held_J, self.node_of, self.copy_chunks)

    def _release_copies(self, y_TD: torch.Tensor, placement: Placement, me: int, weights) -> torch.Tensor:
        """Re-materialization (`core.rematerialize`, the planner's `rematerialize` option): free the
        copies `weights` this forward computed with, gather them again for backward. Records their
        bytes."""
        if weights is None:  # exactly its own experts: nothing gathered, nothing to free
            if self.held_bytes != (0, 0):  # (a module's attribute write costs more than the check)
                self.held_bytes = (0, 0)
            return y_TD
        rematerialize = self.planner.rematerializes
        held_J = np.flatnonzero(placement.holders_EW[:, me])

        def refill() -> dict[str, torch.Tensor]:  # the same gather again, in backward
            with torch.no_grad():
                return self._gather(placement, held_J)

        y_TD, self.held_bytes = release_held(y_TD, weights, rematerialize, refill)
        return y_TD
