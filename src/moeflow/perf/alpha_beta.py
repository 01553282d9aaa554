"""α-β models of one operation kind, and the published constants (FSMoE §4.1 Eq. 1, §6.2 Fig. 5).

``t = α + β·n`` with n in bytes (collectives) or FLOPs (GEMM), fitted by ``moeflow profile``
(least squares over a sweep of sizes on the live backend) or taken from a paper.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import optimize

OP_KINDS = (
    "a2a",
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "broadcast",
    "reduce",
    "p2p_intra",
    "p2p_inter",
    "copies",
    "gemm",
    "elementwise",
    "chunk_forward",
    "chunk_backward",
)
"""Operation kinds the profiler measures and the cost model prices. ``chunk_*``: the cost of one
more chunk of FSMoE's pipelined block, forward and backward (``profiling.chunk_profile``; n = chunks)."""
UNITS = ("byte", "flop", "chunk")
CHUNK_KINDS = ("chunk_forward", "chunk_backward")


@dataclass(frozen=True)
class AlphaBeta:
    """``t = α + β·n`` for one operation kind (FSMoE §4.1 Eq. 1; TA-MoE Eq. 2)."""

    alpha_s: float
    """Start-up time in seconds."""
    beta_s_per_unit: float
    """Seconds per byte (collectives), per FLOP (GEMM) or per chunk (``chunk_*``)."""
    unit: str = "byte"
    """``byte``, ``flop`` or ``chunk``."""
    r2: float | None = None
    """Coefficient of determination of the least-squares fit (None for published constants)."""
    source: str = ""
    """Where the constants come from (profile file, paper figure)."""

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(f"AlphaBeta unit={self.unit!r}: expected one of {list(UNITS)}")
        for name in ("alpha_s", "beta_s_per_unit"):
            v = getattr(self, name)
            if not math.isfinite(v):
                raise ValueError(f"AlphaBeta {name}={v!r}: must be finite")

    def __call__(self, n: Any) -> Any:
        return self.alpha_s + self.beta_s_per_unit * np.asarray(n, dtype=np.float64)

    @classmethod
    def fit(cls, sizes: Sequence[float], times_s: Sequence[float], unit: str = "byte", source: str = "") -> AlphaBeta:
        """Least-squares line through (size, time) with an intercept, constrained to α, β >= 0
        (``scipy.optimize.lsq_linear``): a start-up time or a cost per byte cannot be negative, and
        an unconstrained fit on noisy small sizes can give α < 0 and negative predictions.
        r² is the coefficient of determination of the fitted line."""
        x, y = np.asarray(sizes, dtype=np.float64), np.asarray(times_s, dtype=np.float64)
        if x.shape != y.shape or x.size < 2 or np.unique(x).size < 2:
            raise ValueError(f"AlphaBeta.fit: need >= 2 distinct sizes with one time each, got sizes={x.tolist()}")
        scale = float(np.abs(x).max())  # columns of similar magnitude for the solver
        A = np.stack([np.ones_like(x), x / scale], axis=1)
        res = optimize.lsq_linear(A, y, bounds=(0.0, np.inf))
        alpha, beta = float(res.x[0]), float(res.x[1] / scale)
        ss_tot = float(np.sum((y - y.mean()) ** 2))
        r2 = 1.0 - float(np.sum((y - A @ res.x) ** 2)) / ss_tot if ss_tot > 0 else 1.0
        return cls(alpha, beta, unit, r2, source)

    @classmethod
    def from_dict(cls, f: dict[str, Any]) -> AlphaBeta:
        return cls(
            float(f["alpha_s"]), float(f["beta_s_per_unit"]), f.get("unit", "byte"), f.get("r2"), f.get("source", "")
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "alpha_s": self.alpha_s,
            "beta_s_per_unit": self.beta_s_per_unit,
            "unit": self.unit,
            "r2": self.r2,
            "source": self.source,
        }


# FSMoE Fig. 5 (§6.2): published fits, α in ms, β in ms per float32 element (comm) or per FLOP
# (GEMM). Converted below to seconds and seconds per byte.
_FSMOE_FIG5 = {
    "fsmoe_a": {
        "gemm": (4.26e-2, 2.29e-11),
        "a2a": (2.87e-1, 2.21e-7),
        "all_gather": (3.37e-1, 2.32e-6),
        "reduce_scatter": (3.95e-1, 2.34e-7),
        "all_reduce": (5.11e-1, 4.95e-6),
    },
    "fsmoe_b": {
        "gemm": (9.24e-2, 4.42e-11),
        "a2a": (1.75e-1, 3.06e-7),
        "all_gather": (3.20e-2, 1.68e-7),
        "reduce_scatter": (3.91e-2, 1.67e-7),
        "all_reduce": (8.37e-2, 5.99e-7),
    },
}


def published_fits(preset: str) -> dict[str, AlphaBeta]:
    out = {}
    for kind, (a_ms, b_ms) in _FSMOE_FIG5.get(preset, {}).items():
        unit = "flop" if kind == "gemm" else "byte"
        beta = b_ms * 1e-3 if unit == "flop" else b_ms * 1e-3 / 4  # per element of 4 bytes
        out[kind] = AlphaBeta(a_ms * 1e-3, beta, unit, None, f"FSMoE Fig. 5 ({preset})")
    return out
