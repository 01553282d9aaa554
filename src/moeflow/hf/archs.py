"""Which `transformers` sparse-MoE blocks `moeflow.hf` converts, how each is laid out and routes,
and which it refuses (and why).

Every supported block has the layout of `transformers` >= 5.6 (the version range of the `hf`
extra): a router module (`gate`, or `router` in GPT-OSS and Llama 4) returning raw logits (and its
top-k), and an experts module `experts` with fused 3-D weights in one of the layouts of
`hf.weights`. Earlier 5.x routers returned probabilities in place of logits (5.0–5.5) and 4.x kept
per-expert `nn.Linear` lists; both are refused with the version named. Blocks are recognised by
class name, so the core never imports `transformers`.

Shape suffixes: T tokens, D d_model (HF's hidden size), E experts, K experts per token, H d_hidden (HF's
expert intermediate size).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from moeflow.hf.router import RouterSemantics

SHARED_KINDS = ("none", "plain", "gated")
"""A block's shared expert: none; a dense MLP added to the routed output (DeepSeek, GLM-4-MoE,
Llama 4); or a dense MLP scaled by the sigmoid of its own one-unit gate (Qwen2-MoE)."""


@dataclass(frozen=True)
class BlockSpec:
    """How one block class routes, where its parts are, and what it keeps beside its routed experts."""

    order: str = "softmax_topk"
    """The router's `RouterSemantics.order`."""
    normalize_attr: str | None = None
    """Router attribute holding the renormalise-the-top-k flag; None: `normalize`."""
    normalize: bool = True
    """The flag when no attribute holds it."""
    weights_in_logits_dtype: bool = False
    """The router casts its top-k weights to the logits' dtype (bf16 in a bf16 model) rather than
    keeping them fp32."""
    groups: str | None = None
    """Group-limited routing read from the router: `"deepseek_v3"` (`num_group`, `topk_group`, group
    score = top-2 sum, `routed_scaling_factor`, `e_score_correction_bias`) or `"deepseek_v2"`
    (`topk_method == "group_limited_greedy"`: group score = the maximum; `routed_scaling_factor`)."""
    router: str = "gate"
    """Attribute of the router module."""
    outputs: str = "logits_weights_experts"
    """The router's `RouterSemantics.outputs`."""
    experts: str = "fused"
    """The experts' layout (`hf.weights.LAYOUTS`)."""
    shared: str = "none"
    """One of `SHARED_KINDS`."""
    shared_attr: str = "shared_expert"
    """Attribute of the shared MLP (`plain` and `gated`); `gated` also has `shared_expert_gate`."""
    returns: str | None = None
    """The block returns `(hidden, router output)`: None (hidden only), `"scores"` (GPT-OSS: its
    router's top-k weights) or `"logits"` (Llama 4: its router's logits)."""
    jitter: bool = False
    """The block multiplies its input by U(1-ε, 1+ε) while training (`jitter_noise`, Mixtral)."""

    def semantics(self, block: nn.Module) -> RouterSemantics:
        """The router semantics of this block instance (its flag values read from the router)."""
        router = getattr(block, self.router)
        normalize = self.normalize if self.normalize_attr is None else bool(getattr(router, self.normalize_attr))
        groups = {}
        if self.groups == "deepseek_v3":
            groups = dict(
                n_group=int(router.num_group),
                topk_group=int(router.topk_group),
                group_score_topn=2,
                scaling_factor=float(router.routed_scaling_factor),
                correction_bias=True,
            )
        elif self.groups == "deepseek_v2":
            limited = router.topk_method == "group_limited_greedy"
            groups = dict(
                n_group=int(router.num_group) if limited else 1,
                topk_group=int(router.topk_group) if limited else 1,
                group_score_topn=1,
                scaling_factor=float(router.routed_scaling_factor),
            )
        return RouterSemantics(self.order, normalize, self.weights_in_logits_dtype, outputs=self.outputs, **groups)


_DEEPSEEK_V3 = BlockSpec(
    "sigmoid_topk", "norm_topk_prob", groups="deepseek_v3", shared="plain", shared_attr="shared_experts"
)

SUPPORTED: dict[str, BlockSpec] = {
    # Mixtral (Jiang et al. 2024, Eq. 1): softmax over fp32 logits, top-k, renormalised, fp32 weights.
    "MixtralSparseMoeBlock": BlockSpec(jitter=True),
    # Qwen1.5/2-MoE: softmax, top-k, renormalised iff `norm_topk_prob`; weights cast to the logits'
    # dtype; a shared expert scaled by its own sigmoid gate is added to every token.
    "Qwen2MoeSparseMoeBlock": BlockSpec(normalize_attr="norm_topk_prob", weights_in_logits_dtype=True, shared="gated"),
    "Qwen3MoeSparseMoeBlock": BlockSpec(normalize_attr="norm_topk_prob", weights_in_logits_dtype=True),
    # OLMoE (Muennighoff et al. 2024): as Qwen3-MoE; its config leaves `norm_topk_prob` off.
    "OlmoeSparseMoeBlock": BlockSpec(normalize_attr="norm_topk_prob", weights_in_logits_dtype=True),
    # DeepSeek-V3 (§2.1.2) and GLM-4.5 (GLM-4-MoE, the same router): sigmoid scores in fp32, the
    # correction bias added for selection, the top-2 sum of each of n_group groups, topk_group
    # groups kept, top-k inside them; weights = the scores (no bias), renormalised iff
    # `norm_topk_prob` (+1e-20), × routed_scaling_factor; a shared MLP added to every token.
    "DeepseekV3MoE": _DEEPSEEK_V3,
    "Glm4MoeMoE": _DEEPSEEK_V3,
    # DeepSeek-V2 (§2.1.3): softmax, top-k ("greedy") or device-limited "group_limited_greedy"
    # (the group maximum), never renormalised, × routed_scaling_factor; a shared MLP.
    "DeepseekV2Moe": BlockSpec(normalize=False, groups="deepseek_v2", shared="plain", shared_attr="shared_experts"),
    # GPT-OSS: logits x·Wᵀ + b in the model dtype, the top-k logits, softmax over those k; experts
    # with biases, interleaved gate/up columns, the clamped SwiGLU; returns (hidden, scores).
    "GptOssMLP": BlockSpec(
        "topk_softmax", weights_in_logits_dtype=True, router="router", experts="interleaved", returns="scores"
    ),
    # Llama 4: the top-k logits, the sigmoid of each scales the expert's input; a shared MLP added;
    # returns (hidden, router logits). The block computes every expert on every (zero-scaled)
    # token; moeflow computes the chosen ones, the same sums.
    "Llama4TextMoe": BlockSpec(
        "topk_sigmoid",
        weights_in_logits_dtype=True,
        router="router",
        outputs="scores_logits",
        experts="stacked",
        shared="plain",
        returns="logits",
    ),
}
"""Block class name → its spec: the blocks `convert_moe_blocks` replaces."""

REFUSED: dict[str, str] = {
    "PhimoeSparseMoeBlock": "Phi-3.5-MoE's sparsemixer routing (two sequential top-1 picks with a "
    "straight-through gradient estimate) is not a top-k of router scores",
    "SwitchTransformersSparseMLP": "Switch Transformers (T5) drops tokens over a per-expert capacity inside its "
    "router and keeps one module per expert",
    "NllbMoeSparseMLP": "NLLB-MoE drops tokens over a batch-wide expert capacity inside its router (with a "
    "padding mask)",
    "JetMoeMoE": "JetMoE also routes its attention heads (JetMoeMoA), which moeflow has no layer for, and its MLP "
    "experts use another layout (input_linear/output_linear and one shared output bias)",
}
"""Sparse-MoE block class name → why `convert_moe_blocks` refuses it (one line)."""


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
