"""The copies' running sums compiled (numba): every step's copy trees and each owner's broadcasts.

The copies' part of a search (`perf.placement_copies.PlacementCopies`, Hecate §4.1's copy trees,
FasterMoE §4.1's and Pro-Prophet's broadcasts of experts held everywhere) as loops, one call per
search (the state, the route entries and the maxima: `perf.compiled_routes`):

- `copy_terms`: every step's copy trees before and after (`core.placement.tree_edges`: the owner
  to its node-mates and one relay per other node, the relay to the rest of its node), per row and
  stage the busiest link's time, the slowest route and whether the stage sends; and each step's
  owner's number of experts held everywhere (priced per owner, as `PlacementCopies._everywhere`
  does);
- `owner_price_sums`: those owners' broadcasts priced, as `prefix_max.running_sums` adds them.

Shape suffixes: W ranks, L links (as `Topology` names them), Q steps, Z rows (Q + 1), X any.
Route-latency classes have no letter (`n_classes` of them); `stage_*` arrays are `[2, Z]`, one row
per stage of the copy trees.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moeflow.perf.compiled_routes import kept, link_maxima, on_routes


@njit(cache=True, nogil=True)
def _tree_one(rows_W, owner, sign, node_W, local_W, pos_W, routes, L, n_classes, nbytes, state, held, pend_i, pend_f):
    """Add `sign` x the copy tree of `rows_W` from `owner` (`core.placement.tree_edges`) to `state`
    (per stage, bytes per link then edges per route latency); returns (the holders beyond the owner,
    the edges: left in `pend_*[:, :edges]`). `held`: scratch `[W]`; `pend_*`: `on_routes`' entries,
    room for W."""
    stage2 = L + n_classes  # where the second stage's sums begin
    n = 0  # edges gathered
    k = 0
    for w in range(rows_W.size):
        if rows_W[w] and w != owner:
            held[k] = w
            k += 1
    if k == 0:
        return 0, 0
    if node_W.size == 0:  # no nodes: every copy straight from the owner
        for i in range(k):
            pend_i[0, n], pend_i[1, n], pend_i[2, n] = owner, held[i], 0
            n += 1
    else:
        # The holders node by node, in rank order within a node (their place in `by_node`): already
        # so where nodes are runs of ranks, else sorted (insertion: a few holders).
        for i in range(1, k):
            w = held[i]
            m = i
            while m > 0 and pos_W[held[m - 1]] > pos_W[w]:
                held[m] = held[m - 1]
                m -= 1
            held[m] = w
        home = node_W[owner]
        i = 0
        while i < k:  # the owner's node-mates from it; on every other node one relay, the rest from it
            node = node_W[held[i]]
            j = i
            while j < k and node_W[held[j]] == node:
                j += 1
            if node == home:
                for m in range(i, j):
                    pend_i[0, n], pend_i[1, n], pend_i[2, n] = owner, held[m], 0
                    n += 1
            else:
                relay = held[i + (local_W[owner] + home) % (j - i)]
                pend_i[0, n], pend_i[1, n], pend_i[2, n] = owner, relay, 0
                n += 1
                for m in range(i, j):
                    if held[m] != relay:
                        pend_i[0, n], pend_i[1, n], pend_i[2, n] = relay, held[m], stage2
                        n += 1
            i = j
    pend_f[0, :n] = sign * nbytes
    pend_f[1, :n] = sign
    on_routes(routes, pend_i, pend_f, n, L, state)
    return k, n


@njit(cache=True, nogil=True)
def _raise_maxima(routes, pend_i, n, L, n_classes, state, inv_bw_L, latency_classes, busiest_2, latency_2, active_2):
    """The stages' maxima (`link_maxima` of each) after the `n` edges in `pend_i` were added to a
    state whose maxima they were: where every change is an increase, a maximum can only move to an
    entry changed, so only the links and route latencies of those edges are read (the same products,
    so the same floats as a full scan)."""
    route_WWH, class_WW, node_W, leave_W2, enter_W2, cross, under_root = routes
    for x in range(n):
        src, dst, offset = pend_i[0, x], pend_i[1, x], pend_i[2, x]
        s = 0 if offset == 0 else 1
        if under_root and node_W[src] != node_W[dst]:
            links = (leave_W2[src, 0], leave_W2[src, 1], enter_W2[dst, 0], enter_W2[dst, 1])
            c = cross
            for link in links:
                t = state[offset + link] * inv_bw_L[link]
                if t > busiest_2[s]:
                    busiest_2[s] = t
        else:
            for h in range(route_WWH.shape[2]):
                link = route_WWH[src, dst, h]
                if link < L:
                    t = state[offset + link] * inv_bw_L[link]
                    if t > busiest_2[s]:
                        busiest_2[s] = t
            c = class_WW[src, dst]
        if state[offset + L + c] > 0.5:  # as `link_maxima` reads a route latency's entries
            active_2[s] = True
            if latency_classes[c] > latency_2[s]:
                latency_2[s] = latency_classes[c]


@njit(cache=True, nogil=True)
def _held_everywhere(rows_W):
    """Whether a state holds its expert on every rank, beyond its owner (a broadcast, not a tree);
    read up to the first rank without it."""
    for w in range(rows_W.size):
        if not rows_W[w]:
            return False
    return rows_W.size >= 2


@njit(cache=True, nogil=True)
def copy_terms(
    new_QW,
    prev_QW,
    owner_Q,
    start_Q,
    keep_Z,
    all_trees,
    node_W,
    local_W,
    pos_W,
    routes,
    nbytes,
    inv_bw_L,
    latency_classes,
):
    """The copies' terms per row (`PlacementCopies._copies`):

    - `[S, Z]` x 3, in the rows kept (`keep_Z`; the others 0): each stage's busiest link time,
      slowest route latency and whether it sends, of
      the copy trees of the partial sets — with `all_trees` also of the experts held everywhere
      (gloo across nodes, `PlacementPricer.tree`);
    - `[Q]` x 2: the step's owner's number of experts held everywhere after and before the step;
    - `[Z]`: the copies beyond the owners.

    `node_W` empty: no nodes (every copy from its owner)."""
    Q, W = new_QW.shape
    L, n_classes = inv_bw_L.size, latency_classes.size
    stage_busiest, stage_latency = np.zeros((2, Q + 1)), np.zeros((2, Q + 1))
    stage_active = np.zeros((2, Q + 1), dtype=np.bool_)
    after_Q = np.zeros(Q, dtype=np.int64)
    before_Q = np.zeros(Q, dtype=np.int64)
    copies_Z = np.zeros(Q + 1, dtype=np.int64)
    state = np.zeros(2 * (L + n_classes))
    every_W = np.zeros(W, dtype=np.int64)
    held = np.empty(W, dtype=np.int64)
    pend_i, pend_f = np.empty((3, W), dtype=np.int64), np.empty((2, W))
    copies = 0
    # The stages' maxima of the state as it stands (`link_maxima`), while `exact`: a step that only
    # adds edges raises them from the edges' links (`_raise_maxima`), one that removes edges (an
    # earlier tree of the same expert, a partial set before) leaves them to a full scan at the next
    # row read, and one without trees (an expert held everywhere: a broadcast) keeps them.
    busiest_2, latency_2 = np.zeros(2), np.zeros(2)
    active_2 = np.zeros(2, dtype=np.bool_)
    exact = True
    for j in range(Q):
        if start_Q[j]:
            state[:] = 0.0
            every_W[:] = 0
            copies = 0
            busiest_2[:], latency_2[:], active_2[:] = 0.0, 0.0, False
            exact = True
        o = owner_Q[j]
        every_new, every_prev = _held_everywhere(new_QW[j]), _held_everywhere(prev_QW[j])
        before_Q[j] = every_W[o]
        every_W[o] += int(every_new) - int(every_prev)
        after_Q[j] = every_W[o]
        # Trees of the partial sets (or of all: `all_trees`); an expert held everywhere has W − 1 copies.
        tree = (node_W, local_W, pos_W, routes, L, n_classes, nbytes, state, held, pend_i, pend_f)
        k_new, k_prev = W - 1, W - 1
        if all_trees or not every_new:
            k_new, added = _tree_one(new_QW[j], o, 1.0, *tree)
            if exact and added > 0:
                maxima = (inv_bw_L, latency_classes, busiest_2, latency_2, active_2)
                _raise_maxima(routes, pend_i, added, L, n_classes, state, *maxima)
        if all_trees or not every_prev:
            k_prev, removed = _tree_one(prev_QW[j], o, -1.0, *tree)
            exact = exact and removed == 0
        copies += k_new - k_prev
        copies_Z[j + 1] = copies
        if not kept(keep_Z, j + 1):
            continue
        for stage in range(2):
            if not exact:
                busiest_2[stage], latency_2[stage], active_2[stage] = link_maxima(
                    state, stage * (L + n_classes), L, n_classes, inv_bw_L, latency_classes
                )
            stage_busiest[stage, j + 1] = busiest_2[stage]
            stage_latency[stage, j + 1] = latency_2[stage]
            stage_active[stage, j + 1] = active_2[stage]
        exact = True
    return stage_busiest, stage_latency, stage_active, after_Q, before_Q, copies_Z


@njit(cache=True, nogil=True)
def owner_price_sums(after_Q, before_Q, start_Q, price_X):
    """`[Z]`: the running sums of `price_X[after] − price_X[before]` as `prefix_max.running_sums`
    adds them (one cumulative sum, each candidate's start subtracted, then the base 0.0), so the
    floats are its own."""
    Q = after_Q.size
    total_Q = np.empty(Q)
    acc = 0.0
    for j in range(Q):
        d = price_X[after_Q[j]] - price_X[before_Q[j]]
        acc = d if j == 0 else acc + d
        total_Q[j] = acc
    starts = 0
    for j in range(Q):
        if start_Q[j]:
            starts += 1
    out = np.empty(Q + 1)
    out[0] = 0.0
    before = 0.0  # the cumulative sum before the current candidate's first step
    for j in range(Q):
        if start_Q[j]:
            before = total_Q[j - 1] if j > 0 else 0.0
        value = total_Q[j] - before if starts > 1 else total_Q[j]
        out[j + 1] = value + 0.0
    return out
