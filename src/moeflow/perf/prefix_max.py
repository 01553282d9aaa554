"""Running maxima of a search's prefixes, without every prefix's sums.

A prefix search (Pro-Prophet's Algorithm 1, Hecate's Algorithm 1 in load order, EPLB's copies in
its order; `perf.placement_pricing`) prices every prefix of its steps, and a price's slowest device
and busiest link are maxima over devices or links of elementwise terms (FasterMoE Eq. 1-2: a
device's compute time of its tokens, a link's bytes over its bandwidth) of running sums of the
steps' changes. Summing every prefix densely costs (steps + 1) x columns per term; here the steps
are read in blocks of `PREFIX_BLOCK`: a block's steps change few columns, which are summed row by
row from the state before the block, and the other columns' largest term is the state's, kept from
block to block. The sums are the dense running sums to the bit where the values are whole numbers
(token counts, bytes in float64): any order sums them alike.

Shape suffixes: Q steps, X columns (devices or links), M entries, B steps of a block, T columns a
block touches.
"""

from __future__ import annotations

from typing import Any

import numpy as np

PREFIX_BLOCK = 64
"""Steps per block (a block's dense part is PREFIX_BLOCK x X)."""
RUNNING_MAX_FROM = 1 << 14
"""Steps x columns from which a search keeps running maxima (below, the dense sums cost less)."""


def running_sums(delta_QX: np.ndarray, base_X: Any, start_Q: np.ndarray) -> np.ndarray:
    """Row 0: `base_X`; row j + 1: `base_X` plus the deltas of its candidate's steps up to j (the
    running sum restarts where `start_Q` is True: a new candidate's first step)."""
    total = np.cumsum(delta_QX, axis=0)
    first = np.flatnonzero(start_Q)
    if first.size > 1:
        before = np.concatenate([np.zeros((1, *total.shape[1:]), total.dtype), total[:-1]])
        total = total - before[np.repeat(first, np.diff(np.append(first, len(start_Q))))]
    out = np.empty((total.shape[0] + 1, *total.shape[1:]), dtype=np.result_type(total, np.asarray(base_X)))
    out[0] = base_X
    np.add(total, base_X, out=out[1:])
    return out


def prefix_max(delta_QX: np.ndarray, base_X: np.ndarray, h, floor: float) -> np.ndarray:
    """`[Q + 1]`: row c the largest of `floor` and `h(state, columns)` over the X columns, where the
    state is `base_X` plus the deltas `delta_QX` of the steps before c (module docstring)."""
    Q = delta_QX.shape[0]

    def blocks():
        for q0 in range(0, Q, PREFIX_BLOCK):
            block = delta_QX[q0 : q0 + PREFIX_BLOCK]
            touched = np.flatnonzero(block.any(0))
            yield q0, block.shape[0], touched, block[:, touched]

    return _block_max(blocks(), Q, base_X, h, floor)


def prefix_max_entries(
    step_M: np.ndarray, col_M: np.ndarray, value_M: np.ndarray, Q: int, base_X: np.ndarray, h, floor: float
) -> np.ndarray:
    """`prefix_max` of deltas given as entries `value_M[i]` at (step, column), where they are few
    beside Q·X (a copy tree's edges, a search's changed links): each block's columns are those its
    entries name (Q / `PREFIX_BLOCK` must fit 16 bits)."""
    order = np.argsort((step_M // PREFIX_BLOCK).astype(np.int16), kind="stable")  # a radix sort by block
    step, col, value = step_M[order], col_M[order], value_M[order]
    bounds = np.searchsorted(step, np.arange(0, Q + PREFIX_BLOCK, PREFIX_BLOCK))

    def blocks():
        for b, q0 in enumerate(range(0, Q, PREFIX_BLOCK)):
            B, lo, hi = min(PREFIX_BLOCK, Q - q0), bounds[b], bounds[b + 1]
            touched, inverse = np.unique(col[lo:hi], return_inverse=True)
            delta = np.bincount(
                (step[lo:hi] - q0) * touched.size + inverse, weights=value[lo:hi], minlength=B * touched.size
            )
            yield q0, B, touched, delta.reshape(B, touched.size)

    return _block_max(blocks(), Q, base_X, h, floor)


def prefix_max_of_entries(
    step_M: np.ndarray, col_M: np.ndarray, value_M: np.ndarray, Q: int, base_X: np.ndarray, h, floor: float
) -> np.ndarray:
    """`prefix_max` of entries (step, column, value): read block by block where they are few beside
    Q·X, else summed into the dense `[Q, X]` first."""
    X = base_X.size
    if step_M.size * 8 < Q * X:
        return prefix_max_entries(step_M, col_M, value_M, Q, base_X, h, floor)
    delta = np.bincount(step_M * X + col_M, weights=value_M, minlength=Q * X).astype(np.float64, copy=False)
    return prefix_max(delta.reshape(Q, X), base_X, h, floor)


def _block_max(blocks, Q: int, base_X: np.ndarray, h, floor: float) -> np.ndarray:
    """The running maxima of `prefix_max` from its blocks `(first step, steps, columns, deltas [B, T])`."""
    X = base_X.size
    state = np.array(base_X, dtype=np.float64)
    h_X = h(state, np.arange(X))
    out = np.empty(Q + 1)
    out[0] = h_X.max(initial=floor)
    free_X = np.ones(X, dtype=bool)
    for q0, B, touched, delta in blocks:
        if touched.size == 0:
            out[q0 + 1 : q0 + 1 + B] = h_X.max(initial=floor)
            continue
        run = np.cumsum(delta, axis=0)
        run += state[touched]
        h_run = h(run, touched)
        free_X[touched] = False
        out[q0 + 1 : q0 + 1 + B] = np.maximum(h_run.max(1), h_X.max(where=free_X, initial=floor))
        free_X[touched] = True
        state[touched] = run[-1]
        h_X[touched] = h_run[-1]
    return out
