"""Token-choice routers: each token picks its k experts (`topk`, `switch`, `noisy_topk`, `sigmoid`,
`xmoe`). Expert-choice and slot-based routers live in `expert_choice.py` and `soft.py`, the
topology-aware one in `hierarchical.py`; all return one `Routing` shape (`routing.py`).

Routing math runs in fp32 whatever the input dtype or autocast state (small logit differences flip
top-k). Selection may add a bias (aux-free balancing, TA-MoE steering) that never touches the
combine weights. Ties go to the lower expert id.

Shape suffixes: T tokens on this rank, D d_model, E experts, K top-k, R a low-rank projection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.core.checks import finite_number, positive_int
from moeflow.routing.routing import Routing, RoutingLayout, stable_topk, token_choices

__all__ = [
    "NoisyTopKGate",
    "Routing",
    "RoutingLayout",
    "SigmoidGate",
    "SwitchGate",
    "TokenChoiceGate",
    "TopKGate",
    "XMoEGate",
]


class TokenChoiceGate(nn.Module):
    """Base of the token-choice gates: fp32 `logits` → (probabilities for balance terms, gate scores
    for selection and weights) → k largest scores (plus a selection-only bias) → weights."""

    routing_kind = "token_choice"

    def __init__(self, num_experts: int, top_k: int, normalize: bool) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.normalize = num_experts, top_k, normalize

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def scores(self, logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs_TE for balance terms, gate scores_TE for selection and weights): softmax for both."""
        probs_TE = torch.softmax(logits_TE, dim=-1)
        return probs_TE, probs_TE

    def forward(
        self, x_TD: torch.Tensor, selection_bias_E: torch.Tensor | None = None, layout: RoutingLayout | None = None
    ) -> Routing:
        with torch.autocast(x_TD.device.type, enabled=False):
            return self._route(self.logits(x_TD), selection_bias_E, layout)

    def _select(self, scores_TE: torch.Tensor, layout: RoutingLayout | None) -> tuple[torch.Tensor, int]:
        """Expert ids `[T, K]` to use, and how many choices were redirected (0 here)."""
        return stable_topk(scores_TE, self.top_k), 0

    def _route(self, logits_TE: torch.Tensor, selection_bias_E, layout: RoutingLayout | None = None) -> Routing:
        probs_TE, gate_TE = self.scores(logits_TE)
        # aux-free balancing (DeepSeek-V3): the bias steers selection only, never the weights.
        select_TE = gate_TE if selection_bias_E is None else gate_TE + selection_bias_E
        expert_TK, redirected = self._select(select_TE.detach(), layout)
        weight_TK = gate_TE.gather(1, expert_TK)
        if self.normalize:
            weight_TK = weight_TK / weight_TK.sum(-1, keepdim=True)
        return token_choices(expert_TK, weight_TK, probs_TE, logits_TE, redirected)


class TopKGate(TokenChoiceGate):
    """`gate="topk"`: softmax over fp32 logits `x·W_gᵀ`, k largest, weights renormalised to sum to 1
    (GShard, Mixtral; `normalize=False` keeps the raw probabilities)."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, normalize: bool = True) -> None:
        super().__init__(num_experts, top_k, normalize)
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initial values (also after a meta-device build: `moeflow.training.init`)."""
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(self.weight.shape[1]))

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        return x_TD.float() @ self.weight.float().t()


class SwitchGate(TopKGate):
    """`gate="switch"` (Switch Transformer): top-1, weight = its probability (not renormalised)."""

    def __init__(self, d_model: int, num_experts: int, top_k: int = 1) -> None:
        if top_k != 1:
            raise ValueError(f"gate='switch' routes each token to one expert; got top_k={top_k}")
        super().__init__(d_model, num_experts, 1, normalize=False)


class NoisyTopKGate(TopKGate):
    """`gate="noisy_topk"` (GShard / Shazeer et al.): `H = x·W_g + N(0,1)·softplus(x·W_noise)` while
    training, `G = softmax(KeepTopK(H, k))` — i.e. the selected noisy probabilities renormalised."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, normalize: bool = True) -> None:
        self.noise_weight = None
        super().__init__(d_model, num_experts, top_k, normalize=normalize)
        self.noise_weight = nn.Parameter(torch.zeros(num_experts, d_model))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.noise_weight is not None:
            nn.init.zeros_(self.noise_weight)

    def forward(
        self, x_TD: torch.Tensor, selection_bias_E: torch.Tensor | None = None, layout: RoutingLayout | None = None
    ) -> Routing:
        with torch.autocast(x_TD.device.type, enabled=False):
            logits_TE = self.logits(x_TD)
            if not self.training:
                return self._route(logits_TE, selection_bias_E, layout)
            noise_std_TE = F.softplus(x_TD.float() @ self.noise_weight.float().t())
            noisy_TE = logits_TE + torch.randn_like(logits_TE) * noise_std_TE
            # Balance loss and z-loss see the noisy logits, as GShard's load estimate does.
            return self._route(noisy_TE, selection_bias_E, layout)


class SigmoidGate(TopKGate):
    """`gate="sigmoid"` (BASE, StableMoE; DeepSeek-V3's scoring, FSMoE §2.1): scores `σ(x·W_g)` in
    fp32, the k largest, each chosen expert's output scaled by its own sigmoid score — no softmax
    couples the experts (`normalize=True` renormalises the k scores to sum to 1, as DeepSeek-V3).
    Balance terms see the scores normalised over the experts as probabilities."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, normalize: bool = False) -> None:
        super().__init__(d_model, num_experts, top_k, normalize=normalize)

    def scores(self, logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate_TE = torch.sigmoid(logits_TE)
        return gate_TE / gate_TE.sum(-1, keepdim=True).clamp(min=1e-30), gate_TE


@dataclass(frozen=True)
class TopKOptions:
    """Options of `gate="topk"` and `gate="noisy_topk"`."""

    normalize: bool = True
    """Renormalise the k chosen probabilities to sum to 1 (False: raw probabilities)."""


@dataclass(frozen=True)
class SigmoidOptions:
    """Options of `gate="sigmoid"`."""

    normalize: bool = False
    """Renormalise the k chosen sigmoid scores to sum to 1 (False: each expert scaled by its own)."""


@dataclass(frozen=True)
class XMoEOptions:
    """Options of `gate="xmoe"` (X-MoE's low-rank cosine router)."""

    proj_dim: int = 16
    """R: dimension of the low-rank projection tokens and expert embeddings meet in."""
    temperature: float = 0.07
    """Initial τ of `s_e = cos(W_proj·x, w_e) / τ` (learned)."""
    min_temperature: float = 0.01
    """Lower clamp of τ (a τ near 0 makes the softmax one-hot and its gradient vanish)."""
    max_temperature: float = 1.0
    """Upper clamp of τ."""
    normalize: bool = True
    """Renormalise the k chosen probabilities to sum to 1."""

    def __post_init__(self) -> None:
        positive_int("proj_dim", self.proj_dim)
        finite_number("min_temperature", self.min_temperature, low=0.0, low_open=True)
        finite_number("max_temperature", self.max_temperature, low=self.min_temperature)
        finite_number("temperature", self.temperature, low=self.min_temperature, high=self.max_temperature)


class XMoEGate(TokenChoiceGate):
    """`gate="xmoe"` (X-MoE, Chi et al. 2022; FSMoE §2.1): tokens are projected to a low dimension R
    (`W_proj`, [R, D]) and compared with learned expert embeddings (`weight`, [E, R]) by cosine
    similarity over a learned temperature, `s_e = cos(W_proj·x, w_e) / τ` with τ clamped to
    [min, max]; then softmax, the k largest, weights renormalised. The projection separates the
    token's hidden state from the routing space (X-MoE's fix for representation collapse)."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, options: XMoEOptions | None = None) -> None:
        options = options or XMoEOptions()
        super().__init__(num_experts, top_k, options.normalize)
        self.min_temperature, self.max_temperature = options.min_temperature, options.max_temperature
        self.initial_temperature = options.temperature
        self.proj = nn.Parameter(torch.empty(options.proj_dim, d_model))
        self.weight = nn.Parameter(torch.empty(num_experts, options.proj_dim))
        self.log_temperature = nn.Parameter(torch.empty(()))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initial values (also after a meta-device build: `moeflow.training.init`)."""
        nn.init.normal_(self.proj, std=1.0 / math.sqrt(self.proj.shape[1]))
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(self.weight.shape[1]))
        nn.init.constant_(self.log_temperature, math.log(self.initial_temperature))

    @property
    def temperature(self) -> torch.Tensor:
        return self.log_temperature.float().exp().clamp(self.min_temperature, self.max_temperature)

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        z_TR = F.normalize(x_TD.float() @ self.proj.float().t(), dim=-1)
        w_ER = F.normalize(self.weight.float(), dim=-1)
        return (z_TR @ w_ER.t()) / self.temperature
