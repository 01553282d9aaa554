"""What the compiled sums share (numba): their state's layout, the route entries, the maxima.

The pricer's kernels (`perf.compiled_sums`: the owners' terms and each step's dispatch;
`perf.compiled_copies`: the copy trees and each owner's broadcasts) read the flow transposed
(`transposed`: one expert's sources in a row, as every step reads them; Pro-Prophet's steps too)
and keep a state vector per search —
tokens per device, then bytes per link, then positive entries per route latency (an exchange), or
per stage of the copy trees its bytes per link then its edges per route latency — and read from it
the maxima a price needs (`link_maxima`). Every value summed is a whole number in float64 (token
counts, bytes, entries), so the sums are the NumPy path's to the bit in any order, and a maximum of
the same products is the same float.

A route entry adds bytes to the links of the route from a source to a destination and one entry to
its latency. Entries are gathered into arrays and applied in one call (`on_routes`): a call per
entry, with the route tables as arguments, cost more than the entry's work. Between two nodes
hanging from the root (`Topology.nodes_under_root`) a route is the source's two links up and the
destination's two down, read from those small tables, not the `[W, W, H]` one.

numba caches each kernel beside its own file and does not recompile a kernel of another file when
this one changes: after editing these helpers, delete the package's `__pycache__` (or set
`NUMBA_CACHE_DIR` to a fresh directory) before timing or testing.

Shape suffixes: W ranks, L links and H the hops of a route (as `Topology` names them; padded with
L), Q steps, Z rows (Q + 1). Route-latency classes have no letter (`n_classes` of them).
"""

from __future__ import annotations

import numpy as np
from numba import njit

EVERY_ROW = np.ones(0, dtype=np.bool_)
"""`keep_Z` of a single candidate's prefixes: every row is read (an empty mask: nothing to build)."""


def kept_rows(start_Q: np.ndarray) -> np.ndarray:
    """`keep_Z`: the rows a caller reads — every prefix of one candidate (`EVERY_ROW`); of several
    (`placements`), the owners' row and each candidate's last (the compiled sums price only those)."""
    if not start_Q[1:].any():
        return EVERY_ROW
    keep_Z = np.ones(start_Q.size + 1, dtype=np.bool_)
    keep_Z[1:-1] = start_Q[1:]
    return keep_Z


@njit(cache=True, nogil=True)
def kept(keep_Z, z):
    return keep_Z.size == 0 or keep_Z[z]


@njit(cache=True, nogil=True)
def on_routes(routes, pend_i, pend_f, n, L, state):
    """Apply the `n` pending entries: entry x adds `pend_f[0, x]` to every link of the route from
    `pend_i[0, x]` to `pend_i[1, x]` (`state[offset + link]`, offset `pend_i[2, x]`) and
    `pend_f[1, x]` entries to its route latency (`state[offset + L + class]`). Between two nodes
    hanging from the root (`Topology.nodes_under_root`) the route is the source's two links up and
    the destination's two down (`leave_W2`, `enter_W2`), of one latency (`cross_class`): read from
    those small tables, not the `[W, W, H]` one. `routes`: `Topology.route_tables`. Entries are
    gathered and applied in one call (a call per entry, with the route tables as arguments, cost
    more than the entry's work)."""
    route_WWH, class_WW, node_W, leave_W2, enter_W2, cross, under_root = routes
    H = route_WWH.shape[2]
    for x in range(n):
        src, dst, offset = pend_i[0, x], pend_i[1, x], pend_i[2, x]
        value, count = pend_f[0, x], pend_f[1, x]
        if under_root and node_W[src] != node_W[dst]:
            state[offset + leave_W2[src, 0]] += value
            state[offset + leave_W2[src, 1]] += value
            state[offset + enter_W2[dst, 0]] += value
            state[offset + enter_W2[dst, 1]] += value
            state[offset + L + cross] += count
            continue
        for h in range(H):
            link = route_WWH[src, dst, h]
            if link < L:
                state[offset + link] += value
        state[offset + L + class_WW[src, dst]] += count


@njit(cache=True, nogil=True)
def link_maxima(state, offset, L, n_classes, inv_bw_L, latency_classes):
    """(busiest link's time — its bytes `state[offset + link]` over its bandwidth, 0 with none —,
    slowest route latency with a positive entry (`state[offset + L + class]`; 0 with none), whether
    any entry is positive): the maxima of an exchange or of one stage of the copy trees."""
    busiest = 0.0
    for link in range(L):
        t = state[offset + link] * inv_bw_L[link]
        if t > busiest:
            busiest = t
    latency = 0.0
    sends = False
    for c in range(n_classes):
        if state[offset + L + c] > 0.5:  # positive entries on routes of this latency (integer counts)
            sends = True
            if latency_classes[c] > latency:
                latency = latency_classes[c]
    return busiest, latency, sends


@njit(cache=True, nogil=True)
def ranks_by_node(node_W, nodes, members_W, start_N):
    """The ranks node by node, in rank order within a node (`members_W`), node n's from `start_N[n]`
    to `start_N[n + 1]`."""
    start_N[: nodes + 1] = 0
    for w in range(node_W.size):
        start_N[node_W[w] + 1] += 1
    for n in range(nodes):
        start_N[n + 1] += start_N[n]
    fill = start_N[:nodes].copy()
    for w in range(node_W.size):
        members_W[fill[node_W[w]]] = w
        fill[node_W[w]] += 1


@njit(cache=True, nogil=True)
def transposed(flow_WE):
    """`flow_WE.T` in C order, float64, copied in tiles of 8 x 8 (a column read rank by rank touches one
    cache line and one page per rank: at 1024 ranks a step's reads would cost more than its work)."""
    W, E = flow_WE.shape
    flow_EW = np.empty((E, W))
    for w0 in range(0, W, 8):
        w1 = min(w0 + 8, W)
        for e0 in range(0, E, 8):
            e1 = min(e0 + 8, E)
            for w in range(w0, w1):
                for e in range(e0, e1):
                    flow_EW[e, w] = flow_WE[w, e]
    return flow_EW
