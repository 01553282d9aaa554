"""`MoEBlock`: what replaces a Hugging Face sparse-MoE block — a `MoELayer` whose gate is the
block's own router, plus (Qwen2-MoE) the shared expert and its sigmoid gate as dense modules
beside it. Its forward is the block's: `[B, S, D] → [B, S, D]`, same numbers.

Shape suffixes: B batch, S sequence, T = B·S tokens, D hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.layer import MoELayer


class MoEBlock(nn.Module):
    """`moe` (the routed experts, any moeflow strategy) + optional `shared_expert` / `shared_expert_gate`.

    `source` is the original block with its expert tensors taken out (it is not a submodule: its
    router and shared expert are this module's own, the same objects); `export_moe_blocks` puts
    the gathered experts back into it.
    """

    def __init__(
        self,
        moe: MoELayer,
        source: nn.Module,
        shared_expert: nn.Module | None = None,
        shared_expert_gate: nn.Module | None = None,
        jitter_noise: float = 0.0,
    ) -> None:
        super().__init__()
        self.moe = moe
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.jitter_noise = float(jitter_noise)
        object.__setattr__(self, "source", source)  # outside the module tree: no parameters of its own

    @property
    def gate(self) -> nn.Module:
        """The block's own router (where the original block kept it, for code that reads `mlp.gate`)."""
        return self.moe.gate.router

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.training and self.jitter_noise > 0:  # Mixtral's router jitter, drawn as the block draws it
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            hidden_states = hidden_states * noise
        x_TD = hidden_states.reshape(-1, hidden_states.shape[-1])
        y_TD = self.moe(x_TD)
        if self.shared_expert is not None:  # Qwen2-MoE: routed + sigmoid(gate(x)) * shared(x), in that order
            y_TD = y_TD + F.sigmoid(self.shared_expert_gate(x_TD)) * self.shared_expert(x_TD)
        return y_TD.reshape(hidden_states.shape)

    def extra_repr(self) -> str:
        return f"source={type(self.source).__name__}, jitter_noise={self.jitter_noise}"
