"""What FSMoE's pipeline-degree optimiser (`perf.pipeline_degree`) runs on: the MoE layer's
workloads per device (`PipelineWorkload`) and the α-β fits of its five operations
(`PipelineFits`), in FSMoE's units (§4.1, §6.2): α in ms, β in ms per element (communication) or
per multiply-add (expert GEMMs). Workloads of one MoE layer per device (the paper names them n_x
without formulas; these are the published tool's): all-to-all ``n_a2a = F·B·L·M/S`` elements,
ESP all-gather and reduce-scatter ``n_ag = n_rs = F·B·L·M``, expert GEMMs
``n_exp = F·B·L·M·H·N/S`` multiply-adds; F = top-k × capacity factor, S the ESP size, N the GEMMs
of one expert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from moeflow.core.checks import finite_number, positive_int
from moeflow.perf.alpha_beta import CHUNK_KINDS

FIT_ORDER = ("a2a", "ag", "gemm", "rs", "ar")
"""Order of α/β values in lists (the published tool's): all-to-all, ESP all-gather, GEMM,
ESP reduce-scatter, gradient all-reduce."""
COST_MODEL_KINDS = {"a2a": "a2a", "ag": "all_gather", "gemm": "gemm", "rs": "reduce_scatter", "ar": "all_reduce"}
"""FSMoE op -> ``CostModel`` op kind (``moeflow.perf.alpha_beta.OP_KINDS``)."""


@dataclass(frozen=True)
class PipelineWorkload:
    """One MoE model as FSMoE's optimiser sees it (the published tool's inputs)."""

    batch: int
    """B: samples per device."""
    seq: int
    """L: sequence length."""
    d_model: int
    """M: embedding size."""
    d_hidden: int
    """H: hidden size of an expert."""
    gemms: int
    """N: GEMMs of one expert (2 for a plain ffn, 3 for Mixtral's)."""
    factor: float
    """F = top-k × capacity factor."""
    esp: int
    """S: devices of an expert-sharding group (one node, FSMoE §4); also the MP group of attention."""
    layers: int
    """MoE layers (= generalized layers, FSMoE §5.2)."""
    others_ms: float
    """Backward time of a generalized layer's gate and attention (the published tool's t_others); its
    ``t_olp,dense`` adds, with S > 1, the attention's all-gather and reduce-scatter
    (``grad_partition.dense_overlappable_ms``)."""
    dense_grad_elements: int | None = None
    """Dense gradient elements of a generalized layer; default: the tool's GPT attention under MP = S,
    ``(3M² + 3M + M²)/S + M`` (QKV weight and bias and output weight sharded, output bias whole)."""

    def __post_init__(self) -> None:
        for name in ("batch", "seq", "d_model", "d_hidden", "gemms", "esp", "layers"):
            positive_int(name, getattr(self, name))
        finite_number("factor", self.factor, 0.0, low_open=True)
        finite_number("others_ms", self.others_ms, 0.0)
        for name in ("d_hidden", "d_model"):
            if getattr(self, name) % self.esp:
                raise ValueError(f"esp={self.esp!r} must divide {name}={getattr(self, name)!r}")
        if self.dense_grad_elements is not None:
            positive_int("dense_grad_elements", self.dense_grad_elements, minimum=0)

    @property
    def tokens(self) -> float:
        """F·B·L: rows an MoE layer dispatches per device."""
        return self.factor * self.batch * self.seq

    def elements(self, op: str) -> float:
        """n_x of one MoE layer: elements (a2a, ag, rs), multiply-adds (gemm), gradient elements (ar)."""
        M, S = self.d_model, self.esp
        if op == "a2a":
            return self.tokens * M / S
        if op in ("ag", "rs"):
            return self.tokens * M
        if op == "gemm":
            return self.tokens * M * self.d_hidden * self.gemms / S
        if op == "ar":
            return float(self.grad_elements)
        raise ValueError(f"op={op!r}: expected one of {list(FIT_ORDER)}")

    @property
    def grad_elements(self) -> int:
        """Dense gradient elements of one generalized layer."""
        if self.dense_grad_elements is not None:
            return self.dense_grad_elements
        M, S = self.d_model, self.esp
        return (3 * M * M + 3 * M + M * M) // S + M


@dataclass(frozen=True)
class PipelineFits:
    """α (ms) and β (ms per element, or per multiply-add for ``gemm``) per op of ``FIT_ORDER``."""

    alpha_ms: tuple[float, ...]
    beta_ms: tuple[float, ...]
    bytes_per_element: int = 4
    """Bytes of one element (FSMoE measures float32)."""
    source: str = "explicit"
    chunk_ms: tuple[float, float] = (0.0, 0.0)
    """What one more chunk costs beyond the ops' α (forward, backward), in ms: the ``chunk_*`` fits
    of ``moeflow profile`` (`chunk_cost_ms`); 0 for FSMoE's own constants, which have no such term."""
    overlap: tuple[float, float] = (1.0, 1.0)
    """η, forward and backward: the share of the pipeline's overlap the machine realises
    (``CostModel.pipeline_overlap``, measured by ``moeflow profile``; 1: FSMoE's model)."""

    def __post_init__(self) -> None:
        for name in ("alpha_ms", "beta_ms"):
            values = tuple(getattr(self, name))
            if len(values) != len(FIT_ORDER):
                raise ValueError(f"{name}={list(values)!r}: expected {len(FIT_ORDER)} values ({' '.join(FIT_ORDER)})")
            for op, v in zip(FIT_ORDER, values):
                finite_number(f"{name}[{op}]", v, 0.0)
            object.__setattr__(self, name, tuple(float(v) for v in values))
        positive_int("bytes_per_element", self.bytes_per_element)
        for name, v in zip(("chunk_ms[forward]", "chunk_ms[backward]"), self.chunk_ms):
            finite_number(name, v, 0.0)
        for name, v in zip(("overlap[forward]", "overlap[backward]"), self.overlap):
            finite_number(name, v, 0.0, 1.0)

    def alpha(self, op: str) -> float:
        return self.alpha_ms[FIT_ORDER.index(op)]

    def beta(self, op: str) -> float:
        return self.beta_ms[FIT_ORDER.index(op)]

    def ar_time_ms(self, elements: Any) -> np.ndarray:
        """FSMoE §5.1 ``t_ar(n) = α_ar + β_ar·n``; nothing to reduce costs nothing (vectorised)."""
        n = np.asarray(elements, dtype=np.float64)
        return np.where(n > 0, self.alpha("ar") + self.beta("ar") * n, 0.0)

    def ar_fit_elements(self, time_ms: float) -> float:
        """FSMoE §5.1 ``g⁻¹(t) = (t − α_ar)/β_ar``, 0 when t does not cover the start-up."""
        if time_ms <= self.alpha("ar"):
            return 0.0
        return math.inf if self.beta("ar") == 0 else (time_ms - self.alpha("ar")) / self.beta("ar")

    @classmethod
    def from_cost_model(cls, cost_model: Any, workload: PipelineWorkload) -> PipelineFits:
        """From a moeflow ``CostModel``: its fits (seconds, per byte or per FLOP) in FSMoE units —
        α·1e3, β·bytes_per_element·1e3 (comm) and β·2·1e3 (a multiply-add is 2 FLOPs, the unit of
        ``moeflow profile``'s GEMM fit). A missing fit: the line through ``op_time`` at the layer's
        size and an eighth of it (exact for the link model, which is affine in bytes)."""
        bpe = cost_model.bytes_per_element
        alphas, betas = [], []
        for op in FIT_ORDER:
            kind = COST_MODEL_KINDS[op]
            per_unit = 2.0 if op == "gemm" else float(bpe)  # FLOPs or bytes in one FSMoE unit
            fit = cost_model.fits.get(kind)
            if fit is not None:
                alpha_s, beta_s = fit.alpha_s, fit.beta_s_per_unit
            else:
                units = workload.elements(op) * (workload.layers if op == "ar" else 1) * per_unit
                sizes = np.array([units / 8, units])
                t_s = np.asarray(cost_model.op_time(kind, sizes), dtype=np.float64)
                beta_s = max(float(t_s[1] - t_s[0]) / float(sizes[1] - sizes[0]), 0.0)
                alpha_s = max(float(t_s[1]) - beta_s * units, 0.0)
            alphas.append(1e3 * alpha_s)
            betas.append(1e3 * beta_s * per_unit)
        return cls(
            tuple(alphas),
            tuple(betas),
            bpe,
            f"cost model {cost_model.name}",
            chunk_cost_ms(cost_model),
            tuple(getattr(cost_model, "pipeline_overlap", (1.0, 1.0))),
        )


def chunk_cost_ms(cost_model: Any) -> tuple[float, float]:
    """What one more chunk of the pipelined block costs beyond the ops' α, forward and backward, in
    ms: β of the cost model's ``chunk_forward`` / ``chunk_backward`` fits (``profiling.chunk_profile``),
    0 where it has none."""
    fits = getattr(cost_model, "fits", {})
    return tuple(1e3 * fits[k].beta_s_per_unit if k in fits else 0.0 for k in CHUNK_KINDS)
