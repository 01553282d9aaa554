"""TA-MoE (NeurIPS'22): topology-aware target dispatch pattern and auxiliary loss (SPEC §2).

Two pieces:

* `target_dispatch_pattern` solves TA-MoE Eq. 2-4 — minimise the slowest rank-to-rank delivery
  `max_ij (α_ij + β_ij · bytes_ij)` subject to (3) every rank sends all its k·S assignments and
  (4) every expert receives the balanced share k·S·W/E — as a linear program (epigraph variable t,
  `scipy.optimize.linprog` / HiGHS), then smooths the result towards uniform (TA-MoE §4.2, "to
  prevent expert isolation"). α, β come from the `CostModel` (profiled p2p fits or the topology's
  links), never from hand-typed numbers.
* `TAMoEBalance` (`balance="ta_moe"`) replaces the GShard term `E·Σ_e f_e·P_e` with
  `Σ_e (c_ie / ĉ_ie) · m_ie`, which pulls this rank's dispatch counts towards its row of ĉ.

Closed forms (tested): homogeneous → uniform; 2-level symmetric tree with m devices per node,
α = 0 → every pair is tight, β₁·x = β₂·y with m·x + (W−m)·y = k (x, y: volume per same-node and
per remote device). SPEC §2 writes the balance as m·x·β₁ = (W−m)·y·β₂, which is the same for two
nodes (W = 2m) only; for more nodes we follow Eq. 2, the problem the LP solves.

Units: a target ĉ is returned in **assignments per token of the sending rank** (the paper's
`c_ie / S`): rows sum to k, columns to k·W/E, uniform = k/E. Multiply by S for assignments.

Shape suffixes: W ranks in the expert-parallel group, E experts, T tokens on this rank,
A assignments on this rank.
    alpha_WW   start-up time of a delivery i -> j (s)
    beta_WW    time per byte of a delivery i -> j (s/byte)
    c_WE       dispatch pattern: assignments per token rank w sends to expert e
    owner_E    rank that computes expert e (plain EP: e // (E/W))
    flow_WE    assignment counts rank w sends to expert e (the layer's `stats.flow`)

    cm = CostModel(Topology.from_spec([[0, 1], [2, 3]], [100e6, 2e9]), gemm_flops_per_s=1e11)
    c_WE = target_dispatch_pattern(cm, num_experts=8, top_k=2, tokens_per_rank=1024, d_model=512)
    layer = MoELayer(512, 1024, 8, top_k=2, balance="ta_moe", cost_model=cm)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from moeflow.routing.gates import Routing

# HiGHS defaults to 1e-7 feasibility tolerances; tighter ones make Eq. 3-4 hold to ~1e-12 (the
# LPs are tiny, so this costs nothing noticeable).
_HIGHS_OPTIONS = {"primal_feasibility_tolerance": 1e-10, "dual_feasibility_tolerance": 1e-10}

DEFAULT_SMOOTHING = 0.1
"""λ of `ĉ ← (1−λ)·ĉ + λ·uniform` (SPEC §2: "a small λ, configurable")."""
DEFAULT_STEER_RATE = 1e-3
"""Step of the per-rank selection bias towards the target (0 = the loss alone)."""

# TA-MoE §3.3 Table 1 on [[0,1],[0̂,1̂]] (row = source; devices 0,1 on node 0, 2,3 on node 1), as
# shares of each source's data: even 1/4 each; uneven self 1/4, neighbour 1/2, each remote 1/8.
TABLE1_EVEN = np.full((4, 4), 1 / 4)
TABLE1_UNEVEN = np.array(
    [
        [1 / 4, 1 / 2, 1 / 8, 1 / 8],
        [1 / 2, 1 / 4, 1 / 8, 1 / 8],
        [1 / 8, 1 / 8, 1 / 4, 1 / 2],
        [1 / 8, 1 / 8, 1 / 2, 1 / 4],
    ]
)


def _check_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}={value!r} must be an int")
    if value < minimum:
        raise ValueError(f"{name}={value!r} must be >= {minimum}")
    return int(value)


def _check_smoothing(smoothing: Any, allow_zero: bool = True) -> float:
    if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)):
        raise TypeError(f"smoothing={smoothing!r} must be a number in [0, 1]")
    low_ok = smoothing >= 0 if allow_zero else smoothing > 0
    if not (math.isfinite(smoothing) and low_ok and smoothing <= 1):
        bound = "[0, 1]" if allow_zero else "(0, 1]"
        raise ValueError(f"smoothing={smoothing!r} must be in {bound}")
    return float(smoothing)


def plain_ep_owners(num_experts: int, world_size: int) -> np.ndarray:
    """owner_E of plain expert parallelism: rank r owns `[r·E/W, (r+1)·E/W)` (DESIGN.md §3.1)."""
    _check_int("num_experts", num_experts)
    _check_int("world_size", world_size)
    if num_experts % world_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by world_size={world_size} (plain EP)")
    return np.arange(num_experts, dtype=np.int64) // (num_experts // world_size)


def _check_owner(owner_E: Any, num_experts: int, world_size: int) -> np.ndarray:
    if owner_E is None:
        return plain_ep_owners(num_experts, world_size)
    owner = np.asarray(owner_E)
    if owner.shape != (num_experts,) or not np.issubdtype(owner.dtype, np.integer):
        raise ValueError(f"owner_E={np.asarray(owner_E).tolist()!r}: expected {num_experts} integer rank ids")
    if owner.size and (owner.min() < 0 or owner.max() >= world_size):
        raise ValueError(f"owner_E={owner.tolist()!r}: rank ids must be in [0, {world_size})")
    return owner.astype(np.int64)


def pair_cost_matrices(cost_model: Any) -> tuple[np.ndarray, np.ndarray]:
    """α_WW (s) and β_WW (s/byte) of every delivery i -> j (TA-MoE §4.1) from a `CostModel`
    (or a `Topology`, priced by its links).

    Uses `CostModel.p2p_time`, so a profiled `p2p_intra`/`p2p_inter` fit wins over the topology's
    link figures (latency + bytes / bottleneck bandwidth of the route), as SPEC §2 asks.

    The self delivery i -> i has no route; we price it like the cheapest delivery from i to any
    other device. Why: TA-MoE §4.2 states that on a homogeneous network *every* one of the P·P
    deliveries shares the same α, β and the target is uniform; and the 2-level closed form of
    SPEC §2 counts the sender among the m devices of its node at the intra-node cost. Pricing
    the self copy at 0 instead would make "keep everything local" optimal on any network.
    """
    from moeflow.perf.costmodel import CostModel
    from moeflow.perf.topology import Topology

    if isinstance(cost_model, Topology):
        # The no-fit branch of CostModel.p2p_time is the topology's link model; FLOP/s are unused.
        cost_model = CostModel(cost_model, gemm_flops_per_s=1.0)
    if not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model={cost_model!r}: expected a moeflow CostModel or Topology")
    W = cost_model.topology.num_devices
    alpha_WW, beta_WW = np.zeros((W, W)), np.zeros((W, W))
    probe = 1e9  # bytes: β from the slope over a large message, exact for an affine model
    for i in range(W):
        for j in range(W):
            if i != j:
                alpha_WW[i, j] = float(cost_model.p2p_time(0.0, i, j))
                beta_WW[i, j] = (float(cost_model.p2p_time(probe, i, j)) - alpha_WW[i, j]) / probe
    if W > 1:
        off_WW = ~np.eye(W, dtype=bool)
        for i in range(W):
            cheapest = np.flatnonzero(off_WW[i])[np.argmin(beta_WW[i, off_WW[i]])]
            alpha_WW[i, i], beta_WW[i, i] = alpha_WW[i, cheapest], beta_WW[i, cheapest]
    return alpha_WW, beta_WW


def solve_dispatch_lp(
    alpha_WW: np.ndarray,
    beta_WW: np.ndarray,
    owner_E: np.ndarray,
    top_k: int,
    bytes_per_rank: float,
) -> tuple[np.ndarray, float]:
    """The un-smoothed optimum of TA-MoE Eq. 2-4 → (c_WE in assignments per token, t* in seconds).

    The problem on c_ie >= 0 (per token of rank i), in epigraph form (Eq. 2):

        min t  s.t.  α_ij + β_ij · bytes_per_rank · Σ_{e: owner(e)=j} c_ie <= t   for every pair i, j
                     Σ_e c_ie = k          (Eq. 3: rank i sends all its k·S assignments)
                     Σ_i c_ie = k·W/E      (Eq. 4: every expert gets the balanced share)

    `bytes_per_rank` = S·d·bytes per element: the bytes rank i would send if its c_i· summed to 1.

    We solve it on the pair volumes f_ij = Σ_{e on j} c_ie, which is exact and W²-sized whatever
    E is (a 64-device cluster with 256 experts: 4k variables instead of 16k, seconds instead of
    half a minute): the objective only sees f; any feasible c sums to an f with row sums k and
    column sums k·W·E_j/E (E_j = experts owned by j); and any such f gives back a feasible c
    by spreading f_ij evenly over j's experts, c_ie = f_ij / E_j (column sums are then exactly
    k·W/E). The optimum is rarely unique (only bottleneck pairs are tight), so stage 2 picks,
    among the stage-1 optima, the f closest to uniform in ℓ1 — the least change to routing that
    reaches the best time. For a fixed f, the even spread is also the ℓ1-closest c to uniform
    (convexity), so it solves the ℓ1 tie-break on c too. Uniform is always feasible.
    """
    from scipy import sparse
    from scipy.optimize import linprog

    alpha_WW = np.asarray(alpha_WW, dtype=np.float64)
    beta_WW = np.asarray(beta_WW, dtype=np.float64)
    W = alpha_WW.shape[0]
    if alpha_WW.shape != (W, W) or beta_WW.shape != (W, W):
        raise ValueError(f"alpha_WW/beta_WW shapes {alpha_WW.shape}/{beta_WW.shape}: expected square, equal")
    for name, m in (("alpha_WW", alpha_WW), ("beta_WW", beta_WW)):
        if not np.all(np.isfinite(m)) or np.any(m < 0):
            raise ValueError(f"{name}={m.tolist()!r}: entries must be finite and >= 0")
    top_k = _check_int("top_k", top_k)
    owner_arr = np.asarray(owner_E if owner_E is not None else [])
    if owner_arr.ndim != 1 or owner_arr.size == 0:
        raise ValueError(f"owner_E={owner_E!r}: expected a non-empty list of owner ranks, one per expert")
    owner_E = _check_owner(owner_arr, owner_arr.size, W)
    E = owner_E.shape[0]
    if not (math.isfinite(bytes_per_rank) and bytes_per_rank > 0):
        raise ValueError(f"bytes_per_rank={bytes_per_rank!r} must be a positive finite number")
    uniform_WE = np.full((W, E), top_k / E)

    experts_W = np.bincount(owner_E, minlength=W)
    recv_R = np.flatnonzero(experts_W)  # ranks that own experts; others receive nothing, no α paid
    R = recv_R.size
    a_WR = alpha_WW[:, recv_R]
    b_WR = beta_WW[:, recv_R] * bytes_per_rank
    cost_scale = float((a_WR + b_WR * top_k).max())  # all k of a token to one peer
    if W == 1 or cost_scale == 0:
        return uniform_WE, 0.0
    # Scaled to O(1) coefficients (α ~ µs, β ~ 1e-10 s/byte): HiGHS tolerances are absolute.
    a_P, b_P = (a_WR / cost_scale).reshape(-1), (b_WR / cost_scale).reshape(-1)
    n = W * R  # f variables, row-major (sender i, receiver r)
    A_eq = sparse.vstack(
        [
            sparse.kron(sparse.eye(W), np.ones((1, R))),  # Σ_j f_ij = k            (Eq. 3)
            sparse.kron(np.ones((1, W)), sparse.eye(R)),  # Σ_i f_ij = k·W·E_j/E    (Eq. 4, summed over j's experts)
        ]
    ).tocsr()
    b_eq = np.concatenate([np.full(W, float(top_k)), top_k * W * experts_W[recv_R] / E])

    # Stage 1: min t s.t. b_ij·f_ij − t <= −a_ij.
    res = linprog(
        c=np.r_[np.zeros(n), 1.0],
        A_ub=sparse.hstack([sparse.diags(b_P), -np.ones((n, 1))]).tocsr(),
        b_ub=-a_P,
        A_eq=sparse.hstack([A_eq, sparse.csr_matrix((A_eq.shape[0], 1))]).tocsr(),
        b_eq=b_eq,
        bounds=[(0, None)] * n + [(None, None)],
        method="highs",
        options=_HIGHS_OPTIONS,
    )
    if res.status != 0:
        raise RuntimeError(f"TA-MoE LP (stage 1) failed: {res.message}")
    t_star = float(res.x[-1])

    # Stage 2: min Σ d_ij, d_ij >= |f_ij − u_ij| (u = uniform pair volume k·E_j/E), every pair
    # within a hair of t* — which is just an upper bound on each f_ij. The slack keeps stage 2
    # feasible despite HiGHS's own tolerances.
    slack = 1e-9 * max(1.0, abs(t_star))
    with np.errstate(divide="ignore"):
        upper_P = np.where(b_P > 0, (t_star + slack - a_P) / b_P, np.inf)
    u_P = np.tile(top_k * experts_W[recv_R] / E, W)
    eye = sparse.eye(n)
    res2 = linprog(
        c=np.r_[np.zeros(n), np.ones(n)],
        A_ub=sparse.vstack([sparse.hstack([eye, -eye]), sparse.hstack([-eye, -eye])]).tocsr(),
        b_ub=np.r_[u_P, -u_P],
        A_eq=sparse.hstack([A_eq, sparse.csr_matrix(A_eq.shape)]).tocsr(),
        b_eq=b_eq,
        bounds=[(0, max(0.0, ub)) for ub in upper_P] + [(0, None)] * n,
        method="highs",
        options=_HIGHS_OPTIONS,
    )
    # Stage 2 only breaks ties; should HiGHS call it infeasible at this slack, the stage-1 optimum
    # is just as good for Eq. 2.
    f_WR = np.clip((res2.x if res2.status == 0 else res.x)[:n].reshape(W, R), 0.0, None)
    f_WW = np.zeros((W, W))
    f_WW[:, recv_R] = f_WR
    c_WE = f_WW[:, owner_E] / experts_W[owner_E]
    return c_WE, t_star * cost_scale


def smooth_towards_uniform(c_WE: np.ndarray, top_k: int, smoothing: float = DEFAULT_SMOOTHING) -> np.ndarray:
    """`ĉ ← (1−λ)·ĉ + λ·uniform` (TA-MoE §4.2 smoothing against expert isolation, SPEC §2).

    A convex combination of two patterns that satisfy Eq. 3-4 satisfies them too; with λ > 0
    every entry is at least λ·k/E, so no expert is starved of any rank's tokens.
    """
    smoothing = _check_smoothing(smoothing)
    c_WE = np.asarray(c_WE, dtype=np.float64)
    return (1.0 - smoothing) * c_WE + smoothing * top_k / c_WE.shape[1]


def target_dispatch_pattern(
    cost_model: Any,
    num_experts: int,
    top_k: int,
    tokens_per_rank: int,
    d_model: int,
    owner_E: Sequence[int] | np.ndarray | None = None,
    smoothing: float = DEFAULT_SMOOTHING,
    bytes_per_element: int | None = None,
) -> np.ndarray:
    """TA-MoE target ĉ `[W, E]` in assignments per token of the sender (rows sum to k, columns
    to k·W/E, uniform = k/E) for S = `tokens_per_rank` tokens of `d_model` elements per rank.

    `cost_model`: a `CostModel` (α-β from its p2p fits or topology) or a `Topology`.
    `owner_E`: rank computing each expert (default plain EP over the topology's W devices).
    `bytes_per_element`: default the cost model's (4 for a bare Topology).
    """
    alpha_WW, beta_WW = pair_cost_matrices(cost_model)
    W = alpha_WW.shape[0]
    num_experts = _check_int("num_experts", num_experts)
    top_k = _check_int("top_k", top_k)
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    tokens_per_rank = _check_int("tokens_per_rank", tokens_per_rank)
    d_model = _check_int("d_model", d_model)
    if bytes_per_element is None:
        bytes_per_element = getattr(cost_model, "bytes_per_element", 4)
    bytes_per_element = _check_int("bytes_per_element", bytes_per_element)
    owner = _check_owner(owner_E, num_experts, W)
    smoothing = _check_smoothing(smoothing)
    c_WE, _ = solve_dispatch_lp(alpha_WW, beta_WW, owner, top_k, float(tokens_per_rank * d_model * bytes_per_element))
    return smooth_towards_uniform(c_WE, top_k, smoothing)


def flow_from_target(c_WE: Any, tokens_per_rank: int) -> np.ndarray:
    """Integer assignment counts `flow_WE` (int64) that realise a pattern for S tokens per rank:
    `c_WE · S` rounded by largest remainder so that every row keeps its exact total (k·S for a
    target). For simulators and benchmarks that need the dispatch a target asks for."""
    c = np.asarray(c_WE, dtype=np.float64)
    if c.ndim != 2 or not np.all(np.isfinite(c)) or np.any(c < 0):
        raise ValueError(f"c_WE shape {c.shape}: expected a [W, E] array of finite entries >= 0")
    tokens_per_rank = _check_int("tokens_per_rank", tokens_per_rank, minimum=0)
    raw = c * tokens_per_rank
    flow = np.floor(raw).astype(np.int64)
    short_W = np.rint(raw.sum(1)).astype(np.int64) - flow.sum(1)
    for i in np.flatnonzero(short_W > 0):
        flow[i, np.argsort(flow[i] - raw[i], kind="stable")[: short_W[i]]] += 1
    return flow


def cross_node_share(flow_WE: Any, owner_E: Any, node_of: Sequence[int]) -> float:
    """Share of the assignments in `flow_WE` whose expert's owner is on another node than the
    sender (0.0 when there are no assignments). Works on counts or on a pattern such as ĉ.
    Counted by owner: under a placement with copies (shadowing) some of these are served locally."""
    flow = np.asarray(flow_WE.cpu() if isinstance(flow_WE, torch.Tensor) else flow_WE, dtype=np.float64)
    if flow.ndim != 2:
        raise ValueError(f"flow_WE shape {flow.shape}: expected [W, E]")
    W, E = flow.shape
    node = np.asarray(node_of)
    if node.shape != (W,) or not np.issubdtype(node.dtype, np.integer):
        raise ValueError(f"node_of={list(node_of)!r}: expected {W} integer node ids (one per rank)")
    owner = _check_owner(np.asarray(owner_E), E, W)
    if np.any(flow < 0):
        raise ValueError(f"flow_WE={flow.tolist()!r}: counts must be >= 0")
    total = flow.sum()
    if total == 0:
        return 0.0
    crosses_WE = node[:, None] != node[owner][None, :]
    return float(flow[crosses_WE].sum() / total)


class TAMoEBalance(nn.Module):
    """`balance="ta_moe"`: TA-MoE's topology-aware auxiliary loss (SPEC §2).

    For rank i with S tokens: `c_ie` = assignments (all k choices, before capacity) from rank i to
    expert e, divided by S; `m_ie` = mean over its tokens of softmax(gate)_e;
    `L_i = Σ_e (c_ie / ĉ_ie) · m_ie`. With ĉ in the same per-token units as c, a uniform target
    ĉ = k/E gives `c_ie/ĉ_ie = E·f_e` and L_i = E·Σ_e f_e·P_e, the GShard loss, exactly — so the
    scale factor is 1 and the usual `balance_weight` applies unchanged. Gradient flows through
    m only (c is a count): experts with more traffic than targeted (c/ĉ large) are pushed down.

    The target depends on S through the bytes of a delivery (TA-MoE Eq. 2): α is a fixed cost per
    pair, so the larger S, the less α matters. S is known only at the first forward, so targets
    are computed lazily and cached per token count. When every α is 0, scaling the bytes scales
    all pair costs alike and the argmin does not move: one target serves every S.

    Steering (our addition, measured in docs/strategies.md): the gate is a dense parameter averaged
    over all ranks and every rank sees i.i.d. tokens, so the loss's rank-dependent pulls cancel on a
    symmetric topology (rank 0 pulls towards its node's experts, rank 2 towards its own) and the
    dispatch does not move. A per-rank selection bias, updated like DeepSeek-V3's aux-free bias
    but towards the target (`b_ie += u · sign(ĉ_ie · S_i − c_ie)`), makes the target reachable:
    it changes which experts are *selected*, never the combine weights, and keeps every expert's
    global load balanced because ĉ is (TA-MoE constraint 4). The `[W, E]` table is updated from the
    global flow on every rank alike, so it is replicated state. `steer_rate=0` is the loss alone.

    Args:
        num_experts, top_k, d_model: the layer's shapes.
        cost_model: `CostModel` whose topology has the EP group's W devices (rank r = device r).
        owner_E: rank computing each expert (default plain EP).
        smoothing: λ in (0, 1] (λ = 0 could leave ĉ_ie = 0 and the loss undefined).
        target_WE: a fixed target (assignments per token) instead of the cost model's.
        steer_rate: u of the per-rank selection bias (0: the loss alone).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        d_model: int,
        cost_model: Any = None,
        owner_E: Sequence[int] | np.ndarray | None = None,
        smoothing: float = DEFAULT_SMOOTHING,
        target_WE: Any = None,
        steer_rate: float = DEFAULT_STEER_RATE,
    ) -> None:
        super().__init__()
        self.num_experts = _check_int("num_experts", num_experts)
        self.top_k = _check_int("top_k", top_k)
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.d_model = _check_int("d_model", d_model)
        self.smoothing = _check_smoothing(smoothing, allow_zero=False)
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
            self.owner_E = _check_owner(owner_E, num_experts, self.world_size)
            self._targets[None] = target
        else:
            alpha_WW, _ = pair_cost_matrices(cost_model)
            self.world_size = alpha_WW.shape[0]
            self.owner_E = _check_owner(owner_E, num_experts, self.world_size)
            self._alpha_free = bool(np.all(alpha_WW == 0))
        if not (steer_rate >= 0 and np.isfinite(steer_rate)):
            raise ValueError(f"steer_rate={steer_rate!r} must be a finite number >= 0")
        self.steer_rate = float(steer_rate)
        # One row per rank, identical on every rank (updated from the global flow): replicated state.
        self.register_buffer("bias_WE", torch.zeros(self.world_size, num_experts))

    def target(self, tokens_per_rank: int) -> np.ndarray:
        """ĉ `[W, E]` (assignments per token) for S = `tokens_per_rank`; cached."""
        if None in self._targets:
            return self._targets[None]
        key = None if self._alpha_free else int(tokens_per_rank)
        if key not in self._targets:
            self._targets[key] = target_dispatch_pattern(
                self.cost_model,
                self.num_experts,
                self.top_k,
                max(int(tokens_per_rank), 1),
                self.d_model,
                self.owner_E,
                self.smoothing,
            )
        return self._targets[key]

    def selection_bias(self, rank: int = 0) -> torch.Tensor | None:
        """Rank `rank`'s steering bias `[E]` (selection only; see the class docstring)."""
        return self.bias_WE[rank] if self.steer_rate > 0 else None

    def loss(self, routing: Routing, rank: int = 0) -> torch.Tensor:
        """This rank's `Σ_e (c_ie / ĉ_ie) · m_ie` (unweighted; the layer applies `balance_weight`)."""
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank!r}: must be in [0, {self.world_size}) (the EP group of the cost model)")
        if routing.num_tokens == 0:
            return routing.probs_TE.sum() * 0.0
        S = routing.num_tokens
        probs_TE = routing.probs_TE
        target_E = torch.as_tensor(self.target(S)[rank], dtype=probs_TE.dtype, device=probs_TE.device)
        c_E = torch.bincount(routing.expert_A, minlength=self.num_experts).to(probs_TE.dtype) / S
        m_E = probs_TE.mean(0)
        return ((c_E / target_E) * m_E).sum()

    @torch.no_grad()
    def observe(self, flow_WE: torch.Tensor) -> None:
        """After a training forward: move every rank's bias towards its target row,
        `b_ie += u · sign(ĉ_ie · S_i − c_ie)` (DeepSeek-V3's aux-free rule, per rank)."""
        if not self.training or self.steer_rate == 0:
            return
        flow = flow_WE.to(self.bias_WE.device, torch.float32)
        if flow.shape != self.bias_WE.shape:
            raise ValueError(f"flow_WE shape {tuple(flow.shape)}: expected {tuple(self.bias_WE.shape)}")
        tokens_W = flow.sum(1) / self.top_k
        target = torch.as_tensor(self.target(int(tokens_W.mean().round())), dtype=torch.float32)
        self.bias_WE += self.steer_rate * torch.sign(target.to(flow.device) * tokens_W[:, None] - flow)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, world_size={self.world_size}, "
            f"smoothing={self.smoothing}"
        )


def balance_from_context(ctx: Any) -> TAMoEBalance:
    """Factory for `BALANCES["ta_moe"]` (`moeflow.routing.balance.BalanceContext` -> module)."""
    if ctx.cost_model is None:
        raise ValueError(
            "balance='ta_moe' needs a cost model for its target pattern: "
            "MoELayer(..., balance='ta_moe', cost_model=CostModel...) (got cost_model=None)"
        )
    return TAMoEBalance(ctx.num_experts, ctx.top_k, ctx.d_model, cost_model=ctx.cost_model)
