"""FSMoE's pipeline-degree optimiser as pure functions of numbers (FSMoE §4.1 Eq. 1, §4.2
predicates Q1–Q7 and Cases 1–4 with Eq. 2, §4.3 Algorithm 1, §4.4 forward and backward apart).

Its inputs — the layer's workloads n_x and the α-β fits, in FSMoE's units — are
`perf.pipeline_inputs`. One of r chunks takes ``t_x,r = α_x + (n_x/r)·β_x`` (Eq. 1).

The cases, as the paper writes them (§4.2; the four formulas below match its text):
Case 1 (inter-node incl. Gradient-AllReduce dominates) ``2r·t_a2a,r + t_gar`` (Eq. 2);
Case 2 (experts) ``2·t_a2a,r + t_ag,r + t_rs,r + r·t_exp,r``; Case 3 (all-to-all)
``2r·t_a2a,r + t_ag,r + t_rs,r``; Case 4 (intra-node) ``2·t_a2a,r + r·t_ag,r + r·t_rs,r``.
Algorithm 1 minimises each case over continuous r (SLSQP, the case's predicates as inequality
constraints, one sub-problem per conjunction of a disjunctive case), keeps the best and snaps r to
an integer. The paper leaves SLSQP's start open: each sub-problem starts from its best feasible
degree on a log grid of [1, r_max] (none feasible: the sub-problem is empty). Backward (§4.4):
α_exp and β_exp doubled, ``t_gar`` from §5 (``grad_partition``).

Pricing an integer r: by the case whose predicates hold at r. The four cases partition r ≥ 1 and
each case is the largest of the formulas where it holds (Q2, Q3 compare Case 2 with Cases 3 and 4;
Q4–Q7 compare Case 1 with the others), so this is the max of the four formulas when
``t_ag,r = t_rs,r`` (the paper's assumption under Q1): a lower bound of the pipeline by each of its
resources, the binding one. Every formula is ``a·r + b/r + c`` with a, b ≥ 0, so that max is
convex in r and the snapped optimum is one of the candidates next to a case's continuous optimum.

Deviations, recorded:
* α_exp: §4.1 multiplies α_gemm by the N GEMMs of an expert; the published tool pays α_gemm once
  per chunk. Default ``expert_alpha="once"`` (the tool, which gives its published degrees 8 and
  [8, 8]); ``"per_gemm"`` is §4.1 (with the tool's constants it gives backward degree 4).
* r is bounded above by the largest candidate degree (the paper only states r ≥ 1).
* Predicates are non-strict as SLSQP constraints (``≥ 0``); the case formulas agree on every
  boundary, so this changes no time.
* A measured per-chunk cost (``PipelineFits.chunk_ms``, ``moeflow profile``'s ``chunk_*`` fits,
  ``profiling.chunk_profile``) is added to α_exp of its pass: where the chunks' collectives share the
  computing cores (CPU ranks on gloo) one more chunk costs milliseconds, not the ops' µs α, and that
  cost lands on the experts' critical path r times (Case 2). 0 for FSMoE's constants.
* Overlap realised (``PassModel.overlap``, η): the case formulas assume that what the chunks
  overlap is hidden. Where the machine hides only a share η of it (CPU ranks on gloo: the
  transfers run on the computing cores; ``profiling.chunk_profile`` measures η), an integer r is priced
  ``η·case formula + (1 − η)·serial``, serial = ``r·(2·t_a2a,r + t_ag,r + t_rs,r + t_exp,r) + t_gar``
  (every stage of every chunk one after another), and every candidate degree is priced (the SLSQP
  optima are those of η = 1). η = 1 (FSMoE's constants, GPUs): the paper's model unchanged.
  Measured on the 2 × 2 CPU testbed: without η the model priced r = 1 and 2 within 2%, r = 2 ran
  11% slower (docs/fsmoe.md).
* Rules of the published tool not applied; where they decide, it picks a degree that Eq. 1 and
  the §4.2 cases price slower than moeflow's (tests/test_fsmoe_tool_agreement.py: on 144 layers ×
  3 α-β sets the degrees agree but where these rules or ``grad_partition``'s deviations decide):
  - forward degree 1 when one unchunked all-to-all takes < 1 ms: a fixed threshold on the
    all-to-all alone, while chunks also overlap the ESP all-gather and reduce-scatter with the
    experts; what a chunk costs beyond its α is measured instead (``chunk_ms``, η);
  - the backward degree of the layer that hides no gradient (the model's last) is 1 whenever the
    forward's is: §4.4 chooses the passes apart, and the backward's doubled expert work can pay
    for chunks where the forward's does not;
  - a snapped degree is priced only inside the case of the SLSQP optimum it neighbours (one
    start per sub-problem), so a cheaper neighbour in another case is dropped; here every
    neighbour is priced by the case that holds at it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from scipy import optimize

from moeflow.core.checks import finite_number, positive_int
from moeflow.perf.pipeline_inputs import PipelineFits, PipelineWorkload

PUBLISHED_DEGREES = (1, 2, 4, 8)
"""The degrees the published tool snaps to."""
CASES = (1, 2, 3, 4)
# Each case is a disjunction of conjunctions of (predicate number, wanted truth value), §4.2.
CASE_BRANCHES: dict[int, tuple[tuple[tuple[int, bool], ...], ...]] = {
    1: (
        ((1, True), (2, False), (4, True)),
        ((1, True), (2, True), (5, True)),
        ((1, False), (3, False), (6, True)),
        ((1, False), (3, True), (7, True)),
    ),
    2: (((1, True), (2, True), (5, False)), ((1, False), (3, True), (7, False))),
    3: (((1, True), (2, False), (4, False)),),
    4: (((1, False), (3, False), (6, False)),),
}
ExpertAlpha = Literal["once", "per_gemm"]


@dataclass(frozen=True)
class PassModel:
    """Algorithm 1's inputs for one pass: per op (a2a, ag, rs, exp) α_x and ``n_x·β_x`` in ms."""

    alpha_ms: tuple[float, float, float, float]
    volume_ms: tuple[float, float, float, float]
    overlap: float = 1.0
    """η: the share of the overlap the case formulas assume that the machine realises (module
    docstring; 1: FSMoE's model)."""

    def __post_init__(self) -> None:
        finite_number("overlap", self.overlap, 0.0, 1.0)

    def chunk_times(self, r: Any) -> np.ndarray:
        """``[4, ...]``: t_a2a,r, t_ag,r, t_rs,r, t_exp,r (Eq. 1)."""
        r = np.asarray(r, dtype=np.float64)
        return np.stack([a + v / r for a, v in zip(self.alpha_ms, self.volume_ms)])


def pass_model(
    workload: PipelineWorkload, fits: PipelineFits, backward: bool, expert_alpha: ExpertAlpha = "once"
) -> PassModel:
    """Forward or backward coefficients (§4.4: the backward doubles α_exp and β_exp)."""
    if expert_alpha not in ("once", "per_gemm"):
        raise ValueError(f"expert_alpha={expert_alpha!r}: expected 'once' or 'per_gemm'")
    scale = 2.0 if backward else 1.0
    alpha_exp = fits.alpha("gemm") * (workload.gemms if expert_alpha == "per_gemm" else 1) * scale
    alpha_exp += fits.chunk_ms[1 if backward else 0]  # measured per-chunk cost, not doubled
    ops = ("a2a", "ag", "rs", "gemm")
    alphas = tuple(fits.alpha(op) for op in ops[:3]) + (alpha_exp,)
    volumes = tuple(workload.elements(op) * fits.beta(op) * (scale if op == "gemm" else 1.0) for op in ops)
    return PassModel(alphas, volumes, fits.overlap[1 if backward else 0])


def _stack(rows: list[Any]) -> np.ndarray:
    return np.stack(np.broadcast_arrays(*rows))


def predicate_margins(model: PassModel, r: Any, t_gar_ms: Any) -> np.ndarray:
    """``[7, ...]``: left minus right side of Q1..Q7 (§4.2); Qk holds where its margin is > 0.
    ``...``: r and t_gar broadcast together."""
    r = np.asarray(r, dtype=np.float64)
    a2a, ag, rs, exp = model.chunk_times(r)
    busy_a2a = 2 * (r - 1) * a2a  # all-to-alls but the first dispatch and the last combine
    return _stack(
        [
            a2a - ag,  # Q1: t_a2a,r > t_ag,r
            r * exp - busy_a2a,  # Q2: r·t_exp,r > 2(r−1)·t_a2a,r
            r * exp - (r - 1) * (ag + rs),  # Q3: r·t_exp,r > (r−1)(t_ag,r + t_rs,r)
            t_gar_ms - (ag + rs),  # Q4: t_gar > t_ag,r + t_rs,r
            t_gar_ms - (r * exp - busy_a2a + ag + rs),  # Q5
            t_gar_ms - (r * ag + r * rs - busy_a2a),  # Q6
            t_gar_ms - (ag + rs + r * exp - busy_a2a),  # Q7
        ]
    )


def case_times(model: PassModel, r: Any, t_gar_ms: Any) -> np.ndarray:
    """``[4, ...]``: the closed-form time of Cases 1..4 at degree r (§4.2, Eq. 2)."""
    r = np.asarray(r, dtype=np.float64)
    a2a, ag, rs, exp = model.chunk_times(r)
    return _stack(
        [
            2 * r * a2a + t_gar_ms,
            2 * a2a + ag + rs + r * exp,
            2 * r * a2a + ag + rs,
            2 * a2a + r * ag + r * rs,
        ]
    )


def case_at(model: PassModel, r: Any, t_gar_ms: Any) -> np.ndarray:
    """The case (1..4) whose predicates hold at r (the cases partition r ≥ 1)."""
    holds = predicate_margins(model, r, t_gar_ms) > 0
    case = np.zeros(holds.shape[1:], dtype=np.int64)
    for c in CASES:
        for branch in CASE_BRANCHES[c]:
            ok = np.logical_and.reduce([holds[q - 1] == want for q, want in branch])
            case = np.where((case == 0) & ok, c, case)
    return case


def priced_time(model: PassModel, r: Any, t_gar_ms: Any) -> np.ndarray:
    """Time at degree r: the formula of the case that holds there (module docstring); with an
    overlap η < 1, ``η·that + (1 − η)·serial``."""
    times = case_times(model, r, t_gar_ms)
    overlapped = np.take_along_axis(times, (case_at(model, r, t_gar_ms) - 1)[None], axis=0)[0]
    if model.overlap == 1.0:
        return overlapped
    r = np.asarray(r, dtype=np.float64)
    a2a, ag, rs, exp = model.chunk_times(r)
    serial = r * (2 * a2a + ag + rs + exp) + t_gar_ms
    return model.overlap * overlapped + (1.0 - model.overlap) * serial


def best_candidate_time_ms(model: PassModel, t_gar_ms: Any, candidates: tuple[int, ...]) -> np.ndarray:
    """Least priced time over the candidate degrees, for every t_gar ``[...]``: Algorithm 1's
    snapped time when the priced time is convex in r (module docstring), without SLSQP; the
    gradient partitioning evaluates it for whole populations at once."""
    t_gar = np.asarray(t_gar_ms, dtype=np.float64)[..., None]
    return priced_time(model, np.asarray(candidates, dtype=np.float64), t_gar).min(axis=-1)


def overlappable_ms(model: PassModel, r: int) -> float:
    """FSMoE §5.2 ``t_olp,moe(r)`` at t_gar = 0: the Gradient-AllReduce time the layer hides at
    degree r — the threshold of Q5/Q7 (Case 2), Q4 (Case 3) or Q6 (Case 4); 0 in Case 1 and
    never negative."""
    case = int(case_at(model, r, 0.0))
    if case == 1:
        return 0.0
    q = {2: 5, 3: 4, 4: 6}[case]  # Q5 and Q7 have the same right side
    return max(0.0, -float(predicate_margins(model, r, 0.0)[q - 1]))


@dataclass(frozen=True)
class DegreeChoice:
    """Algorithm 1 for one pass."""

    degree: int
    """The snapped pipeline degree."""
    case: int
    """The case whose predicates hold at ``degree``."""
    time_ms: float
    """Priced time at ``degree``."""
    t_gar_ms: float
    """The Gradient-AllReduce time it was solved with (0 forward)."""
    continuous_degree: float
    """Algorithm 1's r before snapping (best case's SLSQP optimum)."""
    case_minima_ms: tuple[float, ...]
    """SLSQP minimum of Cases 1..4 (nan: the case's predicates hold for no r in range)."""
    case_degrees: tuple[float, ...]
    """Continuous r of each case's minimum (nan where infeasible)."""
    candidate_times_ms: tuple[tuple[int, float], ...] = field(default=())
    """Priced time at every candidate degree, for a table."""

    def to_dict(self) -> dict[str, Any]:
        def num(v: float) -> float | None:
            return None if math.isnan(v) else v

        return {
            "degree": self.degree,
            "case": self.case,
            "time_ms": self.time_ms,
            "t_gar_ms": self.t_gar_ms,
            "continuous_degree": self.continuous_degree,
            "case_minima_ms": {str(c): num(v) for c, v in zip(CASES, self.case_minima_ms)},
            "case_degrees": {str(c): num(v) for c, v in zip(CASES, self.case_degrees)},
            "candidate_times_ms": {str(r): t for r, t in self.candidate_times_ms},
        }


def candidate_degrees(snap: str, chunk_dim: int | None = None) -> tuple[int, ...]:
    """``powers``: the published tool's {1, 2, 4, 8}; ``divisors``: every divisor of ``chunk_dim``."""
    if snap == "powers":
        return PUBLISHED_DEGREES
    if snap == "divisors":
        n = positive_int("chunk_dim", chunk_dim)
        low = np.arange(1, math.isqrt(n) + 1)
        low = low[n % low == 0]
        return tuple(int(d) for d in np.union1d(low, n // low))
    raise ValueError(f"snap={snap!r}: expected 'powers' or 'divisors'")


def _scalar_case_terms(model: PassModel, t_gar_ms: float, r: float) -> tuple[list[float], list[float]]:
    """``predicate_margins`` (Q1..Q7) then ``case_times`` (Cases 1..4) at one r, and their
    derivatives in r, in plain floats: what SLSQP evaluates thousands of times per solve."""
    (a0, a1, a2, a3), (v0, v1, v2, v3) = model.alpha_ms, model.volume_ms
    a2a, ag, rs, exp = a0 + v0 / r, a1 + v1 / r, a2 + v2 / r, a3 + v3 / r
    d_a2a, d_ag, d_rs, d_exp = -v0 / r**2, -v1 / r**2, -v2 / r**2, -v3 / r**2
    ex, d_ex = r * exp, exp + r * d_exp  # r·t_exp,r
    busy, d_busy = 2 * (r - 1) * a2a, 2 * a2a + 2 * (r - 1) * d_a2a  # 2(r−1)·t_a2a,r
    intra, d_intra = ag + rs, d_ag + d_rs
    values = [
        a2a - ag,
        ex - busy,
        ex - (r - 1) * intra,
        t_gar_ms - intra,
        t_gar_ms - (ex - busy + intra),
        t_gar_ms - (r * intra - busy),
        t_gar_ms - (intra + ex - busy),
        2 * r * a2a + t_gar_ms,
        2 * a2a + intra + ex,
        2 * r * a2a + intra,
        2 * a2a + r * intra,
    ]
    slopes = [
        d_a2a - d_ag,
        d_ex - d_busy,
        d_ex - intra - (r - 1) * d_intra,
        -d_intra,
        -(d_ex - d_busy + d_intra),
        -(intra + r * d_intra - d_busy),
        -(d_intra + d_ex - d_busy),
        2 * a2a + 2 * r * d_a2a,
        2 * d_a2a + d_intra + d_ex,
        2 * a2a + 2 * r * d_a2a + d_intra,
        2 * d_a2a + intra + r * d_intra,
    ]
    return values, slopes


START_GRID = 257
"""Log-spaced degrees in [1, r_max] where each sub-problem's feasible set is sampled for a start."""


def _solve_case(model: PassModel, t_gar_ms: float, case: int, r_max: float) -> tuple[float, float]:
    """SLSQP over r in [1, r_max] for one case, one sub-problem per conjunction; (r, time) or nans.
    Each sub-problem starts from its best feasible point on a log grid of ``START_GRID`` degrees
    (none: skipped as infeasible); objective, constraints and their exact derivatives come from
    ``_scalar_case_terms``."""
    best = (math.nan, math.inf)
    grid = np.geomspace(1.0, r_max, START_GRID) if r_max > 1 else np.array([1.0])
    grid_margins = predicate_margins(model, grid, t_gar_ms)
    grid_times = case_times(model, grid, t_gar_ms)[case - 1]
    at = functools.lru_cache(maxsize=64)(lambda r: _scalar_case_terms(model, t_gar_ms, r))
    obj = 7 + case - 1  # index of the case's time among the terms
    for branch in CASE_BRANCHES[case]:
        signs = [(q - 1, 1.0 if want else -1.0) for q, want in branch]
        feasible = np.logical_and.reduce([s * grid_margins[i] >= 0 for i, s in signs])
        if not feasible.any():
            continue
        x0 = float(grid[feasible][np.argmin(grid_times[feasible])])

        def margins(x: np.ndarray, signs: list = signs) -> np.ndarray:
            values = at(float(x[0]))[0]
            return np.array([s * values[i] for i, s in signs])

        def margins_jac(x: np.ndarray, signs: list = signs) -> np.ndarray:
            slopes = at(float(x[0]))[1]
            return np.array([[s * slopes[i]] for i, s in signs])

        def objective(x: np.ndarray) -> float:
            return at(float(x[0]))[0][obj]

        def objective_jac(x: np.ndarray) -> np.ndarray:
            return np.array([at(float(x[0]))[1][obj]])

        res = optimize.minimize(
            objective,
            np.array([x0]),
            jac=objective_jac,
            method="SLSQP",
            bounds=[(1.0, r_max)],
            constraints=[{"type": "ineq", "fun": margins, "jac": margins_jac}],
        )
        for r in (float(np.clip(res.x[0], 1.0, r_max)), x0):
            x = np.array([r])
            scale = 1e-6 * (1.0 + objective(x))
            if np.all(margins(x) >= -scale) and objective(x) < best[1]:
                best = (r, objective(x))
    return best if math.isfinite(best[1]) else (math.nan, math.nan)


@functools.lru_cache(maxsize=4096)
def find_degree(
    model: PassModel, t_gar_ms: float = 0.0, candidates: tuple[int, ...] = PUBLISHED_DEGREES
) -> DegreeChoice:
    """FSMoE Algorithm 1 (§4.3) with snapping: each case minimised by SLSQP under its predicates,
    then the candidate degrees next to every feasible case's optimum priced (``priced_time``), the
    cheapest kept (ties: the smaller degree). Memoised."""
    finite_number("t_gar_ms", t_gar_ms, 0.0)
    cands = np.asarray(sorted(set(candidates)), dtype=np.float64)
    if cands.size == 0 or cands[0] < 1:
        raise ValueError(f"candidates={candidates!r}: expected degrees >= 1")
    solved = [_solve_case(model, t_gar_ms, c, float(cands[-1])) for c in CASES]
    degrees = np.array([r for r, _ in solved])
    minima = np.array([t for _, t in solved])
    near: set[float] = set()
    for r in degrees[np.isfinite(degrees)]:
        near.update(cands[cands <= r + 1e-9][-1:].tolist() + cands[cands >= r - 1e-9][:1].tolist())
    if not near or model.overlap < 1.0:  # no case solved (SLSQP failed everywhere), or η < 1: price all
        near = set(cands.tolist())
    near_r = np.array(sorted(near))
    near_t = priced_time(model, near_r, t_gar_ms)
    pick = int(np.argmin(near_t))
    best_case = int(np.nanargmin(np.where(np.isfinite(minima), minima, np.inf))) if np.isfinite(minima).any() else 0
    all_t = priced_time(model, cands, t_gar_ms)
    return DegreeChoice(
        degree=int(near_r[pick]),
        case=int(case_at(model, near_r[pick], t_gar_ms)),
        time_ms=float(near_t[pick]),
        t_gar_ms=float(t_gar_ms),
        continuous_degree=float(degrees[best_case]),
        case_minima_ms=tuple(float(t) for t in minima),
        case_degrees=tuple(float(r) for r in degrees),
        candidate_times_ms=tuple((int(r), float(t)) for r, t in zip(cands, all_t)),
    )


@dataclass(frozen=True)
class DegreePlan:
    """Pipeline degrees of a model: one forward degree, one backward degree per MoE layer."""

    forward: DegreeChoice
    backward: tuple[DegreeChoice, ...]
    """Per MoE layer in forward order (layer 0 first)."""
    candidates: tuple[int, ...]
    snap: str

    @property
    def forward_degree(self) -> int:
        return self.forward.degree

    @property
    def backward_degrees(self) -> list[int]:
        return [b.degree for b in self.backward]

    def to_dict(self) -> dict[str, Any]:
        return {
            "forward_degree": self.forward_degree,
            "backward_degrees": self.backward_degrees,
            "forward_case": self.forward.case,
            "backward_cases": [b.case for b in self.backward],
            "snap": self.snap,
            "candidates": list(self.candidates),
            "forward": self.forward.to_dict(),
            "backward": [b.to_dict() for b in self.backward],
        }


def plan_degrees(
    workload: PipelineWorkload,
    fits: PipelineFits,
    gar_ms_per_layer: tuple[float, ...] | None = None,
    snap: str = "powers",
    chunk_dim: int | None = None,
    expert_alpha: ExpertAlpha = "once",
) -> DegreePlan:
    """Algorithm 1 forward (t_gar = 0) and backward for every MoE layer with its Gradient-AllReduce
    time (``grad_partition.partition_gradients``; default none). ``chunk_dim`` (``divisors`` only)
    defaults to B·L, the tokens of a device's batch."""
    candidates = candidate_degrees(snap, chunk_dim or workload.batch * workload.seq)
    gars = tuple(gar_ms_per_layer) if gar_ms_per_layer is not None else (0.0,) * workload.layers
    if len(gars) != workload.layers:
        raise ValueError(f"gar_ms_per_layer has {len(gars)} values: expected one per MoE layer ({workload.layers})")
    forward = find_degree(pass_model(workload, fits, False, expert_alpha), 0.0, candidates)
    backward_model = pass_model(workload, fits, True, expert_alpha)
    backward = tuple(find_degree(backward_model, float(g), candidates) for g in gars)
    return DegreePlan(forward, backward, candidates, snap)
