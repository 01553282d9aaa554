"""`gate="expert_choice"` (Zhou et al. 2022, FSMoE §2.1): each expert takes its top-C tokens.

Scores `S = softmax(x·W_gᵀ)` over the experts (fp32); expert e takes the C tokens of this rank with
the highest `S[:, e]` (ties to the earlier token), `C = min(T, ceil(c·k·T/E))` with c the layer's
`capacity_factor` (1 when dropless) — the same number of slots as token choice with k per token, so
the experts' load is balanced by construction and a token gets anywhere from 0 to E experts. A
chosen pair's combine weight is its score (not renormalised). No balance loss is needed
(`balance="none"` by default); token-choice balance terms are refused. Routing is over the rank's
own batch (docs/architecture.md, "The invariant").

Shape suffixes: T tokens on this rank, D d_model, E experts, C tokens per expert, A = E·C rows.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moeflow.routing.routing import Routing, RoutingLayout, stable_topk


class ExpertChoiceGate(nn.Module):
    """See the module docstring; `capacity_factor` c sets C = ceil(c·k·T/E)."""

    routing_kind = "expert_choice"

    def __init__(self, d_model: int, num_experts: int, top_k: int, capacity_factor: float | None = None) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor = 1.0 if capacity_factor is None else float(capacity_factor)
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initial values (also after a meta-device build: `moeflow.training.init`)."""
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(self.weight.shape[1]))

    def capacity(self, num_tokens: int) -> int:
        """C: tokens each expert takes from a batch of `num_tokens`."""
        return min(num_tokens, math.ceil(self.capacity_factor * self.top_k * num_tokens / self.num_experts))

    def forward(
        self, x_TD: torch.Tensor, selection_bias_E: torch.Tensor | None = None, layout: RoutingLayout | None = None
    ) -> Routing:
        del selection_bias_E, layout  # experts choose: a per-expert bias cannot change their ranking
        with torch.autocast(x_TD.device.type, enabled=False):
            logits_TE = x_TD.float() @ self.weight.float().t()
            probs_TE = torch.softmax(logits_TE, dim=-1)
            C = self.capacity(x_TD.shape[0])
            token_EC = stable_topk(probs_TE.detach().t(), C)
            expert_EC = torch.arange(self.num_experts, device=x_TD.device)[:, None].expand(-1, C)
            return Routing(
                expert_A=expert_EC.reshape(-1),
                weight_A=probs_TE[token_EC, expert_EC].reshape(-1),
                probs_TE=probs_TE,
                logits_TE=logits_TE,
                num_tokens=x_TD.shape[0],
                token_A=token_EC.reshape(-1),
                kind="expert_choice",
            )
