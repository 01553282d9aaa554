"""`export_moe_blocks`: the reverse of `convert_moe_blocks` — each `MoEBlock` becomes its original
`transformers` block again, so `save_pretrained` writes a plain checkpoint that `from_pretrained`
reads. Under expert parallelism the experts are gathered from their owners (a collective: call it
on every rank of the group)."""

from __future__ import annotations

from torch import nn

from moeflow.hf.archs import find_blocks
from moeflow.hf.block import MoEBlock
from moeflow.hf.weights import fused_from_swiglu, gather_experts


def export_moe_blocks(model: nn.Module) -> int:
    """Put every `MoEBlock` of `model` back as its original block (router, shared expert and every
    expert's weights, in their current values, dtype and device); returns how many."""
    blocks = find_blocks(model, (MoEBlock.__name__,))
    for _, parent, attr, block in blocks:
        layer, source = block.moe, block.source
        gate_up_EiD, down_EDI = fused_from_swiglu(gather_experts(layer))
        requires_grad = layer.experts.w1.requires_grad
        source.experts.gate_up_proj = nn.Parameter(gate_up_EiD, requires_grad=requires_grad)
        source.experts.down_proj = nn.Parameter(down_EDI, requires_grad=requires_grad)
        source.gate = block.gate  # the same router object (already there unless reassigned since)
        if block.shared_expert is not None:
            source.shared_expert, source.shared_expert_gate = block.shared_expert, block.shared_expert_gate
        setattr(parent, attr, source.train(block.training))
    return len(blocks)
