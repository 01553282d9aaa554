"""The dispatch plan compiled (numba): its sums and its dense plan without expanding it into entries.

`core.placement.dispatch_entries` expands every (source, expert) pair into one entry per holder
that gets something, as NumPy arrays, and `dispatch_loads` summed those entries: every entry cost a
few array elements in each of a dozen passes. At 1024 ranks x 1024 experts an FSSDP placement has
some 615,000 entries (a Zipf load's, over a million) and its loads took ~60 ms, above the 50 ms a
layer may wait at that size (benchmarks/planner_scale.py, `dispatch_ms`). Here the same split is
one pass over the flow, source after source (the flow read row by row), that adds every share
where it lands; no per-entry arrays:

- `loads`: what the plan sends rank to rank and computes per rank and expert (`dispatch_loads`);
- `plan`: the dense plan itself (`dispatch_counts`).

The split is Hecate §4.4's, as `dispatch_entries` runs it: the source itself if it holds the
expert; else the holders on the source's node; only if the node holds none, every holder. The
candidates are sorted by rank and form a ring that starts at the first candidate of rank above the
source; each gets `f // n` and the `f % n` first in the ring one more (one candidate takes the count
whole). The sources come in rank order, so the holders already passed — on the source's node and
in all — are the source's place in that ring: a counter per expert and node, no search. Counts are
whole (the callers cast the flow to int64), so the sums are exact and equal the NumPy path's
(tests/test_placement.py compares them on hundreds of cases).

Shape suffixes: W ranks, E experts, C the experts split (their slots), N nodes (dense indices), H
the most holders of a split expert, R two runs of H (every holder by rank, then by node and rank),
3 a node's run: start, holders, place of its first holder not yet passed.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _rings(holders_EW, slot_E, C, node_W, N):
    """The candidate runs of the C experts with a slot (`slot_E[e]` >= 0), each slot's numbers side
    by side (the sources visit every slot in turn): `rings_CR[c, :H]` every holder of slot c by
    rank, `rings_CR[c, H:]` its holders by node, then rank (a counting sort: node m's run starts at
    `H + nodes_CN3[c, m, 0]` and has `nodes_CN3[c, m, 1]` holders); `nodes_CN3[c, m, 2]` the place
    in that run of node m's first holder not yet passed (the sources are scanned in rank order);
    `count_C` the number of holders, H their most."""
    E, W = holders_EW.shape
    count_C = np.zeros(C, dtype=np.int64)
    H = 1
    for e in range(E):
        c = slot_E[e]
        if c >= 0:
            for w in range(W):
                if holders_EW[e, w]:
                    count_C[c] += 1
            H = max(H, count_C[c])
    rings_CR = np.empty((C, 2 * H), dtype=np.int64)
    nodes_CN3 = np.zeros((C, N, 3), dtype=np.int64)
    for e in range(E):
        c = slot_E[e]
        if c < 0:
            continue
        n = 0
        for w in range(W):
            if holders_EW[e, w]:
                rings_CR[c, n] = w
                n += 1
                nodes_CN3[c, node_W[w], 1] += 1
        first = 0
        for m in range(N):
            nodes_CN3[c, m, 0] = first
            first += nodes_CN3[c, m, 1]
        for h in range(n):
            w = rings_CR[c, h]
            m = node_W[w]
            rings_CR[c, H + nodes_CN3[c, m, 0] + nodes_CN3[c, m, 2]] = w
            nodes_CN3[c, m, 2] += 1
        for m in range(N):
            nodes_CN3[c, m, 2] = 0
    return rings_CR, nodes_CN3, count_C, H


@njit(cache=True, nogil=True)
def _dispatch(flow_WE, holders_EW, owner_E, slot_E, C, node_W, N, to_plan):
    """The plan of every expert with a slot (Hecate §4.4) and plain EP's for the others (`slot_E[e]`
    < 0: held by the owner alone), source after source so the flow is read row by row: each share
    added to `send_WW[s, d]` and (through `taken_CR`) `computed_WE[d, e]`, or written to
    `plan_WEW[s, e, d]` when `to_plan` (the unused outputs stay `[1, 1(, 1)]`). Only positive counts
    are split (as `dispatch_entries`); plain EP's experts take every count (as `send_by_owner`)."""
    W = node_W.shape[0]
    E = slot_E.shape[0]
    rings_CR, nodes_CN3, count_C, H = _rings(holders_EW, slot_E, C, node_W, N)
    passed_C = np.zeros(C, dtype=np.int64)  # holders of rank below s: s's place in every holder's ring
    sums = 1 if to_plan else W
    send_WW = np.zeros((sums, sums), dtype=np.int64)
    computed_WE = np.zeros((sums, E if sums > 1 else 1), dtype=np.int64)
    plan_WEW = np.zeros((W, E, W) if to_plan else (1, 1, 1), dtype=np.int64)
    total_E = np.zeros(E, dtype=np.int64)
    # The tokens computed per slot and place in its runs (`rings_CR`'s layout): a few numbers per
    # expert that stay in cache, turned into `computed_WE` once at the end.
    taken_CR = np.zeros((C if not to_plan else 1, 2 * H), dtype=np.int64)
    for s in range(W):
        node = node_W[s]
        for e in range(E):
            f = flow_WE[s, e]
            c = slot_E[e]
            if c < 0:
                send_WW[s, owner_E[e]] += f
                total_E[e] += f
                continue
            k = passed_C[c]
            if k < count_C[c] and rings_CR[c, k] == s:  # s holds e: it computes its own tokens
                passed_C[c] = k + 1
                nodes_CN3[c, node, 2] += 1
                if f > 0:
                    if to_plan:
                        plan_WEW[s, e, s] = f
                    else:
                        send_WW[s, s] += f
                        taken_CR[c, k] += f
                continue
            if f <= 0:
                continue
            n = nodes_CN3[c, node, 1]
            if n > 0:  # the holders on the source's node, else every holder
                first, place = H + nodes_CN3[c, node, 0], nodes_CN3[c, node, 2]
            else:
                first, n, place = 0, count_C[c], k
            if f < n:  # the first f in ring order get one each: no division
                base, rem, reached = 0, f, f
            else:
                base = f // n
                rem, reached = f - base * n, n
            for t in range(reached):
                m = place + t
                if m >= n:
                    m -= n
                d = rings_CR[c, first + m]
                share = base + 1 if t < rem else base
                if to_plan:
                    plan_WEW[s, e, d] = share
                else:
                    send_WW[s, d] += share
                    taken_CR[c, first + m] += share
    if not to_plan:
        for e in range(E):
            c = slot_E[e]
            if c < 0:
                computed_WE[owner_E[e], e] += total_E[e]
                continue
            for h in range(count_C[c]):
                computed_WE[rings_CR[c, h], e] += taken_CR[c, h]
                computed_WE[rings_CR[c, H + h], e] += taken_CR[c, H + h]
    return send_WW, computed_WE, plan_WEW


@njit(cache=True, nogil=True)
def loads(flow_WE, holders_EW, owner_E, node_W, N):
    """(send_WW, computed_WE) int64 of the dispatch plan, from dense node indices: the experts with
    copies split (`_dispatch`), those held by their owner alone as under plain EP."""
    E, W = holders_EW.shape
    slot_E = np.full(E, -1, dtype=np.int64)
    C = 0
    for e in range(E):
        copies = 0
        for w in range(W):
            if holders_EW[e, w]:
                copies += 1
        if copies > 1:
            slot_E[e] = C
            C += 1
    send_WW, computed_WE, _ = _dispatch(flow_WE, holders_EW, owner_E, slot_E, C, node_W, N, False)
    return send_WW, computed_WE


@njit(cache=True, nogil=True)
def plan(flow_WE, holders_EW, owner_E, node_W, N):
    """plan_WEW int64 `[W, E, W]`: every expert's positive counts split over its holders."""
    E = holders_EW.shape[0]
    slot_E = np.arange(E)
    return _dispatch(flow_WE, holders_EW, owner_E, slot_E, E, node_W, N, True)[2]
