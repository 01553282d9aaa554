"""Expert arithmetic, in one place: parameters, FLOPs and GEMMs of one expert of each kind.

Every consumer — the experts themselves (`core/experts.py`), the planners (parameter bytes a copy
moves), the cost model (compute time), the simulator and the roofline (FLOPs) — reads these
numbers from here, so a new expert kind is described once.

`expert="ffn"`:    y = gelu(x·w1 + b1)·w2 + b2      2 matrices d×h, biases; 4·d·h FLOPs per token
`expert="swiglu"`: y = (silu(x·w_gate) * (x·w_up))·w2   3 matrices d×h (gate and up in one
                   d×2×h tensor `w13`), no biases; 6·d·h FLOPs per token
`expert="clamped_swiglu"` (GPT-OSS): g = min(x·w_gate + b_gate, l), u = clamp(x·w_up + b_up, −l, l),
                   y = ((u + 1) · g·σ(α·g))·w2 + b2   3 matrices d×h, biases; 6·d·h FLOPs per token

A matmul of a token row through a d×h matrix costs 2·d·h FLOPs forward; backward costs twice the
forward (input and weight gradients), FasterMoE §3.1.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeflow.core.checks import finite_number, positive_int


@dataclass(frozen=True)
class NoExpertOptions:
    """The expert kind takes no options."""


@dataclass(frozen=True)
class ClampedSwiGLUOptions:
    """Options of `expert="clamped_swiglu"` (GPT-OSS's expert; its released constants by default)."""

    alpha: float = 1.702
    """α of the gate's `g·σ(α·g)`."""
    limit: float = 7.0
    """l: the gate is clamped to at most l, the up projection to [−l, l]."""

    def __post_init__(self) -> None:
        finite_number("alpha", self.alpha)
        finite_number("limit", self.limit, low=0.0, low_open=True)


@dataclass(frozen=True)
class ExpertKind:
    """What distinguishes one expert formula from another, as numbers."""

    matrices: int
    """d×h weight matrices: 2 (w1, w2) or 3 (gate and up, stored as one d×2×h `w13`, and w2)."""
    biases: bool
    """Whether it has per-expert biases: on the first projection (`b1` [h], or `b13` [2, h]) and b2 [d]."""
    options: type = NoExpertOptions
    """Dataclass of its options (`MoELayer(expert_options=...)`, `[moe.expert_options]`)."""

    @property
    def gated(self) -> bool:
        """Gate and up projections (3 matrices), stored interleaved in `w13`."""
        return self.matrices == 3

    @property
    def first_projection(self) -> str:
        """Name of the `[d, width]` input projection: `w1` (ffn) or `w13` (gate and up)."""
        return "w13" if self.gated else "w1"

    @property
    def first_bias(self) -> str:
        """Name of its bias."""
        return "b13" if self.gated else "b1"


EXPERT_KINDS: dict[str, ExpertKind] = {
    "ffn": ExpertKind(matrices=2, biases=True),
    "swiglu": ExpertKind(matrices=3, biases=False),
    "clamped_swiglu": ExpertKind(matrices=3, biases=True, options=ClampedSwiGLUOptions),
}


@dataclass(frozen=True)
class ExpertShape:
    """One expert: model dimension, hidden dimension and kind (`EXPERT_KINDS`)."""

    d_model: int
    """d: width of a token row."""
    d_hidden: int
    """h: hidden width of the expert."""
    kind: str = "ffn"
    """`ffn` (GELU, biases), `swiglu` (gated, no biases) or `clamped_swiglu` (GPT-OSS, biases)."""

    def __post_init__(self) -> None:
        positive_int("d_model", self.d_model)
        positive_int("d_hidden", self.d_hidden)
        if self.kind not in EXPERT_KINDS:
            raise ValueError(f"unknown expert={self.kind!r}; valid: {sorted(EXPERT_KINDS)}")

    @property
    def spec(self) -> ExpertKind:
        return EXPERT_KINDS[self.kind]

    @property
    def gemms(self) -> int:
        """GEMMs per expert forward (one per weight matrix; gate and up count twice, though one
        grouped GEMM computes both)."""
        return self.spec.matrices

    @property
    def param_count(self) -> int:
        """Parameters of one expert: ffn = w1, b1, w2, b2; swiglu = w1, w3, w2; clamped_swiglu = all
        three matrices and b1, b3, b2."""
        hidden_biases = (self.spec.matrices - 1) * self.d_hidden
        biases = self.d_model + hidden_biases if self.spec.biases else 0
        return self.spec.matrices * self.d_model * self.d_hidden + biases

    def param_bytes(self, bytes_per_element: int) -> int:
        return self.param_count * bytes_per_element

    @property
    def forward_flops_per_token(self) -> int:
        """f: forward FLOPs of one assignment (ffn 4·d·h, FasterMoE's 4·α·H²; swiglu 6·d·h)."""
        return 2 * self.spec.matrices * self.d_model * self.d_hidden

    @property
    def elementwise_elements_per_token(self) -> int:
        """Memory-bound work per assignment outside the GEMMs, forward, in elements read and
        written: the dispatch copy (2·d), bias and activation on the hidden (4·h), second bias and the
        weighted combine (4·d). Backward touches about twice as much. FasterMoE's model leaves it out
        (GPU kernels fuse it and GEMMs dominate); on CPU it is 10-40% of a layer."""
        return 6 * self.d_model + 4 * self.d_hidden
