"""Load-balancing objectives: `balance="gshard" | "aux_free" | "none" | "ta_moe"` and the router z-loss.

A balance module returns the auxiliary loss of one rank's routing (unweighted; the layer applies
`balance_weight`), may bias expert *selection* of a rank (aux-free, TA-MoE steering), and observes
the global flow matrix after the count exchange (identical on every rank, so replicated state —
even a per-rank table — stays identical everywhere and checkpoints like any replicated buffer).

Shape suffixes: T tokens on this rank, E experts, A assignments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moeflow.core.registry import build_named
from moeflow.routing.gates import Routing


def assignment_share_E(routing: Routing, num_experts: int) -> torch.Tensor:
    """f_e: share of this rank's assignments (all k choices, before capacity) that go to e."""
    counts_E = torch.bincount(routing.expert_A, minlength=num_experts).float()
    return counts_E / max(routing.expert_A.numel(), 1)


class GShardBalance(nn.Module):
    """GShard / Switch balance loss `E · Σ_e f_e · P_e` (P_e: mean router probability of e).

    Equals 1 under perfect balance; its gradient flows through P_e only (f_e is a count).
    """

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts

    def selection_bias(self, rank: int = 0) -> torch.Tensor | None:
        """`[E]` added to rank `rank`'s routing scores for top-k selection only (None: no bias)."""
        return None

    def loss(self, routing: Routing, rank: int = 0) -> torch.Tensor:
        """This rank's term; `rank` (in the EP group) matters to topology-aware losses only."""
        if routing.num_tokens == 0:
            return routing.probs_TE.sum() * 0.0
        f_E = assignment_share_E(routing, self.num_experts)
        p_E = routing.probs_TE.mean(0)
        return self.num_experts * (f_E * p_E).sum()

    def observe(self, flow_WE: torch.Tensor) -> None:
        """After a training forward: the global flow `[W, E]` (assignments rank w sent to expert e)."""
        del flow_WE


class NoBalance(GShardBalance):
    """`balance="none"`: no auxiliary term."""

    def loss(self, routing: Routing, rank: int = 0) -> torch.Tensor:
        return routing.probs_TE.sum() * 0.0


class AuxFreeBalance(GShardBalance):
    """Auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2): a per-expert bias added to the routing
    scores for top-k *selection only*; after each training forward, `b_e += u · sign(mean − count_e)`
    from the global counts, so overloaded experts become less likely to be picked."""

    def __init__(self, num_experts: int, update_rate: float = 1e-3) -> None:
        super().__init__(num_experts)
        if update_rate < 0:
            raise ValueError(f"update_rate={update_rate} must be >= 0")
        self.update_rate = update_rate
        self.register_buffer("bias_E", torch.zeros(num_experts))

    def selection_bias(self, rank: int = 0) -> torch.Tensor:
        return self.bias_E

    def loss(self, routing: Routing, rank: int = 0) -> torch.Tensor:
        return routing.probs_TE.sum() * 0.0

    @torch.no_grad()
    def observe(self, flow_WE: torch.Tensor) -> None:
        if not self.training or self.update_rate == 0:
            return
        counts_E = flow_WE.to(self.bias_E.device, torch.float32).sum(0)
        self.bias_E += self.update_rate * torch.sign(counts_E.mean() - counts_E)


@dataclass(frozen=True)
class BalanceContext:
    """What a balance objective may need from its layer to be built by name."""

    num_experts: int
    top_k: int
    d_model: int
    cost_model: Any = None
    """The layer's `moeflow.perf.costmodel.CostModel` (topology-aware objectives need it), or None."""


def _ta_moe(ctx: BalanceContext) -> nn.Module:
    from moeflow.routing.ta_moe import balance_from_context  # scipy's LP solver: imported only when used

    return balance_from_context(ctx)


BALANCES: dict[str, Callable[[BalanceContext], nn.Module]] = {
    "gshard": lambda ctx: GShardBalance(ctx.num_experts),
    "aux_free": lambda ctx: AuxFreeBalance(ctx.num_experts),
    "none": lambda ctx: NoBalance(ctx.num_experts),
    "ta_moe": _ta_moe,
}


def build_balance(balance: str | nn.Module, ctx: BalanceContext) -> nn.Module:
    return build_named("balance", balance, BALANCES, ctx, lambda value: isinstance(value, nn.Module))


def router_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)²; keeps logits small."""
    if logits_TE.shape[0] == 0:
        return logits_TE.sum() * 0.0
    return torch.logsumexp(logits_TE, dim=-1).square().mean()
