"""Expert weights between the `transformers` layouts and `MoELayer`'s experts, and the gather of
every expert from its owner under expert parallelism.

moeflow (`core.experts`): gate and up in one `w13 [E, D, 2, H]` (`[..., 0, :]` the gate), `w2`
(down) `[E, H, D]`, applied as `x·W`; biases `b13 [E, 2, H]` and `b2 [E, D]` where the kind has
them. `transformers` stores them three ways (`ExpertLayout`), each a view of moeflow's:

- `fused` (Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2/V3, GLM-4-MoE): `gate_up_proj [E, 2H, D]` (gate
  rows, then up rows) and `down_proj [E, D, H]`, applied as `F.linear`, i.e. `x·Wᵀ`; SiLU gate.
- `interleaved` (GPT-OSS): `gate_up_proj [E, D, 2H]` with gate and up in alternating columns
  (gate at even ones), `gate_up_proj_bias [E, 2H]` likewise, `down_proj [E, H, D]`,
  `down_proj_bias [E, D]`, applied as `x·W + b`; the clamped SwiGLU.
- `stacked` (Llama 4): `gate_up_proj [E, D, 2H]` (gate columns, then up columns) and
  `down_proj [E, H, D]`, applied as `x·W` (a `bmm`); SiLU gate.

Shape suffixes: E experts, O experts this rank owns (holds in its module), D d_model (HF's hidden size),
H d_hidden (HF's expert intermediate size), X any trailing dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moeflow.layer import MoELayer


@dataclass(frozen=True)
class ExpertLayout:
    """How one `transformers` experts module stores its weights (module docstring)."""

    name: str
    """`fused`, `interleaved` or `stacked`."""
    kind: str
    """The `MoELayer` expert kind it maps to."""
    tensors: tuple[str, ...]
    """Its parameter names."""

    def source_of(self, moeflow_name: str) -> str:
        """The `transformers` tensor a moeflow weight is taken from (its `requires_grad` is kept)."""
        return {"w13": "gate_up_proj", "b13": "gate_up_proj_bias", "w2": "down_proj", "b2": "down_proj_bias"}[
            moeflow_name
        ]

    def to_moeflow(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """moeflow's `[E, ...]` weights as views of the `transformers` tensors."""
        gate_up = hf["gate_up_proj"]
        num, first, second = gate_up.shape
        if self.name == "fused":  # [E, 2H, D] → [E, D, 2, H]
            return {"w13": gate_up.view(num, 2, first // 2, second).permute(0, 3, 1, 2), "w2": hf["down_proj"].mT}
        if self.name == "stacked":  # [E, D, 2H], gate columns then up columns
            return {"w13": gate_up.view(num, first, 2, second // 2), "w2": hf["down_proj"]}
        bias = hf["gate_up_proj_bias"]  # interleaved columns: [E, D, H, 2] → [E, D, 2, H]
        return {
            "w13": gate_up.view(num, first, second // 2, 2).transpose(2, 3),
            "b13": bias.view(num, -1, 2).transpose(1, 2),
            "w2": hf["down_proj"],
            "b2": hf["down_proj_bias"],
        }

    def to_hf(self, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The `transformers` tensors, contiguous, from moeflow's `[E, ...]` weights."""
        w13 = w["w13"]
        num, d_model, _, inter = w13.shape
        if self.name == "fused":
            gate_up = w13.permute(0, 2, 3, 1).reshape(num, 2 * inter, d_model)
            return {"gate_up_proj": gate_up, "down_proj": w["w2"].mT.contiguous()}
        if self.name == "stacked":
            return {"gate_up_proj": w13.reshape(num, d_model, 2 * inter).clone(), "down_proj": w["w2"].contiguous()}
        return {
            "gate_up_proj": w13.transpose(2, 3).reshape(num, d_model, 2 * inter),
            "gate_up_proj_bias": w["b13"].transpose(1, 2).reshape(num, 2 * inter),
            "down_proj": w["w2"].contiguous(),
            "down_proj_bias": w["b2"].contiguous(),
        }

    def shapes(self, hf: dict[str, torch.Tensor]) -> tuple[int, int, int]:
        """(E, D, H) of the experts."""
        gate_up = hf["gate_up_proj"]
        if self.name == "fused":
            return gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2
        return gate_up.shape[0], gate_up.shape[1], gate_up.shape[2] // 2


LAYOUTS = {
    "fused": ExpertLayout("fused", "swiglu", ("gate_up_proj", "down_proj")),
    "interleaved": ExpertLayout(
        "interleaved", "clamped_swiglu", ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    ),
    "stacked": ExpertLayout("stacked", "swiglu", ("gate_up_proj", "down_proj")),
}
"""`ExpertLayout` by name."""


def hf_tensors(experts: nn.Module, layout: ExpertLayout) -> dict[str, torch.Tensor]:
    """The experts module's tensors of `layout`, by name (a missing one is absent)."""
    return {name: t for name in layout.tensors if isinstance(t := getattr(experts, name, None), torch.Tensor)}


def gather_experts(layer: MoELayer) -> dict[str, torch.Tensor]:
    """Every expert's weights `[E, ...]` on every rank of the layer's group (a collective).

    Each expert has exactly one owner in the group — a contiguous range under plain EP, any set
    after Hecate's re-sharding — so summing zero-filled full tensors over the group is the gather,
    whatever the ownership.
    """
    out = {}
    for name, param_OX in layer.experts.weights().items():
        full_EX = param_OX.new_zeros((layer.num_experts, *param_OX.shape[1:]))
        if layer.experts.expert_ids:
            full_EX[torch.tensor(layer.experts.expert_ids, device=param_OX.device)] = param_OX.detach()
        if layer.group is not None:
            dist.all_reduce(full_EX, group=layer.group)
        out[name] = full_EX
    return out
