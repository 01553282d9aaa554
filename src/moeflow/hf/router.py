"""A `MoELayer` gate that is a Hugging Face block's own router (`HFRouterGate`), and the router
semantics it reproduces where moeflow steers selection (`RouterSemantics`).

The gate calls the block's router module exactly as the block does, so the routing is the model's
by construction (same ops, same dtype, same ties) and `transformers` still records the router's
logits (it hooks the router class): the model's own auxiliary loss keeps working. Only when a
moeflow balance term adds a selection bias (aux-loss-free balancing, DeepSeek-V3 §2.1.2; TA-MoE's
steering) does the gate re-select from the router's logits with `RouterSemantics`, the bias moving
the choice and never the weights, as moeflow's own gates do. `check_semantics` proves on a probe
batch, at conversion, that the semantics equal the router's.

Shape suffixes: T tokens, D hidden size, E experts, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moeflow.routing.routing import Routing, RoutingLayout, stable_topk, token_choices

ORDERS = ("softmax_topk", "topk_softmax")
"""softmax over all E then the k largest (Mixtral, Qwen-MoE, OLMoE), or the k largest logits then
a softmax over those k (Switch-style top-k gating, GraniteMoE)."""


@dataclass(frozen=True)
class RouterSemantics:
    """How a router turns logits into top-k experts and weights."""

    order: str = "softmax_topk"
    """One of `ORDERS`."""
    normalize: bool = True
    """softmax_topk only: renormalise the k chosen probabilities to sum to 1 (topk_softmax always sums to 1)."""
    weights_in_logits_dtype: bool = False
    """Round the weights to the logits' dtype (Qwen-MoE, OLMoE) instead of keeping them fp32 (Mixtral)."""

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"RouterSemantics order={self.order!r}: expected one of {list(ORDERS)}")

    def select(
        self, logits_TE: torch.Tensor, top_k: int, selection_bias_E: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(weights_TK, experts_TK)` from the router's logits; a bias moves the selection only."""
        logits32_TE = logits_TE.float()  # every supported router does its softmax in fp32
        scores_TE = torch.softmax(logits32_TE, dim=-1) if self.order == "softmax_topk" else logits32_TE
        select_TE = scores_TE if selection_bias_E is None else scores_TE + selection_bias_E
        expert_TK = stable_topk(select_TE.detach(), top_k)
        weight_TK = scores_TE.gather(1, expert_TK)
        if self.order == "topk_softmax":
            weight_TK = torch.softmax(weight_TK, dim=-1)
        elif self.normalize:
            weight_TK = weight_TK / weight_TK.sum(dim=-1, keepdim=True)
        if self.weights_in_logits_dtype:
            weight_TK = weight_TK.to(logits_TE.dtype)
        return weight_TK, expert_TK


def check_semantics(name: str, router: nn.Module, semantics: RouterSemantics, top_k: int, d_model: int) -> None:
    """Raise (one line, naming the block) unless `semantics` gives the router's own top-k weights on
    a probe batch. Compared as sorted per-token values, so that ties (a zero-initialised router
    ties every expert) may pick different ids with the same weights."""
    weight = router.weight
    if weight.device.type == "meta":
        return  # nothing to compute with; the first forward would fail anyway
    gen = torch.Generator(device=weight.device).manual_seed(0)  # a private stream: no global RNG drawn
    x_TD = torch.randn(64, d_model, generator=gen, device=weight.device).to(weight.dtype)
    with torch.no_grad():
        logits_TE, want_TK, want_ids_TK = router(x_TD)
        got_TK, got_ids_TK = semantics.select(logits_TE, top_k)
        probs_TE = torch.softmax(logits_TE.float(), dim=-1)
        same_weights = torch.allclose(want_TK.float().sort(-1).values, got_TK.float().sort(-1).values, atol=1e-6)
        same_choice = torch.allclose(
            probs_TE.gather(1, want_ids_TK).sort(-1).values, probs_TE.gather(1, got_ids_TK).sort(-1).values, atol=0
        )
    if not (same_weights and same_choice and want_TK.dtype == got_TK.dtype):
        raise ValueError(
            f"{name}: its router ({type(router).__name__}) does not compute {semantics} from raw logits "
            f"(transformers 5.0-5.5 routers returned probabilities as logits; the hf extra needs >= 5.6)"
        )


class HFRouterGate(nn.Module):
    """`MoELayer` gate: the block's own router → `Routing` (fp32 weights, probabilities and logits)."""

    routing_kind = "token_choice"

    def __init__(self, router: nn.Module, semantics: RouterSemantics, top_k: int) -> None:
        super().__init__()
        self.router = router
        self.semantics = semantics
        self.top_k = top_k

    def forward(
        self, x_TD: torch.Tensor, selection_bias_E: torch.Tensor | None = None, layout: RoutingLayout | None = None
    ) -> Routing:
        logits_TE, weight_TK, expert_TK = self.router(x_TD)  # as the block calls it: recorded by transformers
        if selection_bias_E is not None:
            weight_TK, expert_TK = self.semantics.select(logits_TE, self.top_k, selection_bias_E)
        logits32_TE = logits_TE.float()
        return token_choices(expert_TK, weight_TK.float(), torch.softmax(logits32_TE, dim=-1), logits32_TE)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, {self.semantics}"
