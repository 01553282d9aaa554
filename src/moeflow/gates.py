"""Routers. Every gate maps tokens to a flat list of (token, expert, weight) assignments.

The flat form (`Routing`) covers token choice (k assignments per token) and is general enough for
expert choice and soft routing later: nothing downstream assumes exactly k per token. Routing math
runs in fp32 whatever the input dtype or autocast state (small logit differences flip top-k).

Shape suffixes: T tokens on this rank, D d_model, E experts, K top-k, A assignments.
Assignments are stored choice-major (all first choices, then all second choices, ...), which is
the capacity priority order of DESIGN.md §3.1: first choices before second, then earlier tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Routing:
    """A gate's decision for the tokens of this rank."""

    token_A: torch.Tensor
    """int64 `[A]`: index of the token of each assignment."""
    expert_A: torch.Tensor
    """int64 `[A]`: global expert id of each assignment."""
    weight_A: torch.Tensor
    """fp32 `[A]`: combine weight (differentiable w.r.t. the gate)."""
    probs_TE: torch.Tensor
    """fp32 `[T, E]`: router probabilities, for the balance loss (P_e)."""
    logits_TE: torch.Tensor
    """fp32 `[T, E]`: raw router logits, for the z-loss."""
    num_tokens: int
    """T, the tokens routed (needed when A = 0)."""


def _stable_topk(scores_TE: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores; ties go to the lower expert id (DESIGN.md §3.1).

    `torch.topk` does not promise an order among equal values; a stable descending sort does.
    """
    return torch.sort(scores_TE, dim=-1, descending=True, stable=True).indices[:, :k]


def _flatten_choices(expert_TK: torch.Tensor, weight_TK: torch.Tensor, probs_TE, logits_TE) -> Routing:
    num_tokens, k = expert_TK.shape
    token_KT = torch.arange(num_tokens, device=expert_TK.device).expand(k, num_tokens)
    return Routing(
        token_A=token_KT.reshape(-1),
        expert_A=expert_TK.t().reshape(-1),
        weight_A=weight_TK.t().reshape(-1),
        probs_TE=probs_TE,
        logits_TE=logits_TE,
        num_tokens=num_tokens,
    )


class TopKGate(nn.Module):
    """`gate="topk"`: softmax over fp32 logits, k largest, weights renormalised to sum to 1."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, normalize: bool = True) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.normalize = num_experts, top_k, normalize
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(d_model))

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        return x_TD.float() @ self.weight.float().t()

    def forward(self, x_TD: torch.Tensor, selection_bias_E: torch.Tensor | None = None) -> Routing:
        with torch.autocast(x_TD.device.type, enabled=False):
            logits_TE = self.logits(x_TD)
            return self._route(logits_TE, selection_bias_E)

    def _route(self, logits_TE: torch.Tensor, selection_bias_E: torch.Tensor | None) -> Routing:
        probs_TE = torch.softmax(logits_TE, dim=-1)
        # aux-free balancing (DeepSeek-V3): the bias steers selection only, never the weights.
        scores_TE = probs_TE if selection_bias_E is None else probs_TE + selection_bias_E
        expert_TK = _stable_topk(scores_TE.detach(), self.top_k)
        weight_TK = probs_TE.gather(1, expert_TK)
        if self.normalize:
            weight_TK = weight_TK / weight_TK.sum(-1, keepdim=True)
        return _flatten_choices(expert_TK, weight_TK, probs_TE, logits_TE)


class SwitchGate(TopKGate):
    """`gate="switch"` (Switch Transformer): top-1, weight = its probability (not renormalised)."""

    def __init__(self, d_model: int, num_experts: int, top_k: int = 1) -> None:
        if top_k != 1:
            raise ValueError(f"gate='switch' routes each token to one expert; got top_k={top_k}")
        super().__init__(d_model, num_experts, 1, normalize=False)


class NoisyTopKGate(TopKGate):
    """`gate="noisy_topk"` (GShard / Shazeer et al.): `H = x·W_g + N(0,1)·softplus(x·W_noise)` while
    training, `G = softmax(KeepTopK(H, k))` — i.e. the selected noisy probabilities renormalised."""

    def __init__(self, d_model: int, num_experts: int, top_k: int) -> None:
        super().__init__(d_model, num_experts, top_k, normalize=True)
        self.noise_weight = nn.Parameter(torch.zeros(num_experts, d_model))

    def forward(self, x_TD: torch.Tensor, selection_bias_E: torch.Tensor | None = None) -> Routing:
        with torch.autocast(x_TD.device.type, enabled=False):
            logits_TE = self.logits(x_TD)
            if not self.training:
                return self._route(logits_TE, selection_bias_E)
            noise_std_TE = F.softplus(x_TD.float() @ self.noise_weight.float().t())
            noisy_TE = logits_TE + torch.randn_like(logits_TE) * noise_std_TE
            # Balance loss and z-loss see the noisy logits, as GShard's load estimate does.
            return self._route(noisy_TE, selection_bias_E)


GATES: dict[str, type[TopKGate]] = {"topk": TopKGate, "switch": SwitchGate, "noisy_topk": NoisyTopKGate}


def build_gate(gate: str | nn.Module, d_model: int, num_experts: int, top_k: int) -> nn.Module:
    if isinstance(gate, nn.Module):
        return gate
    if not isinstance(gate, str) or gate not in GATES:
        raise ValueError(f"unknown gate={gate!r}; valid: {sorted(GATES)}")
    return GATES[gate](d_model, num_experts, top_k)
