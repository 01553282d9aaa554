"""TA-MoE (NeurIPS'22) §3-4: the topology-aware target dispatch pattern, a linear program.

`target_dispatch_pattern` solves TA-MoE Eq. 2-4 — minimise the slowest rank-to-rank delivery
`max_ij (α_ij + β_ij · bytes_ij)` subject to (3) every rank sends all its k·S assignments and
(4) every expert receives the balanced share k·S·W/E — as a linear program (epigraph variable t,
`scipy.optimize.linprog` / HiGHS), then smooths the result towards uniform (TA-MoE §4.2, "to
prevent expert isolation"). α, β come from the `CostModel` (`CostModel.pair_costs`: profiled p2p
fits or the topology's links), never from hand-typed numbers. The balance term that steers the
gate towards this target is `moeflow.routing.ta_moe.TAMoEBalance`.

Closed forms (tested): homogeneous → uniform; 2-level symmetric tree with m devices per node,
α = 0 → every pair is tight, β₁·x = β₂·y with m·x + (W−m)·y = k (x, y: volume per same-node and
per remote device). A balance written as m·x·β₁ = (W−m)·y·β₂ agrees with this only for two nodes
(W = 2m); for more nodes we follow Eq. 2, the problem the LP solves (docs/ta-moe.md).

Units: a target ĉ is returned in **assignments per token of the sending rank** (the paper's
`c_ie / S`): rows sum to k, columns to k·W/E, uniform = k/E. Multiply by S for assignments.

Shape suffixes: W ranks in the expert-parallel group, E experts.
    alpha_WW   start-up time of a delivery i -> j (s)
    beta_WW    time per byte of a delivery i -> j (s/byte)
    c_WE       dispatch pattern: assignments per token rank w sends to expert e
    owner_E    rank that computes expert e (plain EP: e // (E/W))
    flow_WE    assignment counts rank w sends to expert e (the layer's `stats.flow`)

    cm = CostModel(Topology.from_spec([[0, 1], [2, 3]], [100e6, 2e9]), gemm_flops_per_s=1e11)
    c_WE = target_dispatch_pattern(cm, num_experts=8, top_k=2, tokens_per_rank=1024, d_model=512)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import sparse
from scipy.optimize import linprog

from moeflow.core.checks import finite_number, positive_int
from moeflow.core.placement import plain_ep_owners

# HiGHS defaults to 1e-7 feasibility tolerances; tighter ones make Eq. 3-4 hold to ~1e-12 (the
# LPs are tiny, so this costs nothing noticeable).
_HIGHS_OPTIONS = {"primal_feasibility_tolerance": 1e-10, "dual_feasibility_tolerance": 1e-10}

DEFAULT_SMOOTHING = 0.1
"""λ of `ĉ ← (1−λ)·ĉ + λ·uniform` (TA-MoE §4.2 smoothing; small and configurable)."""

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


def check_owner(owner_E: Any, num_experts: int, world_size: int) -> np.ndarray:
    if owner_E is None:
        return plain_ep_owners(num_experts, world_size)
    owner = np.asarray(owner_E)
    if owner.shape != (num_experts,) or not np.issubdtype(owner.dtype, np.integer):
        raise ValueError(f"owner_E={np.asarray(owner_E).tolist()!r}: expected {num_experts} integer rank ids")
    if owner.size and (owner.min() < 0 or owner.max() >= world_size):
        raise ValueError(f"owner_E={owner.tolist()!r}: rank ids must be in [0, {world_size})")
    return owner.astype(np.int64)


def solve_dispatch_lp(
    alpha_WW: np.ndarray,
    beta_WW: np.ndarray,
    owner_E: np.ndarray,
    top_k: int,
    bytes_per_rank: float,
) -> tuple[np.ndarray, float]:
    """The un-smoothed optimum of TA-MoE Eq. 2-4 → (c_WE in assignments per token, t* in seconds).
    (Long: half of it is this derivation.)

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
    alpha_WW = np.asarray(alpha_WW, dtype=np.float64)
    beta_WW = np.asarray(beta_WW, dtype=np.float64)
    W = alpha_WW.shape[0]
    if alpha_WW.shape != (W, W) or beta_WW.shape != (W, W):
        raise ValueError(f"alpha_WW/beta_WW shapes {alpha_WW.shape}/{beta_WW.shape}: expected square, equal")
    for name, m in (("alpha_WW", alpha_WW), ("beta_WW", beta_WW)):
        if not np.all(np.isfinite(m)) or np.any(m < 0):
            raise ValueError(f"{name}={m.tolist()!r}: entries must be finite and >= 0")
    top_k = positive_int("top_k", top_k)
    owner_arr = np.asarray(owner_E if owner_E is not None else [])
    if owner_arr.ndim != 1 or owner_arr.size == 0:
        raise ValueError(f"owner_E={owner_E!r}: expected a non-empty list of owner ranks, one per expert")
    owner_E = check_owner(owner_arr, owner_arr.size, W)
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
    A_eq = sparse.vstack(
        [
            sparse.kron(sparse.eye(W), np.ones((1, R))),  # Σ_j f_ij = k            (Eq. 3)
            sparse.kron(np.ones((1, W)), sparse.eye(R)),  # Σ_i f_ij = k·W·E_j/E    (Eq. 4, summed over j's experts)
        ]
    ).tocsr()
    b_eq = np.concatenate([np.full(W, float(top_k)), top_k * W * experts_W[recv_R] / E])

    f_P, t_star = _lp_fastest(a_P, b_P, A_eq, b_eq)
    tie_broken = _lp_closest_to_uniform(a_P, b_P, A_eq, b_eq, t_star, np.tile(top_k * experts_W[recv_R] / E, W))
    f_WR = np.clip((f_P if tie_broken is None else tie_broken).reshape(W, R), 0.0, None)
    f_WW = np.zeros((W, W))
    f_WW[:, recv_R] = f_WR
    c_WE = f_WW[:, owner_E] / experts_W[owner_E]
    return c_WE, t_star * cost_scale


def _lp_fastest(a_P, b_P, A_eq, b_eq) -> tuple[np.ndarray, float]:
    """Stage 1: min t s.t. a_ij + b_ij·f_ij <= t (Eq. 2 in epigraph form) and Eq. 3-4 -> (f, t*)."""
    n = a_P.size  # f variables, row-major (sender i, receiver r)
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
    return res.x[:n], float(res.x[-1])


def _lp_closest_to_uniform(a_P, b_P, A_eq, b_eq, t_star: float, u_P) -> np.ndarray | None:
    """Stage 2: min Σ d_ij, d_ij >= |f_ij − u_ij| (u = uniform pair volume k·E_j/E), every pair
    within a hair of t* — which is just an upper bound on each f_ij. The slack keeps it feasible
    despite HiGHS's own tolerances; None if HiGHS still calls it infeasible (stage 2 only breaks
    ties, so the stage-1 optimum is just as good for Eq. 2)."""
    n = a_P.size
    slack = 1e-9 * max(1.0, abs(t_star))
    with np.errstate(divide="ignore"):
        upper_P = np.where(b_P > 0, (t_star + slack - a_P) / b_P, np.inf)
    eye = sparse.eye(n)
    res = linprog(
        c=np.r_[np.zeros(n), np.ones(n)],
        A_ub=sparse.vstack([sparse.hstack([eye, -eye]), sparse.hstack([-eye, -eye])]).tocsr(),
        b_ub=np.r_[u_P, -u_P],
        A_eq=sparse.hstack([A_eq, sparse.csr_matrix(A_eq.shape)]).tocsr(),
        b_eq=b_eq,
        bounds=[(0, max(0.0, ub)) for ub in upper_P] + [(0, None)] * n,
        method="highs",
        options=_HIGHS_OPTIONS,
    )
    return res.x[:n] if res.status == 0 else None


def smooth_towards_uniform(c_WE: np.ndarray, top_k: int, smoothing: float = DEFAULT_SMOOTHING) -> np.ndarray:
    """`ĉ ← (1−λ)·ĉ + λ·uniform` (TA-MoE §4.2 smoothing against expert isolation).

    A convex combination of two patterns that satisfy Eq. 3-4 satisfies them too; with λ > 0
    every entry is at least λ·k/E, so no expert is starved of any rank's tokens.
    """
    smoothing = finite_number("smoothing", smoothing, 0.0, 1.0)
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

    `cost_model`: a `CostModel` (α-β of every pair from `CostModel.pair_costs`).
    `owner_E`: rank computing each expert (default plain EP over the topology's W devices).
    `bytes_per_element`: default the cost model's.
    """
    alpha_WW, beta_WW = cost_model.pair_costs()
    W = alpha_WW.shape[0]
    num_experts = positive_int("num_experts", num_experts)
    top_k = positive_int("top_k", top_k)
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    tokens_per_rank = positive_int("tokens_per_rank", tokens_per_rank)
    d_model = positive_int("d_model", d_model)
    if bytes_per_element is None:
        bytes_per_element = cost_model.bytes_per_element
    bytes_per_element = positive_int("bytes_per_element", bytes_per_element)
    owner = check_owner(owner_E, num_experts, W)
    smoothing = finite_number("smoothing", smoothing, 0.0, 1.0)
    c_WE, _ = solve_dispatch_lp(alpha_WW, beta_WW, owner, top_k, float(tokens_per_rank * d_model * bytes_per_element))
    return smooth_towards_uniform(c_WE, top_k, smoothing)


def flow_from_target(c_WE: Any, tokens_per_rank: int) -> np.ndarray:
    """Integer assignment counts `flow_WE` (int64) that realise a pattern for S tokens per rank:
    `c_WE · S` rounded by largest remainder so that every row keeps its exact total (k·S for a
    target). For simulators and benchmarks that need the dispatch a target asks for."""
    c = np.asarray(c_WE, dtype=np.float64)
    if c.ndim != 2 or not np.all(np.isfinite(c)) or np.any(c < 0):
        raise ValueError(f"c_WE shape {c.shape}: expected a [W, E] array of finite entries >= 0")
    tokens_per_rank = positive_int("tokens_per_rank", tokens_per_rank, minimum=0)
    raw = c * tokens_per_rank
    flow = np.floor(raw).astype(np.int64)
    short_W = np.rint(raw.sum(1)).astype(np.int64) - flow.sum(1)
    for i in np.flatnonzero(short_W > 0):
        flow[i, np.argsort(flow[i] - raw[i], kind="stable")[: short_W[i]]] += 1
    return flow
