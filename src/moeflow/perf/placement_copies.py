"""The copies' terms of many placements at once: the part of `perf.placement_pricing.PlacementPricer`
that prices the copies out and back (FasterMoE §4.1's shadows, Pro-Prophet's Trans / Agg, Hecate's
spAG / spRS along §4.1's copy trees), kept apart from the tokens and the exchange (its base class).

A step changes one expert's holders, so its copies change by that expert's tree edges before and
after (`core.placement.tree_edges`) and, for an expert held everywhere, by one broadcast and one
reduce of its owner's count (`_everywhere`: `f(n + 1) − f(n)`); the candidates are running sums of
those changes, each tree stage priced as its busiest link plus its slowest active route
(`CostModel.stage_time_from_traffic`), in a search by running maxima (`perf.prefix_max`), the two
stages one after the other or, for `materialize` with the cost model's `copy_chunks` > 1, in the
chunk pipeline (`copies_pricing.pipelined_trees`, Hecate §4.1). A search
prices its bound on the copies of the whole order, then prefixes of it: the copies are kept for
them (`_prefix_copies`, `_known_copies`).

It reads from the pricer: `W`, `L`, `N`, `owner`, `tree`, `topology`, `cm`, `param_bytes`,
`max_stages`, `_copies_of`, `_on_links`, `_per_class`, `_previous`, `_link_time`.

Shape suffixes: W ranks, L links, Q steps, F dispatched states (Q after the steps, then Q before),
N latency classes here (`PlacementPricer.N`).
"""

from __future__ import annotations

import numpy as np

from moeflow.core.placement import tree_edges
from moeflow.perf import prefix_max as running
from moeflow.perf.copies_pricing import pipelined_trees
from moeflow.perf.placement_compiled import CompiledPricing
from moeflow.perf.prefix_max import prefix_max, prefix_max_entries, running_sums

DIRECTIONS = ("materialize", "reduce")


class PlacementCopies(CompiledPricing):
    """The copies' terms of `PlacementPricer` (module docstring)."""

    def _copies(self, experts, owner_Q, new_QW, prev_QW, start):
        """Copies out and back per candidate `[Q + 1]` (and as the prefetch sends them), and their
        number: the copy trees of the partial sets (`core.placement.tree_edges`) and the experts held
        everywhere by owner — broadcasts / reduces, or on gloo across nodes (`self.tree`) in the
        same trees; the prefetch sends those by broadcast / reduce beside the partial sets' trees."""
        Q, W = experts.size, self.W
        if self.compiled and self.max_stages:
            return self._compiled_copies(owner_Q, new_QW, prev_QW, start)
        own_QW = np.zeros((Q, W), dtype=bool)
        own_QW[np.arange(Q), owner_Q] = True
        extra_new, extra_prev = new_QW & ~own_QW, prev_QW & ~own_QW
        every_new = new_QW.all(1) & extra_new.any(1)
        every_prev = prev_QW.all(1) & extra_prev.any(1)
        every_trans, every_agg = self._everywhere(owner_Q, every_new.astype(np.int64) - every_prev, start)
        copies = running_sums((extra_new.sum(1) - extra_prev.sum(1))[:, None], np.zeros(1, np.int64), start)[:, 0]
        owner_F = np.concatenate([owner_Q, owner_Q])
        every_F = np.concatenate([every_new, every_prev])
        partial_FW = np.where(every_F[:, None], np.concatenate([own_QW, own_QW]), np.concatenate([new_QW, prev_QW]))
        terms = self._stages(Q, partial_FW, owner_F, self.topology.node_of, start)
        trees = pipelined_trees(*terms, 1)  # the prefetch sends each stage whole (`strategies.prefetch`)
        trans, agg = every_trans + trees, every_agg + trees  # as the prefetch sends them
        chunks = self.cm.copy_chunks  # `materialize` sends the trees in pieces (`core.copy_rounds`)
        if self.tree:  # as `materialize` sends them: everything through the trees, at once
            full = self._stages(Q, np.concatenate([new_QW, prev_QW]), owner_F, self.topology.node_of, start)
            every = pipelined_trees(*full, chunks)
            return every, every, trans, agg, copies
        if chunks == 1:
            return trans, agg, trans, agg, copies
        piped = pipelined_trees(*terms, chunks)
        return every_trans + piped, every_agg + piped, trans, agg, copies

    def _stages(self, Q: int, rows_FW: np.ndarray, owner_F: np.ndarray, node_of, start: np.ndarray) -> list[tuple]:
        """The copy trees of the states `rows_FW` (Q after the steps, then Q before) per candidate:
        each stage's (busiest link `[Q + 1]` (`CostModel.stage_time_from_traffic`), slowest active
        route `[Q + 1]`, active `[Q + 1]`), for `copies_pricing.pipelined_trees`."""
        k, src, dst, stage = tree_edges(rows_FW, owner_F, node_of)
        step, sign = np.where(k < Q, k, k - Q), np.where(k < Q, 1.0, -1.0)
        L, N = self.L, self.N
        idle = (np.zeros(Q + 1), np.zeros(Q + 1), np.zeros(Q + 1, dtype=bool))
        if k.size == 0:
            return [idle, idle]
        if self.max_stages and int(start.sum()) == 1 and Q * L >= running.RUNNING_MAX_FROM:  # a search: running maxima
            terms = [idle, idle]
            for s in (0, 1):
                m = stage == s
                if m.any():
                    run = running_sums(self._per_class(Q, step[m], src[m], dst[m], sign[m]), np.zeros(N), start)
                    active = run > 0.5
                    latency = np.where(active, self.topology.latency_classes, 0.0).max(-1, initial=0.0)
                    hops = self.topology.route_WWH[src[m], dst[m]]  # [n, H], padded with L
                    if hops.size * 8 > Q * L:  # many edges a step: their bytes per step and link, dense
                        d_links = self._on_links(Q, step[m], src[m], dst[m], sign[m] * self.param_bytes)
                        busiest = prefix_max(d_links, np.zeros(L), self._link_time, 0.0)
                    else:
                        H, link = hops.shape[-1], hops.reshape(-1)
                        on = link < L
                        at, value = np.repeat(step[m], H)[on], np.repeat(sign[m] * self.param_bytes, H)[on]
                        busiest = prefix_max_entries(at, link[on], value, Q, np.zeros(L), self._link_time, 0.0)
                    terms[s] = (busiest, latency, active.any(-1))
            return terms
        # Both stages' link bytes and route-latency counts side by side: one running sum.
        deltas = [np.zeros((Q, L + N)), np.zeros((Q, L + N))]
        for s in (0, 1):
            m = stage == s
            if m.any():
                deltas[s][:, :L] = self._on_links(Q, step[m], src[m], dst[m], sign[m] * self.param_bytes)
                deltas[s][:, L:] = self._per_class(Q, step[m], src[m], dst[m], sign[m])
        run = running_sums(np.concatenate(deltas, axis=1), np.zeros(2 * (L + N)), start)
        terms = []
        for s in (0, 1):
            part = run[:, s * (L + N) : (s + 1) * (L + N)]
            active = part[:, L:] > 0.5
            latency = np.where(active, self.topology.latency_classes, 0.0).max(-1, initial=0.0)
            terms.append((self.cm.stage_time_from_traffic(part[:, :L]), latency, active.any(-1)))
        return terms

    def copies_of_prefixes(self, experts_Q: np.ndarray, holders_QW: np.ndarray) -> np.ndarray:
        """Copies out and back `[Q + 1]` of every prefix of the steps (as `prefixes` prices them, the
        rest left out): a lower bound of each prefix's price."""
        trans, agg, *_ = self._prefix_copies(experts_Q, holders_QW)
        return trans + agg

    def _prefix_copies(self, experts_Q: np.ndarray, holders_QW: np.ndarray) -> tuple:
        """`_copies` of every prefix of the steps (row c: the first c steps), kept for the prefixes
        of these steps that a search prices next (`_known_copies`)."""
        experts = np.asarray(experts_Q, dtype=np.int64)
        start = np.zeros(experts.size, dtype=bool)
        start[:1] = True
        new_QW = np.asarray(holders_QW, dtype=bool).reshape(experts.size, self.W)
        owner_Q = self.owner[experts]
        copies = self._copies(experts, owner_Q, new_QW, self._previous(experts, owner_Q, new_QW, start), start)
        self._copies_of = (experts, new_QW, copies)
        return copies

    def _known_copies(self, experts: np.ndarray, new_QW: np.ndarray) -> tuple | None:
        """The copies of the prefixes of `experts` if the steps priced last began with them (a
        prefix's running sums are the first rows of a longer order's), else None."""
        known = self._copies_of
        Q = experts.size
        if known is None or known[0].size < Q or not np.array_equal(known[0][:Q], experts):
            return None
        if not np.array_equal(known[1][:Q], new_QW):
            return None
        return tuple(c[: Q + 1] for c in known[2])

    def _everywhere(self, owner_Q: np.ndarray, d_every_Q: np.ndarray, start: np.ndarray):
        """The broadcasts / reduces of the experts held everywhere, per candidate `[Q + 1]` each way.
        A step changes one owner's count by one: one broadcast's price changes, `f(n + 1) − f(n)`."""
        cm, W, Q = self.cm, self.W, owner_Q.size
        if Q == 0:
            return np.zeros(1), np.zeros(1)
        # Each owner's count before and after every step (running per owner within its candidate).
        candidate = np.cumsum(start)
        key = candidate * W + owner_Q
        order = np.lexsort((np.arange(Q), key))
        run = np.cumsum(d_every_Q[order])
        first = np.r_[True, key[order][1:] != key[order][:-1]]
        run -= np.repeat((run - d_every_Q[order])[first], np.diff(np.r_[np.flatnonzero(first), Q]))
        after = np.empty(Q, dtype=np.int64)
        after[order] = run
        before = after - d_every_Q
        out = []
        for direction in DIRECTIONS:
            kind = "broadcast" if direction == "materialize" else "reduce"
            top = int(max(after.max(initial=0), before.max(initial=0)))
            price = cm.collective_times(kind, np.arange(top + 1) * self.param_bytes)
            out.append(running_sums((price[after] - price[before])[:, None], np.zeros(1), start)[:, 0])
        return out[0], out[1]
