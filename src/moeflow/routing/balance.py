"""Load-balancing terms (`balance="gshard" | "sequence" | "aux_free" | "none"`, and `ta_moe` in
`ta_moe.py`) and the router z-loss.

A balance term returns the auxiliary loss of one rank's routing (unweighted; the layer applies
`balance_weight`), may bias expert *selection* (aux-free, TA-MoE steering), and may keep state
updated from the expert choices of a whole optimizer step:

    loss(routing, rank, counts_E)
                             every forward; `rank` = this rank in the expert-parallel group, or
                             None when the cluster is unknown (one process, or a cost model of
                             another size): topology-aware terms then act as GShard's;
                             `counts_E` = expert choices over the global batch (every rank of
                             the data-parallel group), passed to terms with `global_counts` set
                             (GShard's global-batch form), else None
    selection_bias(rank)     [E] added to the routing scores for top-k selection only, or None
    observe(choices_WE)      once per optimizer step (`MoELayer.update_balance`, called by
                             `all_reduce_gradients`): every rank's expert choices *before* capacity
                             drops, summed over the step's training forwards and over the
                             data-parallel replicas, so replicated state stays identical everywhere

Shape suffixes: T tokens on this rank, E experts, A assignments, W ranks of the EP group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moeflow.core import dispatch
from moeflow.core.checks import finite_number
from moeflow.routing.gates import Routing


def assignment_share_E(routing: Routing, num_experts: int) -> torch.Tensor:
    """f_e: share of this rank's assignments (all k choices, before capacity) that go to e."""
    counts_E = routing.expert_counts(num_experts).float()  # the layer's count of the same rows
    return counts_E / max(routing.expert_A.numel(), 1)


def gshard_loss(routing: Routing, num_experts: int) -> torch.Tensor:
    """GShard / Switch balance loss `E · Σ_e f_e · P_e` (P_e: mean router probability of e);
    equals 1 under perfect balance, its gradient flows through P_e only (f_e is a count)."""
    if routing.num_tokens == 0:
        return routing.probs_TE.sum() * 0.0
    return num_experts * (assignment_share_E(routing, num_experts) * routing.probs_TE.mean(0)).sum()


class BalanceTerm(nn.Module):
    """Base of every balance term: no loss, no bias, no state (the module docstring's interface)."""

    global_counts = False
    """Whether `loss` needs the expert choices of the global batch (`counts_E`): the layer then
    sums them over its expert-parallel group (the count exchange it makes anyway) and its
    data-parallel replicas (`MoELayer.balance_group`, one all-reduce of E numbers)."""
    observes = False
    """Whether `observe` uses the step's expert choices (the layer accumulates them only then)."""
    token_choice_only = True
    """Whether it shapes a token's choice of experts (refused with expert-choice and slot gates)."""
    model_bias = False
    """Whether its selection bias is part of the model's routing, applied at inference too
    (aux-free): a Hugging Face export adds it to the router's own correction bias."""
    topology_aware = False
    """Whether its bias and state belong to its loss term and to the cluster (TA-MoE): the layer
    then uses it only with `balance_weight > 0` and a cost model that describes its group, and
    otherwise calls `loss(routing, None)` (the topology-free form)."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts

    def selection_bias(self, rank: int | None = None) -> torch.Tensor | None:
        return None

    def loss(self, routing: Routing, rank: int | None = None, counts_E: torch.Tensor | None = None) -> torch.Tensor:
        return routing.probs_TE.sum() * 0.0

    def observe(self, choices_WE: torch.Tensor) -> None:
        del choices_WE


@dataclass(frozen=True)
class GShardOptions:
    """Options of `balance="gshard"`."""

    global_batch: bool = False
    """Global-batch balance (Qiu et al. 2025, "Demons in the details", Qwen3-MoE): `f_e` from the
    expert choices summed over every data-parallel rank before the loss (`P_e` stays this rank's),
    so that a sequence-specialised expert is not pushed towards uniform use within each micro-batch."""


class GShardBalance(BalanceTerm):
    """`balance="gshard"`: `E · Σ_e f_e · P_e` (`gshard_loss`); with `global_batch`, `f_e` over the
    global batch (`GShardOptions`)."""

    def __init__(self, num_experts: int, options: GShardOptions | None = None) -> None:
        super().__init__(num_experts)
        self.global_counts = (options or GShardOptions()).global_batch

    def loss(self, routing: Routing, rank: int | None = None, counts_E: torch.Tensor | None = None) -> torch.Tensor:
        if counts_E is None:
            return gshard_loss(routing, self.num_experts)
        if routing.num_tokens == 0:
            return routing.probs_TE.sum() * 0.0
        share_E = counts_E.to(routing.probs_TE.device, torch.float32) / counts_E.sum().clamp(min=1)
        return self.num_experts * (share_E * routing.probs_TE.mean(0)).sum()


class SequenceBalance(BalanceTerm):
    """`balance="sequence"`: DeepSeek-V3's complementary sequence-wise balance loss (§2.1.2,
    Eq. 17-20), per sequence of S tokens, averaged over the rank's sequences:

        L = Σ_e f_e · P_e,   f_e = E / (k·S) · Σ_t 1[e ∈ topk(t)],   P_e = (1/S) Σ_t s'_{e,t}

    with `s'` the router scores normalised over the experts (`Routing.probs_TE`: softmax, or the
    sigmoid scores over their sum). The sequences are the rows of the layer's input `[B, S, D]`
    (`Routing.sequence_length`); a `[T, D]` input is one sequence. Use a small weight (DeepSeek-V3:
    α = 1e-4) beside `aux_free`-style balancing, or alone."""

    def loss(self, routing: Routing, rank: int | None = None, counts_E: torch.Tensor | None = None) -> torch.Tensor:
        tokens = routing.num_tokens
        if tokens == 0:
            return routing.probs_TE.sum() * 0.0
        length = routing.sequence_length or tokens
        if tokens % length:
            raise ValueError(f"balance='sequence': {tokens} tokens are not whole sequences of length {length}")
        sequences = tokens // length
        k = routing.expert_A.numel() / tokens  # choices per token
        seq_A = routing.token_A // length
        counts_BE = dispatch.count_per_expert(seq_A * self.num_experts + routing.expert_A, sequences * self.num_experts)
        share_BE = counts_BE.view(sequences, self.num_experts).float() * (self.num_experts / (k * length))
        mean_BE = routing.probs_TE.view(sequences, length, self.num_experts).mean(1)
        return (share_BE * mean_BE).sum(1).mean()


class NoBalance(BalanceTerm):
    """`balance="none"`: no auxiliary term."""

    token_choice_only = False


@dataclass(frozen=True)
class AuxFreeOptions:
    """Options of `balance="aux_free"`."""

    update_rate: float = 1e-3
    """u: step of the bias per optimizer step (DeepSeek-V3 §2.1.2 uses 0.001)."""

    def __post_init__(self) -> None:
        finite_number("update_rate", self.update_rate, low=0.0)


class AuxFreeBalance(BalanceTerm):
    """`balance="aux_free"`: auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2). A per-expert bias
    is added to the routing scores for top-k *selection only*; at the end of each step,
    `b_e += u · sign(mean − count_e)` from the step's global counts, so overloaded experts become
    less likely to be picked. The bias is part of the model's routing: it applies at inference too."""

    observes = True
    model_bias = True

    def __init__(self, num_experts: int, update_rate: float = 1e-3) -> None:
        super().__init__(num_experts)
        self.update_rate = finite_number("update_rate", update_rate, low=0.0)
        self.register_buffer("bias_E", torch.zeros(num_experts))

    def reset_parameters(self) -> None:
        """Initial state (also after a meta-device build: `moeflow.training.init`): no bias."""
        with torch.no_grad():
            self.bias_E.zero_()

    def selection_bias(self, rank: int | None = None) -> torch.Tensor:
        return self.bias_E

    @torch.no_grad()
    def observe(self, choices_WE: torch.Tensor) -> None:
        counts_E = choices_WE.to(self.bias_E.device, torch.float32).sum(0)
        self.bias_E += self.update_rate * torch.sign(counts_E.mean() - counts_E)


def router_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)²; keeps logits small."""
    if logits_TE.shape[0] == 0:
        return logits_TE.sum() * 0.0
    return torch.logsumexp(logits_TE, dim=-1).square().mean()
