"""The prefixes of a shadow order priced directly: every step holds one more expert on every rank.

FasterMoE's shadowing (§4.1, Algorithm 1) decides on the current flow, so its search is on the
layer's critical path. Its steps are all of one kind — an expert that only its owner held becomes
held by every rank — and for that kind the general pricer's work (`PlacementPricer._terms`: both
states' dispatch by Hecate §4.4's order, node-local candidates, spread sources, copy trees) reduces
to a few array operations:

- after the step every source computes its own tokens of the expert (no exchange), before it every
  source sent them to the owner: the tokens each device computes change by the expert's column
  minus its sum at the owner, and the exchange loses the before-state's remote entries (their bytes
  on every link of their route, one positive entry each per route latency);
- the copies are one broadcast out and one reduce back per owner (`PlacementPricer._everywhere`),
  no partial set, so no copy tree.

The arithmetic is the general pricer's, entry for entry and in the same order, so the prices are
the same floats (tests/test_vectorised_planners.py compares the two). Steps of any other kind, a
cost model that counts GEMM launches, gloo's trees across nodes (`PlacementPricer.tree`) and
per-device local counts (`detail`) take the general path.

On a whole flow (the compiled path, `perf.placement_compiled`) a search of such steps
(`cheapest_prefixes`) runs on `perf.compiled_everywhere`: the copies of every prefix first (each
owner's broadcasts, no tree), then the dispatch of as many prefixes as the copies' bound asks for,
each round going on from the state where the last one stopped (a prefix is dispatched once) — the
same floats as the general path (tests/test_compiled_sums.py), with no copy trees (every copy is a
broadcast) and no per-step bookkeeping (every step is of the one kind).

Shape suffixes: W ranks, E experts, Q steps (one expert each), Z candidates (prefixes: Q + 1).
"""

from __future__ import annotations

import numpy as np

from moeflow.core.placement import dispatch_entries
from moeflow.perf.placement_pricing import PlacementPricer, PlacementTerms
from moeflow.perf.placement_search import PRICED_FIRST
from moeflow.perf.prefix_max import running_sums


class EverywherePricer(PlacementPricer):
    """`PlacementPricer` with the shadow steps' prices computed directly (module docstring)."""

    def cheapest_prefixes(self, experts_Q, holders_QW, price, detail: bool = False, bounded: bool = True) -> np.ndarray:
        """`PlacementPricer.cheapest_prefixes`; on a whole flow, steps that each hold one more
        expert everywhere run on `perf.compiled_everywhere` (module docstring)."""
        experts = np.asarray(experts_Q, dtype=np.int64)
        rows = np.asarray(holders_QW, dtype=bool).reshape(experts.size, self.W)
        Q = experts.size
        pruned = bounded and Q > PRICED_FIRST
        compiled = (
            Q > 0
            and self.compiled
            and not detail
            and self.max_stages
            and not self.tree
            and self.W > 1
            and bool(rows.all())
            and self._distinct(experts)
        )
        if not compiled or (pruned and not self._copies_grow(experts, rows)):
            return super().cheapest_prefixes(experts, rows, price, detail, bounded)
        trans, agg = self._everywhere_copies(experts)  # every prefix's: each owner's broadcasts, no tree
        n_copies = np.arange(Q + 1) * (self.W - 1)
        copies = trans + agg
        state = np.concatenate((self.tokens0, self.traffic0, self.classes0))
        # A cost model that prices every device (`perf.compiled_rows`): every device's tokens and
        # experts per row too, priced as the general path prices them.
        fast = self._compiled_terms(detail)
        calls = None if fast else self.calls0.astype(np.float64)
        rows: list[np.ndarray] = []
        done, priced = 0, PRICED_FIRST if pruned else Q
        while True:  # as `_cheapest_growing`: price, then as far as the copies' bound leaves
            rows_Z = self._everywhere_rows(experts[done:priced], state, calls)
            # Row 0 of a later round is the last row of the one before.
            rows = [np.concatenate((m, r[1:])) for m, r in zip(rows, rows_Z)] if done else list(rows_Z)
            done = priced
            most, busiest, latency, sends, tokens, experts_computed = rows
            if fast:
                (compute, a2a), tokens = self._priced_maxima(most, busiest, latency, sends), None
            else:
                compute, a2a = self._priced_rows(tokens, experts_computed, busiest, latency, sends)
            kept = slice(0, priced + 1)
            terms = PlacementTerms(
                compute, a2a, trans[kept], agg[kept], trans[kept], agg[kept], tokens, None, n_copies[kept]
            )
            predicted = price(terms)
            if not pruned:
                return predicted
            beyond = np.flatnonzero(copies > predicted.min())
            last = int(beyond[0]) if beyond.size else Q
            if last <= priced:
                return predicted
            priced = last

    def _direct(self, experts: np.ndarray, new_QW: np.ndarray, start: np.ndarray, detail: bool) -> bool:
        """Whether the steps are one prefix of distinct experts, each held everywhere after it."""
        return (
            not detail
            and not self.compiled
            and not self.tree
            and not self.cm.prices_gemm_calls
            and self.W > 1
            and bool(start[:1].all())
            and not start[1:].any()
            and bool(new_QW.all())
            and np.unique(experts).size == experts.size
        )

    def _terms(self, experts: np.ndarray, new_QW: np.ndarray, start: np.ndarray, detail: bool) -> PlacementTerms:
        if not self._direct(experts, new_QW, start, detail):
            return super()._terms(experts, new_QW, start, detail)
        W, Q = self.W, experts.size
        cm, shape = self.cm, self.shape
        owner_Q = self.owner[experts]
        prev_QW = np.zeros((Q, W), dtype=bool)
        prev_QW[np.arange(Q), owner_Q] = True
        # The sources whose candidates a step changes (all but an owner alone on its node).
        flow_WQ = np.where(self._affected(new_QW, prev_QW).T, self.flow[:, experts], 0)
        # Before each step: the owner alone (`dispatch_entries`, as the general pricer runs it).
        k, src, dst, count = dispatch_entries(flow_WQ, prev_QW, self.node_of)
        before_QW = np.bincount(k * W + dst, weights=count, minlength=Q * W).reshape(Q, W)
        after_QW = np.where(flow_WQ > 0, flow_WQ, 0).T  # every source its own tokens
        tokens = running_sums(after_QW - before_QW, self.tokens0, start)
        remote = src != dst
        k, src, dst, count = k[remote], src[remote], dst[remote], count[remote]
        sign = -np.ones(k.size)
        traffic = running_sums(self._on_links(Q, k, src, dst, sign * count * self.tok_bytes), self.traffic0, start)
        classes = running_sums(self._per_class(Q, k, src, dst, sign), self.classes0, start)
        copies = self._known_copies(experts, new_QW)  # the search's bound priced them for the whole order
        trans, agg, _, _, n_copies = (
            copies if copies is not None else self._copies(experts, owner_Q, new_QW, prev_QW, start)
        )
        compute = cm.slowest(cm.expert_forward_time(tokens, shape, None) + cm.elementwise_time(tokens, shape))
        active = classes > 0.5
        latency = np.where(active, self.topology.latency_classes, 0.0).max(-1, initial=0.0)
        a2a = cm.a2a_from_traffic(traffic, latency, active.any(-1))
        return PlacementTerms(compute, a2a, trans, agg, trans, agg, tokens, None, n_copies)

    def _copies(self, experts, owner_Q, new_QW, prev_QW, start):
        """Each step's expert held everywhere, before only by its owner: one broadcast out and one
        reduce back per owner (`_everywhere`), no copy tree (module docstring); else the general's."""
        Q = experts.size
        if not self._direct(experts, new_QW, start, False):
            return super()._copies(experts, owner_Q, new_QW, prev_QW, start)
        trans, agg = self._everywhere(owner_Q, np.ones(Q, dtype=np.int64), start)
        return trans, agg, trans, agg, np.arange(Q + 1) * (self.W - 1)
