"""Hecate §3.2 / §4.2: FSSDP's sparse collectives hidden behind the attention (`overlap_attention`).

Hecate launches SparseAllGather twice per MoE layer and iteration — the forward materialisation and,
with re-materialization (the copies freed after their forward use), the re-gather before the
layer's backward — and schedules every instance behind the dense (attention) compute that precedes
it (§3.2, Fig. 1c; §4.2 sizes the placement so that spAG fits in the attention forward, Eq. 1's
overlap degree t):

- forward: the spAG of layer l runs during the attention forward of block l (`T`, the placement is
  planned from earlier iterations, so it is known at the block's start);
- backward: block l's attention backward (2·T) hides two instances, SparseReduceScatter of layer l's
  gradients and the re-gather of layer l − 1 (the next layer backward); the re-gather of the last
  layer has no attention backward before it and is exposed.

Unlike Pro-Prophet's Eq. 8 (`prophet_model.overlapped_copies`, the block-wise prefetch), the windows
hold the attention alone — Hecate does not overlap the collectives with the experts' compute (§5.1)
— and the first layer hides its copies too (its own block's attention precedes it). A layer whose
placement was not the one planned ahead (a calibration changed it) has its forward spAG exposed.

Shape suffixes: I iterations, L layers.
"""

from __future__ import annotations

import numpy as np


def attention_overlapped_copies(
    gather_IL: np.ndarray,
    reduce_IL: np.ndarray,
    nonmoe_forward_s: float,
    regather: bool,
    planned_IL: np.ndarray,
) -> np.ndarray:
    """What each layer's copies leave exposed `[I, L]` (module docstring): `gather_IL` one spAG of
    the layer's placement, `reduce_IL` its spRS, `regather` whether the spAG runs again before the
    backward, `planned_IL` whether the placement that ran was planned ahead."""
    gather_IL = np.asarray(gather_IL, dtype=np.float64)
    reduce_IL = np.asarray(reduce_IL, dtype=np.float64)
    window = nonmoe_forward_s
    forward_IL = np.where(planned_IL, np.maximum(gather_IL - window, 0.0), gather_IL)
    regather_IL = gather_IL if regather else np.zeros_like(gather_IL)
    shared_IL = reduce_IL.copy()  # block l's attention backward: spRS of l and the re-gather of l − 1
    shared_IL[:, 1:] += regather_IL[:, :-1]
    backward_IL = np.maximum(shared_IL - 2.0 * window, 0.0)
    backward_IL[:, -1] += regather_IL[:, -1]  # the first layer backward: nothing before it hides it
    return forward_IL + backward_IL
