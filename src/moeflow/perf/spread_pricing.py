"""The tokens of the ranks that spread over every holder of an expert, summed per holder.

The dispatch plan (Hecate §4.4, `core.placement.dispatch_entries`) sends a rank's tokens to itself
if it holds the expert, else to the holders on its node, else — no holder on its node — evenly over
every holder, the remainder to the holders that follow it in ring order. Expanded, that last case
is an entry per (rank, holder): at 1024 ranks a search's states hold hundreds of thousands of them.
Where every node hangs from the root (`Topology.nodes_under_root`) such a rank's tokens all leave by
its own two links and reach each holder by the holder's two, on routes of one latency class, so the
placement pricer (`perf.placement_pricing`) needs only each holder's share — the same quotient from
every such rank plus one from each rank whose remainder reaches it, a cyclic window of the holder
list added as differences — and each rank's bytes out.

Shape suffixes: W ranks, F dispatched states (a search's Q steps after, then before), O states
split (not repeated, several holders), U states with one holder, L links.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class Spread:
    """Sources on a node without a holder, each spreading its tokens over every holder of its state
    (`dispatch_entries`' last case), summed instead of expanded into an entry per (source, holder):
    where every node hangs from the root (`Topology.nodes_under_root`), such a source's tokens all
    leave by its own link and its node's, and reach each holder by the holder's node's link and its
    own; a holder's share is the same quotient from every source plus one from each source whose
    remainder reaches it in ring order — a cyclic window of the holder list, added as differences."""

    def __init__(
        self,
        pricer: Any,
        flow_WF: np.ndarray,
        rows_FW: np.ndarray,
        alone_WF: np.ndarray,
        same_F: np.ndarray,
    ):
        """`same_F[F]`: a state with the same holders and sources alone as state F (F itself, or a
        step's state before it that an earlier step's state after it repeats), whose split is F's."""
        Q2, W = rows_FW.shape
        self.alone_WF = alone_WF
        hold_k, hold_w = np.nonzero(rows_FW)  # every state's holders by rank, state after state
        n_F = np.bincount(hold_k, minlength=Q2)
        offset_F = np.cumsum(n_F) - n_F
        computed_F = same_F == np.arange(Q2)
        # A state with one holder: it receives its sources' tokens whole.
        one = np.flatnonzero(computed_F & (n_F == 1))
        alone_WU = alone_WF[:, one]
        received = np.zeros(hold_k.size)
        received[offset_F[one]] = np.where(alone_WU, flow_WF[:, one].astype(np.int64), 0).sum(0)
        positive_F = np.zeros(Q2)
        positive_F[one] = alone_WU.sum(0)
        # The others, state by state (its sources by rank): boolean masks read them in order.
        own = np.flatnonzero(computed_F & (n_F > 1))
        alone_OW = np.ascontiguousarray(alone_WF[:, own].T)
        per_O = alone_OW.sum(1)
        k = np.repeat(own, per_O)
        f = np.ascontiguousarray(flow_WF[:, own].T)[alone_OW].astype(np.int64)  # whole assignments (a split needs them)
        n = np.repeat(n_F[own], per_O)
        # Holders below the source (a source alone holds none): its place in the ring of holders.
        first = np.cumsum(rows_FW[own], axis=1, dtype=np.int32)[alone_OW]
        base, rem = np.divmod(f, n)
        # Each source's remainder: one more on the cyclic window [first, first + rem) of its holders,
        # counted as +1 where the window starts and -1 past its end (twice where it wraps round; a
        # window of none starts and ends at one place).
        M = hold_k.size
        at = np.repeat(offset_F[own], per_O)
        stop = first + rem
        diff = np.bincount(at + first, minlength=M + 1) - np.bincount(at + np.minimum(stop, n), minlength=M + 1)
        wrap = np.flatnonzero(stop > n)
        diff += np.bincount(at[wrap], minlength=M + 1) - np.bincount(at[wrap] + stop[wrap] - n[wrap], minlength=M + 1)
        received += np.bincount(k, weights=base, minlength=Q2)[hold_k] + np.cumsum(diff)[:-1]
        positive_F += np.bincount(k, weights=np.minimum(n, f), minlength=Q2)  # holders reached
        # A repeated state's holders receive what those of the state it repeats receive (same order).
        self.received = received[offset_F[same_F][hold_k] + np.arange(M) - offset_F[hold_k]]
        self.hold_k, self.hold_w = hold_k, hold_w
        self.positive_F = positive_F[same_F]
        topo = pricer.topology
        # A source alone both before and after a step sends the same tokens out by the same two links:
        # its bytes out cancel (exactly, with whole counts); those of the others are kept.
        if pricer.max_exchange:
            Q = Q2 // 2
            both_WQ = alone_WF[:, :Q] & alone_WF[:, Q:]
            src, k = np.nonzero(alone_WF & ~np.concatenate([both_WQ, both_WQ], axis=1))
        else:
            src, k = np.nonzero(alone_WF)
        self.out_k, self.out_f = k, flow_WF[src, k].astype(np.int64)
        self.up, self.down = topo.leave_W2[src], topo.enter_W2[hold_w]  # the four links between two nodes
        self.cls = topo.cross_class
        self.L, self.N, self.Q = len(topo.links), pricer.N, Q2 // 2

    def _step_sign(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.where(k < self.Q, k, k - self.Q), np.where(k < self.Q, 1.0, -1.0)

    def traffic(self, Q: int, tok_bytes: float) -> np.ndarray:
        """Their bytes on every link `[Q, L]` (after the step minus before)."""
        step, sign = self._step_sign(self.out_k)
        hstep, hsign = self._step_sign(self.hold_k)
        index = np.concatenate(
            [(step[:, None] * (self.L + 1) + self.up).ravel(), (hstep[:, None] * (self.L + 1) + self.down).ravel()]
        )
        value = np.concatenate([np.repeat(sign * self.out_f, 2), np.repeat(hsign * self.received, 2)]) * tok_bytes
        return np.bincount(index, weights=value, minlength=Q * (self.L + 1)).reshape(Q, self.L + 1)[:, : self.L]

    def link_entries(self, tok_bytes: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`traffic` as (step, link, bytes) entries: a source's two links out, a holder's two links in."""
        step, sign = self._step_sign(self.out_k)
        hstep, hsign = self._step_sign(self.hold_k)
        link = np.concatenate([self.up.reshape(-1), self.down.reshape(-1)]).astype(np.int64)
        at = np.concatenate([np.repeat(step, 2), np.repeat(hstep, 2)])
        value = np.concatenate([np.repeat(sign * self.out_f, 2), np.repeat(hsign * self.received, 2)]) * tok_bytes
        keep = link < self.L
        return at[keep], link[keep], value[keep]

    def computed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(step, holder, tokens) each holder computes of them (after the step +, before it −)."""
        hstep, hsign = self._step_sign(self.hold_k)
        return hstep, self.hold_w, hsign * self.received

    def classes(self, Q: int) -> np.ndarray:
        """The change in positive (source, holder) counts per route latency `[Q, classes]`."""
        step, sign = self._step_sign(np.arange(2 * self.Q))
        return np.bincount(step * self.N + self.cls, weights=sign * self.positive_F, minlength=Q * self.N).reshape(
            Q, self.N
        )
