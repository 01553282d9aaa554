"""Grouped experts: the experts of one layer on one rank, stored as `[E_local, ...]` tensors and
computed as grouped matmuls over variable-size groups of tokens (never a loop over tokens).

`expert="ffn"`:    y = gelu(x·w1[e] + b1[e])·w2[e] + b2[e]     (exact erf GELU; GPT, FasterMoE)
`expert="swiglu"`: y = (silu(x·w1[e]) * (x·w3[e]))·w2[e]        (Mixtral; no biases)
Their parameters, FLOPs and GEMMs as numbers: `moeflow.core.expert_shape`.

Shape suffixes: N rows (tokens × choices) sorted by expert, D d_model, H d_hidden, L local experts.
"""

from __future__ import annotations

import math
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.core.expert_shape import EXPERT_KINDS
from moeflow.core.expert_sharding import ForwardOnMemberZero


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
    docs/performance.md): on CPU it matches `bmm` for fp32 but is ~10x slower than per-expert `mm`
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
    weight-gradient slices. The fallback where `torch._grouped_mm` is not the fastest kernel.

    With `gemm_dtype` wider than the operands' (bf16 on a CPU without AMX: `_gemm_dtype`) each
    group's GEMM runs on widened copies of its rows and expert, and its result is rounded back to
    the operands' dtype; only the narrow operands are saved for backward and the widened copies
    live one group at a time, so a step's memory stays that of the narrow kernels. Groups of fewer
    than `min_wide_rows` rows stay narrow: there widening the expert's weights costs more than the
    faster GEMM saves.
    """

    min_wide_rows = 32
    """Measured (bf16, d=512, h=1024, forward+backward, no AMX): widened / narrow time 1.24 at 16
    rows per group, 0.95 at 32, 0.81 at 64, 0.67 at 256."""

    @staticmethod
    def forward(ctx, x_ND, w_LDH, counts_L, gemm_dtype=None):
        ctx.save_for_backward(x_ND, w_LDH)
        ctx.counts, ctx.gemm_dtype = counts_L, gemm_dtype or x_ND.dtype
        widen = ctx.gemm_dtype != x_ND.dtype
        out_NH = x_ND.new_empty((x_ND.shape[0], w_LDH.shape[2]))
        start = 0
        with torch.autocast(x_ND.device.type, enabled=False):  # autocast would narrow the copies again
            for i, n in enumerate(counts_L):
                if n:
                    rows = slice(start, start + n)
                    if widen and n >= _PerExpertMM.min_wide_rows:
                        out_NH[rows] = torch.mm(x_ND[rows].to(ctx.gemm_dtype), w_LDH[i].to(ctx.gemm_dtype))
                    else:
                        torch.mm(x_ND[rows], w_LDH[i], out=out_NH[rows])
                start += n
        return out_NH

    @staticmethod
    def backward(ctx, grad_NH):
        x_ND, w_LDH = ctx.saved_tensors
        grad_NH = grad_NH.contiguous()
        grad_x = torch.empty_like(x_ND) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(w_LDH) if ctx.needs_input_grad[1] else None  # experts without rows: 0
        widen = ctx.gemm_dtype != x_ND.dtype
        start = 0
        with torch.autocast(x_ND.device.type, enabled=False):
            for i, n in enumerate(ctx.counts):
                if n:
                    rows = slice(start, start + n)
                    if widen and n >= _PerExpertMM.min_wide_rows:
                        g_nH, w_DH = grad_NH[rows].to(ctx.gemm_dtype), w_LDH[i].to(ctx.gemm_dtype)
                        if grad_x is not None:
                            grad_x[rows] = torch.mm(g_nH, w_DH.t())
                        if grad_w is not None:
                            grad_w[i] = torch.mm(x_ND[rows].to(ctx.gemm_dtype).t(), g_nH)
                    else:
                        if grad_x is not None:
                            torch.mm(grad_NH[rows], w_LDH[i].t(), out=grad_x[rows])
                        if grad_w is not None:
                            torch.mm(x_ND[rows].t(), grad_NH[rows], out=grad_w[i])
                start += n
        return grad_x, grad_w, None, None


class _GroupBias(torch.autograd.Function):
    """`x[rows of group l] + b[l]` (Tutel's per-expert bias) with a backward that is a segment sum
    over each group's contiguous rows, as one GEMM `onehot_LN @ grad_NH` (few experts) or one sum
    per group (many): no accumulating `index_put` over all N rows, the backward of
    `x + b[row_expert]` that took 15-20% of an ffn step. Forward: the same broadcast add as before
    (bit-identical). Few large ops rather than one per group, because each op is a parallel region
    and on a busy machine every region can wait a time slice for its second thread."""

    onehot_max_local = 64
    """Up to this many local experts the bias gradient is one GEMM (its `2·L·N·H` flops are
    `L / D` of one expert GEMM's): with more, one sum per group."""

    @staticmethod
    def forward(ctx, x_NH, b_LH, counts_L):
        counts_t = torch.tensor(counts_L, device=x_NH.device)
        ctx.save_for_backward(counts_t)
        ctx.counts = counts_L
        return x_NH + b_LH.repeat_interleave(counts_t, dim=0, output_size=x_NH.shape[0])

    @staticmethod
    def backward(ctx, grad_NH):
        if not ctx.needs_input_grad[1]:
            return grad_NH, None, None
        (counts_t,) = ctx.saved_tensors
        num_local = counts_t.numel()
        if num_local <= _GroupBias.onehot_max_local:
            eye_LL = torch.eye(num_local, dtype=grad_NH.dtype, device=grad_NH.device)
            onehot_LN = eye_LL.repeat_interleave(counts_t, dim=1, output_size=grad_NH.shape[0])
            return grad_NH, onehot_LN @ grad_NH, None
        grad_b = grad_NH.new_zeros((num_local, grad_NH.shape[1]))
        start = 0
        for i, n in enumerate(ctx.counts):
            if n:
                torch.sum(grad_NH[start : start + n], 0, out=grad_b[i])
            start += n
        return grad_NH, grad_b, None


@cache
def _cpu_has_amx_bf16() -> bool:
    return bool(torch.cpu.get_capabilities().get("amx_bf16", False))


def _gemm_dtype(x_ND: torch.Tensor) -> torch.dtype:
    """The dtype the expert GEMMs run in, chosen per machine (measured, docs/performance.md, "Layer
    speed"): bf16 on a CPU without AMX runs oneDNN's AVX-512-BF16 kernels at about half the fp32
    speed (a [1024, 512] x [512, 1024] mm: 12.8 ms bf16, 6.6 ms fp32, 7.2 ms fp32 with both casts),
    so there the GEMMs take fp32 copies of their bf16 operands and round the result to bf16 (what
    a bf16 kernel with fp32 accumulation returns, up to the order of the sums); with AMX (2.5x the
    fp32 speed) and on CUDA they stay bf16."""
    if x_ND.dtype == torch.bfloat16 and x_ND.device.type == "cpu" and not _cpu_has_amx_bf16():
        return torch.float32
    return x_ND.dtype


def grouped_mm(
    x_ND: torch.Tensor, w_LDH: torch.Tensor, counts_L: list[int], b_LH: torch.Tensor | None = None
) -> torch.Tensor:
    """`out[rows of group l] = x[rows of group l] @ w[l] (+ b[l])` for consecutive groups of
    `counts_L` rows, in `x_ND`'s dtype (weights and bias cast to it). The bias is added per group
    after the GEMM's result is rounded to that dtype, as `mm` then `+ b[row_expert]` did."""
    dtype = x_ND.dtype
    w_LDH = w_LDH.to(dtype)
    counts_L = [int(n) for n in counts_L]
    gemm = _gemm_dtype(x_ND)
    if gemm == dtype and _use_grouped_mm_kernel(x_ND, w_LDH):
        offs_L = torch.tensor(counts_L, dtype=torch.int64).cumsum(0).to(torch.int32).to(x_ND.device)
        out_NH = _ContiguousGrad.apply(torch._grouped_mm(x_ND.contiguous(), w_LDH.contiguous(), offs=offs_L))
    else:
        out_NH = _PerExpertMM.apply(x_ND.contiguous(), w_LDH.contiguous(), counts_L, gemm)
    return out_NH if b_LH is None else _GroupBias.apply(out_NH, b_LH.to(dtype), counts_L)


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
        self.esp_rank, self.esp_size = None, 1  # expert sharding by hidden slice (core.expert_sharding)
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

    def initial_expert(self, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """One expert's initial parameters at the FULL hidden size, drawn from `generator` (CPU,
        fp32, in parameter order): the distribution of `reset_parameters` — weights uniform in
        ±1/sqrt(fan_in), biases zero. A meta-device build draws each expert from a generator seeded
        by its global id (`moeflow.training.init`), so that it is the same whichever rank holds it."""
        full = {"w1": (self.d_model, self.full_hidden), "w3": (self.d_model, self.full_hidden)}
        full |= {"w2": (self.full_hidden, self.d_model), "b1": (self.full_hidden,), "b2": (self.d_model,)}
        out = {}
        for name, _ in self.named_parameters():
            shape = full[name]
            if name.startswith("w"):
                bound = 1.0 / math.sqrt(shape[0])
                out[name] = torch.empty(shape).uniform_(-bound, bound, generator=generator)
            else:
                out[name] = torch.zeros(shape)
        return out

    @property
    def full_hidden(self) -> int:
        """The experts' hidden size before expert sharding (`core.expert_sharding`) sliced it."""
        return self.d_hidden * self.esp_size

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
            # Biases are broadcast over each group's rows, never gathered per row (Tutel's way):
            # their backward is a sum over contiguous rows, not a scatter over all of them.
            hidden_NH = F.gelu(grouped_mm(x_ND, w["w1"], counts_L, w["b1"]))  # exact erf GELU, as GPT's
            b2 = w["b2"] if self.esp_rank is None else ForwardOnMemberZero.apply(w["b2"], self.esp_rank == 0)
            return grouped_mm(hidden_NH, w["w2"], counts_L, b2)
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
