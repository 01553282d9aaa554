"""Grouped experts: the experts of one layer on one rank, stored as `[E_local, ...]` tensors and
computed as grouped matmuls over variable-size groups of tokens (never a loop over tokens).

`expert="ffn"`:    y = gelu(x·w1[e] + b1[e])·w2[e] + b2[e]     (exact erf GELU; GPT, FasterMoE)
`expert="swiglu"`: [g | u] = x·w13[e],  y = (silu(g) * u)·w2[e]  (Mixtral; no biases)
`expert="clamped_swiglu"`: [g | u] = x·w13[e] + b13[e], g = min(g, l), u = clamp(u, −l, l),
                   y = ((u + 1) · g·σ(α·g))·w2[e] + b2[e]        (GPT-OSS; α, l: `expert_options`)
The gated kinds keep the gate and up projections in one `[O, D, 2, H]` tensor `w13` (`[..., 0, :]`
the gate, `[..., 1, :]` the up; bias `b13 [O, 2, H]`): one grouped GEMM on its `[O, D, 2H]` view
computes both, as transformers' fused `gate_up_proj` does — two would double the per-expert GEMMs,
and on a CPU each is a parallel region, the cost that dominates fine-grained experts — and a slice
of the last axis is a slice of hidden units with both halves (expert sharding, checkpoints of any
`esp_size`). Their parameters, FLOPs and GEMMs as numbers:
`moeflow.core.expert_shape`. `SharedExperts` is the
same formula as one dense MLP on every token (DeepSeek-MoE's shared experts): its parameters are
dense parameters, never planned, copied or dispatched.

Shape suffixes: R rows (tokens × choices) received, grouped by expert, D d_model, H d_hidden, J experts
held (computed) by this rank, O experts this rank owns (its parameters), X any width.
"""

from __future__ import annotations

import itertools
import math
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.core.checks import positive_int
from moeflow.core.expert_shape import EXPERT_KINDS
from moeflow.core.expert_sharding import ForwardOnMemberZero
from moeflow.core.registry import parse_options


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: `torch._grouped_mm`'s backward
    rejects the stride-0 gradients that `.sum()` and `expand` produce."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _use_grouped_mm_kernel(x_RD: torch.Tensor, w_JDH: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` is the fastest path here (measured, torch 2.13, see
    docs/speed.md): on CPU it matches `bmm` for fp32 but is ~10x slower than per-expert `mm`
    for bf16 (no AMX path); on CUDA it is the bf16 kernel. It needs 16-byte aligned rows."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    wanted = torch.float32 if x_RD.device.type == "cpu" else torch.bfloat16
    item = x_RD.element_size()
    aligned = (w_JDH.shape[1] * item) % 16 == 0 and (w_JDH.shape[2] * item) % 16 == 0
    return x_RD.dtype == wanted and aligned


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
    def forward(ctx, x_RD, w_JDH, counts_J, gemm_dtype=None):
        ctx.save_for_backward(x_RD, w_JDH)
        ctx.counts, ctx.gemm_dtype = counts_J, gemm_dtype or x_RD.dtype
        widen = ctx.gemm_dtype != x_RD.dtype
        out_RH = x_RD.new_empty((x_RD.shape[0], w_JDH.shape[2]))
        start = 0
        with torch.autocast(x_RD.device.type, enabled=False):  # autocast would narrow the copies again
            for i, n in enumerate(counts_J):
                if n:
                    rows = slice(start, start + n)
                    if widen and n >= _PerExpertMM.min_wide_rows:
                        out_RH[rows] = torch.mm(x_RD[rows].to(ctx.gemm_dtype), w_JDH[i].to(ctx.gemm_dtype))
                    else:
                        torch.mm(x_RD[rows], w_JDH[i], out=out_RH[rows])
                start += n
        return out_RH

    @staticmethod
    def backward(ctx, grad_RH):
        x_RD, w_JDH = ctx.saved_tensors
        grad_RH = grad_RH.contiguous()
        grad_x = torch.empty_like(x_RD) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(w_JDH) if ctx.needs_input_grad[1] else None  # experts without rows: 0
        widen = ctx.gemm_dtype != x_RD.dtype
        start = 0
        with torch.autocast(x_RD.device.type, enabled=False):
            for i, n in enumerate(ctx.counts):
                if n:
                    rows = slice(start, start + n)
                    if widen and n >= _PerExpertMM.min_wide_rows:
                        g_nH, w_DH = grad_RH[rows].to(ctx.gemm_dtype), w_JDH[i].to(ctx.gemm_dtype)
                        if grad_x is not None:
                            grad_x[rows] = torch.mm(g_nH, w_DH.t())
                        if grad_w is not None:
                            grad_w[i] = torch.mm(x_RD[rows].to(ctx.gemm_dtype).t(), g_nH)
                    else:
                        if grad_x is not None:
                            torch.mm(grad_RH[rows], w_JDH[i].t(), out=grad_x[rows])
                        if grad_w is not None:
                            torch.mm(x_RD[rows].t(), grad_RH[rows], out=grad_w[i])
                start += n
        return grad_x, grad_w, None, None


class _GroupBias(torch.autograd.Function):
    """`x[rows of group l] + b[l]` (Tutel's per-expert bias) with a backward that is a segment sum
    over each group's contiguous rows, as one GEMM `onehot_JR @ grad_RH` (few experts) or one sum
    per group (many): no accumulating `index_put` over all R rows, the backward of
    `x + b[row_expert]` that took 15-20% of an ffn step. Forward: the same broadcast add as before
    (bit-identical). Few large ops rather than one per group, because each op is a parallel region
    and on a busy machine every region can wait a time slice for its second thread."""

    onehot_max_local = 64
    """Up to this many local experts the bias gradient is one GEMM (its `2·J·R·H` flops are
    `J / D` of one expert GEMM's): with more, one sum per group."""

    @staticmethod
    def forward(ctx, x_RH, b_JH, counts_J):
        counts_t = host_to_device(counts_J, torch.int64, x_RH.device)
        ctx.save_for_backward(counts_t)
        ctx.counts = counts_J
        return x_RH + b_JH.repeat_interleave(counts_t, dim=0, output_size=x_RH.shape[0])

    @staticmethod
    def backward(ctx, grad_RH):
        if not ctx.needs_input_grad[1]:
            return grad_RH, None, None
        (counts_t,) = ctx.saved_tensors
        num_local = counts_t.numel()
        if num_local <= _GroupBias.onehot_max_local:
            eye_JJ = torch.eye(num_local, dtype=grad_RH.dtype, device=grad_RH.device)
            onehot_JR = eye_JJ.repeat_interleave(counts_t, dim=1, output_size=grad_RH.shape[0])
            return grad_RH, onehot_JR @ grad_RH, None
        grad_b = grad_RH.new_zeros((num_local, grad_RH.shape[1]))
        start = 0
        for i, n in enumerate(ctx.counts):
            if n:
                torch.sum(grad_RH[start : start + n], 0, out=grad_b[i])
            start += n
        return grad_RH, grad_b, None


def host_to_device(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Small host integers (group sizes, offsets) as a tensor on `device`: made there on the CPU;
    on CUDA made in pinned memory and copied without blocking — a copy from pageable memory
    waits for the device to finish its queue (a synchronisation per call). The caching host
    allocator keeps the buffer until the copy has run."""
    if device.type != "cuda":  # the CPU, or a device without pinned memory (meta)
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def group_offsets(counts_J: list[int], device: torch.device) -> torch.Tensor:
    """int32 `[J]`: the end row of each consecutive group of `counts_J` rows (`torch._grouped_mm`'s
    `offs`), summed on the host, which has the counts, and sent without a synchronisation."""
    return host_to_device(list(itertools.accumulate(counts_J)), torch.int32, device)


class GroupSizes:
    """Row counts of consecutive groups, with their `torch._grouped_mm` offsets made once for
    every GEMM over the same groups (an expert's two projections)."""

    def __init__(self, counts_J) -> None:
        self.counts = [int(n) for n in counts_J]
        self._offsets_J: torch.Tensor | None = None

    def offsets(self, device: torch.device) -> torch.Tensor:
        if self._offsets_J is None:
            self._offsets_J = group_offsets(self.counts, device)
        return self._offsets_J


@cache
def _cpu_has_amx_bf16() -> bool:
    return bool(torch.cpu.get_capabilities().get("amx_bf16", False))


def _gemm_dtype(x_RD: torch.Tensor) -> torch.dtype:
    """The dtype the expert GEMMs run in, chosen per machine (measured, docs/speed.md, "Layer
    speed"): bf16 on a CPU without AMX runs oneDNN's AVX-512-BF16 kernels at about half the fp32
    speed (a [1024, 512] x [512, 1024] mm: 12.8 ms bf16, 6.6 ms fp32, 7.2 ms fp32 with both casts),
    so there the GEMMs take fp32 copies of their bf16 operands and round the result to bf16 (what
    a bf16 kernel with fp32 accumulation returns, up to the order of the sums); with AMX (2.5x the
    fp32 speed) and on CUDA they stay bf16."""
    if x_RD.dtype == torch.bfloat16 and x_RD.device.type == "cpu" and not _cpu_has_amx_bf16():
        return torch.float32
    return x_RD.dtype


def grouped_mm(
    x_RD: torch.Tensor,
    w_JDH: torch.Tensor,
    counts_J: list[int] | GroupSizes,
    b_JH: torch.Tensor | None = None,
    dense_grad: bool = False,
) -> torch.Tensor:
    """`out[rows of group l] = x[rows of group l] @ w[l] (+ b[l])` for consecutive groups of
    `counts_J` rows (a list, or `GroupSizes` shared by several calls), in `x_RD`'s dtype (weights
    and bias cast to it). The bias is added per group after the GEMM's result is rounded to that
    dtype, as `mm` then `+ b[row_expert]` did. `dense_grad`: the caller's next op always hands back
    a dense gradient (an activation's backward), so the output needs no `_ContiguousGrad` node."""
    dtype = x_RD.dtype
    if w_JDH.dtype != dtype:  # a cast of the right dtype returns the tensor: the call alone costs
        w_JDH = w_JDH.to(dtype)
    groups = counts_J if isinstance(counts_J, GroupSizes) else GroupSizes(counts_J)
    counts_J = groups.counts
    gemm = _gemm_dtype(x_RD)
    if gemm == dtype and _use_grouped_mm_kernel(x_RD, w_JDH):
        offs_J = groups.offsets(x_RD.device)
        out_RH = torch._grouped_mm(x_RD.contiguous(), w_JDH.contiguous(), offs=offs_J)
        if not dense_grad:
            out_RH = _ContiguousGrad.apply(out_RH)
    else:
        out_RH = _PerExpertMM.apply(x_RD.contiguous(), w_JDH.contiguous(), counts_J, gemm)
    return out_RH if b_JH is None else _GroupBias.apply(out_RH, b_JH.to(dtype), counts_J)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def activate(kind: str, options, h_RX: torch.Tensor) -> torch.Tensor:
    """The hidden activation `[R, H]` of expert `kind` from its first projection (biases added):
    ffn's `[R, H]`, or the gated kinds' interleaved gate and up `[R, 2H]`."""
    if kind == "ffn":
        return F.gelu(h_RX)  # exact erf GELU, as GPT's
    h1_RH, h3_RH = h_RX.unflatten(-1, (2, -1)).unbind(-2)  # gate, up (backward: one stack)
    if kind == "swiglu":
        return F.silu(h1_RH) * h3_RH
    # GPT-OSS (transformers' GptOssExperts._apply_gate, the same operations in the same order).
    gate_RH = h1_RH.clamp(min=None, max=options.limit)
    up_RH = h3_RH.clamp(min=-options.limit, max=options.limit)
    return (up_RH + 1) * (gate_RH * torch.sigmoid(gate_RH * options.alpha))


def expert_options(kind: str, options, where: str = "expert_options") -> object:
    """The validated options dataclass of expert `kind` (a mapping, an instance, or None)."""
    if kind not in EXPERT_KINDS:
        raise ValueError(f"unknown expert={kind!r}; valid: {sorted(EXPERT_KINDS)}")
    return parse_options(EXPERT_KINDS[kind].options, options, f"{where} for expert={kind!r}")


class GroupedExperts(nn.Module):
    """`num_local` experts of one layer; row l holds global expert `expert_ids[l]` (ascending).

    Plain expert parallelism keeps a contiguous range; Hecate's heterogeneous sharding (§4.3) any
    set, of any size (0 included), per layer and rank (`reshard_`)."""

    def __init__(self, num_local: int, d_model: int, d_hidden: int, kind: str = "ffn", options=None):
        super().__init__()
        self.options = expert_options(kind, options)
        self.kind = kind
        spec = EXPERT_KINDS[kind]
        self.expert_ids = list(range(num_local))
        self.d_model, self.d_hidden = d_model, d_hidden
        self.esp_rank, self.esp_size = None, 1  # expert sharding by hidden slice (core.expert_sharding)
        hidden = (2, d_hidden) if spec.gated else (d_hidden,)
        setattr(self, spec.first_projection, nn.Parameter(torch.empty(num_local, d_model, *hidden)))
        self.w2 = nn.Parameter(torch.empty(num_local, d_hidden, d_model))
        if spec.biases:
            setattr(self, spec.first_bias, nn.Parameter(torch.zeros(num_local, *hidden)))
            self.b2 = nn.Parameter(torch.zeros(num_local, d_model))
        self.reset_parameters()

    @property
    def num_local(self) -> int:
        return self.w2.shape[0]

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
        out = {}
        for name, param in self.named_parameters():
            shape = list(param.shape[1:])
            if name != "b2":  # the hidden axis: w2's first, the last of w1/w13/b1/b13
                shape[0 if name == "w2" else -1] = self.full_hidden
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
        """The `[O, ...]` tensors by name; sparse collectives and sharding work on this dict.
        (Its own parameters, in registration order: what `named_parameters` lists for a module
        without children, without its walk, which costs more than the dict every forward.)"""
        return {name: param for name, param in self._parameters.items() if param is not None}

    def forward(
        self, x_RD: torch.Tensor, counts_J: list[int], weights: dict | None = None, dense_grad: bool = False
    ) -> torch.Tensor:
        """Rows of `x_RD` are grouped by expert, `counts_J[l]` rows for expert l of `weights`
        (default: this module's own parameters; a planner may pass materialized copies).
        `dense_grad`: the caller's next ops hand the output a dense gradient (`grouped_mm`)."""
        w = self.weights() if weights is None else weights
        dtype = _compute_dtype(x_RD)
        x_RD = x_RD.to(dtype)
        # Biases are broadcast over each group's rows, never gathered per row (Tutel's way): their
        # backward is a sum over contiguous rows, not a scatter over all of them.
        spec = EXPERT_KINDS[self.kind]
        bias = w.get(spec.first_bias)
        groups = GroupSizes(counts_J)  # both projections' groups: their offsets made once
        # The activation's backward (a stack of the gated halves, gelu's) hands back a dense gradient.
        b_JX = None if bias is None else bias.flatten(1)
        h_RX = grouped_mm(x_RD, w[spec.first_projection].flatten(2), groups, b_JX, dense_grad=True)
        hidden_RH = activate(self.kind, self.options, h_RX)
        b2 = w.get("b2")
        if b2 is not None and self.esp_rank is not None:
            b2 = ForwardOnMemberZero.apply(b2, self.esp_rank == 0)
        return grouped_mm(hidden_RH, w["w2"], groups, b2, dense_grad=dense_grad)

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


def _dense_projection(x_TX: torch.Tensor, w_X: torch.Tensor, b_X: torch.Tensor | None, dtype) -> torch.Tensor:
    """`x @ w (+ b)` in `dtype`, the weight `[D, ...]` as `[D, X]` (w13: `[D, 2, H]` as `[D, 2H]`)."""
    out = x_TX @ w_X.to(dtype).flatten(1)
    return out if b_X is None else out + b_X.to(dtype).flatten()


class SharedExperts(nn.Module):
    """Shared experts (DeepSeek-MoE, DeepSeek-V3 §2.1.2): one dense MLP of the routed experts' kind,
    hidden width `d_hidden` (= shared experts × their width), applied to every token and added to
    the routed output by `MoELayer`. Its parameters are dense: replicated on every rank and
    averaged like attention's, never planned, copied or dispatched."""

    def __init__(self, d_model: int, d_hidden: int, kind: str = "ffn", options=None):
        super().__init__()
        self.options = expert_options(kind, options)
        self.kind = kind
        spec = EXPERT_KINDS[kind]
        self.d_model, self.d_hidden = d_model, d_hidden
        hidden = (2, d_hidden) if spec.gated else (d_hidden,)
        setattr(self, spec.first_projection, nn.Parameter(torch.empty(d_model, *hidden)))
        self.w2 = nn.Parameter(torch.empty(d_hidden, d_model))
        if spec.biases:
            setattr(self, spec.first_bias, nn.Parameter(torch.zeros(*hidden)))
            self.b2 = nn.Parameter(torch.zeros(d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's bound 1/sqrt(fan_in) for the weights, zero biases (also after a meta-device
        build: `moeflow.training.init`)."""
        for name, param in self.named_parameters():
            if name.startswith("w"):
                bound = 1.0 / math.sqrt(param.shape[0])
                nn.init.uniform_(param, -bound, bound)
            else:
                nn.init.zeros_(param)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        # Its own parameters by name, without `named_parameters`' walk (a module without children).
        w = self._parameters
        dtype = _compute_dtype(x_TD)
        x_TD = x_TD.to(dtype)
        spec = EXPERT_KINDS[self.kind]
        h_TX = _dense_projection(x_TD, w[spec.first_projection], w.get(spec.first_bias), dtype)
        hidden_TH = activate(self.kind, self.options, h_TX)
        return _dense_projection(hidden_TH, w["w2"], w.get("b2"), dtype)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, d_model={self.d_model}, d_hidden={self.d_hidden}"


def shared_experts_of(
    count: int, d_hidden: int | None, module: nn.Module | None, d_model: int, routed_d_hidden: int, kind: str, options
) -> nn.Module | None:
    """A layer's shared experts from its arguments: moeflow's own (`count` of them, `d_hidden` wide
    together, default `count` × the routed experts' width), a given module, or None."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"num_shared_experts={count!r} must be an int >= 0")
    if module is not None:
        if count or d_hidden is not None:
            raise ValueError("shared_experts= (a module) excludes num_shared_experts and shared_d_hidden")
        if not isinstance(module, nn.Module):
            raise TypeError(f"shared_experts={type(module).__name__}: expected an nn.Module [T, D] -> [T, D]")
        return module
    if d_hidden is not None:
        positive_int("shared_d_hidden", d_hidden)
        if not count:
            raise ValueError(f"shared_d_hidden={d_hidden} needs num_shared_experts >= 1 (got 0)")
    if not count:
        return None
    return SharedExperts(d_model, d_hidden or count * routed_d_hidden, kind, options)
