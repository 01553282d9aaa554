"""Pro-Prophet's search steps compiled (numba): Algorithm 1's loop without NumPy calls.

Pro-Prophet §IV-C Algorithm 1 takes one expert per step: on the heaviest device that owns an
expert it can still relieve (an *open* expert: one with tokens on its owner and senders without a
copy), the heaviest such expert; it sends copies to that expert's senders by descending tokens
(all but `keep_out` of them) and recomputes the expert's column of the dispatch plan, hence every
device's load, until the loads are balanced (Eq. 7) or no device can be relieved
(`planners.prophet`, module docstring). Each step is a few small array operations on one column;
in NumPy their call overhead, not their work, was the search's time (about 115 µs a step, hundreds
of steps at 1024 ranks x 1024 experts). Here a step is a few loops over the ranks, and the whole
search one call.

The steps are those of the NumPy version (tests/reference_planners.py `search_steps`) for any
input, ties included: the device is the first of the heaviest with an open expert; on it the open
expert with the most tokens on its owner, ties the lower id (what its per-device heaps of
``(-load, expert)`` popped: an expert is open exactly while it sat on its owner's heap, with its
current load, so a scan of the device's experts finds the same one); the senders sorted stably by
descending flow (ties keep rank order); the column of the expert as `core.placement.dispatch_entries`
dispatches it, Hecate §4.4 order: a source that holds the expert computes its own tokens, else the
holders on its node share them, else every holder — spread evenly from the source's place in the
candidates' rank order, the remainder one each to the candidates that follow it in ring order.
`flow_WE` orders the senders (it may be fractional: a window's mean); the dispatch sends its
rounding (`np.rint`, whole tokens). Loads are whole numbers in int64, as in the NumPy version.

Shape suffixes: W ranks, E experts, N nodes, Q steps, T copies sent over all steps (a step's
devices one after the other), K rows of the open experts a step changed, S senders of one step.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moeflow.perf.compiled_routes import transposed


@njit(cache=True, nogil=True)
def search_steps(flow_WE, owner_E, total_E, start_W, node_W, N, keep_out, threshold):
    """Algorithm 1's steps → `(expert_Q, bounds, devices_T, rows_QW)`: step q sends expert
    `expert_Q[q]` to `devices_T[bounds[q]:bounds[q + 1]]`, after which the expert is held where
    `rows_QW[q]` says (its owner and every device a step of it reached).

    `total_E`: each expert's whole tokens (all on its owner until a step changes it); `start_W`:
    every device's load with each expert on its owner; `node_W`: nodes numbered 0..N-1; the search
    stops once ``max(H) − min(H) < threshold`` (Eq. 7)."""
    W, E = flow_WE.shape
    flow_EW = transposed(flow_WE)  # a step reads one expert's column: a row here
    # Senders without a copy per expert; an expert with some and with tokens is open.
    waiting_E = np.zeros(E, dtype=np.int64)
    for w in range(W):
        for e in range(E):
            if flow_WE[w, e] > 0 and owner_E[e] != w:
                waiting_E[e] += 1
    bound = 0  # every step sends at least one copy to a sender without one: at most this many
    for e in range(E):
        bound += waiting_E[e]
    open_E = np.zeros(E, dtype=np.bool_)
    open_W = np.zeros(W, dtype=np.int64)  # open experts each device owns
    K = 0
    for e in range(E):
        if waiting_E[e] > 0 and total_E[e] > 0:
            open_E[e] = True
            open_W[owner_E[e]] += 1
            K += 1
    open_devices = 0
    for w in range(W):
        if open_W[w] > 0:
            open_devices += 1
    # Each device's experts in id order (the heap's tie rule: the lower id).
    first_W = np.zeros(W + 1, dtype=np.int64)
    for e in range(E):
        first_W[owner_E[e] + 1] += 1
    for w in range(W):
        first_W[w + 1] += first_W[w]
    mine = np.empty(E, dtype=np.int64)
    fill_W = first_W[:W].copy()
    for e in range(E):
        mine[fill_W[owner_E[e]]] = e
        fill_W[owner_E[e]] += 1
    H_W = start_W.copy()
    at_owner_E = total_E.copy()  # tokens each expert leaves on its owner
    # The open experts a step changed, one row each: where they are held and what each device
    # computes. A closed expert is never taken again, so its row goes back to `free` for the next
    # one: the rows written are those of the experts open at once, not one per expert (the pages
    # of a large array cost their first write).
    row_E = np.full(E, -1, dtype=np.int64)
    held_KW = np.empty((K, W), dtype=np.bool_)
    column_KW = np.empty((K, W), dtype=np.int64)
    free = np.arange(K - 1, -1, -1)  # a stack: row 0 first
    n_free = K
    expert_Q = np.empty(bound, dtype=np.int64)
    bounds = np.empty(bound + 1, dtype=np.int64)
    bounds[0] = 0
    devices_T = np.empty(bound, dtype=np.int64)
    # Scratch of one step.
    tokens_W = np.empty(W, dtype=np.int64)  # the expert's whole tokens per source (what the plan sends)
    senders = np.empty(W, dtype=np.int64)  # its senders without a copy, and the flow each sends it
    sent = np.empty(W)
    scratch = np.empty(W, dtype=np.int64)
    scratch_sent = np.empty(W)
    runs = np.empty(2 * W, dtype=np.int64)  # the expert's holders in rank order, then node by node
    end_N = np.zeros(N, dtype=np.int64)
    count_N = np.zeros(N, dtype=np.int64)
    before_W = np.zeros(W, dtype=np.int64)  # holders before each rank: every one, then its node's
    near_W = np.zeros(W, dtype=np.int64)
    share_N = np.zeros(N, dtype=np.int64)  # whole shares per holder of a node, from its sources
    Q = 0
    T = 0
    while open_devices > 0:
        high = H_W[0]
        low = H_W[0]
        for w in range(1, W):
            high = max(high, H_W[w])
            low = min(low, H_W[w])
        if not high - low >= threshold:
            break  # Eq. 7: balanced
        # The heaviest device with an open expert (first of equal loads, compared as float64 as
        # the NumPy version's `H_W + closed_W` does), and its heaviest open expert.
        device = -1
        heaviest = 0.0
        for w in range(W):
            if open_W[w] > 0 and (device < 0 or float(H_W[w]) > heaviest):
                device = w
                heaviest = float(H_W[w])
        e = -1
        for i in range(first_W[device], first_W[device + 1]):
            x = mine[i]
            if open_E[x] and (e < 0 or at_owner_E[x] > at_owner_E[e]):
                e = x
        k = row_E[e]
        if k < 0:  # first step of this expert: held by its owner alone
            n_free -= 1
            k = free[n_free]
            row_E[e] = k
            for w in range(W):
                held_KW[k, w] = False
            held_KW[k, owner_E[e]] = True
            H_W[owner_E[e]] -= total_E[e]
        else:
            for w in range(W):
                H_W[w] -= column_KW[k, w]
        n = 0
        for w in range(W):
            f = flow_EW[e, w]
            tokens_W[w] = np.int64(np.rint(f))
            if f > 0 and not held_KW[k, w]:
                senders[n] = w
                sent[n] = f
                n += 1
        _by_flow(senders, sent, n, scratch, scratch_sent)
        to = min(n, max(1, n - keep_out))  # Algorithm 1's n: all but keep_out of them
        for i in range(to):
            held_KW[k, senders[i]] = True
            devices_T[T] = senders[i]
            T += 1
        expert_Q[Q] = e
        Q += 1
        bounds[Q] = T
        spread = False  # a sender still without a copy sends it tokens: the dispatch plan's column
        for i in range(to, n):
            if tokens_W[senders[i]] > 0:
                spread = True
        if spread:
            _column(tokens_W, held_KW, column_KW, k, node_W, runs, end_N, count_N, before_W, near_W, share_N)
        else:  # every sender holds it: each computes its own
            for w in range(W):
                column_KW[k, w] = tokens_W[w]
        for w in range(W):
            H_W[w] += column_KW[k, w]
        at_owner_E[e] = column_KW[k, owner_E[e]]
        if not (n > to and at_owner_E[e] > 0):  # closed: no longer on its device's heap
            open_E[e] = False
            free[n_free] = k
            n_free += 1
            open_W[device] -= 1
            if open_W[device] == 0:
                open_devices -= 1
    # Each step's expert's holders after it: its owner and every device an earlier step of it reached.
    rows_QW = np.zeros((Q, W), dtype=np.bool_)
    last_E = np.full(E, -1, dtype=np.int64)
    for q in range(Q):
        e = expert_Q[q]
        if last_E[e] < 0:
            rows_QW[q, owner_E[e]] = True
        else:
            for w in range(W):
                rows_QW[q, w] = rows_QW[last_E[e], w]
        for i in range(bounds[q], bounds[q + 1]):
            rows_QW[q, devices_T[i]] = True
        last_E[e] = q
    return expert_Q[:Q], bounds[: Q + 1], devices_T[:T], rows_QW


@njit(cache=True, nogil=True)
def _by_flow(senders, sent, n, scratch, scratch_sent):
    """Sort `senders[:n]` (in rank order) by descending flow `sent[:n]` (sorted along), stably (ties
    keep rank order, as NumPy's ``argsort(-flow, kind="stable")``).

    A window's mean of whole counts takes few distinct values in a column (about 20 at 1024 ranks
    on Zipf 1.2), so the senders are first counted by value (`_by_few_values`: linear, no
    comparison per pair); a column of more than `FEW` values is merge sorted."""
    if n > 32 and _by_few_values(senders, sent, n, scratch, scratch_sent):
        return
    _merge_sorted(senders, sent, n, scratch, scratch_sent)


FEW = 64
"""Most distinct flows in a column that `_by_few_values` sorts by counting."""


@njit(cache=True, nogil=True)
def _by_few_values(senders, sent, n, scratch, scratch_sent):
    """The stable counting sort of `_by_flow` if `sent[:n]` holds at most `FEW` distinct values
    (returns False, the arrays untouched, if not). Flows here are positive, and positive float64s
    compare as their bits do as unsigned integers: the values are hashed and compared by their bits."""
    bits = sent.view(np.uint64)
    slots = 2 * FEW  # open addressing, at most half full
    key_H = np.empty(slots, dtype=np.uint64)
    value_H = np.full(slots, -1, dtype=np.int64)  # the value's index in `distinct`; -1: empty
    distinct = np.empty(FEW, dtype=np.uint64)
    value_S = np.empty(n, dtype=np.int64)
    d = 0
    for i in range(n):
        b = bits[i]
        h = np.int64((b * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(57))  # Fibonacci hash: 7 bits, 2·FEW slots
        while value_H[h] >= 0 and key_H[h] != b:
            h = (h + 1) & (slots - 1)
        if value_H[h] < 0:
            if d == FEW:
                return False
            key_H[h] = b
            value_H[h] = d
            distinct[d] = b
            d += 1
        value_S[i] = value_H[h]
    # Each value's place in descending order (an insertion sort of at most FEW values), then the
    # senders counted into their value's place, in rank order within it.
    order = np.empty(d, dtype=np.int64)
    for v in range(d):
        at = v
        while at > 0 and distinct[order[at - 1]] < distinct[v]:
            order[at] = order[at - 1]
            at -= 1
        order[at] = v
    start = np.zeros(d + 1, dtype=np.int64)
    place = np.empty(d, dtype=np.int64)
    for at in range(d):
        place[order[at]] = at
    for i in range(n):
        start[place[value_S[i]] + 1] += 1
    for at in range(d):
        start[at + 1] += start[at]
    for i in range(n):
        at = place[value_S[i]]
        scratch[start[at]] = senders[i]
        scratch_sent[start[at]] = sent[i]
        start[at] += 1
    for i in range(n):
        senders[i] = scratch[i]
        sent[i] = scratch_sent[i]
    return True


@njit(cache=True, nogil=True)
def _merge_sorted(senders, sent, n, scratch, scratch_sent):
    """`_by_flow` by comparisons: a bottom-up merge sort through the scratch arrays."""
    width = 1
    while width < n:
        lo = 0
        while lo < n:
            mid = min(lo + width, n)
            hi = min(lo + 2 * width, n)
            i = lo
            j = mid
            out = lo
            while i < mid and j < hi:
                if sent[j] > sent[i]:  # strictly more: the right run first
                    scratch[out] = senders[j]
                    scratch_sent[out] = sent[j]
                    j += 1
                else:
                    scratch[out] = senders[i]
                    scratch_sent[out] = sent[i]
                    i += 1
                out += 1
            while i < mid:
                scratch[out] = senders[i]
                scratch_sent[out] = sent[i]
                i += 1
                out += 1
            while j < hi:
                scratch[out] = senders[j]
                scratch_sent[out] = sent[j]
                j += 1
                out += 1
            lo = hi
        for i in range(n):
            senders[i] = scratch[i]
            sent[i] = scratch_sent[i]
        width *= 2


@njit(cache=True, nogil=True)
def _column(tokens_W, held_KW, column_KW, k, node_W, runs, end_N, count_N, before_W, near_W, share_N):
    """The expert's column of the dispatch plan (tokens each device computes of it) into
    `column_KW[k]`, from its holders `held_KW[k]` and the whole tokens each source sends it
    (`tokens_W`): `dispatch_entries` for one expert (module docstring). `runs[:W]` holds every
    holder in rank order, `runs[W:]` the same node by node (one array read at an offset, not two
    bound in turn to one name: numba counts an array variable's references). A source's candidates
    are a run of holders in rank order and its ring start the number of them before it, both read
    from one pass over the ranks; the whole shares ``tokens // n`` of a node's sources are summed
    per node and given once to its holders, so a division is done only for a source that sends at
    least one token per candidate."""
    W = node_W.size
    N = count_N.size
    count_N[:] = 0
    share_N[:] = 0
    n_all = 0
    for w in range(W):
        column_KW[k, w] = 0
        if held_KW[k, w]:
            runs[n_all] = w
            n_all += 1
            count_N[node_W[w]] += 1
        else:
            before_W[w] = n_all
            near_W[w] = count_N[node_W[w]]
    offset = 0
    for g in range(N):
        end_N[g] = offset
        offset += count_N[g]
    for i in range(n_all):  # node by node, rank order within a node; end_N[g] ends node g's run
        w = runs[i]
        runs[W + end_N[node_W[w]]] = w
        end_N[node_W[w]] += 1
    share_all = 0  # whole shares per holder from the sources whose node has none
    for s in range(W):
        tokens = tokens_W[s]
        if tokens <= 0:
            continue
        if held_KW[k, s]:
            column_KW[k, s] += tokens
            continue
        g = node_W[s]
        n = count_N[g]
        if n > 0:  # the holders on the source's node
            start = W + end_N[g] - n
            first = near_W[s]
        else:  # every holder
            n = n_all
            start = 0
            first = before_W[s]
        if n == 1:
            column_KW[k, runs[start]] += tokens
            continue
        rest = tokens
        if tokens >= n:
            whole = tokens // n
            rest = tokens - whole * n
            if count_N[g] > 0:
                share_N[g] += whole
            else:
                share_all += whole
        m = first  # the remainder: one each to the candidates from the source's place in the ring
        for _ in range(rest):
            if m >= n:
                m -= n
            column_KW[k, runs[start + m]] += 1
            m += 1
    for i in range(n_all):
        w = runs[i]
        column_KW[k, w] += share_N[node_W[w]] + share_all
