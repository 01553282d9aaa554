"""Every device's tokens and experts per candidate, compiled (numba): for the cost models whose
slowest device is not simply the one with the most tokens.

`perf.compiled_sums.dispatch_terms` keeps, per candidate, only the most tokens on a device: enough
where a device's expert time grows with its tokens alone (`CostModel.compute_grows_with_tokens`).
A cost model with a fitted GEMM launch (`moeflow profile` fits one: `CostModel.prices_gemm_calls`)
also prices the experts each device computes (α per launch), and one that shares a host's cores
(`CostModel.host_cores`, processor sharing) prices every device's time together; both need every
device's tokens, and the first the number of experts each computes, per candidate — what the NumPy
path builds densely (`PlacementPricer._terms`). Here:

- `dispatch_rows`: each step's expert dispatched before and after the step in full (every source:
  a device computes an expert iff some source sends it a token, so no source's dispatch may be left
  out as the fast kernel leaves out those that cancel), its tokens per device in each state telling
  which devices start or stop computing it; per kept row every device's tokens and experts computed
  and the exchange's maxima (`compiled_routes.link_maxima`). Whole numbers throughout: the rows are
  the NumPy path's to the bit, and the `CostModel` prices them with the NumPy path's own calls.

Shape suffixes: W ranks, E experts, L links (as `Topology` names them), Q steps, Z rows (Q + 1).
Route-latency classes have no letter (`n_classes` of them).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moeflow.perf.compiled_routes import kept, link_maxima
from moeflow.perf.compiled_sums import dispatch_one, dispatch_scratch


@njit(cache=True, nogil=True)
def dispatch_rows(
    flow_EW,
    experts_Q,
    new_QW,
    prev_QW,
    start_Q,
    node_W,
    routes,
    spread_by_holder,
    tok_bytes,
    tokens0_W,
    calls0_W,
    traffic0_L,
    classes0,
    inv_bw_L,
    latency_classes,
    keep_Z,
):
    """Per row kept (`keep_Z`; the others 0): every device's tokens `[Z, W]`, the experts it computes
    `[Z, W]`, and the exchange's busiest link time, slowest route latency with a positive entry and
    whether it sends `[Z]`; row 0 the owners alone, row j + 1 after step j (a candidate's rows restart
    from the owners where `start_Q` is True)."""
    Q, W = new_QW.shape
    L, n_classes = traffic0_L.size, classes0.size
    base = np.concatenate((tokens0_W, traffic0_L, classes0))
    state, calls_W = base.copy(), calls0_W.astype(np.float64)
    tokens_ZW, calls_ZW = np.zeros((Q + 1, W)), np.zeros((Q + 1, W))
    busiest_Z, latency_Z = np.zeros(Q + 1), np.zeros(Q + 1)
    sends_Z = np.zeros(Q + 1, dtype=np.bool_)
    if kept(keep_Z, 0):
        tokens_ZW[0], calls_ZW[0] = state[:W], calls_W
        busiest_Z[0], latency_Z[0], sends_Z[0] = link_maxima(state, W, L, n_classes, inv_bw_L, latency_classes)
    nodes, work, pend_i, pend_f = dispatch_scratch(node_W)
    none_N = np.zeros(nodes, dtype=np.bool_)  # no source left out: each state dispatched in full
    memo_f, memo_x = np.zeros(0), np.zeros(0, dtype=np.int64)
    start_W, added_W = np.zeros(W), np.zeros(W)  # every device's tokens before and between the two states
    for j in range(Q):
        if start_Q[j] and j > 0:
            state[:] = base
            calls_W[:] = calls0_W
        flow_W = flow_EW[experts_Q[j]]
        rest = (routes, spread_by_holder, L, tok_bytes, state, work, pend_i, pend_f, memo_f, memo_x)
        start_W[:] = state[:W]
        dispatch_one(flow_W, new_QW[j], node_W, none_N, none_N, 1.0, *rest)
        added_W[:] = state[:W]
        dispatch_one(flow_W, prev_QW[j], node_W, none_N, none_N, -1.0, *rest)
        for w in range(W):  # a device computes the expert iff it receives any of its tokens (whole numbers)
            after, before = added_W[w] - start_W[w], added_W[w] - state[w]
            calls_W[w] += (1.0 if after > 0 else 0.0) - (1.0 if before > 0 else 0.0)
        if kept(keep_Z, j + 1):
            tokens_ZW[j + 1], calls_ZW[j + 1] = state[:W], calls_W
            busiest_Z[j + 1], latency_Z[j + 1], sends_Z[j + 1] = link_maxima(
                state, W, L, n_classes, inv_bw_L, latency_classes
            )
    return tokens_ZW, calls_ZW, busiest_Z, latency_Z, sends_Z
