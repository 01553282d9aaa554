"""`MoEBlock`: what replaces a Hugging Face sparse-MoE block — a `MoELayer` whose gate is the
block's own router and whose shared experts are the block's own shared MLP (plus, for Qwen2-MoE,
its sigmoid gate: `GatedSharedExpert`). Its forward is the block's: `[B, T, D] → [B, T, D]` (and
the router output GPT-OSS and Llama 4 return beside it), same numbers.

Shape suffixes: B batch, T tokens of a sequence (B·T tokens once flattened), D d_model (HF's hidden size).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.hf.archs import BlockSpec
from moeflow.layer import MoELayer


class GatedSharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: `sigmoid(shared_expert_gate(x)) * shared_expert(x)` (the block's
    own two modules, under their own names)."""

    def __init__(self, shared_expert: nn.Module, shared_expert_gate: nn.Module) -> None:
        super().__init__()
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return F.sigmoid(self.shared_expert_gate(x_TD)) * self.shared_expert(x_TD)


class MoEBlock(nn.Module):
    """`moe` (the routed experts under any moeflow strategy; the block's router as its gate and its
    shared MLP as its shared experts).

    `source` is the original block with its expert tensors taken out (it is not a submodule: its
    router and shared expert are this module's own, the same objects); `export_moe_blocks` puts
    the gathered experts back into it. `spec` says how the block routes and what it returns.
    """

    def __init__(self, moe: MoELayer, source: nn.Module, spec: BlockSpec, jitter_noise: float = 0.0) -> None:
        super().__init__()
        self.moe = moe
        self.jitter_noise = float(jitter_noise)
        object.__setattr__(self, "source", source)  # outside the module tree: no parameters of its own
        object.__setattr__(self, "spec", spec)

    @property
    def gate(self) -> nn.Module:
        """The block's own router (where Mixtral-style blocks kept it, for code that reads `mlp.gate`)."""
        return self.moe.gate.router

    @property
    def router(self) -> nn.Module:
        """The block's own router (where GPT-OSS and Llama 4 keep it)."""
        return self.moe.gate.router

    def original_name(self, name: str) -> str:
        """The name, in the original block, of this module's parameter `name` (experts excluded:
        their tensors are `hf.weights` layouts of `moe.experts`)."""
        for prefix, original in (("moe.gate.router.", f"{self.spec.router}."), ("moe.shared_experts.", "")):
            if name.startswith(prefix):
                rest = name[len(prefix) :]
                plain = self.spec.shared == "plain" and prefix == "moe.shared_experts."
                return (f"{self.spec.shared_attr}." if plain else original) + rest
        raise KeyError(f"{name}: not a router or shared-expert parameter of {type(self.source).__name__}")

    def forward(self, hidden_states: torch.Tensor):
        if self.training and self.jitter_noise > 0:  # Mixtral's router jitter, drawn as the block draws it
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            hidden_states = hidden_states * noise
        y = self.moe(hidden_states)  # [B, T, D]: the layer sees the sequences (balance="sequence")
        if self.spec.returns is None:
            return y
        # GPT-OSS returns its router's scores, `(logits, scores, experts)[1]`, beside `[B, T, D]`;
        # Llama 4 its router's logits, `(scores, logits)[1]`, beside `[T, D]`.
        if self.spec.returns == "logits":
            y = y.reshape(-1, y.shape[-1])
        return y, self.moe.gate.last_outputs[1]

    def extra_repr(self) -> str:
        return f"source={type(self.source).__name__}, jitter_noise={self.jitter_noise}"
