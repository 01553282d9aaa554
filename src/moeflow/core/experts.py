"""Grouped experts: the experts of one layer on one rank, stored as `[E_local, ...]` tensors and
computed as grouped matmuls over variable-size groups of tokens (never a loop over tokens).

`expert="ffn"`:    y = gelu(x·w1[e] + b1[e])·w2[e] + b2[e]     (exact erf GELU; GPT, FasterMoE)
`expert="swiglu"`: y = (silu(x·w1[e]) * (x·w3[e]))·w2[e]        (Mixtral; no biases)
Their parameters, FLOPs and GEMMs as numbers: `moeflow.core.expert_shape`.

Shape suffixes: N rows (tokens × choices) sorted by expert, D d_model, H d_hidden, L local experts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.core.expert_shape import EXPERT_KINDS


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: `torch._grouped_mm`'s backward
    rejects the stride-0 gradients that `.sum()` and `expand` produce."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _use_grouped_mm_kernel(x_ND: torch.Tensor, w_LDH: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` is the fastest path here (measured, torch 2.13, see
    docs/benchmarks.md): on CPU it matches `bmm` for fp32 but is ~10x slower than per-expert `mm`
    for bf16 (no AMX path); on CUDA it is the bf16 kernel. It needs 16-byte aligned rows."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    wanted = torch.float32 if x_ND.device.type == "cpu" else torch.bfloat16
    item = x_ND.element_size()
    aligned = (w_LDH.shape[1] * item) % 16 == 0 and (w_LDH.shape[2] * item) % 16 == 0
    return x_ND.dtype == wanted and aligned


class _PerExpertMM(torch.autograd.Function):
    """One `mm` per expert written straight into its rows of one output (and, in backward, of the
    input and weight gradients): no per-expert autograd nodes, no concatenation, no stacking of
    weight-gradient slices. The fallback where `torch._grouped_mm` is not the fastest kernel."""

    @staticmethod
    def forward(ctx, x_ND, w_LDH, counts_L):
        ctx.save_for_backward(x_ND, w_LDH)
        ctx.counts = counts_L
        out_NH = x_ND.new_empty((x_ND.shape[0], w_LDH.shape[2]))
        start = 0
        for i, n in enumerate(counts_L):
            if n:
                torch.mm(x_ND[start : start + n], w_LDH[i], out=out_NH[start : start + n])
            start += n
        return out_NH

    @staticmethod
    def backward(ctx, grad_NH):
        x_ND, w_LDH = ctx.saved_tensors
        grad_NH = grad_NH.contiguous()
        grad_x = torch.empty_like(x_ND) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(w_LDH) if ctx.needs_input_grad[1] else None  # experts without rows: 0
        start = 0
        for i, n in enumerate(ctx.counts):
            if n:
                rows = slice(start, start + n)
                if grad_x is not None:
                    torch.mm(grad_NH[rows], w_LDH[i].t(), out=grad_x[rows])
                if grad_w is not None:
                    torch.mm(x_ND[rows].t(), grad_NH[rows], out=grad_w[i])
            start += n
        return grad_x, grad_w, None


def grouped_mm(x_ND: torch.Tensor, w_LDH: torch.Tensor, counts_L: list[int]) -> torch.Tensor:
    """`out[rows of group l] = x[rows of group l] @ w[l]` for consecutive groups of `counts_L` rows."""
    w_LDH = w_LDH.to(x_ND.dtype)
    if _use_grouped_mm_kernel(x_ND, w_LDH):
        offs_L = torch.tensor(counts_L, dtype=torch.int64).cumsum(0).to(torch.int32).to(x_ND.device)
        out = torch._grouped_mm(x_ND.contiguous(), w_LDH.contiguous(), offs=offs_L)
        return _ContiguousGrad.apply(out)
    return _PerExpertMM.apply(x_ND.contiguous(), w_LDH.contiguous(), list(counts_L))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class GroupedExperts(nn.Module):
    """`num_local` experts of one layer; row l holds global expert `expert_ids[l]` (ascending).

    Plain expert parallelism keeps a contiguous range; Hecate's heterogeneous sharding (§4.3) any
    set, of any size (0 included), per layer and rank (`reshard_`)."""

    def __init__(self, num_local: int, d_model: int, d_hidden: int, kind: str = "ffn"):
        super().__init__()
        if kind not in EXPERT_KINDS:
            raise ValueError(f"unknown expert={kind!r}; valid: {sorted(EXPERT_KINDS)}")
        self.kind = kind
        self.expert_ids = list(range(num_local))
        self.d_model, self.d_hidden = d_model, d_hidden
        self.w1 = nn.Parameter(torch.empty(num_local, d_model, d_hidden))
        self.w2 = nn.Parameter(torch.empty(num_local, d_hidden, d_model))
        if EXPERT_KINDS[kind].biases:
            self.b1 = nn.Parameter(torch.zeros(num_local, d_hidden))
            self.b2 = nn.Parameter(torch.zeros(num_local, d_model))
        if EXPERT_KINDS[kind].matrices == 3:
            self.w3 = nn.Parameter(torch.empty(num_local, d_model, d_hidden))
        self.reset_parameters()

    @property
    def num_local(self) -> int:
        return self.w1.shape[0]

    def reset_parameters(self) -> None:
        # nn.Linear's default bound 1/sqrt(fan_in), expert by expert.
        for name, param in self.named_parameters():
            if name.startswith("w"):
                bound = 1.0 / math.sqrt(param.shape[1])
                nn.init.uniform_(param, -bound, bound)

    def weights(self) -> dict[str, torch.Tensor]:
        """The `[L, ...]` tensors by name; sparse collectives and sharding work on this dict."""
        return dict(self.named_parameters())

    def forward(self, x_ND: torch.Tensor, counts_L: list[int], weights: dict | None = None) -> torch.Tensor:
        """Rows of `x_ND` are grouped by expert, `counts_L[l]` rows for expert l of `weights`
        (default: this module's own parameters; a planner may pass materialized copies)."""
        w = self.weights() if weights is None else weights
        dtype = _compute_dtype(x_ND)
        x_ND = x_ND.to(dtype)
        if self.kind == "ffn":
            row_expert_N = torch.repeat_interleave(
                torch.arange(len(counts_L), device=x_ND.device),
                torch.tensor(counts_L, device=x_ND.device),
                output_size=x_ND.shape[0],
            )
            hidden_NH = grouped_mm(x_ND, w["w1"], counts_L) + w["b1"].to(dtype)[row_expert_N]
            hidden_NH = F.gelu(hidden_NH)  # exact erf GELU, as GPT's FFN
            return grouped_mm(hidden_NH, w["w2"], counts_L) + w["b2"].to(dtype)[row_expert_N]
        gated_NH = F.silu(grouped_mm(x_ND, w["w1"], counts_L)) * grouped_mm(x_ND, w["w3"], counts_L)
        return grouped_mm(gated_NH, w["w2"], counts_L)

    def row_of(self, expert: int) -> int:
        """Local row of global expert `expert` (KeyError when this rank does not own it)."""
        return self._rows[expert]

    @property
    def expert_ids(self) -> list[int]:
        return self._ids

    @expert_ids.setter
    def expert_ids(self, ids: list[int]) -> None:
        self._ids = [int(e) for e in ids]
        self._rows = {e: row for row, e in enumerate(self._ids)}

    def shard_(self, expert_ids) -> GroupedExperts:
        """Keep only the experts `expert_ids` (global ids) of those held now, as new parameters."""
        ids = sorted(int(e) for e in expert_ids)
        missing = [e for e in ids if e not in self._rows]
        if missing:
            raise ValueError(f"shard_: experts {missing} are not held here (held: {self.expert_ids})")
        rows = torch.tensor([self._rows[e] for e in ids], dtype=torch.long)
        for name, param in list(self.named_parameters()):
            setattr(self, name, nn.Parameter(param.detach().index_select(0, rows.to(param.device))))
        self.expert_ids = ids
        return self

    def extra_repr(self) -> str:
        return f"kind={self.kind}, experts={self.expert_ids}, d_model={self.d_model}, d_hidden={self.d_hidden}"
