"""The compiled path of `perf.placement_pricing.PlacementPricer`: its terms from the numba kernels
on a whole flow (`perf.compiled_sums` for the dispatch, `perf.compiled_copies` for the copies),
priced by the same `CostModel` calls as the NumPy path, to the bit (tests/test_compiled_sums.py). A
base class of `PlacementCopies`, kept apart from the NumPy path it stands beside.

It reads from the pricer: `compiled`, `max_compute`, `cm`, `shape`, `topology`, `owner`, `W`,
`tok_bytes`, `param_bytes`, `inv_bw_L`, `tree`, the owners' state (`tokens0`, `traffic0`,
`classes0`, `_flow_EW`, `_node_W`, `_spread_by_holder`), `_price_tables`, `_known_copies` and
`_copies`.

Shape suffixes: W ranks, Q steps.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from moeflow.perf import compiled_copies, compiled_sums
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
        topo = self.topology
        most, busiest, latency, sends = compiled_sums.dispatch_terms(
            self._flow_EW,
            experts,
            np.ascontiguousarray(new_QW),
            prev_QW,
            start,
            self._earlier,
            self._node_W,
            topo.route_tables,
            self._spread_by_holder,
            float(self.tok_bytes),
            self.tokens0,
            self.traffic0,
            self.classes0,
            self.inv_bw_L,
            topo.latency_classes,
            kept_rows(start),
        )
        compute, a2a = self._priced_maxima(most, busiest, latency, sends)
        copies = self._known_copies(experts, new_QW) if int(start.sum()) == 1 else None
        if copies is None:
            copies = self._copies(experts, owner_Q, new_QW, prev_QW, start)
        trans, agg, trans_pf, agg_pf, n_copies = copies
        return PlacementTerms(compute, a2a, trans, agg, trans_pf, agg_pf, None, None, n_copies)

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
