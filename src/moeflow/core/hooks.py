"""FSMoE §3.1 hook points: non-invasive changes at six named places of the MoE step.

A hook object implements any of the methods below; each receives the layer and the tensor at that
point and returns a replacement tensor, or None to leave it unchanged. Hooks run in list order.

Pieces. A schedule that exchanges the block in pieces (`pairwise`: one per step) runs the points
between the exchanges once per piece — a hook that transforms the rows (the wire casts) must see
every piece. A hook that marks the block (`once_per_block = True`: the block-wise prefetch, which
sends copies after the first rows arrived and waits for them once all are computed) runs at the
first piece's `after_dispatch` and the last piece's `before_combine` only: on every step of
`pairwise` the prefetch waited for the copies after the first step's compute, half the window it
hides them behind (2 × 1 testbed, Zipf 1.6, `strategy=auto`: the prefetched layer 0.283 s under
`pairwise` against 0.232 under `sync`, runs s of docs/benchmarks.md).

FSMoE's motivating use, compressing what crosses the network, is built in: `wire_hooks(dtype)`
(`MoELayer(dispatch_dtype="bfloat16")`) sends the dispatched rows and the expert outputs in a
lower precision and restores the compute dtype on arrival, in forward and — through autograd's
casts — backward, where the gradients cross the network in the same precision. It halves the
all-to-all bytes of fp32 training and changes the numbers by the rounding of the rows sent
(bf16: a relative error of about 2⁻⁸ per element; tested at 2 % of the output's scale).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

HOOK_POINTS = (
    "before_moe_start",  # input tokens [T, D]
    "before_dispatch",  # ordered rows about to be sent [A, D]
    "after_dispatch",  # rows received [R, D]
    "before_combine",  # expert outputs about to be sent back [R, D]
    "after_combine",  # outputs back on this rank, in send order [A, D]
    "before_moe_end",  # layer output [T, D]
)


class MoEHook:
    """Base class with every hook point a no-op; override the ones you need."""

    def before_moe_start(self, layer, x):
        return None

    def before_dispatch(self, layer, x):
        return None

    def after_dispatch(self, layer, x):
        return None

    def before_combine(self, layer, y):
        return None

    def after_combine(self, layer, y):
        return None

    def before_moe_end(self, layer, y):
        return None


def run_hooks(
    hooks: Sequence[object], point: str, layer, tensor: torch.Tensor, first: bool = True, last: bool = True
) -> torch.Tensor:
    """`hooks` at `point`; `first`/`last`: the piece is the block's first/last (module docstring,
    "Pieces": a `once_per_block` hook runs at the first piece's dispatch points and the last's
    combine points only)."""
    once = first if point in ("before_dispatch", "after_dispatch") else last
    for hook in hooks:
        if not once and getattr(hook, "once_per_block", False):
            continue
        fn = getattr(hook, point, None)
        if fn is not None:
            out = fn(layer, tensor)
            if out is not None:
                tensor = out
    return tensor


WIRE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float8_e4m3fn": torch.float8_e4m3fn}
"""Precisions `dispatch_dtype` may send rows in (float8 only where the backend moves it: nccl)."""


class _WireCompress(MoEHook):
    """Casts the rows about to cross the network to the wire dtype (runs after the other hooks)."""

    def __init__(self, dtype: torch.dtype, restore: _WireRestore) -> None:
        self.dtype, self.restore = dtype, restore

    def before_dispatch(self, layer, x):
        self.restore.dispatch_dtype = x.dtype
        return x.to(self.dtype)

    def before_combine(self, layer, y):
        self.restore.combine_dtype = y.dtype
        return y.to(self.dtype)


class _WireRestore(MoEHook):
    """Casts arrived rows back to the dtype they left in (runs before the other hooks)."""

    dispatch_dtype = combine_dtype = torch.float32

    def after_dispatch(self, layer, x):
        return x.to(self.dispatch_dtype)

    def after_combine(self, layer, y):
        return y.to(self.combine_dtype)


def wire_hooks(dtype_name: str) -> tuple[MoEHook, MoEHook]:
    """(restore, compress) for `dispatch_dtype`: the layer runs `restore` first and `compress` last,
    so every other hook sees rows in the compute dtype."""
    if dtype_name not in WIRE_DTYPES:
        raise ValueError(f"dispatch_dtype={dtype_name!r}: expected one of {sorted(WIRE_DTYPES)} or None")
    restore = _WireRestore()
    return restore, _WireCompress(WIRE_DTYPES[dtype_name], restore)


def layer_hooks(hooks: Sequence[object] | None, dispatch_dtype: str | None) -> list[object]:
    """A layer's hooks in running order: each checked to implement some hook point, and with a
    `dispatch_dtype` the wire pair around them (`wire_hooks`)."""
    hooks = list(hooks or [])
    for hook in hooks:
        if not any(hasattr(hook, point) for point in HOOK_POINTS):
            raise TypeError(f"hooks entry {hook!r} implements none of {list(HOOK_POINTS)}")
    if dispatch_dtype is None:
        return hooks
    restore, compress = wire_hooks(dispatch_dtype)
    return [restore, *hooks, compress]


class Mark(torch.autograd.Function):
    """Identity; runs `on_forward()` in forward and `on_backward()` when its gradient arrives (the
    block-wise prefetch posts and waits transfers at such points; `schedule="auto"` times the
    block's backward between two of them)."""

    @staticmethod
    def forward(ctx, x, on_forward, on_backward):
        ctx.on_backward = on_backward
        on_forward()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.on_backward()
        return grad, None, None


def time_backward(entry: torch.Tensor, record: Callable[[float], None]):
    """Time the backward of a span of the graph, from its output's gradient arriving to its input's
    gradient leaving: returns `entry` marked (use it in place of the span's input) and `close(exit)`,
    which marks the span's output. When `entry` needs no gradient (a first layer fed by data), the
    span's backward ends the backward pass: it is timed to the autograd engine's end-of-pass callback
    (the point DDP hooks), which also counts what runs after the span's own nodes. `record(seconds)`
    runs once per backward. Cheap: two identity nodes, no synchronisation."""
    started = [0.0]
    needs_grad = entry.requires_grad

    def ends() -> None:
        record(time.perf_counter() - started[0])

    def starts() -> None:
        started[0] = time.perf_counter()
        if not needs_grad:  # nothing before the span needs a gradient: it ends the backward pass
            torch.autograd.Variable._execution_engine.queue_callback(ends)

    marked = Mark.apply(entry, _nothing, ends) if needs_grad else entry
    return marked, lambda exit_: Mark.apply(exit_, _nothing, starts)


def _nothing() -> None:
    pass
