"""`export_moe_blocks`: the reverse of `convert_moe_blocks` — each `MoEBlock` becomes its original
`transformers` block again, so `save_pretrained` writes a plain checkpoint that `from_pretrained`
reads. Under expert parallelism the experts are gathered from their owners (a collective: call it
on every rank of the group). A selection bias that is part of the model's routing (`aux_free`'s,
`BalanceTerm.model_bias`) is added to the router's `e_score_correction_bias` where the router has
one (DeepSeek-V3, GLM-4-MoE), so the exported model routes as the trained one did."""

from __future__ import annotations

import torch
from torch import nn

from moeflow.hf.archs import find_blocks
from moeflow.hf.block import GatedSharedExpert, MoEBlock
from moeflow.hf.weights import LAYOUTS, gather_experts


def export_moe_blocks(model: nn.Module) -> int:
    """Put every `MoEBlock` of `model` back as its original block (router, shared expert and every
    expert's weights, in their current values, dtype and device); returns how many."""
    blocks = find_blocks(model, (MoEBlock.__name__,))
    for _, parent, attr, block in blocks:
        layer, source, spec = block.moe, block.source, block.spec
        layout = LAYOUTS[spec.experts]
        requires_grad = {n: p.requires_grad for n, p in layer.experts.weights().items()}
        for name, tensor in layout.to_hf(gather_experts(layer)).items():
            trained = any(requires_grad[w] for w in requires_grad if layout.source_of(w) == name)
            setattr(source.experts, name, nn.Parameter(tensor, requires_grad=trained))
        router = block.router
        if layer.balance.model_bias and layer.gate.semantics.correction_bias:
            with torch.no_grad():
                router.e_score_correction_bias += layer.balance.selection_bias(None).to(router.e_score_correction_bias)
        setattr(source, spec.router, router)  # the same router object (already there unless reassigned since)
        shared = layer.shared_experts
        if isinstance(shared, GatedSharedExpert):
            source.shared_expert, source.shared_expert_gate = shared.shared_expert, shared.shared_expert_gate
        elif shared is not None:
            setattr(source, spec.shared_attr, shared)
        setattr(parent, attr, source.train(block.training))
    return len(blocks)
