"""`gate="soft"` (SoftMoE, Puigcerver et al. 2023; FSMoE §2.1): no discrete routing, nothing dropped.

Every expert has `slots_per_expert` slots. With logits `L = x·Φ` ([T, A], A = E·slots, fp32):
a slot's input is a mix of this rank's tokens, `x̃_s = Σ_t D[t, s] · x_t` with `D = softmax(L)`
over the tokens (each column sums to 1); a token's output is a mix of the slots' outputs,
`y_t = Σ_s C[t, s] · f_e(s)(x̃_s)` with `C = softmax(L)` over the slots (each row sums to 1).
Under expert parallelism each rank sends its E·slots slot rows — fixed counts — to the experts'
owners; mixing is over the rank's own batch (docs/architecture.md, "The invariant").
A rank without tokens sends empty (all-zero) slots. No balance term applies (`balance="none"`).

Shape suffixes: T tokens on this rank, D d_model, E experts, A rows (the slots, E·slots_per_expert).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from moeflow.core.checks import positive_int
from moeflow.routing.routing import Routing, RoutingLayout, SlotMixing


@dataclass(frozen=True)
class SoftOptions:
    """Options of `gate="soft"`."""

    slots_per_expert: int = 1
    """Slots of each expert on each rank (rows it computes per rank)."""

    def __post_init__(self) -> None:
        positive_int("slots_per_expert", self.slots_per_expert)


class SoftGate(nn.Module):
    """See the module docstring. `weight` is Φᵀ, `[A, D]` (one row per slot, expert-major)."""

    routing_kind = "soft"

    def __init__(self, d_model: int, num_experts: int, options: SoftOptions | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.slots_per_expert = (options or SoftOptions()).slots_per_expert
        self.weight = nn.Parameter(torch.empty(num_experts * self.slots_per_expert, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initial values (also after a meta-device build: `moeflow.training.init`)."""
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(self.weight.shape[1]))

    def forward(
        self, x_TD: torch.Tensor, selection_bias_E: torch.Tensor | None = None, layout: RoutingLayout | None = None
    ) -> Routing:
        del selection_bias_E, layout  # nothing is selected
        with torch.autocast(x_TD.device.type, enabled=False):
            logits_TA = x_TD.float() @ self.weight.float().t()
            dispatch_TA = torch.softmax(logits_TA, dim=0)
            combine_TA = torch.softmax(logits_TA, dim=1)
            A = logits_TA.shape[1]
            expert_A = torch.arange(self.num_experts, device=x_TD.device).repeat_interleave(self.slots_per_expert)
            return Routing(
                expert_A=expert_A,
                weight_A=torch.ones(A, device=x_TD.device),
                # A token's output share from each expert: its combine weights summed over the slots.
                probs_TE=combine_TA.view(-1, self.num_experts, self.slots_per_expert).sum(-1),
                logits_TE=logits_TA,
                num_tokens=x_TD.shape[0],
                slots=SlotMixing(dispatch_TA, combine_TA),
                kind="soft",
            )
