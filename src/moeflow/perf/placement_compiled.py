"""The compiled path of `perf.placement_pricing.PlacementPricer`: its terms from the numba kernels
on a whole flow (`perf.compiled_sums` for the dispatch, `perf.compiled_copies` for the copies,
`perf.compiled_everywhere` for steps that hold an expert everywhere), priced by the same
`CostModel` calls as the NumPy path, to the bit (tests/test_compiled_sums.py). A base class of
`PlacementCopies`, kept apart from the NumPy path it stands beside.

Plans priced plan by plan (`PlacementPricer.of_placements`, `auto`'s proposals): what does not
depend on the flow — a plan's steps, its copies — is kept on the plan (`Placement.memo`), so a plan
that stands several calls pays only its dispatch on each new flow.

It reads from the pricer: `compiled`, `max_compute`, `max_stages`, `cm`, `shape`, `topology`,
`owner`, `W`, `tok_bytes`, `param_bytes`, `inv_bw_L`, `tree`, the owners' state (`tokens0`,
`traffic0`, `classes0`, `_flow_EW`, `_node_W`, `_spread_by_holder`, `_owners_maxima`), `_earlier`,
`_price_tables`, `_known_copies` and `_copies`.

Shape suffixes: W ranks, Q steps, Z candidates.
"""

from __future__ import annotations

import weakref
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from moeflow.perf import compiled_copies, compiled_everywhere, compiled_rows, compiled_sums
from moeflow.perf.compiled_routes import kept_rows
from moeflow.perf.copies_pricing import pipelined_trees
from moeflow.perf.placement_terms import PlacementTerms


@lru_cache(maxsize=64)
def _tree_layout(node_of: tuple | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(node of every rank, its index among its node's ranks, its place among the ranks ordered
    node by node then by rank) as `core.placement.tree_edges` reads them; all empty without nodes."""
    if node_of is None:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    node = np.asarray(node_of, dtype=np.int64)
    W = node.size
    by_node = np.lexsort((np.arange(W), node))
    first_W = np.searchsorted(node[by_node], node)
    local_W = np.empty(W, dtype=np.int64)
    local_W[by_node] = np.arange(W) - first_W[by_node]
    pos_W = np.empty(W, dtype=np.int64)
    pos_W[by_node] = np.arange(W)
    arrays = (node, local_W, pos_W)
    for a in arrays:
        a.flags.writeable = False  # shared by every pricer on this layout
    return arrays


class PlanSteps(NamedTuple):
    """A plan's steps as `compiled_sums.dispatch_terms` reads them (`CompiledPricing._plan_steps`)."""

    experts: np.ndarray
    """`[Q]` its copied experts, ascending."""
    new_QW: np.ndarray
    """Their holders."""
    prev_QW: np.ndarray
    """Their owners alone."""
    start: np.ndarray
    """One candidate."""
    earlier: np.ndarray
    """No step repeats an earlier one (-1)."""
    keep: np.ndarray
    """The last row read."""
    everywhere: bool
    """Every copied expert held by every rank."""


class CompiledPricing:
    """The compiled path's terms and copies (module docstring)."""

    def _compiled_terms(self, detail: bool) -> bool:
        """Whether `_terms` runs on `perf.compiled_sums`: a whole flow, no per-device local counts
        (`detail`), and a slowest device that is the one with the most tokens (no processor sharing,
        `CostModel.compute_grows_with_tokens`)."""
        return self.compiled and not detail and self.max_compute and self.cm.compute_grows_with_tokens

    def _compiled(self, experts, owner_Q, new_QW, prev_QW, start) -> PlacementTerms:
        """`_terms` from the compiled running sums of the dispatch (`compiled_sums.dispatch_terms`):
        the same maxima as the NumPy path, priced by the same `CostModel` calls."""
        new_QW = np.ascontiguousarray(new_QW)
        most, busiest, latency, sends = self._dispatch(experts, new_QW, prev_QW, start, self._earlier, kept_rows(start))
        compute, a2a = self._priced_maxima(most, busiest, latency, sends)
        copies = self._known_copies(experts, new_QW) if int(start.sum()) == 1 else None
        if copies is None:
            copies = self._copies(experts, owner_Q, new_QW, prev_QW, start)
        trans, agg, trans_pf, agg_pf, n_copies = copies
        return PlacementTerms(compute, a2a, trans, agg, trans_pf, agg_pf, None, None, n_copies)

    def _compiled_rows(self, experts, owner_Q, new_QW, prev_QW, start) -> PlacementTerms:
        """`_terms` where the slowest device is not simply the one with the most tokens (a fitted
        GEMM launch, processor sharing): every device's tokens and experts computed per row
        (`compiled_rows.dispatch_rows`), priced by the NumPy path's own `CostModel` calls."""
        new_QW = np.ascontiguousarray(new_QW)
        tokens, calls, busiest, latency, sends = self._rows(experts, new_QW, prev_QW, start, kept_rows(start))
        compute, a2a = self._priced_rows(tokens, calls, busiest, latency, sends)
        copies = self._known_copies(experts, new_QW) if int(start.sum()) == 1 else None
        if copies is None:
            copies = self._copies(experts, owner_Q, new_QW, prev_QW, start)
        trans, agg, trans_pf, agg_pf, n_copies = copies
        return PlacementTerms(compute, a2a, trans, agg, trans_pf, agg_pf, tokens, None, n_copies)

    def _compiled_plans(self, placements: list) -> PlacementTerms:
        """`of_placements` plan by plan on the compiled sums: each plan's dispatch on this flow (its
        maxima, or every device's rows where the cost model needs them: `_compiled_rows`); its
        steps (its copied experts, each from its owner alone) and its copies, which do not depend on
        the flow, kept on it (`Placement.memo`) for this cost model and expert size."""
        Z, fast = len(placements), self._compiled_terms(False)
        most, busiest, latency = np.zeros(Z), np.zeros(Z), np.zeros(Z)
        sends = np.zeros(Z, dtype=bool)
        tokens_ZW, calls_ZW = (None, None) if fast else (np.zeros((Z, self.W)), np.zeros((Z, self.W)))
        copies = np.zeros((4, Z))
        n_copies = np.zeros(Z, dtype=np.int64)
        for z, placement in enumerate(placements):
            steps = self._plan_steps(placement)
            if steps is None:  # the owners alone
                most[z], busiest[z], latency[z], sends[z] = self._owners_row()
                if not fast:
                    tokens_ZW[z], calls_ZW[z] = self.tokens0, self.calls0
                continue
            if steps.everywhere:  # every copied expert held by every rank: the shadow steps' kernel
                row = self._everywhere_rows(steps.experts, calls=None if fast else self.calls0.copy())
                most[z], busiest[z], latency[z], sends[z] = (a[-1] for a in row[:4])
                if not fast:
                    tokens_ZW[z], calls_ZW[z] = row[4][-1], row[5][-1]
            elif not fast:
                rows = self._rows(*steps[:4], steps.keep)
                tokens_ZW[z], calls_ZW[z], busiest[z], latency[z], sends[z] = (a[-1] for a in rows)
            else:
                most[z], busiest[z], latency[z], sends[z] = (a[-1] for a in self._dispatch(*steps[:6]))
            *copies[:, z], n_copies[z] = self._plan_copies(placement, steps)
        if fast:
            compute, a2a = self._priced_maxima(most, busiest, latency, sends)
        else:
            compute, a2a = self._priced_rows(tokens_ZW, calls_ZW, busiest, latency, sends)
        return PlacementTerms(compute, a2a, *copies, tokens_ZW, None, n_copies)

    def _plan_steps(self, placement) -> PlanSteps | None:
        """A plan's steps as `dispatch_terms` reads them — its copied experts, their holders, their
        owners alone before, one candidate, no earlier step, the last row kept — kept on it (None:
        the owners alone)."""
        memo = placement.memo
        if "steps" not in memo:
            experts = placement.copied_E
            Q = experts.size
            steps = None
            if Q:
                prev_QW = np.zeros((Q, self.W), dtype=bool)
                prev_QW[np.arange(Q), self.owner[experts]] = True
                start, keep = np.zeros(Q, dtype=bool), np.zeros(Q + 1, dtype=bool)
                start[0] = keep[Q] = True
                new_QW = np.ascontiguousarray(placement.holders_EW[experts])
                everywhere = self.W > 1 and bool(new_QW.all())
                steps = PlanSteps(experts, new_QW, prev_QW, start, np.full(Q, -1, dtype=np.int64), keep, everywhere)
            memo["steps"] = steps
        return memo["steps"]

    def _plan_copies(self, placement, steps: PlanSteps) -> tuple:
        """(copies out, back, both as the prefetch sends them, their number) of a plan alone
        (`_copies`), kept on it for this cost model and expert size."""
        key = ("copies", id(self.cm), float(self.param_bytes))
        kept = placement.memo.get(key)
        if kept is None or kept[0]() is not self.cm:  # (a cost model since freed at the same address)
            experts, new_QW, prev_QW, start = steps[:4]
            if steps.everywhere and self.max_stages and not self.tree:  # each owner's broadcasts
                trans, agg = self._everywhere_copies(experts)
                terms = (trans, agg, trans, agg, np.array([experts.size * (self.W - 1)]))
            else:
                terms = self._copies(experts, self.owner[experts], new_QW, prev_QW, start)
            kept = placement.memo[key] = (weakref.ref(self.cm), tuple(t[-1] for t in terms))
        return kept[1]

    def _everywhere_rows(self, experts: np.ndarray, state: np.ndarray | None = None, calls=None) -> tuple:
        """The dispatch's maxima of the prefixes of steps that each hold one more expert everywhere
        (`compiled_everywhere.everywhere_rows`), from the owners alone or going on from `state`
        (left as after the last step); with `calls` (the experts each device computes, going on
        likewise: a cost model that prices every device) every device's rows too."""
        if state is None:
            state = np.concatenate((self.tokens0, self.traffic0, self.classes0))
        return compiled_everywhere.everywhere_rows(
            self._flow_EW,
            experts,
            self.owner,
            self._node_W,
            self.topology.route_tables,
            self._spread_by_holder,
            float(self.tok_bytes),
            state,
            np.zeros(0) if calls is None else calls,
            self.inv_bw_L,
            self.topology.latency_classes,
        )

    def _everywhere_copies(self, experts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Copies out and back `[Q + 1]` of the prefixes of distinct experts each held everywhere
        after its step (its owner's alone before): each owner's broadcasts and reduces
        (`compiled_copies.owner_price_sums` of `compiled_everywhere.owner_counts`), no copy tree —
        the floats `_compiled_copies` gives them."""
        start = np.zeros(experts.size, dtype=bool)
        start[:1] = True
        after, before = compiled_everywhere.owner_counts(experts, self.owner, self.W)
        trans, agg = (compiled_copies.owner_price_sums(after, before, start, t) for t in self._owner_price_tables())
        return trans, agg

    def _owners_row(self) -> tuple:
        """The dispatch's maxima of the owners alone (`dispatch_terms` of no step), made once per pricer."""
        if self._owners_maxima is None:
            none_QW = np.zeros((0, self.W), dtype=bool)
            empty = (
                np.zeros(0, dtype=np.int64),
                none_QW,
                none_QW,
                np.zeros(0, dtype=bool),
                np.zeros(0, dtype=np.int64),
            )
            self._owners_maxima = tuple(a[0] for a in self._dispatch(*empty, np.zeros(0, dtype=bool)))
        return self._owners_maxima

    def _dispatch(self, experts, new_QW, prev_QW, start, earlier, keep) -> tuple:
        """`compiled_sums.dispatch_terms` of these steps on the pricer's flow, from the owners alone."""
        topo = self.topology
        return compiled_sums.dispatch_terms(
            self._flow_EW,
            experts,
            new_QW,
            prev_QW,
            start,
            earlier,
            self._node_W,
            topo.route_tables,
            self._spread_by_holder,
            float(self.tok_bytes),
            self.tokens0,
            self.traffic0,
            self.classes0,
            self.inv_bw_L,
            topo.latency_classes,
            keep,
        )

    def _rows(self, experts, new_QW, prev_QW, start, keep) -> tuple:
        """`compiled_rows.dispatch_rows` of these steps on the pricer's flow, from the owners alone."""
        topo = self.topology
        return compiled_rows.dispatch_rows(
            self._flow_EW,
            experts,
            new_QW,
            prev_QW,
            start,
            self._node_W,
            topo.route_tables,
            self._spread_by_holder,
            float(self.tok_bytes),
            self.tokens0,
            self.calls0,
            self.traffic0,
            self.classes0,
            self.inv_bw_L,
            topo.latency_classes,
            keep,
        )

    def _priced_rows(self, tokens_ZW, calls_ZW, busiest, latency, sends) -> tuple[np.ndarray, np.ndarray]:
        """(forward expert compute of the slowest device, one exchange) from every device's tokens
        and experts computed (the fitted GEMM launch's α per expert) and the exchange's maxima, by the
        NumPy path's own `CostModel` calls."""
        cm, shape = self.cm, self.shape
        gemm_calls = calls_ZW * shape.gemms if cm.prices_gemm_calls else None
        compute = cm.slowest(
            cm.expert_forward_time(tokens_ZW, shape, gemm_calls) + cm.elementwise_time(tokens_ZW, shape)
        )
        return compute, cm.a2a_from_busiest(busiest, latency, sends)

    def _priced_maxima(self, most, busiest, latency, sends) -> tuple[np.ndarray, np.ndarray]:
        """(forward expert compute of the slowest device, one exchange) from the dispatch's maxima
        (most tokens, busiest link time, slowest route used, whether it sends), by the NumPy path's
        own `CostModel` calls."""
        cm, shape = self.cm, self.shape
        compute = cm.expert_forward_time(most, shape, None) + cm.elementwise_time(most, shape)
        return compute, cm.a2a_from_busiest(busiest, latency, sends)

    def _compiled_copies(self, owner_Q, new_QW, prev_QW, start):
        """`_copies` from the compiled running sums (`compiled_copies.copy_terms`): the same maxima
        as the NumPy path, priced by the same calls."""
        new_QW, prev_QW = np.ascontiguousarray(new_QW), np.ascontiguousarray(prev_QW)
        topo = self.topology
        layout = _tree_layout(None if topo.node_of is None else tuple(topo.node_of))
        args = (*layout, topo.route_tables, float(self.param_bytes), self.inv_bw_L, topo.latency_classes)
        keep = kept_rows(start)
        busiest, latency, active, after, before, copies = compiled_copies.copy_terms(
            new_QW, prev_QW, owner_Q, start, keep, False, *args
        )
        terms = [(busiest[s], latency[s], active[s]) for s in (0, 1)]
        tables = self._owner_price_tables()
        every_trans, every_agg = (compiled_copies.owner_price_sums(after, before, start, t) for t in tables)
        trees = pipelined_trees(*terms, 1)  # the prefetch sends each stage whole (`strategies.prefetch`)
        trans, agg = every_trans + trees, every_agg + trees
        chunks = self.cm.copy_chunks
        if self.tree:  # as `materialize` sends them: everything through the trees, at once
            full = compiled_copies.copy_terms(new_QW, prev_QW, owner_Q, start, keep, True, *args)
            every = pipelined_trees(*[(full[0][s], full[1][s], full[2][s]) for s in (0, 1)], chunks)
            return every, every, trans, agg, copies
        if chunks == 1:
            return trans, agg, trans, agg, copies
        piped = pipelined_trees(*terms, chunks)
        return every_trans + piped, every_agg + piped, trans, agg, copies

    def _owner_price_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """The broadcast and the reduce of n experts' parameters, n = 0 .. the most experts an owner
        has (`CostModel.collective_table`, elementwise: each entry as `_everywhere` prices it), for the
        compiled sums (`compiled_copies.owner_price_sums`)."""
        if self._price_tables is None:
            most = int(np.bincount(self.owner, minlength=1).max())
            self._price_tables = tuple(
                self.cm.collective_table(k, self.param_bytes, most) for k in ("broadcast", "reduce")
            )
        return self._price_tables
