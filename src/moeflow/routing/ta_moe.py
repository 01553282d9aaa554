"""`balance="ta_moe"`: TA-MoE's topology-aware auxiliary loss (TA-MoE §4.1-4.2), with a bounded
per-rank selection steering that makes its target reachable (docs/ta-moe.md).

The target dispatch pattern ĉ (a linear program over the cost model's pair costs) is
`moeflow.routing.topology_aware.target_dispatch_pattern`; this module is the balance term
that pulls the gate towards it.

Shape suffixes: W ranks in the expert-parallel group, E experts, T tokens on this rank.

    layer = MoELayer(512, 1024, 8, top_k=2, balance="ta_moe", cost_model=cm,
                     balance_options={"smoothing": 0.3, "steer_rate": 1e-3})
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from moeflow.core.checks import finite_number, positive_int
from moeflow.routing.balance import BalanceTerm, gshard_loss
from moeflow.routing.gates import Routing
from moeflow.routing.topology_aware import check_owner, target_dispatch_pattern


@dataclass(frozen=True)
class TAMoEOptions:
    """Options of `balance="ta_moe"` (`--set moe.balance_options.<key>=...`)."""

    smoothing: float = 0.3
    """λ of `ĉ ← (1−λ)·ĉ + λ·uniform`, in (0, 1] (λ = 0 could leave ĉ_ie = 0 and the loss undefined).
    0.3, not the simulators' 0.1 (`topology_aware.DEFAULT_SMOOTHING`): the closer ĉ is to
    "everything on the own node", the more of the routing follows the node instead of the token,
    and that costs convergence (class docstring, "Convergence")."""
    steer_rate: float = 1e-3
    """u: step of the per-rank selection bias per optimizer step (0: the loss alone)."""
    steer_limit: float = 0.1
    """Bound on |b_ie|: the steering may move a choice only between experts whose routing
    probabilities differ by less than this."""
    loss: Literal["ta_moe", "gshard"] = "ta_moe"
    """Balance loss: `"ta_moe"` = TA-MoE's `Σ_e (c_ie/ĉ_ie)·m_ie`; `"gshard"` = GShard's
    `E·Σ_e f_e·P_e` (uniform target), leaving the topology to the steering alone."""

    def __post_init__(self) -> None:
        finite_number("smoothing", self.smoothing, 0.0, 1.0, low_open=True)
        finite_number("steer_rate", self.steer_rate, low=0.0)
        finite_number("steer_limit", self.steer_limit, low=0.0)
        if self.loss not in ("ta_moe", "gshard"):
            raise ValueError(f"loss={self.loss!r}: expected 'ta_moe' or 'gshard'")


class TAMoEBalance(BalanceTerm):
    """TA-MoE's topology-aware balance term; see the module docstring.

    Loss, for rank i with S tokens: `c_ie` = assignments (all k choices, before capacity) from rank
    i to expert e, divided by S; `m_ie` = mean over its tokens of softmax(gate)_e;
    `L_i = Σ_e (c_ie / ĉ_ie) · m_ie`. With ĉ in the same per-token units as c, a uniform target
    ĉ = k/E gives `c_ie/ĉ_ie = E·f_e` and L_i = E·Σ_e f_e·P_e, the GShard loss, exactly — so the
    scale factor is 1 and the usual `balance_weight` applies unchanged. Gradient flows through
    m only (c is a count): experts with more traffic than targeted (c/ĉ large) are pushed down.
    Where the cluster is unknown (one process, or a cost model of another size: `rank=None`) the
    loss is GShard's and nothing is steered.

    The target depends on S through the bytes of a delivery (TA-MoE Eq. 2): α is a fixed cost per
    pair, so the larger S, the less α matters. Targets are computed lazily and cached per token
    count; when every α is 0 one target serves every S.

    Steering (our addition): the gate is a dense parameter averaged over all ranks and every rank
    sees i.i.d. tokens, so the loss's rank-dependent pulls cancel on a symmetric topology and the
    dispatch does not move (measured, docs/ta-moe.md). A per-rank selection bias, updated like
    DeepSeek-V3's aux-free bias but towards the target, `b_ie += u · sign(ĉ_ie · S_i − c_ie)`, makes
    the target reachable. It changes which experts are *selected*, never the combine weights; it
    keeps every expert's global load balanced because ĉ is (TA-MoE constraint 4). It is training-
    only (in `eval()` and at inference every rank routes a token alike), bounded by `steer_limit`,
    updated once per optimizer step from the step's choices before capacity drops summed over the
    data-parallel replicas (identical on every rank, so it is replicated state), and off with the
    loss term (`balance_weight=0`).

    Convergence (benchmarks/ta_moe_training.py: 2 x 2 ranks, slow inter-node link, 100 steps, 5
    seeds): a steered layer's output tells later layers which node a token is on, so their gates
    can route by node; TA-MoE's loss trains them to (GShard's loss trains them against it). What
    costs loss per step is the share of routing decided by node instead of by token, whichever
    term produces it: with λ = 0.1 (92% of assignments on the own node reached) validation loss
    ended ≈ 0.08 nat above GShard's, and steering with GShard's loss strong enough to get there
    (`steer_limit=1`) cost as much. With λ = 0.3 (the default) the cross-node share falls from
    0.50 to ≈ 0.23 with the loss per step within the seed spread of GShard's; `loss="gshard"`
    keeps the steering with GShard's loss (share ≈ 0.34, per-step loss closest to GShard's).

    Args:
        num_experts, top_k, d_model: the layer's shapes.
        cost_model: `CostModel` whose topology has the EP group's W devices (rank r = device r).
        owner_E: rank computing each expert (default plain EP).
        target_WE: a fixed target (assignments per token) instead of the cost model's.
        options: `TAMoEOptions` (smoothing, steering rate and bound, loss).
    """

    observes = True
    topology_aware = True

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        d_model: int,
        cost_model: Any = None,
        owner_E: Sequence[int] | np.ndarray | None = None,
        target_WE: Any = None,
        options: TAMoEOptions | None = None,
    ) -> None:
        super().__init__(positive_int("num_experts", num_experts))
        self.top_k = positive_int("top_k", top_k)
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.d_model = positive_int("d_model", d_model)
        self.options = options or TAMoEOptions()
        if (cost_model is None) == (target_WE is None):
            raise ValueError("TAMoEBalance: give exactly one of cost_model= or target_WE=")
        self.cost_model = cost_model
        self._targets: dict[int | None, np.ndarray] = {}
        if target_WE is not None:
            target = np.asarray(target_WE, dtype=np.float64)
            if target.ndim != 2 or target.shape[1] != num_experts:
                raise ValueError(f"target_WE shape {target.shape}: expected [W, num_experts={num_experts}]")
            if not np.all(np.isfinite(target)) or np.any(target <= 0):
                raise ValueError("target_WE: every entry must be finite and > 0 (the loss divides by it)")
            self.world_size = target.shape[0]
            self._targets[None] = target
        else:
            alpha_WW, _ = cost_model.pair_costs()
            self.world_size = alpha_WW.shape[0]
            self._alpha_free = bool(np.all(alpha_WW == 0))
        self.owner_E = check_owner(owner_E, num_experts, self.world_size)
        # One row per rank, identical on every rank (updated from global counts): replicated state.
        self.register_buffer("bias_WE", torch.zeros(self.world_size, num_experts))

    def reset_parameters(self) -> None:
        """Initial state (also after a meta-device build: `moeflow.training.init`): no steering."""
        with torch.no_grad():
            self.bias_WE.zero_()

    def target(self, tokens_per_rank: int) -> np.ndarray:
        """ĉ `[W, E]` (assignments per token) for S = `tokens_per_rank`; cached."""
        if None in self._targets:
            return self._targets[None]
        key = None if self._alpha_free else max(int(tokens_per_rank), 1)
        if key not in self._targets:
            self._targets[key] = target_dispatch_pattern(
                self.cost_model,
                self.num_experts,
                self.top_k,
                max(int(tokens_per_rank), 1),
                self.d_model,
                self.owner_E,
                self.options.smoothing,
            )
        return self._targets[key]

    def _check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank!r}: must be in [0, {self.world_size}) (the EP group of the cost model)")
        return int(rank)

    def selection_bias(self, rank: int | None = None) -> torch.Tensor | None:
        """Rank `rank`'s steering bias `[E]` while training (selection only; class docstring)."""
        if rank is None or not self.training or self.options.steer_rate == 0:
            return None
        return self.bias_WE[self._check_rank(rank)]

    def loss(self, routing: Routing, rank: int | None = None, counts_E: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's `Σ_e (c_ie / ĉ_ie) · m_ie` (unweighted; the layer applies `balance_weight`);
        GShard's loss with `loss="gshard"` or without a topology (`rank=None`)."""
        if rank is None or self.options.loss == "gshard":
            return gshard_loss(routing, self.num_experts)
        rank = self._check_rank(rank)
        if routing.num_tokens == 0:
            return routing.probs_TE.sum() * 0.0
        S = routing.num_tokens
        probs_TE = routing.probs_TE
        target_E = torch.as_tensor(self.target(S)[rank], dtype=probs_TE.dtype, device=probs_TE.device)
        c_E = routing.expert_counts(self.num_experts).to(probs_TE.dtype) / S
        return ((c_E / target_E) * probs_TE.mean(0)).sum()

    @torch.no_grad()
    def observe(self, choices_WE: torch.Tensor) -> None:
        """Once per optimizer step, with every rank's mean choices per forward (before capacity):
        `b_ie += u · sign(ĉ_ie · S_i − c_ie)`, clamped to ±`steer_limit`."""
        if self.options.steer_rate == 0:
            return
        choices = choices_WE.to(self.bias_WE.device, torch.float32)
        if choices.shape != self.bias_WE.shape:
            raise ValueError(f"choices_WE shape {tuple(choices.shape)}: expected {tuple(self.bias_WE.shape)}")
        tokens_W = choices.sum(1) / self.top_k
        target = torch.as_tensor(self.target(int(tokens_W.mean().round())), dtype=torch.float32)
        self.bias_WE += self.options.steer_rate * torch.sign(target.to(choices.device) * tokens_W[:, None] - choices)
        self.bias_WE.clamp_(-self.options.steer_limit, self.options.steer_limit)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, top_k={self.top_k}, world_size={self.world_size}, {self.options}"
