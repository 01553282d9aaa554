"""Prices of expert copies: the sparse collectives that materialize experts on extra holders and
reduce their gradients back (FasterMoE §4.1 shadowing, Hecate §3's sparse all-gather,
Pro-Prophet's Trans). A part of `CostModel` (its base class), kept apart because planners of three
systems price placements with it.

It reads from the cost model: `topology`, `backend`, `link_time`, `_latency`, `collective_time` and
`_copies_eta` (the calibration on the profile's `copies` fit, set in `CostModel.__post_init__`).

Shape suffixes: E experts, W devices; ``...`` = any leading batch dims.
"""

from __future__ import annotations

import numpy as np

from moeflow.core.placement import copies_by_tree, tree_flows


class CopiesPricing:
    """`materialize_time` and `copies_time` of `moeflow.perf.costmodel.CostModel`."""

    def materialize_time(self, param_bytes: float, holders_EW: np.ndarray, owner_E: np.ndarray) -> np.ndarray:
        """Sparse all-gather (Hecate §3) / Trans (Pro-Prophet) / shadow broadcast (FasterMoE §4.1):
        every non-owner holder of expert e receives ``param_bytes`` from its owner, all at once.
        ``holders_EW`` bool ``[..., E, W]`` -> ``[...]`` seconds. The reduce back is the same traffic
        reversed, priced by ``materialize_time`` on the transposed flow (symmetric links here)."""
        holders = np.asarray(holders_EW, dtype=bool)
        owner = np.asarray(owner_E, dtype=np.int64)
        W = self.topology.num_devices
        onehot_EW = np.zeros((owner.size, W))
        onehot_EW[np.arange(owner.size), owner] = 1.0
        extra = holders & ~onehot_EW.astype(bool)
        if not extra.any():  # no partial replica set: nothing travels point-to-point
            return np.zeros(extra.shape[:-2])
        flow_WW = np.einsum("eo,...ej->...oj", onehot_EW, extra.astype(np.float64)) * param_bytes
        t = self.link_time(flow_WW) + self._latency(flow_WW)
        return np.where(extra.any(axis=(-2, -1)), t, 0.0)

    def copies_time(
        self,
        param_bytes: float,
        holders_EW: np.ndarray,
        owner_E: np.ndarray,
        direction: str = "materialize",
        tree: bool | None = None,
    ) -> float:
        """The sparse collectives as ``moeflow.core.sparse_collectives`` runs them, one direction
        (``"materialize"``: forward copies, ``"reduce"``: gradients back). Experts held by *every*
        device move as one message per owner: one broadcast / reduce per owner (FasterMoE Eq. 8: a
        pipelined ring carries the parameters once per link), or, where ``placement.copies_by_tree``
        says so (gloo across nodes), the two stages of ``broadcast_tree`` for all owners at once
        (the reduce runs the same links in reverse: equal time on symmetric links), with η when
        the profile has a ``copies`` fit: the link model calibrated on every owner copying at once,
        as the all-to-all's is on the uniform exchange (concurrent messages on a CPU backend reach
        less than the links' rates), applied to the bytes that cross others going the other way
        (`_tree_stage_time`). Partial replica sets go point-to-point
        (``materialize_time``; the gradients retrace the same routes reversed). ``tree=False``: one
        broadcast / reduce per owner whatever the backend (the block-wise prefetch of
        ``strategies.prefetch`` launches them asynchronously: a two-stage tree would block in between)."""
        if direction not in ("materialize", "reduce"):
            raise ValueError(f"direction={direction!r}: expected 'materialize' or 'reduce'")
        holders = np.asarray(holders_EW, dtype=bool)
        owner = np.asarray(owner_E, dtype=np.int64)
        W = holders.shape[1]
        owner_onehot_EW = np.eye(W, dtype=bool)[owner]
        everywhere_E = holders.all(axis=1) & (holders & ~owner_onehot_EW).any(axis=1)
        per_owner = np.bincount(owner[everywhere_E], minlength=W)
        tree = copies_by_tree(self.topology.node_of, self.backend) if tree is None else tree
        t = float(self.everywhere_copies_time(param_bytes, per_owner, direction, tree))
        partial_EW = np.where(everywhere_E[:, None], owner_onehot_EW, holders)
        return float(t + self.materialize_time(param_bytes, partial_EW, owner))

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

    def _tree_stage_time(self, bytes_WW: np.ndarray) -> float:
        """One stage of the gloo tree: the link model with η on the bytes that cross bytes going the
        other way on the same link. η is calibrated on every owner copying at once, where every
        link carries as much each way; on the 2 × 1 testbed one expert crossing one way arrived at
        about the wire's speed (24–26 ms for 21 ms at 800 Mbit/s) and one crossing another going the
        other way at η's (42–43 ms, η = 1.96): the links are shaped per direction, the two
        directions' transfers share the hosts' cores (docs/performance.md)."""
        traffic_L = self.topology.link_traffic(bytes_WW)
        reverse_L = self.topology.reverse_L
        crossing_L = np.where(reverse_L >= 0, np.minimum(traffic_L, traffic_L[reverse_L]), 0.0)
        return float(((traffic_L + (self._copies_eta - 1.0) * crossing_L) * self._inv_bw_L).max())
