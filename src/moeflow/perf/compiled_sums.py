"""The pricer's running sums compiled (numba): every step's dispatch.

`perf.placement_pricing.PlacementPricer` prices every candidate of a search from sums over experts
kept as running sums of each step's change, and from the maxima that make a price (the device with
the most tokens, the busiest link, the slowest route used). In NumPy that is a few hundred array
calls per search on a few thousand numbers each: at 64 ranks x 256 experts their call overhead, not
their work, was most of the time a layer waits for FasterMoE's shadowing or `auto` (docs/speed.md,
"Planning off the critical path"). Here the same sums and maxima are loops, one call per search
(the state, the route entries and the maxima: `perf.compiled_routes`; the owners' starting state:
`perf.compiled_owners`; the copies: `perf.compiled_copies`):

- `dispatch_terms`: every step's expert dispatched before and after the step (Hecate §4.4 order,
  `core.placement.dispatch_entries`: the source itself, else the holders on its node spread evenly
  from its place in ring order, else every holder), then per row the most tokens on a device, the
  busiest link's time, the slowest route with a positive entry and whether anything is sent; a
  state an earlier step made (an expert copied again, as EPLB's steps do) taken back from the sums
  that step kept of the sources that spread over every holder, not from a pass over every source;
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

from moeflow.perf.compiled_routes import kept, link_maxima, on_routes, ranks_by_node


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
def dispatch_one(
    flow_W,
    holders_W,
    node_W,
    skip_N,
    bare_N,
    sign,
    routes,
    spread_by_holder,
    L,
    tok_bytes,
    state,
    work,
    pend_i,
    pend_f,
    memo_f,
    memo_x,
):
    """Add `sign` x the dispatch of one expert's flow `flow_W` to `holders_W`
    (`core.placement.dispatch_entries`) to `state` (tokens per device, then bytes per link, then
    entries per route latency), leaving out the sources on the nodes of `skip_N` (their dispatch is
    the same before and after the step: they would cancel), and the bytes out of the sources on the
    nodes of `bare_N` (no holder before or after: all they send leaves their node both times).
    `work`: scratch `[6, W + 1]` (rows 4 and 5: the ranks node by node,
    `compiled_routes.ranks_by_node`); `pend_*`: `on_routes`' entries, room for a node's ranks per
    source.

    Sources whose node holds none spread over every holder: where nodes hang from the root, all of
    a source's tokens leave by its links up and each holder's share enters by its links down, so
    the shares are summed per holder — the even part once, the remainders as runs on the ring of
    holders (a difference array) — instead of expanded per (source, holder). Those sums are left in
    `memo_f` (the even part, the entries, whether any source spread) and `memo_x` (the difference
    array) where they are not empty, for the step that takes this state back (`_dispatch_memo`);
    returns whether it left them."""
    W = holders_W.size
    every, grouped, end, extra = work[0], work[1], work[2], work[3]
    n_all = _holder_runs(holders_W, node_W, skip_N.size, spread_by_holder, every, grouped, end)
    leave_W2, enter_W2, cross = routes[3], routes[4], routes[5]
    B = W + L  # where the route-latency counts begin
    if n_all == W:  # held everywhere: every source computes its own
        for s in range(W):
            if flow_W[s] > 0 and not skip_N[node_W[s]]:
                state[s] += sign * flow_W[s]
        return False
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
        return False
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
        n_pend = _to_candidates(s, work[run], first, n, base, rem, sign, W, tok_bytes, state, pend_i, pend_f, n_pend)
    on_routes(routes, pend_i, pend_f, n_pend, L, state)
    stored = spread_by_holder and memo_f.size > 0
    if stored:
        memo_f[0], memo_f[1], memo_f[2] = spread, crossing, 1.0 if spreading else 0.0
        memo_x[: n_all + 1] = extra[: n_all + 1]
    if spreading:
        _spread_shares(every, extra, n_all, spread, crossing, sign, W, L, enter_W2, cross, tok_bytes, state)
    return stored


@njit(cache=True, nogil=True)
def _to_candidates(s, candidates, first, n, base, rem, sign, W, tok_bytes, state, pend_i, pend_f, n_pend):
    """Source s's tokens to its `n` candidates `candidates[first:first + n]` (rank order), `base`
    each and one more to the `rem` from its place in the ring (`core.placement.dispatch_entries`);
    the entries to other ranks appended to `pend_*` from `n_pend` (links from `state[W]`). Returns
    the entries pending."""
    m0 = 0  # the source's place in the ring: the candidates of lower rank
    while m0 < n and candidates[first + m0] < s:
        m0 += 1
    for t in range(n):
        c = base + (1.0 if t < rem else 0.0)
        if not c > 0:
            break
        m = m0 + t
        if m >= n:
            m -= n
        d = candidates[first + m]
        state[d] += sign * c
        if d != s:
            pend_i[0, n_pend], pend_i[1, n_pend], pend_i[2, n_pend] = s, d, W
            pend_f[0, n_pend], pend_f[1, n_pend] = sign * c * tok_bytes, sign
            n_pend += 1
    return n_pend


@njit(cache=True, nogil=True)
def _spread_shares(every, extra, n_all, spread, crossing, sign, W, L, enter_W2, cross, tok_bytes, state):
    """Each holder's share of the sources that spread over every holder (the even part and the
    remainders' runs, `extra` a difference array on the ring of holders), entering by its links
    down, and their entries."""
    state[W + L + cross] += sign * crossing
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
def _dispatch_memo(
    flow_W, holders_W, node_W, skip_N, bare_N, sign, routes, L, tok_bytes, state, work, pend_i, pend_f, memo_f, memo_x
):
    """`dispatch_one` of a state an earlier step dispatched as its after-state with sources that
    spread (`memo_*`: what that step left): the sources on the nodes holding the expert are
    dispatched here, those on the nodes that hold it in the other state send their bytes out, and
    the spreading sources' shares and entries are the memo's — the same sums without a pass over
    every source (a step that adds a holder to an expert already copied, as EPLB's do)."""
    W = holders_W.size
    every, grouped, end = work[0], work[1], work[2]
    nodes = skip_N.size
    n_all = _holder_runs(holders_W, node_W, nodes, True, every, grouped, end)
    leave_W2, enter_W2, cross = routes[3], routes[4], routes[5]
    members_W, start_N = work[4], work[5]  # the ranks node by node (`dispatch_terms` fills them)
    n_pend = 0
    for node in range(nodes):
        if skip_N[node]:
            continue
        hi = end[node]
        lo = end[node - 1] if node > 0 else 0
        if hi == lo and bare_N[node]:  # spreads; bare before and after: its bytes out cancel
            continue
        for m in range(start_N[node], start_N[node + 1]):
            s = members_W[m]
            f = flow_W[s]
            if not f > 0:
                continue
            if hi == lo:  # spreads (the memo's shares), from a node that holds in the other state
                value = sign * f * tok_bytes
                state[W + leave_W2[s, 0]] += value
                state[W + leave_W2[s, 1]] += value
            elif holders_W[s]:
                state[s] += sign * f
            else:
                base, rem = _split(f, hi - lo)
                to = (sign, W, tok_bytes, state, pend_i, pend_f, n_pend)
                n_pend = _to_candidates(s, grouped, lo, hi - lo, base, rem, *to)
    on_routes(routes, pend_i, pend_f, n_pend, L, state)
    if memo_f[2] > 0:
        _spread_shares(every, memo_x, n_all, memo_f[0], memo_f[1], sign, W, L, enter_W2, cross, tok_bytes, state)


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
def dispatch_scratch(node_W):
    """(the number of nodes, `dispatch_one`'s scratch `[6, W + 1]`, its pending route entries
    `pend_i` `[3, n]` and `pend_f` `[2, n]`, room for a node's ranks per source)."""
    W = node_W.size
    nodes = node_W.max() + 1
    per_node = np.bincount(node_W).max()  # a source's candidates on its node, at most
    n = W * per_node + 1
    return nodes, np.empty((6, W + 1), dtype=np.int64), np.empty((3, n), dtype=np.int64), np.empty((2, n))


@njit(cache=True, nogil=True)
def row_maxima(state, W, L, n_classes, inv_bw_L, latency_classes):
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
    earlier_Q,
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
    entry and whether it sends at all. `earlier_Q`: the step whose holders each step's expert had
    before it (-1: its owner's; `previous_rows`): that step's sums of the sources that spread are
    kept for it (`_dispatch_memo`)."""
    Q, W = new_QW.shape
    L, n_classes = traffic0_L.size, classes0.size
    base = np.concatenate((tokens0_W, traffic0_L, classes0))
    state = base.copy()
    most_Z, busiest_Z, latency_Z = np.zeros(Q + 1), np.zeros(Q + 1), np.zeros(Q + 1)
    sends_Z = np.zeros(Q + 1, dtype=np.bool_)
    if kept(keep_Z, 0):
        most_Z[0], busiest_Z[0], latency_Z[0], sends_Z[0] = row_maxima(
            state, W, L, n_classes, inv_bw_L, latency_classes
        )
    nodes, work, pend_i, pend_f = dispatch_scratch(node_W)
    ranks_by_node(node_W, nodes, work[4], work[5])
    skip_N, bare_N = np.empty(nodes, dtype=np.bool_), np.empty(nodes, dtype=np.bool_)
    held_new, held_prev = np.empty(nodes, dtype=np.bool_), np.empty(nodes, dtype=np.bool_)
    # Room for the sums a later step takes back: the steps some later step names in `earlier_Q`.
    memo_at = np.zeros(Q + 1, dtype=np.int64)
    wanted = np.zeros(Q, dtype=np.bool_)
    if spread_by_holder:
        for j in range(Q):
            if earlier_Q[j] >= 0:
                wanted[earlier_Q[j]] = True
    for j in range(Q):
        memo_at[j + 1] = memo_at[j] + (np.count_nonzero(new_QW[j]) + 1 if wanted[j] else 0)
    memo_f, memo_x = np.zeros((Q, 3)), np.zeros(memo_at[Q], dtype=np.int64)
    memo_ok = np.zeros(Q, dtype=np.bool_)
    for j in range(Q):
        if start_Q[j] and j > 0:
            state[:] = base
        flow_W = flow_EW[experts_Q[j]]
        _unchanged_nodes(new_QW[j], prev_QW[j], node_W, skip_N, bare_N, held_new, held_prev)
        args = (node_W, skip_N, bare_N)
        rest = (routes, spread_by_holder, L, tok_bytes, state, work, pend_i, pend_f)
        keep = memo_f[j, : 3 if wanted[j] else 0], memo_x[memo_at[j] : memo_at[j + 1]]
        memo_ok[j] = dispatch_one(flow_W, new_QW[j], *args, 1.0, *rest, *keep)
        e = earlier_Q[j]
        if e >= 0 and memo_ok[e]:
            memo = memo_f[e], memo_x[memo_at[e] : memo_at[e + 1]]
            _dispatch_memo(flow_W, prev_QW[j], *args, -1.0, routes, L, tok_bytes, state, work, pend_i, pend_f, *memo)
        else:
            dispatch_one(flow_W, prev_QW[j], *args, -1.0, *rest, memo_f[j, :0], memo_x[:0])
        if kept(keep_Z, j + 1):
            most_Z[j + 1], busiest_Z[j + 1], latency_Z[j + 1], sends_Z[j + 1] = row_maxima(
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
