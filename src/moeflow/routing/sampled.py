"""Synthetic skewed routing for benchmarks: a gate whose *selection* follows given probabilities.

FasterMoE Fig. 4 / Hecate Fig. 3 show that expert popularity is skewed and drifts; to measure
strategies against a known skew, `SampledGate` samples each token's k experts (without replacement)
from `p_e ∝ 1 / rank(e)^s` over a fixed random ranking of the experts (the same on every rank),
with `SampledGate.zipf`.
Everything else is a real top-k gate: fp32 logits from its own weight, combine weights the
renormalised probabilities of the chosen experts, gradients as usual — so a benchmark does the
same work as training, with routing it controls. s = 0 is uniform. `SampledGate` also replays a
recorded trace's per-rank expert distribution.

Shape suffixes: T tokens, E experts, K top-k.
"""

from __future__ import annotations

import torch

from moeflow.routing.gates import RoutingLayout, TopKGate


def zipf_probabilities(num_experts: int, skew: float, seed: int = 0) -> torch.Tensor:
    """`p_E`: Zipf(s) over a random ranking of the experts (fixed by `seed`)."""
    if skew < 0:
        raise ValueError(f"skew={skew} must be >= 0")
    ranks = torch.randperm(num_experts, generator=torch.Generator().manual_seed(seed)) + 1
    weights = ranks.double().pow(-skew)
    return (weights / weights.sum()).float()


class SampledGate(TopKGate):
    """A top-k gate whose choices are drawn from given expert probabilities (module docstring).

    `probs` is `[E]` (every rank alike, e.g. `zipf_probabilities`) or `[W, E]` (rank w draws from
    row w, e.g. a recorded trace's flow matrix normalised per source rank).
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int,
        probs: torch.Tensor,
        seed: int = 0,
        rank: int = 0,
        even: bool = False,
    ):
        super().__init__(d_model, num_experts, top_k)
        self.even = even
        """Perfectly even routing instead (`probs` unused): token t takes experts t·k … t·k + k − 1
        (mod E), so every expert gets the same count — the force-balanced ceiling of a benchmark."""
        probs = torch.as_tensor(probs, dtype=torch.float32)
        row = probs if probs.dim() == 1 else probs[rank]
        if row.shape != (num_experts,) or (row < 0).any() or int((row > 0).sum()) < top_k:
            raise ValueError(
                f"probs: need {num_experts} non-negative entries with at least top_k={top_k} > 0 "
                f"(for rank {rank}), got {row.tolist()}"
            )
        self.register_buffer("popularity_E", row / row.sum(), persistent=False)
        # Each rank draws its own tokens' choices (different tokens), reproducibly.
        self.sampler = torch.Generator().manual_seed(seed * 1_000_003 + rank)

    @classmethod
    def zipf(cls, d_model: int, num_experts: int, top_k: int, skew: float, seed: int = 0, rank: int = 0):
        return cls(d_model, num_experts, top_k, zipf_probabilities(num_experts, skew, seed), seed, rank)

    def _select(self, scores_TE: torch.Tensor, layout: RoutingLayout | None) -> tuple[torch.Tensor, int]:
        num_tokens = scores_TE.shape[0]
        if num_tokens == 0:
            return torch.zeros(0, self.top_k, dtype=torch.int64, device=scores_TE.device), 0
        if self.even:
            expert_TK = torch.arange(num_tokens)[:, None] * self.top_k + torch.arange(self.top_k)[None, :]
            return (expert_TK % self.num_experts).to(scores_TE.device), 0
        probs_TE = self.popularity_E.expand(num_tokens, -1)
        expert_TK = torch.multinomial(probs_TE, self.top_k, replacement=False, generator=self.sampler)
        return expert_TK.to(scores_TE.device), 0
