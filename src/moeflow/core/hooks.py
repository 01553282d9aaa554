"""FSMoE §3.1 hook points: non-invasive changes at six named places of the MoE step.

A hook object implements any of the methods below; each receives the layer and the tensor at that
point and returns a replacement tensor, or None to leave it unchanged. Hooks run in list order.
Example (compress what crosses the network, FSMoE's motivating use):

    class Bf16Wire(MoEHook):
        def before_dispatch(self, layer, x):  return x.to(torch.bfloat16)
        def after_dispatch(self, layer, x):   return x.float()
        def before_combine(self, layer, y):   return y.to(torch.bfloat16)
        def after_combine(self, layer, y):    return y.float()
"""

from __future__ import annotations

from collections.abc import Sequence

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


def run_hooks(hooks: Sequence[object], point: str, layer, tensor: torch.Tensor) -> torch.Tensor:
    for hook in hooks:
        fn = getattr(hook, point, None)
        if fn is not None:
            out = fn(layer, tensor)
            if out is not None:
                tensor = out
    return tensor
