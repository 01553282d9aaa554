"""Re-materialization (Hecate §4.2, memory mode): the copies of other ranks' experts that a layer
computed with are freed as soon as its forward is done and gathered again when its backward
starts, so at most one layer's copies exist at a time instead of every layer's from forward until
backward (Hecate reports −90.2% parameter memory for 3.6× the sparse-collective time).

Mechanism, as FSDP frees unsharded parameters: the held weights (one tensor per parameter, owned
rows and copies, `[J, ...]`) keep their tensor objects — autograd saved them for the expert
backward — but their storage is resized to 0 at the layer's end (`_Release` forward) and back,
refilled by a fresh gather from the owners, when backward reaches that point (`_Release`
backward, which runs before the combine's and the experts' backward). The refill writes through
`.data`, so the saved tensors' version counters do not change. Every rank of the group passes the
same point in the same order, so the refill's collectives meet.

The refill is synchronous: Hecate overlaps it with the dense backward before the layer; here it
is on the critical path (measured: docs/hecate.md, Hecate).

Shape suffixes: J experts held (computed) by this rank, T tokens, D d_model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def held_bytes(weights: dict[str, torch.Tensor]) -> int:
    """Bytes of storage the held weights occupy now (0 once released)."""
    return sum(t.untyped_storage().nbytes() for t in weights.values())


class _Release(torch.autograd.Function):
    """forward: identity on the layer output; frees the held weights' storage. backward: gathers
    them again (`refill`), then passes the gradient on unchanged."""

    @staticmethod
    def forward(ctx, y_TD, weights, refill):
        ctx.weights, ctx.refill = weights, refill
        for t in weights.values():
            t.untyped_storage().resize_(0)
        return y_TD.view_as(y_TD)

    @staticmethod
    def backward(ctx, grad_TD):
        fresh = ctx.refill()
        with torch.no_grad():
            for name, t in ctx.weights.items():
                t.untyped_storage().resize_(fresh[name].numel() * fresh[name].element_size())
                t.data.copy_(fresh[name])  # through .data: autograd's saved version stays valid
        return grad_TD, None, None


def release_after_forward(
    y_TD: torch.Tensor, weights: dict[str, torch.Tensor], refill: Callable[[], dict[str, torch.Tensor]]
) -> torch.Tensor:
    """`y_TD` unchanged; `weights` freed now and refilled by `refill()` in backward (module docstring)."""
    return _Release.apply(y_TD, weights, refill)


def release_held(
    y_TD: torch.Tensor,
    weights: dict[str, torch.Tensor] | None,
    rematerialize: bool,
    refill: Callable[[], dict[str, torch.Tensor]],
) -> tuple[torch.Tensor, tuple[int, int]]:
    """At a layer's end: with `rematerialize`, `release_after_forward` of the held `weights` (None:
    the layer held exactly its own experts); returns the output and the held bytes (when built,
    after the forward), for `MoEStats`."""
    if weights is None:
        return y_TD, (0, 0)
    built = held_bytes(weights)
    if rematerialize:
        y_TD = release_after_forward(y_TD, weights, refill)
    return y_TD, (built, held_bytes(weights))
