"""A Hugging Face sparse-MoE block rebuilt on `MoELayer`: the block's own router decides, moeflow's
layer dispatches and computes (`moeflow.hf.convert_moe_blocks`).

The router is the block's own module, called as the block calls it, so its semantics are the
model's by construction — softmax then top-k (Mixtral, Qwen-MoE, OLMoE), renormalised or not
(`norm_topk_prob`), in the dtype the model computes it — and the model's auxiliary loss keeps
working: `transformers` records router logits from the router modules of its own classes, which
stay in the tree. Only the experts move into `MoELayer`'s `[E, ...]` tensors (SwiGLU, the Mixtral
layout: `w1` gate, `w3` up, `w2` down). A shared expert and its sigmoid gate (Qwen2-MoE) stay dense
modules beside the layer.

Shape suffixes: T tokens, D hidden size, E experts, K experts per token, I expert intermediate size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.core.layer import MoELayer
from moeflow.routing.routing import Routing, token_choices


class BlockRouter(nn.Module):
    """A `MoELayer` gate that asks the block's own router: `(logits_TE, weights_TK, experts_TK)`."""

    routing_kind = "token_choice"

    def __init__(self, router: nn.Module) -> None:
        super().__init__()
        self.router = router

    def forward(self, x_TD: torch.Tensor, selection_bias_E=None, layout=None) -> Routing:
        logits_TE, weight_TK, expert_TK = self.router(x_TD)
        logits_TE = logits_TE.float()
        return token_choices(expert_TK, weight_TK.float(), torch.softmax(logits_TE, dim=-1), logits_TE)


class MoEBlock(nn.Module):
    """What replaces a sparse-MoE block: `moe` (a `MoELayer` whose gate is the block's router) plus,
    where the block has them, `shared_expert` and `shared_expert_gate` (Qwen2-MoE). Its forward is
    the block's: `[B, S, D] -> [B, S, D]`. `source` remembers the block's class and config so
    `export_moe_blocks` can build the original again."""

    def __init__(self, moe: MoELayer, source: tuple[type, object], shared_expert=None, shared_expert_gate=None):
        super().__init__()
        self.moe = moe
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.jitter_noise = getattr(source[1], "router_jitter_noise", 0.0) or 0.0
        self.source = source

    @property
    def gate(self) -> nn.Module:
        """The block's own router (where the original block kept it)."""
        return self.moe.gate.router

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.training and self.jitter_noise > 0:  # Mixtral's router jitter, as the block applies it
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise
            )
        x_TD = hidden_states.reshape(-1, hidden_states.shape[-1])
        y_TD = self.moe(x_TD)
        if self.shared_expert is not None:
            y_TD = y_TD + F.sigmoid(self.shared_expert_gate(x_TD)) * self.shared_expert(x_TD)
        return y_TD.reshape(hidden_states.shape)
