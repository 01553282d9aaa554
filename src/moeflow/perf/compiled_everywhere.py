"""A shadow order's prefixes compiled (numba): every step holds one more expert on every rank.

FasterMoE's shadowing (§4.1) prices the prefixes of its candidates in load order on the layer's
critical path (`perf.everywhere_pricing`). Its steps are all of one kind — an expert its owner
alone held becomes held everywhere — so its search needs none of the general kernels' bookkeeping
(`perf.compiled_sums.dispatch_terms`: the nodes a step leaves unchanged, the sums an earlier state
kept; `perf.compiled_copies.copy_terms`: the copy trees), and it can go on from where it stopped
when the copies' bound asks for more prefixes:

- `everywhere_rows`: each step's dispatch after it (every source computes its own tokens) and
  before it (every token to the owner), added to a running state that the next call goes on from,
  and per row the maxima a price reads — and, for a cost model that prices every device
  (`perf.compiled_rows`), every device's tokens and the experts it computes. The dispatch and the
  maxima are the general kernel's own (`compiled_sums.dispatch_one`, `compiled_sums.row_maxima`);
  every value summed is a whole number, so the sums, and the maxima, are the general kernel's to
  the bit; after a step every source computes its own tokens and before it the owner all of them,
  so a device computes the expert after the step iff it sends any, and the owner before it iff any
  is sent.
- `owner_counts`: each step's owner's number of experts held everywhere before and after it, which
  `compiled_copies.owner_price_sums` prices (one broadcast out and one reduce back per owner:
  FasterMoE Eq. 8's copy term).

numba caches each kernel beside its own file: after editing `perf.compiled_sums`, delete the
package's `__pycache__` before timing or testing (`perf.compiled_routes`).

Shape suffixes: W ranks, E experts, L links (as `Topology` names them), Q steps, Z rows (Q + 1).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moeflow.perf.compiled_sums import dispatch_one, dispatch_scratch, row_maxima


@njit(cache=True, nogil=True)
def everywhere_rows(
    flow_EW, experts_Q, owner_E, node_W, routes, spread_by_holder, tok_bytes, state, calls_W, inv_bw_L, latency_classes
):
    """Rows `[Z]` (most tokens on a device, busiest link time, slowest route latency with a positive
    entry, whether anything is sent) and, where `calls_W` is given (`[W]`, the experts each device
    computes, else empty), every device's tokens and experts `[Z, W]` (else `[Z, 0]`): row 0 of
    `state` as given (tokens per device, bytes per link, positive entries per route latency), row
    j + 1 after step j holds `experts_Q[j]` everywhere instead of on its owner alone. `state` and
    `calls_W` are left as after the last step."""
    Q, W = experts_Q.size, node_W.size
    L, n_classes = inv_bw_L.size, latency_classes.size
    rows = calls_W.size > 0
    most_Z, busiest_Z, latency_Z = np.zeros(Q + 1), np.zeros(Q + 1), np.zeros(Q + 1)
    sends_Z = np.zeros(Q + 1, dtype=np.bool_)
    tokens_ZW, calls_ZW = np.zeros((Q + 1, W if rows else 0)), np.zeros((Q + 1, W if rows else 0))
    most_Z[0], busiest_Z[0], latency_Z[0], sends_Z[0] = row_maxima(state, W, L, n_classes, inv_bw_L, latency_classes)
    if rows:
        tokens_ZW[0], calls_ZW[0] = state[:W], calls_W
    nodes, work, pend_i, pend_f = dispatch_scratch(node_W)
    # No node is skipped (a node that holds the expert before and after on the same ranks would add
    # and take back the same whole counts) and none is bare (every node holds it after).
    none_N = np.zeros(nodes, dtype=np.bool_)
    everywhere_W, alone_W = np.ones(W, dtype=np.bool_), np.zeros(W, dtype=np.bool_)
    memo_f, memo_x = np.zeros(0), np.zeros(0, dtype=np.int64)  # no later step takes these states back
    rest = (routes, spread_by_holder, L, tok_bytes, state, work, pend_i, pend_f, memo_f, memo_x)
    for j in range(Q):
        e = experts_Q[j]
        o = owner_E[e]
        flow_W = flow_EW[e]
        dispatch_one(flow_W, everywhere_W, node_W, none_N, none_N, 1.0, *rest)
        alone_W[o] = True
        dispatch_one(flow_W, alone_W, node_W, none_N, none_N, -1.0, *rest)
        alone_W[o] = False
        most_Z[j + 1], busiest_Z[j + 1], latency_Z[j + 1], sends_Z[j + 1] = row_maxima(
            state, W, L, n_classes, inv_bw_L, latency_classes
        )
        if rows:  # after the step every source computes its own tokens; before it the owner all of them
            total = 0.0
            for w in range(W):
                total += flow_W[w]
                if flow_W[w] > 0:
                    calls_W[w] += 1.0
            if total > 0:
                calls_W[o] -= 1.0
            tokens_ZW[j + 1], calls_ZW[j + 1] = state[:W], calls_W
    return most_Z, busiest_Z, latency_Z, sends_Z, tokens_ZW, calls_ZW


@njit(cache=True, nogil=True)
def owner_counts(experts_Q, owner_E, W):
    """`[Q]` x 2: each step's owner's number of experts held everywhere after and before the step
    (distinct experts, each held by its owner alone before), as `compiled_copies.copy_terms` counts
    them."""
    Q = experts_Q.size
    count_W = np.zeros(W, dtype=np.int64)
    after_Q, before_Q = np.empty(Q, dtype=np.int64), np.empty(Q, dtype=np.int64)
    for j in range(Q):
        o = owner_E[experts_Q[j]]
        before_Q[j] = count_W[o]
        count_W[o] += 1
        after_Q[j] = count_W[o]
    return after_Q, before_Q
