"""The owners alone compiled (numba): the placement pricer's starting state.

`owner_sums`: plain EP's terms of a whole flow — tokens per device, bytes per link, positive entries
per route latency — from which `perf.compiled_sums` runs every step's sums, and the flow transposed
(`compiled_routes.transposed`: one expert's sources in a row, as every step reads them).

Shape suffixes: W ranks, E experts, M a rank's place in its node (or its rank), L links (as
`Topology` names them). Route-latency classes have no letter (`n_classes` of them).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moeflow.perf.compiled_routes import on_routes, ranks_by_node, transposed


@njit(cache=True, nogil=True)
def owner_sums(flow_WE, owner_E, routes, L, n_classes, tok_bytes):
    """(tokens_W, local_W, calls_W, traffic_L, classes) of the owners alone, the flow transposed
    (`compiled_routes.transposed`) and the tokens each expert receives `[E]`. Between nodes hanging
    from the root only each device's bytes out and in are summed; the pairs inside a node, or of
    another topology, pair by pair (`compiled_routes.on_routes`)."""
    W, E = flow_WE.shape
    node_W, leave_W2, enter_W2, cross, under_root = routes[2], routes[3], routes[4], routes[5], routes[6]
    # Each rank's column among the pairs summed one by one: its place in its node (or its rank).
    column_W = np.arange(W)
    members_W = np.arange(W)  # ranks node by node
    start_W = np.zeros(W + 1, dtype=np.int64)  # where each node's ranks begin in `members_W`
    if under_root:
        ranks_by_node(node_W, node_W.max() + 1, members_W, start_W)
        for m in range(W):
            column_W[members_W[m]] = m - start_W[node_W[members_W[m]]]
    M = column_W.max() + 1 if under_root else W
    tokens = np.zeros(W)
    local = np.zeros(W)
    calls = np.zeros(W)
    received_E = np.empty(E)
    out_W = np.zeros(W)  # bytes each device sends to other nodes, and receives from them
    in_W = np.zeros(W)
    crossing = 0.0  # positive entries between nodes
    near_WM = np.zeros((W, M))  # the rest per (owner, source column)
    entries_WM = np.zeros((W, M))
    flow_EW = transposed(flow_WE)
    for e in range(E):
        o = owner_E[e]
        home = node_W[o]
        received = 0.0
        into = 0.0  # from other nodes
        for s in range(W):
            f = flow_EW[e, s]
            received += f
            if s == o:
                continue
            if under_root and node_W[s] != home:
                out_W[s] += f
                into += f
                if f > 0:
                    crossing += 1.0
            else:
                near_WM[o, column_W[s]] += f
                if f > 0:
                    entries_WM[o, column_W[s]] += 1.0
        in_W[o] += into
        received_E[e] = received
        tokens[o] += received
        local[o] += flow_EW[e, o]
        if received > 0:
            calls[o] += 1.0
    state = np.zeros(L + n_classes)  # bytes per link, then positive entries per route latency
    if under_root:
        for w in range(W):
            for h in range(2):
                state[leave_W2[w, h]] += out_W[w] * tok_bytes
                state[enter_W2[w, h]] += in_W[w] * tok_bytes
        state[L + cross] += crossing
    pend_i, pend_f = np.empty((3, W * M + 1), dtype=np.int64), np.empty((2, W * M + 1))
    n_pend = 0
    for o in range(W):
        lo, hi = (start_W[node_W[o]], start_W[node_W[o] + 1]) if under_root else (0, W)
        for m in range(lo, hi):
            s = members_W[m]
            c = column_W[s]
            if s != o and (near_WM[o, c] != 0 or entries_WM[o, c] != 0):
                pend_i[0, n_pend], pend_i[1, n_pend], pend_i[2, n_pend] = s, o, 0
                pend_f[0, n_pend], pend_f[1, n_pend] = near_WM[o, c] * tok_bytes, entries_WM[o, c]
                n_pend += 1
    on_routes(routes, pend_i, pend_f, n_pend, L, state)
    return tokens, local, calls, state[:L].copy(), state[L:].copy(), flow_EW, received_E
