"""Prices of expert copies: the sparse collectives that materialize experts on extra holders and
reduce their gradients back (FasterMoE §4.1 shadowing, Hecate §3's sparse all-gather along §4.1's
topology-aware copy trees, Pro-Prophet's Trans). A part of `CostModel` (its base class), kept apart
because planners of three systems price placements with it.

It reads from the cost model: `topology`, `backend`, `copy_chunks`, `link_time`, `_latency`,
`collective_time` and `_copies_eta` (the calibration on the profile's `copies` fit, set in
`CostModel.__post_init__`).

The two stages of the trees run one after the other, or with `copy_chunks` c > 1 as the chunk
pipeline of `core.copy_rounds` runs them (Hecate §4.1: a relay forwards piece j while it receives
piece j + 1): c + 1 rounds, each the slower of its two stages' pieces (`pipelined_trees`).

Shape suffixes: E experts, W devices, L directed links (as `Topology` names them); ``...`` = any
leading batch dims.
"""

from __future__ import annotations

import numpy as np

from moeflow.core.placement import copies_by_tree, tree_edges, tree_flows, tree_stage_bytes


def check_copy_chunks(name: str, chunks) -> int:
    """`chunks` if it is an integer >= 1, else a one-line ValueError naming `name` and the value."""
    if isinstance(chunks, bool) or not isinstance(chunks, (int, np.integer)) or chunks < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {chunks!r}")
    return int(chunks)


def pipelined_trees(first: tuple, second: tuple, chunks: int) -> np.ndarray:
    """The copy trees' time from their stages' terms `(link time, latency, active)` (arrays of one
    shape, or floats): each stage whole, one after the other (c = 1: t₁ + l₁ + t₂ + l₂, an empty
    stage 0), or with both stages active and c = `chunks` > 1 the chunk pipeline of
    `core.copy_rounds` (Hecate §4.1) — stage 1's piece r beside stage 2's piece r − 1 in c + 1
    rounds: (t₁/c + l₁) + (c − 1)·max(t₁/c + l₁, t₂/c + l₂) + (t₂/c + l₂). A single stage is sent
    whole by the engine (nothing to overlap), so it is priced whole."""
    (t1, l1, a1), (t2, l2, a2) = first, second
    whole = np.where(a1, t1 + l1, 0.0) + np.where(a2, t2 + l2, 0.0)
    if chunks == 1:
        return whole
    piece1, piece2 = np.divide(t1, chunks) + l1, np.divide(t2, chunks) + l2
    return np.where(np.logical_and(a1, a2), piece1 + (chunks - 1) * np.maximum(piece1, piece2) + piece2, whole)


class CopiesPricing:
    """`materialize_time` and `copies_time` of `moeflow.perf.costmodel.CostModel`."""

    def materialize_time(
        self, param_bytes: float, holders_EW: np.ndarray, owner_E: np.ndarray, direct: bool = False
    ) -> np.ndarray:
        """Sparse all-gather (Hecate §3, §4.1) / Trans (Pro-Prophet) of partial replica sets along the
        copy trees as `core.sparse_collectives` builds them (`placement.copy_tree`): stage 1 from
        every owner to its node-mates and one relay per other node, stage 2 from the relays inside
        their nodes, every expert at once; each stage costs its busiest link plus its slowest route's
        latency. ``direct``: every copy straight from its owner in one stage (the block-wise prefetch).
        ``holders_EW`` bool ``[..., E, W]`` -> ``[...]`` seconds. The reduce back runs the same edges
        reversed: the same time on symmetric links."""
        node_of = None if direct else self.topology.node_of
        return self._stages_time(tree_stage_bytes(holders_EW, owner_E, node_of, param_bytes))

    def _stages_time(self, bytes_SWW: np.ndarray) -> np.ndarray:
        """The two stages, each its `_tree_stage_time` plus latency (0 if empty), one after the other
        or in `copy_chunks` pieces (`pipelined_trees`)."""
        terms = []
        for s in (0, 1):
            f = bytes_SWW[..., s, :, :]
            terms.append((self._tree_stage_time(f), self._latency(f), f.any(axis=(-2, -1))))
        return np.zeros(bytes_SWW.shape[:-3]) + pipelined_trees(*terms, self.copy_chunks)

    def copies_time(
        self,
        param_bytes: float,
        holders_EW: np.ndarray,
        owner_E: np.ndarray,
        direction: str = "materialize",
        tree: bool | None = None,
    ) -> float:
        """The sparse collectives as ``moeflow.core.sparse_collectives`` runs them, one direction
        (``"materialize"``: forward copies, ``"reduce"``: gradients back). Partial replica sets go
        along the copy trees (`materialize_time`; the gradients retrace them reversed). Experts held
        by *every* device: one broadcast / reduce per owner (FasterMoE Eq. 8: a pipelined ring carries
        the parameters once per link), or, where ``placement.copies_by_tree`` says so (gloo across
        nodes), through the same two stages as the partial sets' trees, all at once (the reduce runs
        the same links in reverse: equal time on symmetric links), with η when the profile has a
        ``copies`` fit: the link model calibrated on every owner copying at once, as the
        all-to-all's is on the uniform exchange (concurrent messages on a CPU backend reach less
        than the links' rates), applied to the bytes that cross others going the other way
        (`_tree_stage_time`). ``tree=False``: as the block-wise prefetch of ``strategies.prefetch``
        sends them — partial sets along their trees, experts held everywhere one broadcast / reduce
        per owner whatever the backend (launched asynchronously beside the trees), each stage whole
        (the prefetch has no chunk pipeline: `strategies.prefetch`); else the trees in
        `copy_chunks` pieces (`pipelined_trees`)."""
        if direction not in ("materialize", "reduce"):
            raise ValueError(f"direction={direction!r}: expected 'materialize' or 'reduce'")
        holders = np.asarray(holders_EW, dtype=bool)
        owner = np.asarray(owner_E, dtype=np.int64)
        W = holders.shape[1]
        owner_onehot_EW = np.eye(W, dtype=bool)[owner]
        everywhere_E = holders.all(axis=1) & (holders & ~owner_onehot_EW).any(axis=1)
        together = copies_by_tree(self.topology.node_of, self.backend) if tree is None else tree
        t = 0.0
        if not together:
            per_owner = np.bincount(owner[everywhere_E], minlength=W)
            t = float(self.everywhere_copies_time(param_bytes, per_owner, direction, False))
            holders = np.where(everywhere_E[:, None], owner_onehot_EW, holders)
        chunks = 1 if tree is False else self.copy_chunks
        return t + self._trees_time(param_bytes, holders, owner, chunks)

    def _trees_time(self, param_bytes: float, holders_EW: np.ndarray, owner_E: np.ndarray, chunks: int = 1) -> float:
        """`materialize_time` of one placement, from the trees' edges (no dense `[W, W]` flows), the
        messages in `chunks` pieces (`pipelined_trees`)."""
        return float(pipelined_trees(*self.tree_stage_terms(param_bytes, holders_EW, owner_E), chunks))

    def tree_stage_terms(self, param_bytes: float, holders_EW: np.ndarray, owner_E: np.ndarray) -> list[tuple]:
        """(link time, latency, active) of each stage of one placement's copy trees: its busiest link
        (`stage_time_from_traffic`) and its slowest route's latency, 0 where the stage is empty."""
        topo = self.topology
        _, src, dst, stage = tree_edges(holders_EW, owner_E, topo.node_of)
        terms = []
        for s in (0, 1):
            m = stage == s
            if not m.any():
                terms.append((0.0, 0.0, False))
                continue
            hops = topo.route_WWH[src[m], dst[m]].reshape(-1)  # link ids, padded with L
            traffic_L = np.bincount(hops, minlength=len(topo.links) + 1)[:-1] * float(param_bytes)
            latency = float(topo.path_latency_WW[src[m], dst[m]].max())
            terms.append((float(self.stage_time_from_traffic(traffic_L)), latency, True))
        return terms

    def everywhere_copies_time(
        self, param_bytes: float, per_owner_W: np.ndarray, direction: str, tree: bool
    ) -> np.ndarray:
        """The experts held by every device, ``per_owner_W[..., o]`` of them owned by o, moved as
        ``copies_time`` moves them (one broadcast / reduce per owner, or `broadcast_tree`'s two
        stages) -> ``[...]`` seconds."""
        per_owner = np.asarray(per_owner_W, dtype=np.int64)
        rows = per_owner.reshape(-1, per_owner.shape[-1])
        if tree:
            out = np.zeros(rows.shape[0])
            for r, counts in enumerate(rows):
                flows = [f for f in tree_flows(self.topology.node_of, counts * param_bytes) if f.any()]
                out[r] = sum(float(self._tree_stage_time(f) + self._latency(f)) for f in flows)
            return out.reshape(per_owner.shape[:-1])
        kind = "broadcast" if direction == "materialize" else "reduce"
        # Owners that hold as many experts everywhere cost the same: price each distinct count once.
        top = int(rows.max(initial=0))
        price_n = np.array([self.collective_time(kind, n * param_bytes) if n else 0.0 for n in range(top + 1)])
        R = rows.shape[0]
        index = (np.arange(R)[:, None] * (top + 1) + rows).reshape(-1)
        owners_Rn = np.bincount(index, minlength=R * (top + 1)).reshape(R, top + 1)  # owners per count
        return (owners_Rn[:, 1:] @ price_n[1:]).reshape(per_owner.shape[:-1])

    def _tree_stage_time(self, bytes_WW: np.ndarray) -> np.ndarray:
        """One stage of a tree (flows ``[..., W, W]`` -> ``[...]`` seconds): the link model with η on
        the bytes that cross bytes going the other way on the same link. η is calibrated on every
        owner copying at once, where every link carries as much each way; on the 2 × 1 testbed one
        expert crossing one way arrived at about the wire's speed (24–26 ms for 21 ms at 800 Mbit/s)
        and one crossing another going the other way at η's (42–43 ms, η = 1.96): the links are
        shaped per direction, the two directions' transfers share the hosts' cores
        (docs/performance.md). Without a ``copies`` fit η = 1: the plain link model."""
        return self.stage_time_from_traffic(self.topology.link_traffic(bytes_WW))

    @property
    def stage_on_busiest_link(self) -> bool:
        """Whether `stage_time_from_traffic` is the busiest link's bytes over its bandwidth (no
        calibration of pairs sending both ways): a search may then take that maximum itself."""
        return self._copies_eta == 1.0

    def stage_time_from_traffic(self, traffic_L: np.ndarray) -> np.ndarray:
        """`_tree_stage_time` of the bytes on every link ``[..., L]`` -> ``[...]`` seconds."""
        traffic_L = np.asarray(traffic_L, dtype=np.float64)
        if self._copies_eta == 1.0:
            return (traffic_L * self._inv_bw_L).max(axis=-1, initial=0.0)
        reverse_L = self.topology.reverse_L
        crossing_L = np.where(reverse_L >= 0, np.minimum(traffic_L, traffic_L[..., reverse_L]), 0.0)
        return ((traffic_L + (self._copies_eta - 1.0) * crossing_L) * self._inv_bw_L).max(axis=-1, initial=0.0)
