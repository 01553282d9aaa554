"""FSMoE's adaptive gradient partitioning (FSMoE §5), as pure numbers: which dense gradient
elements each layer's Gradient-AllReduce carries, so that it hides behind intra-node work.

A generalized layer is an MoE layer and the dense operations after it up to the next MoE layer
(§5.2). Its backward runs the dense part first (time ``others_ms``, its ``t_olp,dense``; its
gradient is ready when it ends), then the MoE layer, whose overlappable time ``t_olp,moe`` is the
§5.2 formula of the case Algorithm 1 picks at t_gar = 0 (``pipeline_degree.overlappable_ms``).
Gradient all-reduce time is ``t_ar(n) = α_ar + β_ar·n`` with inverse ``g⁻¹`` (§5.1).

Step 1 (Eq. 3–4): walk these parts in backward order; each takes from the pending gradient the
elements whose all-reduce fits its overlappable time, ``g⁻¹(min(t_ar(pending), t_olp))``; the rest
is carried on, with the gradient the dense part produced added.
Step 2 (Eq. 5): the elements step 1 left are distributed over the MoE layers by
``scipy.optimize.differential_evolution`` (fixed seed, deterministic) to minimise
``Σ_i f_moe^i(t_ar(x_i + first_i)) + t_ar(exposed)``, f_moe being Algorithm 1's backward time for
that all-reduce load (``best_candidate_time_ms``), first_i the elements step 1 put into MoE
layer i; a gradient can only be delayed (the prefix constraint of Eq. 5), parametrised as
``x_k = u_k·(cap_k − Σ_{j<k} x_j)``, u ∈ [0, 1], so every trial point is feasible.

Deviations, recorded:
* Eq. 3–4 are applied per part (dense, then MoE) rather than per generalized layer, so that a
  layer's dense gradient meets its own MoE layer (Fig. 3d launches the all-reduce inside the MoE
  pipeline). The carried remainder is ``pending − assigned`` (elements are conserved; Eq. 4 read
  literally, ``g⁻¹(t_ar(n) − t_olp)``, drops α_ar/β_ar elements per layer).
* What no MoE layer takes is all-reduced after the backward, exposed (the tool prices it at
  β_ar per element; here ``t_ar``). Eq. 5's objective has no such term.
* Only dense gradients are partitioned (as the published tool): expert gradients are reduced over
  their own expert-data-parallel groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import optimize

from moeflow.perf.pipeline_degree import (
    ExpertAlpha,
    best_candidate_time_ms,
    candidate_degrees,
    find_degree,
    overlappable_ms,
    pass_model,
)
from moeflow.perf.pipeline_inputs import PipelineFits, PipelineWorkload


@dataclass(frozen=True)
class GradientPartition:
    """Where every dense gradient element is all-reduced; per-layer tuples in forward layer order."""

    total_elements: int
    bytes_per_element: int
    dense_elements: tuple[int, ...]
    """Step 1: hidden in the layer's dense backward."""
    moe_first_elements: tuple[int, ...]
    """Step 1: hidden in the MoE layer's overlappable time."""
    moe_extra_elements: tuple[int, ...]
    """Step 2: added to the MoE layer's pipeline."""
    exposed_elements: int
    """All-reduced after the backward (launched after layer 0's backward)."""
    olp_dense_ms: float
    olp_moe_ms: float
    """t_olp,moe of every MoE layer (they share one backward model)."""
    moe_gar_ms: tuple[float, ...]
    """t_gar of each MoE layer: Algorithm 1's backward input."""
    objective_ms: float
    """Σ f_moe^i(t_gar_i) + t_ar(exposed), the step-2 objective at the integer partition."""

    @property
    def layer_elements(self) -> tuple[int, ...]:
        """Elements whose all-reduce each layer launches; the exposed rest counts to layer 0, whose
        backward ends last. Sums to ``total_elements`` exactly."""
        per = [d + f + x for d, f, x in zip(self.dense_elements, self.moe_first_elements, self.moe_extra_elements)]
        per[0] += self.exposed_elements
        return tuple(per)

    @property
    def layer_bytes(self) -> tuple[int, ...]:
        return tuple(n * self.bytes_per_element for n in self.layer_elements)

    def to_dict(self) -> dict[str, Any]:
        bpe = self.bytes_per_element
        return {
            "total_bytes": self.total_elements * bpe,
            "layer_bytes": list(self.layer_bytes),
            "dense_overlapped_bytes": [n * bpe for n in self.dense_elements],
            "moe_overlapped_bytes": [n * bpe for n in self.moe_first_elements],
            "moe_added_bytes": [n * bpe for n in self.moe_extra_elements],
            "exposed_bytes": self.exposed_elements * bpe,
            "moe_gar_ms": list(self.moe_gar_ms),
            "olp_dense_ms": self.olp_dense_ms,
            "olp_moe_ms": self.olp_moe_ms,
            "objective_ms": self.objective_ms,
        }


def _fits_in(fits: PipelineFits, time_ms: float) -> int:
    g = fits.ar_fit_elements(time_ms)
    return int(g) if math.isfinite(g) else np.iinfo(np.int64).max


def step1(
    layer_grad_elements: list[int], olp_dense_ms: float, olp_moe_ms: float, fits: PipelineFits
) -> tuple[list[int], list[int], list[int], int]:
    """Eq. 3–4 in backward order (k = 0 is the model's last layer). Returns per k the elements
    hidden in the dense part and in the MoE part, ``caps``: the most step 2 may have taken by MoE
    layer k (the carried elements at the latest point they must stay untouched), and the leftover."""
    dense_fit, moe_fit = _fits_in(fits, olp_dense_ms), _fits_in(fits, olp_moe_ms)
    n = len(layer_grad_elements)
    dense, moe, before_production = [0] * n, [0] * n, [0] * n
    carried = 0
    for k in range(n):
        dense[k] = min(carried, dense_fit)
        carried -= dense[k]
        before_production[k] = carried  # what step 2 may have drawn from by now (MoE layers < k)
        carried += layer_grad_elements[k]
        moe[k] = min(carried, moe_fit)
        carried -= moe[k]
    # Step 2 may take x_k at MoE layer k only from what stays pending through the next dense part.
    bound = before_production[1:] + [carried]
    caps = np.minimum.accumulate(np.asarray(bound, dtype=np.int64)[::-1])[::-1].tolist()
    return dense, moe, caps, carried


def _extra_from_u(u_NS: np.ndarray, caps_N: np.ndarray) -> np.ndarray:
    """x_k = u_k·(cap_k − Σ_{j<k} x_j) for every MoE layer k (backward order) and trial s:
    feasible for every u in [0, 1]^N."""
    x_NS = np.zeros_like(u_NS)
    taken_S = np.zeros(u_NS.shape[1:])
    for k in range(u_NS.shape[0]):
        x_NS[k] = u_NS[k] * np.maximum(caps_N[k] - taken_S, 0.0)
        taken_S += x_NS[k]
    return x_NS


def partition_gradients(
    workload: PipelineWorkload,
    fits: PipelineFits,
    snap: str = "powers",
    chunk_dim: int | None = None,
    expert_alpha: ExpertAlpha = "once",
    seed: int = 0,
) -> GradientPartition:
    """FSMoE §5: steps 1 and 2 for the workload's MoE layers (module docstring)."""
    candidates = candidate_degrees(snap, chunk_dim or workload.batch * workload.seq)
    backward = pass_model(workload, fits, True, expert_alpha)
    r0 = find_degree(backward, 0.0, candidates).degree
    olp_moe = overlappable_ms(backward, r0)
    n = workload.layers
    grads = [workload.grad_elements] * n
    dense_k, moe_k, caps_k, leftover = step1(grads, workload.others_ms, olp_moe, fits)
    caps = np.asarray(caps_k, dtype=np.float64)
    first = np.asarray(moe_k, dtype=np.float64)

    def cost(x_NS: np.ndarray) -> np.ndarray:
        """Step-2 objective ``[S]`` of trial partitions ``x_NS`` (elements added per MoE layer)."""
        layers_S = best_candidate_time_ms(backward, fits.ar_time_ms(first[:, None] + x_NS), candidates).sum(0)
        return layers_S + fits.ar_time_ms(leftover - x_NS.sum(0))

    def cost_of_u(u_NS: np.ndarray) -> np.ndarray:
        return cost(_extra_from_u(u_NS, caps))

    u = np.zeros(n)
    if leftover > 0:
        res = optimize.differential_evolution(
            cost_of_u, [(0.0, 1.0)] * n, seed=seed, polish=False, tol=1e-8, vectorized=True, updating="deferred"
        )
        # DE ends near, not on, the bounds where optima of a piecewise-linear cost sit: try each
        # share at 0 and 1 in turn and keep what helps (deterministic, 2N evaluations).
        u = np.asarray(res.x, dtype=np.float64)
        for k in range(n):
            trials_NS = np.repeat(u[:, None], 3, axis=1)
            trials_NS[k, 1:] = (0.0, 1.0)
            u = trials_NS[:, int(np.argmin(cost_of_u(trials_NS)))]
    extra = _extra_from_u(u[:, None], caps)[:, 0]
    # Integers: floor the cumulative sums (still within the caps), so the partition is exact.
    cum = np.minimum(np.floor(np.cumsum(extra) + 1e-6), caps).astype(np.int64)
    extra_int = np.diff(np.maximum.accumulate(cum), prepend=0)
    exposed = int(leftover - extra_int.sum())
    gar = [float(fits.ar_time_ms(f + e)) for f, e in zip(moe_k, extra_int)]
    objective = float(cost(extra_int.astype(np.float64)[:, None])[0])
    backward_to_forward = slice(None, None, -1)  # k = 0 is the last layer
    return GradientPartition(
        total_elements=sum(grads),
        bytes_per_element=fits.bytes_per_element,
        dense_elements=tuple(int(v) for v in dense_k[backward_to_forward]),
        moe_first_elements=tuple(int(v) for v in moe_k[backward_to_forward]),
        moe_extra_elements=tuple(int(v) for v in extra_int[backward_to_forward]),
        exposed_elements=exposed,
        olp_dense_ms=workload.others_ms,
        olp_moe_ms=olp_moe,
        moe_gar_ms=tuple(gar[backward_to_forward]),
        objective_ms=objective,
    )
