"""A `MoELayer` gate that is a Hugging Face block's own router (`HFRouterGate`), and the router
semantics it reproduces where moeflow steers selection (`RouterSemantics`).

The gate calls the block's router module exactly as the block does, so the routing is the model's
by construction (same ops, same dtype, same ties) and `transformers` still records the router's
logits (it hooks the router class): the model's own auxiliary loss keeps working. Only when a
moeflow balance term adds a selection bias (aux-loss-free balancing, DeepSeek-V3 §2.1.2; TA-MoE's
steering) does the gate re-select from the router's logits with `RouterSemantics`, the bias moving
the choice and never the weights, as moeflow's own gates do — and with moeflow's own selection
machinery (`routing.group_limited`, `stable_topk`). `check_semantics` proves on a probe batch, at
conversion, that the semantics equal the router's.

Shape suffixes: T tokens, D d_model (HF's hidden size), E experts, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moeflow.routing.group_limited import GroupLimit
from moeflow.routing.routing import Routing, RoutingLayout, stable_topk, token_choices

ORDERS = ("softmax_topk", "topk_softmax", "sigmoid_topk", "topk_sigmoid")
"""softmax over all E then the k largest (Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2); the k largest
logits then a softmax over those k (GPT-OSS, Switch-style top-k gating); sigmoid scores then the k
largest (DeepSeek-V3, GLM-4-MoE); the k largest logits then the sigmoid of each (Llama 4)."""

OUTPUTS = ("logits_weights_experts", "scores_logits")
"""What the router module returns: `(logits_TE, weights_TK, experts_TK)` (every block but Llama 4),
or `(scores_TE, logits_TE)` with the unchosen scores 0 (Llama 4's `Llama4Router`)."""


@dataclass(frozen=True)
class RouterSemantics:
    """How a router turns logits into top-k experts and weights."""

    order: str = "softmax_topk"
    """One of `ORDERS`."""
    normalize: bool = True
    """softmax_topk and sigmoid_topk: renormalise the k chosen scores to sum to 1."""
    weights_in_logits_dtype: bool = False
    """Round the weights to the logits' dtype (Qwen-MoE, OLMoE, GPT-OSS, Llama 4) instead of keeping
    them fp32 (Mixtral, DeepSeek)."""
    n_group: int = 1
    """Group-limited routing: experts in this many groups (DeepSeek-V2/V3, GLM-4-MoE); 1: off."""
    topk_group: int = 1
    """Groups kept per token."""
    group_score_topn: int = 2
    """A group's score: the sum of its this many best selection scores (DeepSeek-V3: 2; V2: 1)."""
    scaling_factor: float = 1.0
    """The weights are multiplied by this (`routed_scaling_factor`)."""
    correction_bias: bool = False
    """The router adds its `e_score_correction_bias` to the scores for selection (DeepSeek-V3)."""
    outputs: str = "logits_weights_experts"
    """One of `OUTPUTS`."""

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"RouterSemantics order={self.order!r}: expected one of {list(ORDERS)}")
        if self.outputs not in OUTPUTS:
            raise ValueError(f"RouterSemantics outputs={self.outputs!r}: expected one of {list(OUTPUTS)}")

    @property
    def scale_inputs(self) -> bool:
        """The block scales each expert's input by its weight (Llama 4), not its output."""
        return self.order == "topk_sigmoid"

    def choice_scores(self, logits32_TE: torch.Tensor) -> torch.Tensor:
        """The fp32 scores the router takes its top-k of (before any bias)."""
        if self.order == "softmax_topk":
            return torch.softmax(logits32_TE, dim=-1)
        if self.order == "sigmoid_topk":
            return torch.sigmoid(logits32_TE)
        return logits32_TE

    def probabilities(self, logits32_TE: torch.Tensor) -> torch.Tensor:
        """`P_e` for moeflow's balance terms: softmax, or the sigmoid scores over their sum."""
        if self.order in ("sigmoid_topk", "topk_sigmoid"):
            scores_TE = torch.sigmoid(logits32_TE)
            return scores_TE / scores_TE.sum(-1, keepdim=True).clamp(min=1e-30)
        return torch.softmax(logits32_TE, dim=-1)

    def unpack(self, outputs, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(logits_TE, weights_TK, experts_TK)` from what the router module returned."""
        if self.outputs == "logits_weights_experts":
            return outputs
        scores_TE, logits_TE = outputs  # Llama 4: its experts are the top-k of its logits (dim 1)
        experts_TK = torch.topk(logits_TE, top_k, dim=1).indices
        return logits_TE, scores_TE.gather(1, experts_TK), experts_TK

    def select(
        self,
        logits_TE: torch.Tensor,
        top_k: int,
        selection_bias_E: torch.Tensor | None = None,
        correction_bias_E: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(weights_TK, experts_TK)` from the router's logits; biases move the selection only."""
        logits32_TE = logits_TE.float()  # every supported router selects in fp32 or exactly so
        scores_TE = self.choice_scores(logits32_TE)
        select_TE = scores_TE
        for bias_E in (correction_bias_E, selection_bias_E):
            if bias_E is not None:
                select_TE = select_TE + bias_E.float()
        if self.n_group > 1:
            limit = GroupLimit(logits_TE.shape[1], top_k, self.n_group, self.topk_group, None, self.group_score_topn)
            select_TE = limit.mask(select_TE, None)
        expert_TK = stable_topk(select_TE.detach(), top_k)
        weight_TK = scores_TE.gather(1, expert_TK)
        if self.order == "topk_softmax":
            weight_TK = torch.softmax(weight_TK, dim=-1)
        elif self.order == "topk_sigmoid":
            weight_TK = torch.sigmoid(weight_TK)
        elif self.normalize:
            weight_TK = weight_TK / (weight_TK.sum(dim=-1, keepdim=True) + 1e-20)
        if self.scaling_factor != 1.0:
            weight_TK = weight_TK * self.scaling_factor
        if self.weights_in_logits_dtype:
            weight_TK = weight_TK.to(logits_TE.dtype)
        return weight_TK, expert_TK


def correction_bias(router: nn.Module, semantics: RouterSemantics) -> torch.Tensor | None:
    """The router's `e_score_correction_bias` where its semantics add one, else None."""
    return router.e_score_correction_bias if semantics.correction_bias else None


def check_semantics(name: str, router: nn.Module, semantics: RouterSemantics, top_k: int, d_model: int) -> None:
    """Raise (one line, naming the block) unless `semantics` gives the router's own top-k weights on
    a probe batch. Compared as sorted per-token values, so that ties (a zero-initialised router
    ties every expert) may pick different ids with the same weights; bf16 weights within one of
    their rounding steps (the router may take its softmax in bf16 where `select` takes it in fp32)."""
    weight = router.weight
    if weight.device.type == "meta":
        return  # nothing to compute with; the first forward would fail anyway
    gen = torch.Generator(device=weight.device).manual_seed(0)  # a private stream: no global RNG drawn
    x_TD = torch.randn(64, d_model, generator=gen, device=weight.device).to(weight.dtype)
    with torch.no_grad():
        logits_TE, want_TK, want_ids_TK = semantics.unpack(router(x_TD), top_k)
        bias_E = correction_bias(router, semantics)
        got_TK, got_ids_TK = semantics.select(logits_TE, top_k, None, bias_E)
        choice_TE = semantics.choice_scores(logits_TE.float())
        choice_TE = choice_TE if bias_E is None else choice_TE + bias_E.float()
        atol = 1e-6 if want_TK.dtype == torch.float32 else 2 * torch.finfo(want_TK.dtype).eps
        same_weights = torch.allclose(want_TK.float().sort(-1).values, got_TK.float().sort(-1).values, atol=atol)
        same_choice = torch.allclose(
            choice_TE.gather(1, want_ids_TK).sort(-1).values, choice_TE.gather(1, got_ids_TK).sort(-1).values, atol=0
        )
    if not (same_weights and same_choice and want_TK.dtype == got_TK.dtype):
        raise ValueError(
            f"{name}: its router ({type(router).__name__}) does not compute {semantics} from raw logits "
            f"(transformers 5.0-5.5 routers returned probabilities as logits; the hf extra needs >= 5.6)"
        )


class HFRouterGate(nn.Module):
    """`MoELayer` gate: the block's own router → `Routing` (fp32 weights, probabilities and logits).
    `last_outputs` holds what the router returned in the last forward (the block returns part of
    it: GPT-OSS its scores, Llama 4 its logits)."""

    routing_kind = "token_choice"

    def __init__(self, router: nn.Module, semantics: RouterSemantics, top_k: int) -> None:
        super().__init__()
        self.router = router
        self.semantics = semantics
        self.top_k = top_k
        self.last_outputs: tuple | None = None

    def forward(
        self, x_TD: torch.Tensor, selection_bias_E: torch.Tensor | None = None, layout: RoutingLayout | None = None
    ) -> Routing:
        self.last_outputs = self.router(x_TD)  # as the block calls it: recorded by transformers
        logits_TE, weight_TK, expert_TK = self.semantics.unpack(self.last_outputs, self.top_k)
        if selection_bias_E is not None:
            bias_E = correction_bias(self.router, self.semantics)
            weight_TK, expert_TK = self.semantics.select(logits_TE, self.top_k, selection_bias_E, bias_E)
        logits32_TE = logits_TE.float()
        return token_choices(
            expert_TK,
            weight_TK.float(),
            self.semantics.probabilities(logits32_TE),
            logits32_TE,
            input_scaled=self.semantics.scale_inputs,
        )

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, {self.semantics}"
