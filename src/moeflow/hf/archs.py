"""Which `transformers` sparse-MoE blocks `moeflow.hf` converts, and how each is laid out.

Every supported block has the layout of `transformers` >= 5.6 (the version range of the `hf`
extra): a router module `gate` returning `(logits_TE, weights_TK, experts_TK)` from raw logits,
and an experts module `experts` with fused 3-D weights `gate_up_proj [E, 2I, D]` (gate rows
first, then up rows) and `down_proj [E, D, I]`, applied as `down(act(gate·x) * up·x)`. Earlier
5.x routers returned probabilities in place of logits (5.0–5.5) and 4.x kept per-expert
`nn.Linear` lists; both are refused with the version named. Blocks are recognised by class name,
so the core never imports `transformers`.

Shape suffixes: T tokens, D hidden size, E experts, K experts per token, I expert intermediate size.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from moeflow.hf.router import RouterSemantics


@dataclass(frozen=True)
class BlockSpec:
    """How one block class routes and what it keeps beside its routed experts."""

    normalize_attr: str | None
    """Router attribute holding the renormalise-the-top-k flag; None: always renormalised."""
    weights_in_logits_dtype: bool
    """The router casts its top-k weights to the logits' dtype (bf16 in a bf16 model) rather than
    keeping them fp32."""
    shared_expert: bool = False
    """The block adds `sigmoid(shared_expert_gate(x)) * shared_expert(x)` (Qwen2-MoE)."""
    jitter: bool = False
    """The block multiplies its input by U(1-ε, 1+ε) while training (`jitter_noise`, Mixtral)."""

    def semantics(self, block: nn.Module) -> RouterSemantics:
        """The router semantics of this block instance (its flag values read from the router)."""
        normalize = True if self.normalize_attr is None else bool(getattr(block.gate, self.normalize_attr))
        return RouterSemantics("softmax_topk", normalize, self.weights_in_logits_dtype)


SUPPORTED: dict[str, BlockSpec] = {
    # Mixtral (Jiang et al. 2024, Eq. 1): softmax over fp32 logits, top-k, renormalised, fp32 weights.
    "MixtralSparseMoeBlock": BlockSpec(normalize_attr=None, weights_in_logits_dtype=False, jitter=True),
    # Qwen1.5/2-MoE: softmax, top-k, renormalised iff `norm_topk_prob`; weights cast to the logits'
    # dtype; a shared expert scaled by its own sigmoid gate is added to every token.
    "Qwen2MoeSparseMoeBlock": BlockSpec("norm_topk_prob", weights_in_logits_dtype=True, shared_expert=True),
    "Qwen3MoeSparseMoeBlock": BlockSpec("norm_topk_prob", weights_in_logits_dtype=True),
    # OLMoE (Muennighoff et al. 2024): as Qwen3-MoE; its config leaves `norm_topk_prob` off.
    "OlmoeSparseMoeBlock": BlockSpec("norm_topk_prob", weights_in_logits_dtype=True),
}
"""Block class name → its spec: the blocks `convert_moe_blocks` replaces."""


def find_blocks(model: nn.Module, class_names) -> list[tuple[str, nn.Module, str, nn.Module]]:
    """`(qualified name, parent, attribute, block)` of every module whose class name is in
    `class_names`, outermost first (a block is never searched inside)."""
    found: list[tuple[str, nn.Module, str, nn.Module]] = []

    def walk(prefix: str, parent: nn.Module) -> None:
        for attr, child in parent.named_children():
            name = f"{prefix}.{attr}" if prefix else attr
            if type(child).__name__ in class_names:
                found.append((name, parent, attr, child))
            else:
                walk(name, child)

    if type(model).__name__ in class_names:
        raise ValueError(f"{type(model).__name__} is itself a MoE block: pass the model that contains it")
    walk("", model)
    return found
