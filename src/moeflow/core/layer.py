"""`MoELayer`: the step sequence and its hook points; no algorithm lives here.

Forward (DESIGN.md §2): gate → capacity → count exchange → plan → order → dispatch (all-to-all)
→ experts → combine (all-to-all) → un-order (weighted sum). Backward mirrors it through autograd.
FSMoE §3.1's six hooks sit at the named points. With `group=None` the dispatcher is local (W = 1)
and every step runs unchanged — gates and planners never branch on "is distributed".

Shape suffixes: T tokens on this rank, D d_model, E experts, A assignments (kept, this rank),
R rows received by this rank, W ranks in the expert-parallel group, H experts held by this rank.

    layer = MoELayer(d_model=512, d_hidden=1024, num_experts=8, top_k=2)
    y = layer(x); loss = task_loss(y) + layer.aux_loss
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from moeflow.core import dispatch
from moeflow.core.experts import GroupedExperts
from moeflow.core.hooks import HOOK_POINTS, MoEHook, run_hooks
from moeflow.core.placement import Placement, dispatch_counts
from moeflow.core.sparse_collectives import materialize
from moeflow.routing.balance import BalanceContext, build_balance, router_z_loss
from moeflow.routing.gates import GateContext, Routing, RoutingLayout, build_gate
from moeflow.strategies.planners import PlannerContext, get_planner
from moeflow.strategies.schedules.pairwise import default_group_size, pairwise_block

SCHEDULES = ("sync", "pairwise")


@dataclass
class MoEStats:
    """What the last forward did; derived from the count exchange, no extra collective."""

    flow: torch.Tensor
    """int64 `[W, E]`, global: assignments rank w sent to expert e (after capacity drops)."""
    device_loads: torch.Tensor
    """int64 `[W]`: assignments each rank computed."""
    dropped: int
    """Assignments dropped by capacity on this rank."""
    bytes_sent: torch.Tensor
    """int64 `[W]`: bytes this rank sent to each peer in the dispatch all-to-all (0 to itself:
    local rows never touch the network; the combine sends the same amount back)."""
    placement: Placement
    """Where every expert was materialized."""
    redirected: int = 0
    """Assignments a topology-aware gate redirected from a remote to a local expert (this rank)."""
    cross_node_share: float = 0.0
    """Global share of assignments dispatched to a rank on another node (0 without a node layout)."""

    @property
    def expert_counts(self) -> torch.Tensor:
        """int64 `[E]`, global: assignments each expert received from all ranks."""
        return self.flow.sum(0)

    @property
    def load_imbalance(self) -> float:
        """max / mean expert load (1.0 = perfectly balanced)."""
        counts = self.expert_counts.double()
        mean = counts.mean().item()
        return counts.max().item() / mean if mean > 0 else 1.0


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an int")
    if value <= 0:
        raise ValueError(f"{name}={value} must be positive")
    return value


class MoELayer(nn.Module):
    """A Mixture-of-Experts FFN layer (contract: DESIGN.md §3.1).

    Args:
        d_model, d_hidden: model and expert hidden sizes.
        num_experts, top_k: experts in the layer and experts chosen per token (1 <= k <= E).
        gate: `topk`, `switch`, `noisy_topk`, `hierarchical` (FasterMoE's topology-aware gate; needs
            `cost_model`), or a gate module returning `Routing`.
        expert: `ffn` (GELU, with biases) or `swiglu` (no biases).
        capacity_factor: None = dropless; c > 0 keeps at most ceil(c·k·T/E) assignments per expert
            and rank, first choices before second, then earlier tokens.
        group: expert-parallel process group (None: single process); see `to_expert_parallel`.
        strategy: planner name (`ep`) or a callable `(flow_WE, placement, cost_model) -> Placement`.
        schedule: `sync` (one all-to-all each way) or `pairwise` (FasterMoE's smart schedule:
            grouped pairwise exchange steps overlapping communication with expert computation).
        balance: `gshard`, `aux_free`, `none`, or a balance module; `balance_weight` scales it.
        z_loss_weight: weight of the router z-loss (0 = off).
        hooks: objects implementing any of FSMoE's six hook points (`moeflow.core.hooks`).
        check_finite: raise on NaN/Inf in the input or the routing scores.
        node_of: node index of every EP rank (dispatch prefers holders on the same node; copies of
            experts held everywhere travel a two-level tree across nodes); defaults to the cost
            model's topology.
        cost_model: `moeflow.perf.costmodel.CostModel` for planners and topology-aware objectives.
        group_size: ranks per group of the pairwise schedule (None: the ranks of a node, else 1).
    """

    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        num_experts: int,
        top_k: int = 2,
        gate: str | nn.Module = "topk",
        expert: str = "ffn",
        capacity_factor: float | None = None,
        group: dist.ProcessGroup | None = None,
        strategy="ep",
        schedule: str = "sync",
        balance: str | nn.Module = "gshard",
        balance_weight: float = 0.01,
        z_loss_weight: float = 0.0,
        hooks: Sequence[MoEHook] | None = None,
        check_finite: bool = False,
        node_of: Sequence[int] | None = None,
        cost_model=None,
        group_size: int | None = None,
    ) -> None:
        super().__init__()
        self.d_model = _positive_int("d_model", d_model)
        self.d_hidden = _positive_int("d_hidden", d_hidden)
        self.num_experts = _positive_int("num_experts", num_experts)
        self.top_k = _positive_int("top_k", top_k)
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        if capacity_factor is not None and not (
            isinstance(capacity_factor, (int, float)) and math.isfinite(capacity_factor) and capacity_factor > 0
        ):
            raise ValueError(f"capacity_factor={capacity_factor!r} must be None (dropless) or > 0")
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule={schedule!r}; valid: {list(SCHEDULES)}")
        for name, value in (("balance_weight", balance_weight), ("z_loss_weight", z_loss_weight)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}={value} must be a finite number >= 0")
        self.capacity_factor = capacity_factor
        self.schedule = schedule
        if group_size is not None and (not isinstance(group_size, int) or group_size < 1):
            raise ValueError(f"group_size={group_size!r} must be a positive int or None (from the topology)")
        self.group_size = group_size
        self._calls = 0  # forward calls: part of the pairwise schedule's message tags
        self.balance_weight, self.z_loss_weight = float(balance_weight), float(z_loss_weight)
        self.check_finite = check_finite
        self.planner = get_planner(strategy, PlannerContext(num_experts, d_model, d_hidden, expert))
        self.strategy = strategy if isinstance(strategy, str) else type(strategy).__name__
        if getattr(self.planner, "needs_cost_model", False) and cost_model is None:
            raise ValueError(f"strategy={self.strategy!r} needs cost_model= (a moeflow.perf.costmodel.CostModel)")
        self.gate = build_gate(gate, GateContext(d_model, num_experts, top_k, cost_model))
        self.cost_model = cost_model
        self.balance = build_balance(balance, BalanceContext(num_experts, top_k, d_model, cost_model))
        self.experts = GroupedExperts(num_experts, d_model, d_hidden, kind=expert)
        self.hooks = list(hooks or [])
        for hook in self.hooks:
            if not any(hasattr(hook, point) for point in HOOK_POINTS):
                raise TypeError(f"hooks entry {hook!r} implements none of {list(HOOK_POINTS)}")
        if node_of is None and cost_model is not None:
            node_of = cost_model.topology.node_of
        self.node_of = None if node_of is None else list(node_of)
        self.group: dist.ProcessGroup | None = None
        self.placement = Placement.expert_parallel(num_experts, 1)
        self.aux_loss = torch.zeros(())
        self.stats: MoEStats | None = None
        if group is not None:
            self.to_expert_parallel(group)

    # ---- parallelism -------------------------------------------------------------------------
    def to_expert_parallel(self, group: dist.ProcessGroup | None) -> MoELayer:
        """Keep only this rank's experts `[r·E_local, (r+1)·E_local)` of the group; returns self.

        Build the layer with the same seed on every rank first: the kept slices then form exactly
        the single-process layer's experts.
        """
        world = dispatch.group_size(group)
        if self.num_experts % world:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by the EP size {world}")
        if self.experts.num_local != self.num_experts:
            raise ValueError("to_expert_parallel: this layer is already sharded")
        local = self.num_experts // world
        self.experts.shard_(dispatch.group_rank(group) * local, local)
        self.group = group
        self.placement = Placement.expert_parallel(self.num_experts, world)
        if self.node_of is not None and len(self.node_of) != world:
            raise ValueError(f"node_of has {len(self.node_of)} entries, expected the EP size {world}")
        return self

    # ---- forward -----------------------------------------------------------------------------
    def _validate_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"MoELayer input must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"MoELayer input dtype={x.dtype} must be floating point")
        if x.dim() == 0 or x.shape[-1] != self.d_model:
            raise ValueError(f"MoELayer input shape {tuple(x.shape)}: last dim must be d_model={self.d_model}")
        if self.check_finite and not torch.isfinite(x).all():
            raise ValueError("MoELayer input contains NaN or Inf (check_finite=True)")

    def _capacity_keep(self, routing: Routing) -> torch.Tensor | None:
        """Mask of kept assignments: at most C = ceil(c·k·T/E) per expert on this rank, in
        assignment order (choice-major: first choices before second, then earlier tokens)."""
        if self.capacity_factor is None:
            return None
        capacity = math.ceil(self.capacity_factor * self.top_k * routing.num_tokens / self.num_experts)
        return dispatch.position_in_expert(routing.expert_A, self.num_experts) < capacity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._validate_input(x)
        x_TD = run_hooks(self.hooks, "before_moe_start", self, x.reshape(-1, self.d_model))
        me, world = dispatch.group_rank(self.group), self.placement.world_size
        if self.cost_model is not None and self.cost_model.topology.num_devices != world:
            raise ValueError(
                f"cost_model describes {self.cost_model.topology.num_devices} devices but the expert-parallel "
                f"group has {world} (rank r of the group is device r of the topology)"
            )

        routing = self.gate(x_TD, self.balance.selection_bias(me), self._routing_layout(me))
        if self.check_finite and not torch.isfinite(routing.logits_TE).all():
            raise ValueError("MoELayer routing scores contain NaN or Inf (check_finite=True)")
        aux = self.balance_weight * self.balance.loss(routing, me)
        if self.z_loss_weight:
            aux = aux + self.z_loss_weight * router_z_loss(routing.logits_TE)
        self.aux_loss = aux

        token_A, expert_A, weight_A = routing.token_A, routing.expert_A, routing.weight_A
        keep_A = self._capacity_keep(routing)
        dropped = 0
        if keep_A is not None:
            dropped = int((~keep_A).sum())
            token_A, expert_A, weight_A = token_A[keep_A], expert_A[keep_A], weight_A[keep_A]

        # Count exchange → global flow → plan (every rank computes the same plan).
        flow_WE = dispatch.exchange_counts(torch.bincount(expert_A, minlength=self.num_experts), self.group)
        placement = self.planner(flow_WE, self.placement, self.cost_model)
        plan_SED = dispatch_counts(flow_WE, placement, self.node_of)

        # Order: sort assignments by (destination, expert); the dispatch plan picks the holder.
        dest_A = dispatch.assignment_destinations(expert_A, plan_SED[me])
        order_A = torch.sort(dest_A * self.num_experts + expert_A, stable=True).indices
        send_splits = plan_SED[me].sum(0).tolist()
        recv_splits = plan_SED[:, :, me].sum(1).tolist()
        token_sorted_A = token_A[order_A]
        x_sent_AD = x_TD.index_select(0, token_sorted_A)
        held_H = np.flatnonzero(placement.holders_EW[:, me])
        counts_SH = plan_SED[:, held_H, me]
        weights_H = self._held_weights(placement, held_H)

        def compute(x_recv_RD: torch.Tensor, counts_SH: np.ndarray) -> torch.Tensor:
            # Rows arrive (source, expert)-major; experts want them (expert, source)-major.
            perm = dispatch.source_major_to_expert_major(counts_SH)
            if perm is None:  # one source: already grouped by expert
                return self.experts(x_recv_RD, counts_SH.sum(0).tolist(), weights_H)
            perm_R = torch.as_tensor(perm, device=x.device)
            inverse_R = dispatch.inverse_permutation(perm_R)
            x_grouped = dispatch.permute_rows(x_recv_RD, perm_R, inverse_R)
            y_grouped = self.experts(x_grouped, counts_SH.sum(0).tolist(), weights_H)
            return dispatch.permute_rows(y_grouped, inverse_R, perm_R)

        if self.schedule == "pairwise" and self.group is not None:
            self._calls += 1
            group_size = self.group_size or default_group_size(len(send_splits), self.node_of)
            y_back_AD = pairwise_block(
                x_sent_AD,
                send_splits,
                counts_SH,
                compute,
                self.group,
                group_size,
                self._calls,
                hooks=lambda point, t: run_hooks(self.hooks, point, self, t),
            )
        else:
            y_back_AD = self._sync_block(x_sent_AD, send_splits, recv_splits, counts_SH, compute)

        # Un-order: weighted sum of each token's expert outputs; dropped assignments add zero. It
        # accumulates in the input's dtype (fp32 under autocast; a bf16 model sums k bf16 terms, as
        # Hugging Face's and MegaBlocks' combines do).
        weighted_AD = y_back_AD.to(x.dtype) * weight_A[order_A, None].to(x.dtype)
        y_TD = torch.zeros(x_TD.shape, dtype=x.dtype, device=x.device).index_add(0, token_sorted_A, weighted_AD)
        y_TD = run_hooks(self.hooks, "before_moe_end", self, y_TD)

        element_bytes = x_sent_AD.element_size() * self.d_model
        self.stats = MoEStats(
            flow=torch.from_numpy(flow_WE),
            device_loads=torch.from_numpy(plan_SED.sum((0, 1))),
            dropped=dropped,
            bytes_sent=torch.tensor(send_splits, dtype=torch.int64).index_fill(0, torch.tensor(me), 0) * element_bytes,
            placement=placement,
            redirected=routing.redirected,
            cross_node_share=self._cross_node_share(plan_SED),
        )
        if self.training:
            self.balance.observe(self.stats.flow)
        return y_TD.reshape(x.shape)

    def _sync_block(self, x_sent_AD, send_splits, recv_splits, counts_SH, compute) -> torch.Tensor:
        """schedule="sync": one all-to-all out, the experts, one all-to-all back."""
        x_sent_AD = run_hooks(self.hooks, "before_dispatch", self, x_sent_AD)
        x_recv_RD = dispatch.all_to_all_v(x_sent_AD, send_splits, recv_splits, self.group)
        x_recv_RD = run_hooks(self.hooks, "after_dispatch", self, x_recv_RD)
        y_recv_RD = run_hooks(self.hooks, "before_combine", self, compute(x_recv_RD, counts_SH))
        y_back_AD = dispatch.all_to_all_v(y_recv_RD, recv_splits, send_splits, self.group)
        return run_hooks(self.hooks, "after_combine", self, y_back_AD)

    def _cross_node_share(self, plan_SED: np.ndarray) -> float:
        if self.node_of is None:
            return 0.0
        node_W = np.asarray(self.node_of)
        total = plan_SED.sum()
        crossing = plan_SED.sum(1)[node_W[:, None] != node_W[None, :]].sum()
        return float(crossing / total) if total else 0.0

    def _routing_layout(self, me: int) -> RoutingLayout:
        world = self.placement.world_size
        node_of = tuple(self.node_of) if self.node_of is not None else (0,) * world
        return RoutingLayout(me, torch.from_numpy(self.placement.owner_E), node_of)

    def _held_weights(self, placement: Placement, held_H: np.ndarray) -> dict[str, torch.Tensor] | None:
        """Weights of the experts this rank computes, in `held_H` order (None: exactly its own).

        With copies anywhere in the group every rank joins the sparse all-gather, so that all ranks
        build the same autograd graph and meet in the same order in backward.
        """
        if placement.is_owners_only():
            return None
        return materialize(
            self.experts.weights(), placement, self.group, self.experts.first_expert, held_H, self.node_of
        )

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, d_hidden={self.d_hidden}, num_experts={self.num_experts}, "
            f"top_k={self.top_k}, capacity_factor={self.capacity_factor}, strategy={self.strategy!r}, "
            f"schedule={self.schedule!r}"
        )
