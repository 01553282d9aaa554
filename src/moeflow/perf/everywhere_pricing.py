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

Shape suffixes: W ranks, E experts, Q steps (one expert each), Z candidates (prefixes: Q + 1).
"""

from __future__ import annotations

import numpy as np

from moeflow.core.placement import dispatch_entries
from moeflow.perf.placement_pricing import PlacementPricer, PlacementTerms, _running


class EverywherePricer(PlacementPricer):
    """`PlacementPricer` with the shadow steps' prices computed directly (module docstring)."""

    _broadcasts_of: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    """(experts of the longest order priced, its broadcasts, its reduces)."""

    def _direct(self, experts: np.ndarray, new_QW: np.ndarray, start: np.ndarray, detail: bool) -> bool:
        """Whether the steps are one prefix of distinct experts, each held everywhere after it."""
        return (
            not detail
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
        tokens = _running(after_QW - before_QW, self.tokens0, start)
        remote = src != dst
        k, src, dst, count = k[remote], src[remote], dst[remote], count[remote]
        sign = -np.ones(k.size)
        traffic = _running(self._on_links(Q, k, src, dst, sign * count * self.tok_bytes), self.traffic0, start)
        classes = _running(self._per_class(Q, k, src, dst, sign), self.classes0, start)
        trans, agg = self._broadcasts(experts)
        copies = np.arange(Q + 1) * (W - 1)
        compute = cm.slowest(cm.expert_forward_time(tokens, shape, None) + cm.elementwise_time(tokens, shape))
        active = classes > 0.5
        latency = np.where(active, self.topology.latency_classes, 0.0).max(-1, initial=0.0)
        a2a = cm.a2a_from_traffic(traffic, latency, active.any(-1))
        return PlacementTerms(compute, a2a, trans, agg, trans, agg, tokens, None, copies)

    def copies_of_prefixes(self, experts_Q: np.ndarray, holders_QW: np.ndarray) -> np.ndarray:
        experts = np.asarray(experts_Q, dtype=np.int64)
        new_QW = np.asarray(holders_QW, dtype=bool).reshape(experts.size, self.W)
        start = np.zeros(experts.size, dtype=bool)
        start[:1] = True
        if not self._direct(experts, new_QW, start, False):
            return super().copies_of_prefixes(experts, new_QW)
        trans, agg = self._broadcasts(experts)
        return trans + agg

    def _broadcasts(self, experts_Q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every prefix's broadcasts out and reduces back `[Q + 1]` each (`_everywhere`); a search
        prices its bound on the whole order, then prefixes of it: their running sums are the first
        entries of the whole order's, so the order is priced once."""
        whole = self._broadcasts_of
        Q = experts_Q.size
        if whole is None or whole[0].size < Q or not np.array_equal(whole[0][:Q], experts_Q):
            start = np.zeros(Q, dtype=bool)
            start[:1] = True
            whole = self._broadcasts_of = (
                experts_Q,
                *self._everywhere(self.owner[experts_Q], np.ones(Q, np.int64), start),
            )
        return whole[1][: Q + 1], whole[2][: Q + 1]
