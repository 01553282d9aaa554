"""The pricer's running sums compiled (numba): the owners' terms and every step's dispatch.

`perf.placement_pricing.PlacementPricer` prices every candidate of a search from sums over experts
kept as running sums of each step's change, and from the maxima that make a price (the device with
the most tokens, the busiest link, the slowest route used). In NumPy that is a few hundred array
calls per search on a few thousand numbers each: at 64 ranks x 256 experts their call overhead, not
their work, was most of the time a layer waits for FasterMoE's shadowing or `auto` (docs/speed.md,
"Planning off the critical path"). Here the same sums and maxima are loops, one call per search
(the state, the route entries and the maxima: `perf.compiled_routes`; the copies:
`perf.compiled_copies`):

- `owner_sums`: the owners alone (plain EP): tokens per device, bytes per link, positive entries
  per route latency — the pricer's starting state — and the flow transposed;
- `dispatch_terms`: every step's expert dispatched before and after the step (Hecate §4.4 order,
  `core.placement.dispatch_entries`: the source itself, else the holders on its node spread evenly
  from its place in ring order, else every holder), then per row the most tokens on a device, the
  busiest link's time, the slowest route with a positive entry and whether anything is sent;
- `previous_rows`: each step's expert's holders before it.

The pricer calls these only for whole flows, and the `CostModel` turns the maxima into prices with
the NumPy path's own calls (tests/test_compiled_sums.py compares the two paths on hundreds of
cases). A candidate's running sums restart where `start` is True; row 0 of every output is the
starting state, row j + 1 the state after step j.

Shape suffixes: W ranks, E experts, N nodes, L links (as `Topology` names them), Q steps, Z rows
(Q + 1). Route-latency classes have no letter (`n_classes` of them).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moeflow.perf.compiled_routes import kept, link_maxima, on_routes, transposed


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
        for w in range(W):
            start_W[node_W[w] + 1] += 1
        for n in range(W):
            start_W[n + 1] += start_W[n]
        fill = start_W[:W].copy()
        for w in range(W):
            column_W[w] = fill[node_W[w]] - start_W[node_W[w]]
            members_W[fill[node_W[w]]] = w
            fill[node_W[w]] += 1
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


@njit(cache=True, nogil=True)
def _holder_runs(holders_W, node_W, nodes, one_alone, every, grouped, end):
    """Every holder in rank order (`every`, returns their number) and, unless they are every rank
    or (`one_alone`) a single one, the holders node by node in rank order within a node (`grouped`;
    node n's run ends at `end[n]`, begins at `end[n - 1]`; `nodes`: how many)."""
    W = holders_W.size
    n_all = 0
    for w in range(W):
        if holders_W[w]:
            every[n_all] = w
            n_all += 1
    if n_all == W or (one_alone and n_all == 1):  # the caller reads `every` alone
        return n_all
    end[:nodes] = 0
    for i in range(n_all):
        end[node_W[every[i]]] += 1
    offset = 0
    for n in range(nodes):
        count = end[n]
        end[n] = offset
        offset += count
    for i in range(n_all):
        w = every[i]
        grouped[end[node_W[w]]] = w
        end[node_W[w]] += 1
    return n_all


@njit(cache=True, nogil=True)
def _dispatch_one(
    flow_W, holders_W, node_W, skip_N, bare_N, sign, routes, spread_by_holder, L, tok_bytes, state, work, pend_i, pend_f
):
    """Add `sign` x the dispatch of one expert's flow `flow_W` to `holders_W`
    (`core.placement.dispatch_entries`) to `state` (tokens per device, then bytes per link, then
    entries per route latency), leaving out the sources on the nodes of `skip_N` (their dispatch is
    the same before and after the step: they would cancel), and the bytes out of the sources on the
    nodes of `bare_N` (no holder before or after: all they send leaves their node both times).
    `work`: scratch `[4, W + 1]`; `pend_*`: `on_routes`' entries, room for a node's ranks per source.

    Sources whose node holds none spread over every holder: where nodes hang from the root, all of
    a source's tokens leave by its links up and each holder's share enters by its links down, so
    the shares are summed per holder — the even part once, the remainders as runs on the ring of
    holders (a difference array) — instead of expanded per (source, holder)."""
    W = holders_W.size
    every, grouped, end, extra = work[0], work[1], work[2], work[3]
    n_all = _holder_runs(holders_W, node_W, skip_N.size, spread_by_holder, every, grouped, end)
    leave_W2, enter_W2, cross = routes[3], routes[4], routes[5]
    B = W + L  # where the route-latency counts begin
    if n_all == W:  # held everywhere: every source computes its own
        for s in range(W):
            if flow_W[s] > 0 and not skip_N[node_W[s]]:
                state[s] += sign * flow_W[s]
        return
    n_pend = 0  # route entries gathered for `on_routes`
    if n_all == 1 and spread_by_holder:  # its owner alone: every token to it, summed
        d = every[0]
        total = into = crossing = 0.0
        for s in range(W):
            f = flow_W[s]
            node = node_W[s]
            if not f > 0 or skip_N[node]:
                continue
            total += f
            if s == d:
                continue
            if node != node_W[d]:  # all of it leaves the source's node, enters the holder's
                into += f
                crossing += 1.0
                if not bare_N[node]:
                    state[W + leave_W2[s, 0]] += sign * f * tok_bytes
                    state[W + leave_W2[s, 1]] += sign * f * tok_bytes
            else:
                pend_i[0, n_pend], pend_i[1, n_pend], pend_i[2, n_pend] = s, d, W
                pend_f[0, n_pend], pend_f[1, n_pend] = sign * f * tok_bytes, sign
                n_pend += 1
        on_routes(routes, pend_i, pend_f, n_pend, L, state)
        state[d] += sign * total
        state[W + enter_W2[d, 0]] += sign * into * tok_bytes
        state[W + enter_W2[d, 1]] += sign * into * tok_bytes
        state[B + cross] += sign * crossing
        return
    spread = 0.0  # the even part every holder takes from the sources that spread
    crossing = 0.0  # and their positive entries
    extra[: n_all + 1] = 0
    spreading = False
    below = 0  # the holders of lower rank than the source (sources come in rank order)
    for s in range(W):
        while below < n_all and every[below] < s:
            below += 1
        f = flow_W[s]
        node = node_W[s]
        if not f > 0 or skip_N[node]:
            continue
        if holders_W[s]:
            state[s] += sign * f
            continue
        hi = end[node]
        lo = end[node - 1] if node > 0 else 0
        # The candidates: the holders on the source's node in rank order (`work[1]`), else every
        # holder (`work[0]`) — a row index, not an array variable (numba would count references).
        if hi > lo:
            run, first, n = 1, lo, hi - lo
        else:
            run, first, n = 0, 0, n_all
        base, rem = _split(f, n)
        if hi == lo and spread_by_holder:  # spreads over every holder, all on other nodes: summed per holder
            spreading = True
            spread += base
            r = int(rem)
            if r > 0:
                m0 = below  # its place in the ring
                extra[m0] += 1
                if m0 + r <= n:
                    extra[m0 + r] -= 1
                else:
                    extra[n] -= 1
                    extra[0] += 1
                    extra[m0 + r - n] -= 1
            if not bare_N[node]:  # on a node bare before and after, its bytes out cancel
                value = sign * f * tok_bytes
                state[W + leave_W2[s, 0]] += value
                state[W + leave_W2[s, 1]] += value
            crossing += n if base > 0 else r
            continue
        m0 = 0  # the source's place in the ring: the candidates of lower rank
        while m0 < n and work[run, first + m0] < s:
            m0 += 1
        for t in range(n):
            c = base + (1.0 if t < rem else 0.0)
            if not c > 0:
                break
            m = m0 + t
            if m >= n:
                m -= n
            d = work[run, first + m]
            state[d] += sign * c
            if d != s:
                pend_i[0, n_pend], pend_i[1, n_pend], pend_i[2, n_pend] = s, d, W
                pend_f[0, n_pend], pend_f[1, n_pend] = sign * c * tok_bytes, sign
                n_pend += 1
    on_routes(routes, pend_i, pend_f, n_pend, L, state)
    if spreading:
        state[B + cross] += sign * crossing
        ring = 0
        for i in range(n_all):
            ring += extra[i]
            share = spread + ring
            if share > 0:
                d = every[i]
                state[d] += sign * share
                value = sign * share * tok_bytes
                state[W + enter_W2[d, 0]] += value
                state[W + enter_W2[d, 1]] += value


@njit(cache=True, nogil=True)
def _split(f, n):
    """(f // n, f % n) of a whole count over n candidates, with one integer division at most (the
    float ones cost two divisions each, per source and state)."""
    if n == 1:
        return f, 0.0
    if f < n:
        return 0.0, f
    base = float(np.int64(f) // n)
    return base, f - base * n


@njit(cache=True, nogil=True)
def _unchanged_nodes(new_W, prev_W, node_W, skip_N, bare_N, held_new, held_prev):
    """`skip_N[n]`: node n holds the expert before and after the step, on the same ranks — its
    sources keep their dispatch (their own copy or their node's); `bare_N[n]`: it holds it neither
    before nor after. `held_*`: scratch `[N]`."""
    skip_N[:] = True
    held_new[:] = False
    held_prev[:] = False
    for w in range(new_W.size):
        n = node_W[w]
        held_new[n] |= new_W[w]
        held_prev[n] |= prev_W[w]
        if new_W[w] != prev_W[w]:
            skip_N[n] = False
    for n in range(skip_N.size):
        if not (held_new[n] and held_prev[n]):
            skip_N[n] = False
        bare_N[n] = not held_new[n] and not held_prev[n]


@njit(cache=True, nogil=True)
def _row_maxima(state, W, L, n_classes, inv_bw_L, latency_classes):
    """(most tokens on a device, then the exchange's `link_maxima`) of a row of `dispatch_terms`."""
    most = state[0]
    for w in range(1, W):
        if state[w] > most:
            most = state[w]
    busiest, latency, sends = link_maxima(state, W, L, n_classes, inv_bw_L, latency_classes)
    return most, busiest, latency, sends


@njit(cache=True, nogil=True)
def dispatch_terms(
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
    traffic0_L,
    classes0,
    inv_bw_L,
    latency_classes,
    keep_Z,
):
    """Per row `[Z]` kept (`keep_Z`; the others 0): the most tokens a device computes, the
    exchange's busiest link time (bytes over bandwidth), its slowest route latency with a positive
    entry and whether it sends at all."""
    Q, W = new_QW.shape
    L, n_classes = traffic0_L.size, classes0.size
    base = np.concatenate((tokens0_W, traffic0_L, classes0))
    state = base.copy()
    most_Z, busiest_Z, latency_Z = np.zeros(Q + 1), np.zeros(Q + 1), np.zeros(Q + 1)
    sends_Z = np.zeros(Q + 1, dtype=np.bool_)
    if kept(keep_Z, 0):
        most_Z[0], busiest_Z[0], latency_Z[0], sends_Z[0] = _row_maxima(
            state, W, L, n_classes, inv_bw_L, latency_classes
        )
    work = np.empty((4, W + 1), dtype=np.int64)
    nodes = node_W.max() + 1
    per_node = np.bincount(node_W).max()  # a source's candidates on its node, at most
    pend_i, pend_f = np.empty((3, W * per_node + 1), dtype=np.int64), np.empty((2, W * per_node + 1))
    skip_N, bare_N = np.empty(nodes, dtype=np.bool_), np.empty(nodes, dtype=np.bool_)
    held_new, held_prev = np.empty(nodes, dtype=np.bool_), np.empty(nodes, dtype=np.bool_)
    for j in range(Q):
        if start_Q[j] and j > 0:
            state[:] = base
        flow_W = flow_EW[experts_Q[j]]
        _unchanged_nodes(new_QW[j], prev_QW[j], node_W, skip_N, bare_N, held_new, held_prev)
        args = (node_W, skip_N, bare_N)
        rest = (routes, spread_by_holder, L, tok_bytes, state, work, pend_i, pend_f)
        _dispatch_one(flow_W, new_QW[j], *args, 1.0, *rest)
        _dispatch_one(flow_W, prev_QW[j], *args, -1.0, *rest)
        if kept(keep_Z, j + 1):
            most_Z[j + 1], busiest_Z[j + 1], latency_Z[j + 1], sends_Z[j + 1] = _row_maxima(
                state, W, L, n_classes, inv_bw_L, latency_classes
            )
    return most_Z, busiest_Z, latency_Z, sends_Z


@njit(cache=True, nogil=True)
def previous_rows(experts_Q, owner_Q, new_QW, start_Q, E):
    """(`[Q, W]` each step's expert's holders before it — its last earlier step's in the same
    candidate, or its owner alone —, `[Q]` that earlier step, -1 for the owner's)."""
    Q, W = new_QW.shape
    prev_QW = np.zeros((Q, W), dtype=np.bool_)
    earlier_Q = np.full(Q, -1, dtype=np.int64)
    stamp_E = np.full(E, -1, dtype=np.int64)  # the candidate that last changed each expert
    last_E = np.zeros(E, dtype=np.int64)
    candidate = -1
    for j in range(Q):
        if start_Q[j]:
            candidate += 1
        e = experts_Q[j]
        if stamp_E[e] == candidate:
            prev_QW[j] = new_QW[last_E[e]]
            earlier_Q[j] = last_E[e]
        else:
            prev_QW[j, owner_Q[j]] = True
        stamp_E[e] = candidate
        last_E[e] = j
    return prev_QW, earlier_Q
