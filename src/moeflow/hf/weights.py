"""Expert weights between the `transformers` fused layout and `MoELayer`'s SwiGLU experts, and the
gather of every expert from its owner under expert parallelism.

`transformers` (>= 5): `gate_up_proj [E, 2I, D]` (rows: gate then up), `down_proj [E, D, I]`,
applied as `F.linear`, i.e. `x·Wᵀ`. moeflow (`expert="swiglu"`, the Mixtral layout): `w1` gate and
`w3` up `[E, D, I]`, `w2` down `[E, I, D]`, applied as `x·W`. So each is a transpose of a slice.

Shape suffixes: E experts, L experts held by this rank, D hidden size, I expert intermediate size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeflow.layer import MoELayer


def swiglu_from_fused(gate_up_EiD: torch.Tensor, down_EDI: torch.Tensor) -> dict[str, torch.Tensor]:
    """`{"w1": [E, D, I], "w3": [E, D, I], "w2": [E, I, D]}` views of the fused tensors (`i` = 2I)."""
    inter = gate_up_EiD.shape[1] // 2
    return {
        "w1": gate_up_EiD[:, :inter, :].transpose(1, 2),
        "w3": gate_up_EiD[:, inter:, :].transpose(1, 2),
        "w2": down_EDI.transpose(1, 2),
    }


def fused_from_swiglu(w: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`(gate_up_proj [E, 2I, D], down_proj [E, D, I])`, contiguous, from `w1`, `w3`, `w2`."""
    gate_up_EiD = torch.cat([w["w1"], w["w3"]], dim=2).transpose(1, 2).contiguous()
    return gate_up_EiD, w["w2"].transpose(1, 2).contiguous()


def gather_experts(layer: MoELayer) -> dict[str, torch.Tensor]:
    """Every expert's weights `[E, ...]` on every rank of the layer's group (a collective).

    Each expert has exactly one owner in the group — a contiguous range under plain EP, any set
    after Hecate's re-sharding — so summing zero-filled full tensors over the group is the gather,
    whatever the ownership.
    """
    out = {}
    for name, param_LX in layer.experts.weights().items():
        full_EX = param_LX.new_zeros((layer.num_experts, *param_LX.shape[1:]))
        if layer.experts.expert_ids:
            full_EX[torch.tensor(layer.experts.expert_ids, device=param_LX.device)] = param_LX.detach()
        if layer.group is not None:
            dist.all_reduce(full_EX, group=layer.group)
        out[name] = full_EX
    return out
