"""Pro-Prophet's planner performance model (§IV-B, Eq. 1-8), priced by the shared `CostModel`.

The Pro-Prophet planner (locality-based greedy search, §IV-C) compares placements with these
terms; they are kept next to the planners, in the paper's own form, so that the planner and its
tests use one implementation.

Shape suffixes: W devices; ``...`` = any leading batch dims.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moeflow.core.expert_shape import ExpertShape


def prophet_layer_times(
    cost_model: Any,
    recv_tokens_W: Any,
    compute_tokens_W: Any,
    num_transferred: Any,
    num_not_transferred: Any,
    shape: ExpertShape,
    nonmoe_forward_s: float = 0.0,
    nonmoe_backward_s: float = 0.0,
) -> dict[str, np.ndarray]:
    """Pro-Prophet §IV-B Eq. 1-8 for one layer. Returns every term and both totals:

    ``a2a = max_i R_i·tok_bytes/B̄`` (Eq. 1, B̄ the mean bandwidth between two devices),
    ``fec = max_i`` forward expert time of ``H_i`` tokens (Eq. 2), ``bec = 2·fec`` (Eq. 3),
    ``trans = s·(D−n)·size/(D·B̄)`` (Eq. 4), ``agg`` likewise (Eq. 5),
    ``total = 4·a2a + 3·fec + trans + agg`` (Eq. 6), ``overlapped`` with
    ``max(0, trans − fec − fnec)`` and ``max(0, agg − bec − bnec)`` (Eq. 7-8).
    """
    D = cost_model.topology.num_devices
    bbar = cost_model.mean_bandwidth_bytes_per_s
    tok_bytes = shape.d_model * cost_model.bytes_per_element
    size = shape.param_bytes(cost_model.bytes_per_element)
    a2a = np.asarray(recv_tokens_W, dtype=np.float64).max(axis=-1) * tok_bytes / bbar
    tokens_W = np.asarray(compute_tokens_W, dtype=np.float64)
    fec = cost_model.slowest(
        cost_model.expert_forward_time(tokens_W, shape) + cost_model.elementwise_time(tokens_W, shape)
    )
    bec = 2 * fec
    s = np.asarray(num_transferred, dtype=np.float64)
    n = np.asarray(num_not_transferred, dtype=np.float64)
    trans = s * (D - n) * size / (D * bbar)
    agg = trans
    total = 4 * a2a + 3 * fec + trans + agg
    ptrans = np.maximum(0.0, trans - fec - nonmoe_forward_s)
    pagg = np.maximum(0.0, agg - bec - nonmoe_backward_s)
    return {
        "a2a": a2a,
        "fec": fec,
        "bec": bec,
        "trans": trans,
        "agg": agg,
        "total": total,
        "overlapped": 4 * a2a + 3 * fec + ptrans + pagg,
    }
