"""Expert sharding (ESP, FSMoE §3): the `esp_size` ranks of an ESP group (consecutive ranks, the devices
of a node) hold the SAME experts, each a slice `H/esp_size` of their hidden dimension, and compute
together on the rows all of them received:

    AllGather(rows of the ESP group) → Expert(hidden slice) → ReduceScatter(partial outputs)

FSMoE's block is AllGather → AlltoAll → Expert → AlltoAll → ReduceScatter. Deviation (recorded):
here each ESP member first runs its own EP dispatch (its EP group is the ranks with the same ESP
index), and the all-gather happens AFTER dispatch, inside the layer's `compute` step: the gathered
rows are then exactly the rows of the node for the node's experts (the same rows FSMoE's order
brings there), and ESP composes with any schedule that calls `compute` (one chunk at a time in a
pipelined schedule) without changing the dispatch.

Exactness: GELU / SiLU·gate act element by element on the hidden units, so the hidden slices'
partial outputs `act(x·w1[:, h]) · w2[h, :]` sum to the full output. `b2` (ffn) is added by ESP
member 0 only, but every member's `b2` receives the gradient of the full output (the partials'
gradient is the all-gathered output gradient, the same on every member): the sum is exact and
`b2` stays identical on the members without any extra reduction.

Autograd: `_GatherRows` (all-gather; backward: reduce-scatter) and `_ScatterSumRows`
(reduce-scatter; backward: all-gather). gloo has no `reduce_scatter` and `all_gather_into_tensor`
only for some dtypes and equal sizes, so both use `dist.all_gather` (list form) and `dist.all_reduce`
of zero-padded `[S, R_max, D]` blocks (one per member) followed by a slice: correct on every
backend; the padding costs `esp_size · R_max` rows of traffic where a backend-native
reduce-scatter would move `Σ R_m`.

Shape suffixes: R rows this member received (grouped by expert), D d_model, J experts held,
S source ranks (the members of the ESP group the rows came from); `x_group`, `y_group`,
`grad_group`: the rows of the whole ESP group (no letter).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeflow.core import dispatch

HIDDEN_AXIS = {"w1": 2, "w13": 3, "b1": 1, "b13": 2, "w2": 1}
"""The axis of each `[J, ...]` expert parameter that runs over the hidden dimension; `b2` has none
(whole on every member)."""


def _padded(x_RD: torch.Tensor, rows: int) -> torch.Tensor:
    if x_RD.shape[0] == rows:
        return x_RD.contiguous()
    return torch.cat([x_RD, x_RD.new_zeros((rows - x_RD.shape[0], x_RD.shape[1]))])


def _all_gather_rows(x_RD: torch.Tensor, sizes_S: list[int], group) -> torch.Tensor:
    """Concatenation of every member's rows, member-major."""
    r_max = max(sizes_S)
    parts = [x_RD.new_empty((r_max, x_RD.shape[1])) for _ in sizes_S]
    dist.all_gather(parts, _padded(x_RD, r_max), group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes_S)])


def _reduce_scatter_rows(y_group: torch.Tensor, sizes_S: list[int], me: int, group) -> torch.Tensor:
    """The sum over members of `y_group`'s block of member `me` (gloo: all_reduce + slice)."""
    r_max = max(sizes_S)
    blocks = list(torch.split(y_group, sizes_S))
    flat_SRD = torch.stack([_padded(b, r_max) for b in blocks])
    dist.all_reduce(flat_SRD, group=group)
    return flat_SRD[me, : sizes_S[me]]


class _GatherRows(torch.autograd.Function):
    """Forward: all-gather of the members' rows. Backward: reduce-scatter of the gradient (each
    member's rows were used by every member)."""

    @staticmethod
    def forward(ctx, x_RD, sizes_S, me, group):
        ctx.sizes, ctx.me, ctx.group = sizes_S, me, group
        return _all_gather_rows(x_RD, sizes_S, group)

    @staticmethod
    def backward(ctx, grad_group):
        return _reduce_scatter_rows(grad_group.contiguous(), ctx.sizes, ctx.me, ctx.group), None, None, None


class _ScatterSumRows(torch.autograd.Function):
    """Forward: reduce-scatter (sum of the members' partial outputs, this member's rows).
    Backward: all-gather of the gradient (every member's partial fed every member's rows)."""

    @staticmethod
    def forward(ctx, y_group, sizes_S, me, group):
        ctx.sizes, ctx.group = sizes_S, group
        return _reduce_scatter_rows(y_group.contiguous(), sizes_S, me, group)

    @staticmethod
    def backward(ctx, grad_RD):
        return _all_gather_rows(grad_RD.contiguous(), ctx.sizes, ctx.group), None, None, None


class ForwardOnMemberZero(torch.autograd.Function):
    """`b` on ESP member 0, zeros elsewhere; the gradient reaches `b` on every member."""

    @staticmethod
    def forward(ctx, b, keep: bool):
        return b.view_as(b) if keep else torch.zeros_like(b)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def shard_hidden_(experts, esp_rank: int, esp_size: int) -> None:
    """Keep this member's slice `[r·H/esp_size, (r+1)·H/esp_size)` of every expert's hidden dimension
    (w1 columns, both halves of w13, their biases, w2 rows); b2 stays whole. Build the layer with the
    same seed on every rank first."""
    from torch import nn

    if esp_size == 1:
        return
    if experts.d_hidden % esp_size:
        raise ValueError(f"esp_size={esp_size} must divide d_hidden={experts.d_hidden}")
    if getattr(experts, "esp_size", 1) != 1:
        raise ValueError("shard_hidden_: these experts are already sharded by hidden slice")
    width = experts.d_hidden // esp_size
    lo = esp_rank * width
    for name, param in list(experts.named_parameters()):
        if name in HIDDEN_AXIS:
            piece = param.detach().narrow(HIDDEN_AXIS[name], lo, width).clone()
            setattr(experts, name, nn.Parameter(piece))
    experts.d_hidden_full, experts.hidden_offset = experts.d_hidden, lo
    experts.d_hidden, experts.esp_rank, experts.esp_size = width, esp_rank, esp_size


def hidden_axis(experts, name: str) -> int | None:
    """The hidden axis of `experts`' parameter `name` when it is a hidden slice (distinct on every
    ESP member), else None (unsharded experts, `b2`)."""
    return HIDDEN_AXIS.get(name) if getattr(experts, "esp_size", 1) > 1 else None


def hidden_slice_parameters(model) -> set[int]:
    """`id`s of the parameters of `model` that are hidden slices: their squares sum over the ESP
    group in a global gradient norm, where a replicated `b2` counts once (FSMoE §3)."""
    return {
        id(param)
        for module in model.modules()
        for name, param in module.named_parameters(recurse=False)
        if hidden_axis(module, name) is not None
    }


def sharded_compute(experts, x_RD: torch.Tensor, counts_J: list[int], group, weights=None) -> torch.Tensor:
    """`experts(x_RD, counts_J)` over the ESP group: rows grouped by expert in, this member's full
    outputs out (the sum of every member's hidden slice)."""
    me, size = dist.get_rank(group), dist.get_world_size(group)
    counts_t = torch.tensor(counts_J, dtype=torch.int64)
    gathered = [torch.empty_like(counts_t) for _ in range(size)]
    dist.all_gather(gathered, counts_t, group=group)
    counts_SJ = torch.stack(gathered).numpy()
    sizes_S = [int(n) for n in counts_SJ.sum(1)]
    x_group = _GatherRows.apply(x_RD, sizes_S, me, group)
    y_group = dispatch.run_expert_major(
        lambda x_grouped, counts_J: experts(x_grouped, counts_J, weights), x_group, counts_SJ
    )
    return _ScatterSumRows.apply(y_group, sizes_S, me, group)


def to_expert_sharding(layer, group) -> None:
    """Shard `layer`'s (already expert-parallel) experts by hidden slice over the ESP `group`."""
    if group is None or dist.get_world_size(group) == 1:
        return
    if layer.strategy != "ep":
        raise ValueError(f"esp_size>1 supports strategy='ep' only, got strategy={layer.strategy!r}")
    shard_hidden_(layer.experts, dist.get_rank(group), dist.get_world_size(group))
    layer.esp_group = group
    layer.experts.esp_group = group  # checkpoints offer the slices as shards of the full tensor
