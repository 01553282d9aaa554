"""Token-choice routers: each token picks its k experts (`topk`, `switch`, `noisy_topk`, `sigmoid`,
`xmoe`). Expert-choice and slot-based routers live in `expert_choice.py` and `soft.py`, the
topology-aware one in `hierarchical.py`; all return one `Routing` shape (`routing.py`).

Routing math runs in fp32 whatever the input dtype or autocast state (small logit differences flip
top-k). Selection may add a bias (aux-free balancing, TA-MoE steering) that never touches the
combine weights. Ties go to the lower expert id.

Shape suffixes: T tokens on this rank, D d_model, E experts, K top-k; `tokens_low_rank` and
`experts_low_rank`: their projections to a low rank (no letter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.core.checks import finite_number, positive_int
from moeflow.routing.group_limited import GroupLimit
from moeflow.routing.routing import Routing, RoutingLayout, stable_topk, token_choices, without_autocast

__all__ = [
    "NoisyTopKGate",
    "Routing",
    "RoutingLayout",
    "SigmoidGate",
    "SigmoidOptions",
    "SwitchGate",
    "TokenChoiceGate",
    "TokenChoiceOptions",
    "TopKGate",
    "TopKOptions",
    "XMoEGate",
]


@dataclass(frozen=True)
class TokenChoiceOptions:
    """Options shared by `gate="topk"`, `"noisy_topk"` and `"sigmoid"` (docs/architectures.md)."""

    normalize: bool = True
    """Renormalise the k chosen scores to sum to 1 (DeepSeek-V3's `norm_topk_prob`; the sum gets
    +1e-20 as theirs does)."""
    scaling_factor: float = 1.0
    """Multiply the combine weights by this (DeepSeek-V3's `routed_scaling_factor`, after the
    renormalisation)."""
    bias: bool = False
    """A learned router bias: logits `x·Wᵀ + b` (GPT-OSS)."""
    n_group: int = 1
    """Group-limited routing (`routing.group_limited`): experts in this many equal groups of
    consecutive ids; 1 = off."""
    topk_group: int = 1
    """Groups each token may use (with `n_group` > 1)."""
    group_score_topn: int | None = None
    """A group's score is the sum of its this many best selection scores (None: 2 with `n_group`,
    DeepSeek-V3; k / M with `node_limited`; 1 = the maximum, DeepSeek-V2)."""
    node_limited: int | None = None
    """M: node-limited routing, groups = the nodes of the EP layout, each token's experts on at
    most M of them (DeepSeek-V3 §2.1.2); no limit where the layout is unknown (one process)."""
    scale_inputs: bool = False
    """Scale each expert's *input* row by its weight and sum the outputs unweighted (Llama 4),
    instead of weighting the outputs."""

    def __post_init__(self) -> None:
        finite_number("scaling_factor", self.scaling_factor, low=0.0, low_open=True)
        positive_int("n_group", self.n_group)
        positive_int("topk_group", self.topk_group)
        for name in ("group_score_topn", "node_limited"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))


@dataclass(frozen=True)
class TopKOptions(TokenChoiceOptions):
    """Options of `gate="topk"` and `gate="noisy_topk"`."""

    normalize: bool = True
    """Renormalise the k chosen probabilities to sum to 1 (False: raw probabilities)."""
    softmax_after_topk: bool = False
    """Select the k largest *logits*, then the weights are a softmax over those k only (GPT-OSS,
    Switch-style top-k gating); `normalize` does not apply."""


@dataclass(frozen=True)
class SigmoidOptions(TokenChoiceOptions):
    """Options of `gate="sigmoid"`."""

    normalize: bool = False
    """Renormalise the k chosen sigmoid scores to sum to 1 (False: each expert scaled by its own)."""


class TokenChoiceGate(nn.Module):
    """Base of the token-choice gates: fp32 `logits` → (probabilities for balance terms, gate scores
    for selection and weights) → k largest scores (plus a selection-only bias; within the kept
    groups when group-limited) → weights (renormalised, softmax over the k, scaled)."""

    routing_kind = "token_choice"

    def __init__(
        self, num_experts: int, top_k: int, normalize: bool, options: TokenChoiceOptions | None = None
    ) -> None:
        super().__init__()
        options = options or TokenChoiceOptions(normalize=normalize)
        self.num_experts, self.top_k, self.normalize = num_experts, top_k, normalize
        self.scaling_factor = options.scaling_factor
        self.scale_inputs = options.scale_inputs
        self.softmax_after_topk = False
        self.group_limit = GroupLimit.of(num_experts, top_k, options)

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def scores(self, logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs_TE for balance terms, gate scores_TE for selection and weights): softmax for both."""
        probs_TE = torch.softmax(logits_TE, dim=-1)
        return probs_TE, probs_TE

    def forward(
        self, x_TD: torch.Tensor, selection_bias_E: torch.Tensor | None = None, layout: RoutingLayout | None = None
    ) -> Routing:
        with without_autocast(x_TD.device.type):
            return self._route(self.logits(x_TD), selection_bias_E, layout)

    def _select(self, scores_TE: torch.Tensor, layout: RoutingLayout | None) -> tuple[torch.Tensor, int]:
        """Expert ids `[T, K]` to use (within each token's kept groups when group-limited), and how
        many choices were redirected (0 here)."""
        if self.group_limit is not None:
            scores_TE = self.group_limit.mask(scores_TE, layout)
        return stable_topk(scores_TE, self.top_k), 0

    def combine_weights(self, chosen_TK: torch.Tensor) -> torch.Tensor:
        """The combine weights from the gate scores of the chosen experts."""
        if self.softmax_after_topk:
            weight_TK = torch.softmax(chosen_TK, dim=-1)
        elif self.normalize:
            weight_TK = chosen_TK / (chosen_TK.sum(-1, keepdim=True) + 1e-20)
        else:
            weight_TK = chosen_TK
        return weight_TK if self.scaling_factor == 1.0 else weight_TK * self.scaling_factor

    def _route(self, logits_TE: torch.Tensor, selection_bias_E, layout: RoutingLayout | None = None) -> Routing:
        probs_TE, gate_TE = self.scores(logits_TE)
        # aux-free balancing (DeepSeek-V3): the bias steers selection only, never the weights.
        select_TE = gate_TE if selection_bias_E is None else gate_TE + selection_bias_E
        expert_TK, redirected = self._select(select_TE.detach(), layout)
        weight_TK = self.combine_weights(gate_TE.gather(1, expert_TK))
        return token_choices(expert_TK, weight_TK, probs_TE, logits_TE, redirected, self.scale_inputs)


class TopKGate(TokenChoiceGate):
    """`gate="topk"`: softmax over fp32 logits `x·W_gᵀ (+ b)`, k largest, weights renormalised to
    sum to 1 (GShard, Mixtral; `normalize=False` keeps the raw probabilities); with
    `softmax_after_topk` the k largest logits and a softmax over them (GPT-OSS). Options:
    `TopKOptions` (group-limited routing, scaling, router bias, scaled inputs)."""

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int,
        normalize: bool | None = None,
        options: TokenChoiceOptions | None = None,
    ) -> None:
        options = options or TopKOptions()
        if normalize is not None:
            options = replace(options, normalize=normalize)
        super().__init__(num_experts, top_k, options.normalize, options)
        self.softmax_after_topk = isinstance(options, TopKOptions) and options.softmax_after_topk
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        self.bias = nn.Parameter(torch.empty(num_experts)) if options.bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initial values (also after a meta-device build: `moeflow.training.init`)."""
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(self.weight.shape[1]))
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        # `linear` without a bias is `x @ wᵀ` (the same matmul, one call fewer); a bias is added
        # after it, as before (a fused addmm would round otherwise).
        logits_TE = F.linear(x_TD.float(), self.weight.float())
        return logits_TE if self.bias is None else logits_TE + self.bias.float()

    def scores(self, logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs_TE = torch.softmax(logits_TE, dim=-1)
        return probs_TE, (logits_TE if self.softmax_after_topk else probs_TE)


class SwitchGate(TopKGate):
    """`gate="switch"` (Switch Transformer): top-1, weight = its probability (not renormalised)."""

    def __init__(self, d_model: int, num_experts: int, top_k: int = 1) -> None:
        if top_k != 1:
            raise ValueError(f"gate='switch' routes each token to one expert; got top_k={top_k}")
        super().__init__(d_model, num_experts, 1, normalize=False)


class NoisyTopKGate(TopKGate):
    """`gate="noisy_topk"` (GShard / Shazeer et al.): `H = x·W_g + N(0,1)·softplus(x·W_noise)` while
    training, `G = softmax(KeepTopK(H, k))` — i.e. the selected noisy probabilities renormalised."""

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int,
        normalize: bool | None = None,
        options: TopKOptions | None = None,
    ) -> None:
        self.noise_weight = None
        super().__init__(d_model, num_experts, top_k, normalize, options)
        self.noise_weight = nn.Parameter(torch.zeros(num_experts, d_model))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.noise_weight is not None:
            nn.init.zeros_(self.noise_weight)

    def forward(
        self, x_TD: torch.Tensor, selection_bias_E: torch.Tensor | None = None, layout: RoutingLayout | None = None
    ) -> Routing:
        with without_autocast(x_TD.device.type):
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
    Balance terms see the scores normalised over the experts as probabilities. With
    `SigmoidOptions` it is DeepSeek-V3's router (group-limited, scaled; its selection bias is
    `balance="aux_free"`) or Llama 4's (top-1, `scale_inputs`)."""

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int,
        normalize: bool | None = None,
        options: SigmoidOptions | None = None,
    ) -> None:
        super().__init__(d_model, num_experts, top_k, normalize, options or SigmoidOptions())

    def scores(self, logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate_TE = torch.sigmoid(logits_TE)
        return gate_TE / gate_TE.sum(-1, keepdim=True).clamp(min=1e-30), gate_TE


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
    """`gate="xmoe"` (X-MoE, Chi et al. 2022; FSMoE §2.1): tokens are projected to a low dimension r
    (`W_proj`, [r, D]) and compared with learned expert embeddings (`weight`, [E, r]) by cosine
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
        tokens_low_rank = F.normalize(x_TD.float() @ self.proj.float().t(), dim=-1)
        experts_low_rank = F.normalize(self.weight.float(), dim=-1)
        return (tokens_low_rank @ experts_low_rank.t()) / self.temperature
