"""FSMoE §3.1 hook points: non-invasive changes at six named places of the MoE step.

A hook is a `MoEHook` overriding any of the six points; each receives the layer and the tensor at
that point and returns a replacement tensor, or None to leave it unchanged. Hooks run in list order.
Two more points wrap a step instead of a tensor: `wrap_copies(layer, gather)` and
`wrap_compute(layer, compute)` return the function the layer calls to get the weights of the
experts it holds this iteration (the block-wise prefetch supplies copies it sent ahead) and to run
them (the timer `auto` learns from measures them); the first hook's wrapper is the outermost.

Pieces. A schedule that exchanges the block in pieces (`pairwise`: one per step) runs the points
between the exchanges once per piece — a hook that transforms the rows (the wire casts) must see
every piece. A hook that marks the block (`once_per_block = True`: the block-wise prefetch, which
sends copies after the first rows arrived and waits for them once all are computed) runs at the
first piece's `after_dispatch` and the last piece's `before_combine` only: on every step of
`pairwise` the prefetch waited for the copies after the first step's compute, half the window it
hides them behind.

FSMoE's motivating use, compressing what crosses the network, is built in: `wire_hooks(dtype)`
(`MoELayer(dispatch_dtype="bfloat16")`) sends the dispatched rows and the expert outputs in a
lower precision and restores the compute dtype on arrival, in forward and — through autograd's
casts — backward, where the gradients cross the network in the same precision. It halves the
all-to-all bytes of fp32 training and changes the numbers by the rounding of the rows sent
(bf16: a relative error of about 2⁻⁸ per element; tested at 2 % of the output's scale).
"""

from __future__ import annotations

import operator
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


_POINTS = {point: operator.attrgetter(point) for point in HOOK_POINTS}


class MoEHook:
    """Base class with every hook point a no-op; override the ones you need."""

    once_per_block: bool = False
    """Under a schedule that exchanges in pieces, run `after_dispatch` at the first piece and
    `before_combine` at the last only (module docstring, "Pieces")."""
    replayable: bool = True
    """It may run twice for one forward: a block recomputed under full activation checkpointing
    (`core.replay`) runs its hooks again. False for hooks that measure or send ahead per forward."""

    def wrap_copies(self, layer, gather: Callable) -> Callable:
        """The function that returns the held experts' weights (`gather(placement, held_J)`)."""
        return gather

    def wrap_compute(self, layer, compute: Callable) -> Callable:
        """The function that runs the held experts on received rows (`compute(x_RD, counts_SJ)`)."""
        return compute

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
    if not hooks:  # most layers have none: six calls per forward that would only look up the point
        return tensor
    once = first if point in ("before_dispatch", "after_dispatch") else last
    method = _POINTS[point]
    for hook in hooks:
        if once or not hook.once_per_block:
            out = method(hook)(layer, tensor)
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


def layer_hooks(hooks: Sequence[MoEHook] | None, dispatch_dtype: str | None) -> list[MoEHook]:
    """A layer's hooks in running order: each checked to be a `MoEHook`, and with a
    `dispatch_dtype` the wire pair around them (`wire_hooks`)."""
    hooks = list(hooks or [])
    for hook in hooks:
        if not isinstance(hook, MoEHook):
            raise TypeError(f"hooks entry {hook!r}: expected a moeflow MoEHook (override the points it needs)")
    if dispatch_dtype is None:
        return hooks
    restore, compress = wire_hooks(dispatch_dtype)
    return [restore, *hooks, compress]


class Mark(torch.autograd.Function):
    """Identity; runs `on_forward()` in forward and `on_backward()` when its gradient arrives (the
    block-wise prefetch posts and waits transfers at such points)."""

    @staticmethod
    def forward(ctx, x, on_forward, on_backward):
        ctx.on_backward = on_backward
        on_forward()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.on_backward()
        return grad, None, None
