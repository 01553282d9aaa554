"""FSMoE's adaptive gradient partitioning (FSMoE §5), as pure numbers: which dense gradient
elements each layer's Gradient-AllReduce carries, so that it hides behind intra-node work.

A generalized layer is an MoE layer and the dense operations after it up to the next MoE layer
(§5.2); its backward runs the dense part first, then the MoE layer. Overlappable times (§5.2):
the dense part's ``t_olp,dense`` (`dense_overlappable_ms`: ``others_ms``, the gate and attention,
plus, under FSMoE's layout with MP = ESP = S > 1, the attention's intra-node all-gather and
reduce-scatter of its B·L·M activations, which the inter-node all-reduce overlaps like any other
intra-node work), and the MoE layer's ``t_olp,moe``, the §5.2 formula of the case Algorithm 1
picks at t_gar = 0 (``pipeline_degree.overlappable_ms``). Gradient all-reduce time is
``t_ar(n) = α_ar + β_ar·n`` with inverse ``g⁻¹`` (§5.1).

Step 1 (Eq. 3–4 as printed): walk the generalized layers in backward order; layer i's overlappable
time (dense part, then MoE part) takes from the pending gradient the elements whose all-reduce
fits it, ``g⁻¹(min(t_ar(pending), t_olp))``, and carries the rest on; the gradient of layer i joins
the pending one after layer i, since a generalized layer's dense gradient is complete only when its
backward ends. So the first layer in backward order (the model's last MoE layer) hides nothing
(t_gar = 0), and the last one's gradient is all-reduced after the backward.
Step 2 (Eq. 5): the elements step 1 left are distributed over the MoE layers by
``scipy.optimize.differential_evolution`` (fixed seed, deterministic) to minimise
``Σ_i f_moe^i(t_ar(x_i + first_i)) + t_ar(exposed)``, f_moe being Algorithm 1's backward time for
that all-reduce load (``best_candidate_time_ms``), first_i the elements step 1 put into MoE
layer i; a gradient can only be delayed (the prefix constraint of Eq. 5), parametrised as
``x_k = u_k·(cap_k − Σ_{j<k} x_j)``, u ∈ [0, 1], so every trial point is feasible.

Deviations, recorded:
* The carried remainder is ``pending − assigned`` (elements are conserved; Eq. 4 read literally,
  ``g⁻¹(t_ar(n) − t_olp)``, drops α_ar/β_ar elements per layer).
* What no MoE layer takes is all-reduced after the backward, exposed (the published tool prices it
  at β_ar per element and leaves the last layer's gradient out; here ``t_ar`` of all of it).
  Eq. 5's objective has no such term.
* Not reproduced from the published tool (none is in §5): when step 1 hides everything it moves up
  to 0.7 of the experts' idle link time (if that exceeds ``others_ms`` + 5 ms) from the dense part
  into the MoE layer, it drops remainders shorter than α_ar, rounds elements up to even, and it
  sizes the MoE part at the backward degree it forces to 1 with the forward's. They change the
  t_gar of some layers, no degree on the grid of tests/test_fsmoe_tool_agreement.py.
* Only dense gradients are partitioned (as the published tool): expert gradients are reduced over
  their own expert-data-parallel groups.

Shape suffixes: L MoE layers, Z candidates (trial partitions of one differential-evolution step).
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


def dense_overlappable_ms(workload: PipelineWorkload, fits: PipelineFits) -> float:
    """``t_olp,dense`` of a generalized layer: ``others_ms`` plus, with S > 1, the attention's
    all-gather and reduce-scatter of B·L·M elements inside the MP = ESP group (module docstring)."""
    if workload.esp == 1:
        return workload.others_ms
    n = workload.batch * workload.seq * workload.d_model
    return workload.others_ms + fits.alpha("ag") + fits.beta("ag") * n + fits.alpha("rs") + fits.beta("rs") * n


def step1(
    layer_grad_elements: list[int], olp_dense_ms: float, olp_moe_ms: float, fits: PipelineFits
) -> tuple[list[int], list[int], list[int], int]:
    """Eq. 3–4 in backward order (k = 0 is the model's last layer): layer k's dense part, then its
    MoE part, take what fits from the gradient of layers < k. Returns per k the elements hidden in
    the dense part and in the MoE part, ``caps``: the most step 2 may have taken by MoE layer k
    (what stays pending from there on, newest elements placed first), and the leftover (with the
    last layer's gradient, which no layer follows)."""
    dense_fit, moe_fit = _fits_in(fits, olp_dense_ms), _fits_in(fits, olp_moe_ms)
    n = len(layer_grad_elements)
    dense, moe, pending_after = [0] * n, [0] * n, [0] * n
    carried = 0
    for k in range(n):
        carried += layer_grad_elements[k - 1] if k else 0
        dense[k] = min(carried, dense_fit)
        carried -= dense[k]
        moe[k] = min(carried, moe_fit)
        carried -= moe[k]
        pending_after[k] = carried  # no gradient arrives until layer k + 1 starts
    caps = np.minimum.accumulate(np.asarray(pending_after, dtype=np.int64)[::-1])[::-1].tolist()
    return dense, moe, caps, carried + layer_grad_elements[-1]


def _extra_from_u(u_LZ: np.ndarray, caps_L: np.ndarray) -> np.ndarray:
    """x_k = u_k·(cap_k − Σ_{j<k} x_j) for every MoE layer k (backward order) and trial s:
    feasible for every u in [0, 1]^L."""
    x_LZ = np.zeros_like(u_LZ)
    taken_Z = np.zeros(u_LZ.shape[1:])
    for k in range(u_LZ.shape[0]):
        x_LZ[k] = u_LZ[k] * np.maximum(caps_L[k] - taken_Z, 0.0)
        taken_Z += x_LZ[k]
    return x_LZ


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
    olp_dense = dense_overlappable_ms(workload, fits)
    dense_k, moe_k, caps_k, leftover = step1(grads, olp_dense, olp_moe, fits)
    caps = np.asarray(caps_k, dtype=np.float64)
    first = np.asarray(moe_k, dtype=np.float64)

    def cost(x_LZ: np.ndarray) -> np.ndarray:
        """Step-2 objective ``[Z]`` of trial partitions ``x_LZ`` (elements added per MoE layer)."""
        layers_Z = best_candidate_time_ms(backward, fits.ar_time_ms(first[:, None] + x_LZ), candidates).sum(0)
        return layers_Z + fits.ar_time_ms(leftover - x_LZ.sum(0))

    def cost_of_u(u_LZ: np.ndarray) -> np.ndarray:
        return cost(_extra_from_u(u_LZ, caps))

    u = np.zeros(n)
    if leftover > 0:
        res = optimize.differential_evolution(
            cost_of_u, [(0.0, 1.0)] * n, seed=seed, polish=False, tol=1e-8, vectorized=True, updating="deferred"
        )
        # DE ends near, not on, the bounds where optima of a piecewise-linear cost sit: try each
        # share at 0 and 1 in turn and keep what helps (deterministic, 2N evaluations).
        u = np.asarray(res.x, dtype=np.float64)
        for k in range(n):
            trials_LZ = np.repeat(u[:, None], 3, axis=1)
            trials_LZ[k, 1:] = (0.0, 1.0)
            u = trials_LZ[:, int(np.argmin(cost_of_u(trials_LZ)))]
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
        olp_dense_ms=olp_dense,
        olp_moe_ms=olp_moe,
        moe_gar_ms=tuple(gar[backward_to_forward]),
        objective_ms=objective,
    )
