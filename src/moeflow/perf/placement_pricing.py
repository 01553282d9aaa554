"""Many placements of one flow priced at once, each a few experts away from the owners alone.

Every planner compares placements that differ from plain EP (owners only) in a handful of experts:
FasterMoE's shadow sets and Pro-Prophet's, Hecate's and EPLB's searches add one expert's copies per
step and price every prefix of their steps; `auto` prices the proposals of five planners. A
placement's price is made of the same terms everywhere (FasterMoE Eq. 7, Pro-Prophet Eq. 6): the
tokens every device computes, the token exchange's traffic on every link, and the copies out and
back (`CostModel.copies_time`). All are sums over experts, so a step that changes one expert changes
them by that expert's dispatch before and after (`core.placement.dispatch_entries`): the owners'
terms are computed once, each step's change once, and the candidates are the running sums of the
changes (a prefix) or the sum of one placement's changes — never the plan of a whole placement.
The maxima that make a price (the slowest device, the busiest link) are then taken per candidate.

Two parts of a price are not sums: the start-up latency of an exchange is the slowest route among
the pairs that exchange anything, and a copies broadcast costs per owner. A pair exchanges
something iff it has a positive count, so the latency is read from the number of positive (source,
expert, destination) counts on routes of each latency (integers: exact); the broadcasts are priced
per owner from the number of experts each owner has held everywhere. The copies' terms are
`perf.placement_copies` (this class's base).

At scale (1024 ranks x 1024 experts, a search of ~1000 steps): a step's sources whose candidates
it does not change are left out (their entries would cancel); where every node hangs from the root,
the sources that spread over every holder of an expert are summed per holder instead of expanded
per (source, holder) (`perf.spread_pricing`) — a state repeated (a step's state before it is an
earlier step's after it) is split once, a one-holder state takes its sources' tokens whole, and the
bytes out of a source that spreads before and after a step cancel — and the owners' link bytes are
summed per node; a prefix search keeps running maxima block by block of steps instead of every
prefix's `[Q + 1, X]` sums (`perf.prefix_max`: a price's slowest device and busiest link are maxima
of elementwise terms of exact sums), and stops where every later prefix's copies alone cost more
than the best priced one (`cheapest_prefixes`; the copies only as far as needed where they never
fall from one prefix to the next). Token counts and bytes are whole numbers in float64, so every
sum is exact in any order: prices equal the dense computation's to the bit, and a fractional flow
takes the dense path.

On a whole flow the sums and maxima above are numba kernels instead (`perf.placement_compiled` on
`perf.compiled_sums` and `perf.compiled_copies`: the
owners' terms, each step's dispatch and copy trees, in one call per search): the same floats, priced
by the same `CostModel` calls, without the few hundred NumPy calls per search whose overhead was most
of a planner's time at 64 ranks. The NumPy path stays for fractional flows, the per-device local
counts of `detail`, a cost model that counts GEMM launches or shares a host's cores, and `COMPILED`
off (tests/test_compiled_sums.py compares the two).

Shape suffixes: W ranks, E experts, L links (as `Topology` names them), Q steps (an expert and its
new holders), F dispatched states (each step's new holders, then its previous ones: 2·Q), Z
candidates, N nodes, X any; route-latency classes have no letter (`PlacementPricer.N` counts them).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import Placement, copies_by_tree, dispatch_entries, send_by_owner
from moeflow.perf import compiled_owners, compiled_sums
from moeflow.perf import prefix_max as running
from moeflow.perf.placement_copies import PlacementCopies
from moeflow.perf.placement_search import PlacementSearch
from moeflow.perf.placement_terms import PlacementTerms
from moeflow.perf.prefix_max import prefix_max_of_entries, running_sums
from moeflow.perf.spread_pricing import Spread


@lru_cache(maxsize=64)
def _node_layout(W: int, node_of: tuple | None) -> tuple:
    """(node of every rank as given, nodes numbered 0..N-1, N, the ranks node by node, where each
    node's ranks begin in that order): built once per layout, read by every pricer on it."""
    node_W = np.zeros(W, dtype=np.int64) if node_of is None else np.asarray(node_of, dtype=np.int64)
    _, numbered_W = np.unique(node_W, return_inverse=True)
    N = int(numbered_W.max()) + 1 if W else 1
    by_node = np.argsort(numbered_W, kind="stable")
    arrays = (node_W, numbered_W, by_node, np.searchsorted(numbered_W[by_node], np.arange(N)))
    for a in arrays:
        a.flags.writeable = False  # shared by every pricer on this layout
    return arrays[0], arrays[1], N, arrays[2], arrays[3]


class PlacementPricer(PlacementSearch, PlacementCopies):
    """The terms of placements on `flow_WE` (module docstring). Built once per flow: the owners'
    terms; then `prefixes` (every prefix of a list of steps) or `placements` (each its own)."""

    def __init__(
        self,
        flow_WE: np.ndarray,
        owner_E: np.ndarray,
        cost_model: Any,
        shape: ExpertShape,
        node_of: Any = None,
        whole: bool | None = None,
    ) -> None:
        """`whole`: the flow is whole counts (None: checked)."""
        self.flow = np.asarray(flow_WE)
        self.owner = np.asarray(owner_E, dtype=np.int64)
        self.cm, self.shape = cost_model, shape
        topo = self.topology = cost_model.topology
        self.node_of = node_of
        W, E = self.flow.shape
        if topo.num_devices != W:
            raise ValueError(f"cost model has {topo.num_devices} devices, the flow {W} ranks")
        self.W, self.E, self.L = W, E, len(topo.links)
        self.N = topo.latency_classes.size
        self.tok_bytes = shape.d_model * cost_model.bytes_per_element
        self.param_bytes = shape.param_bytes(cost_model.bytes_per_element)
        if whole is None:
            whole = self.flow.dtype.kind in "iub" or bool(np.array_equal(self.flow, np.rint(self.flow)))
        layout = _node_layout(W, None if node_of is None else tuple(node_of))
        self._node_of_W, self._node_W, self._N, self._by_node, self._node_start = layout
        # The owners alone; the running sums compiled (`perf.compiled_sums`) where every value summed
        # is a whole number.
        self.compiled = COMPILED and whole and W > 0
        if self.compiled:
            owners = compiled_owners.owner_sums(
                np.ascontiguousarray(self.flow), self.owner, topo.route_tables, self.L, self.N, float(self.tok_bytes)
            )
            self.tokens0, self.local0, self.calls0, self.traffic0, self.classes0, self._flow_EW, self.received_E = (
                owners
            )
        else:
            self._owners(whole)
        self.tree = copies_by_tree(topo.node_of, cost_model.backend)
        # Sources that spread over every holder are summed per holder where their nodes are the
        # topology's and hang from the root (`compiled_sums.dispatch_one`).
        self._spread_by_holder = bool(
            topo.nodes_under_root
            and node_of is not None
            and (node_of is topo.node_of or np.array_equal(self._node_of_W, topo.node_of))
        )
        self._price_tables: tuple | None = None
        """Each owner's broadcast and reduce of its experts held everywhere (`_owner_price_tables`)."""
        self._owners_alone: np.ndarray | None = None
        self._owners_maxima: tuple | None = None
        """The dispatch's maxima of the owners alone (`CompiledPricing._owners_row`)."""
        self._copies_of: tuple | None = None
        """(steps, holders, `_copies`) of the last prefix search's copies (`_prefix_copies`)."""
        self.inv_bw_L = cost_model.inv_bw_L
        # A prefix search keeps running maxima (`perf.prefix_max`) where a price is a maximum of per-device
        # or per-link terms of sums that are exact (whole counts and bytes: any order sums alike).
        self.max_compute = (
            whole and not cost_model.prices_gemm_calls and (cost_model.host_cores is None or cost_model.host_cores >= W)
        )
        self.max_exchange = whole
        self.max_stages = cost_model.stage_on_busiest_link and float(self.param_bytes).is_integer()

    def _owners(self, whole: bool) -> None:
        """The owners' terms in NumPy (a fractional flow, or with `COMPILED` off)."""
        topo, W, E = self.topology, self.W, self.E
        colsum_E = self.received_E = self.flow.sum(0)
        experts = np.arange(E)
        self.tokens0 = np.bincount(self.owner, weights=colsum_E, minlength=W)
        self.local0 = np.bincount(self.owner, weights=self.flow[self.owner, experts], minlength=W)
        self.calls0 = np.bincount(self.owner, weights=colsum_E > 0, minlength=W)
        # What the owners send: a rank's tokens to itself take no link (its route is empty), and are
        # left out of the positive entries that price the exchange's latency.
        send = send_by_owner(self.flow, self.owner)
        positive0 = send_by_owner(self.flow > 0, self.owner)
        positive0[np.arange(W), np.arange(W)] -= np.bincount(
            self.owner, weights=self.flow[self.owner, experts] > 0, minlength=W
        ).astype(positive0.dtype)
        by_node = W >= BY_NODE_FROM and topo.nodes_under_root and self.node_of is not None
        if by_node and np.array_equal(self._node_of_W, topo.node_of):
            self._owners_by_node(send * self.tok_bytes, positive0, whole)
        else:
            self.traffic0 = topo.link_traffic(send * self.tok_bytes)
            self.classes0 = np.bincount(
                topo.latency_class_WW.reshape(-1), weights=positive0.reshape(-1), minlength=self.N
            )

    def _owners_by_node(self, bytes_WW: np.ndarray, positive_WW: np.ndarray, whole: bool) -> None:
        """`traffic0` and `classes0` where every node hangs from the root (`Topology.nodes_under_root`):
        bytes between two nodes leave by their source's two links and enter by their destination's
        two, on a route of one latency class (`cross_class`), so only the pairs inside a node are
        routed one by one (W x ranks per node, not W x W). Sums of whole counts: exact in any order;
        a fractional flow is routed pair by pair (`Topology.link_traffic`)."""
        topo, W = self.topology, self.W
        ranks = self._by_node
        size = np.diff(np.append(self._node_start, W))
        node_of_rank = self._node_W[ranks]
        # Every ordered pair inside a node (the diagonal included): each rank with each of its node's.
        reps = size[node_of_rank]
        src = np.repeat(ranks, reps)
        offset = np.arange(src.size) - np.repeat(np.cumsum(reps) - reps, reps)
        dst = ranks[self._node_start[node_of_rank].repeat(reps) + offset]
        cls = topo.latency_class_WW[src, dst]
        positive = positive_WW[src, dst]
        self.classes0 = np.bincount(cls, weights=positive, minlength=self.N)
        self.classes0[topo.cross_class] += positive_WW.sum() - positive.sum()
        if not whole:
            self.traffic0 = topo.link_traffic(bytes_WW)
            return
        inside = bytes_WW[src, dst]
        out_W = bytes_WW.sum(1) - np.bincount(src, weights=inside, minlength=W)
        in_W = bytes_WW.sum(0) - np.bincount(dst, weights=inside, minlength=W)
        hops = topo.route_WWH[src, dst]
        L = self.L
        index = np.concatenate([topo.leave_W2.reshape(-1), topo.enter_W2.reshape(-1), hops.reshape(-1)])
        value = np.concatenate([np.repeat(out_W, 2), np.repeat(in_W, 2), np.repeat(inside, hops.shape[-1])])
        self.traffic0 = np.bincount(index, weights=value, minlength=L + 1)[:L]

    # ---- candidates ------------------------------------------------------------------------------
    def prefixes(self, experts_Q: np.ndarray, holders_QW: np.ndarray, detail: bool = False) -> PlacementTerms:
        """Candidate c = the owners with the first c steps applied (c = 0..Q): step j gives expert
        `experts_Q[j]` the holders `holders_QW[j]` (its owner included; a later step of the same
        expert replaces an earlier one)."""
        experts = np.asarray(experts_Q, dtype=np.int64)
        start = np.zeros(experts.size, dtype=bool)
        start[:1] = True
        return self._terms(experts, np.asarray(holders_QW, dtype=bool).reshape(experts.size, self.W), start, detail)

    def placements(self, holders_ZEW: list[np.ndarray], detail: bool = False) -> PlacementTerms:
        """Candidate c = the placement with holders `holders_ZEW[c]` (same owners)."""
        holders_ZEW = np.asarray(holders_ZEW, dtype=bool).reshape(-1, self.E, self.W)
        # Each candidate's steps: the experts held other than by their owner alone.
        z, experts = np.nonzero((holders_ZEW != self._owners_EW()).any(axis=2))
        return self._candidates(z, experts, holders_ZEW[z, experts], holders_ZEW.shape[0], detail)

    def of_placements(self, placements: list[Placement], detail: bool = False) -> PlacementTerms:
        """`placements` of `Placement`s with the pricer's owners: each one's steps are its
        `Placement.copied_E`. On the compiled sums each is priced alone, with what does not depend
        on the flow kept on it (`CompiledPricing._compiled_plans`: a plan that stands several calls
        pays only its dispatch on each new flow); its copies are then the floats `placements` gives
        it alone, which in company may differ in the last bit (running sums over the candidates)."""
        if any(p.owner_E is not self.owner and not np.array_equal(p.owner_E, self.owner) for p in placements):
            raise ValueError("of_placements: a placement has other owners than the pricer's")
        if self.compiled and not detail:
            return self._compiled_plans(placements)
        steps = [p.copied_E for p in placements]
        z = np.repeat(np.arange(len(placements)), [s.size for s in steps])
        experts = np.concatenate([np.zeros(0, dtype=np.int64), *steps])
        rows = np.concatenate(
            [np.zeros((0, self.W), dtype=bool), *(p.holders_EW[s] for p, s in zip(placements, steps))]
        )
        return self._candidates(z, experts, rows, len(placements), detail)

    def _candidates(self, z, experts, new_QW, Z: int, detail: bool) -> PlacementTerms:
        """Candidates `[Z]` from their steps in candidate order (step j: candidate `z[j]` gives
        `experts[j]` the holders `new_QW[j]`)."""
        steps = np.bincount(z, minlength=Z)
        start = np.ones(z.size, dtype=bool)
        start[1:] = z[1:] != z[:-1]
        terms = self._terms(experts, new_QW, start, detail)
        # Row 0 is the owners alone; a candidate's row is its last step's (or row 0: unchanged).
        pick = np.where(steps > 0, np.cumsum(steps), 0)
        fields = {f: getattr(terms, f) for f in PlacementTerms.__dataclass_fields__}
        return PlacementTerms(**{f: None if v is None else v[pick] for f, v in fields.items()})

    def _owners_EW(self) -> np.ndarray:
        """Every expert held by its owner alone `[E, W]` (made once per pricer)."""
        if self._owners_alone is None:
            self._owners_alone = Placement.owners_only(self.owner, self.W).holders_EW
        return self._owners_alone

    # ---- the work ------------------------------------------------------------------------------------
    def _terms(self, experts: np.ndarray, new_QW: np.ndarray, start: np.ndarray, detail: bool) -> PlacementTerms:
        W, Q = self.W, experts.size
        topo, cm, shape = self.topology, self.cm, self.shape
        owner_Q = self.owner[experts]
        prev_QW = self._previous(experts, owner_Q, new_QW, start)
        if self._compiled_terms(detail):
            return self._compiled(experts, owner_Q, new_QW, prev_QW, start)
        if self.compiled and not detail:  # a fitted GEMM launch or processor sharing: every device's rows
            return self._compiled_rows(experts, owner_Q, new_QW, prev_QW, start)
        # The dispatch of every step's expert after (state j) and before (state Q + j) the step, of
        # the sources whose candidates it changes (the others' entries would cancel out) — unless
        # the experts each device computes are counted (a fitted GEMM launch): then of all.
        flow_WQ = self.flow[:, experts]
        if not cm.prices_gemm_calls:
            flow_WQ = np.where(self._affected(new_QW, prev_QW).T, flow_WQ, 0)
        flow_WF, rows_FW = np.concatenate([flow_WQ, flow_WQ], axis=1), np.concatenate([new_QW, prev_QW])
        spread = self._spread(flow_WF, rows_FW, self._earlier) if topo.nodes_under_root else None
        if spread is not None:
            flow_WF = np.where(spread.alone_WF, 0, flow_WF)
        k, src, dst, count = dispatch_entries(flow_WF, rows_FW, self.node_of)
        step, sign = np.where(k < Q, k, k - Q), np.where(k < Q, 1.0, -1.0)
        # One candidate's prefixes (a search) keep running maxima; several candidates, the detail
        # of Eq. 1 or a price that is not a maximum of sums: every candidate's terms in full.
        prefix = not detail and int(start.sum()) == 1 and Q * max(W, self.L) >= running.RUNNING_MAX_FROM
        local = src == dst
        tokens = calls = local_Z = None
        if prefix and self.max_compute:
            entries = (step, dst, sign * count)
            if spread is not None:
                entries = tuple(np.concatenate(e) for e in zip(entries, spread.computed()))
            compute = prefix_max_of_entries(*entries, Q, self.tokens0, self._device_time, -np.inf)
        else:
            computed_FW = np.bincount(k * W + dst, weights=count, minlength=2 * Q * W).astype(np.float64, copy=False)
            computed_FW = computed_FW.reshape(2 * Q, W)
            if spread is not None:
                computed_FW += np.bincount(
                    spread.hold_k * W + spread.hold_w, weights=spread.received, minlength=2 * Q * W
                ).reshape(2 * Q, W)
            tokens = running_sums(computed_FW[:Q] - computed_FW[Q:], self.tokens0, start)
            if cm.prices_gemm_calls:  # experts with tokens per device: priced only with a fitted GEMM launch
                calls = running_sums((computed_FW[:Q] > 0).astype(np.int64) - (computed_FW[Q:] > 0), self.calls0, start)
            gemm_calls = None if calls is None else calls * shape.gemms
            compute = cm.slowest(cm.expert_forward_time(tokens, shape, gemm_calls) + cm.elementwise_time(tokens, shape))
        if detail:
            local_FW = np.bincount(k[local] * W + dst[local], weights=count[local], minlength=2 * Q * W)
            local_Z = running_sums(
                local_FW[: Q * W].reshape(Q, W) - local_FW[Q * W :].reshape(Q, W), self.local0, start
            )
        # The exchange: the remote entries' bytes on every link, and their count per route latency.
        remote = ~local
        step, sign, src, dst, count = step[remote], sign[remote], src[remote], dst[remote], count[remote]
        d_classes = self._per_class(Q, step, src, dst, sign)
        if spread is not None:
            d_classes += spread.classes(Q)
        classes = running_sums(d_classes, self.classes0, start)
        active = classes > 0.5  # positive entries per latency class (integer counts)
        latency = np.where(active, topo.latency_classes, 0.0).max(-1, initial=0.0)
        if prefix and self.max_exchange:
            entries = self._link_entries(step, src, dst, sign * count * self.tok_bytes)
            if spread is not None:
                entries = tuple(np.concatenate(e) for e in zip(entries, spread.link_entries(self.tok_bytes)))
            busiest = prefix_max_of_entries(*entries, Q, self.traffic0, self._link_time, 0.0)
            a2a = cm.a2a_from_busiest(busiest, latency, active.any(-1))
        else:
            d_traffic = self._on_links(Q, step, src, dst, sign * count * self.tok_bytes)
            if spread is not None:
                d_traffic += spread.traffic(Q, self.tok_bytes)
            traffic = running_sums(d_traffic, self.traffic0, start)
            a2a = cm.a2a_from_traffic(traffic, latency, active.any(-1))
        copies = self._known_copies(experts, new_QW) if int(start.sum()) == 1 else None
        if copies is None:
            copies = self._copies(experts, owner_Q, new_QW, prev_QW, start)
        trans, agg, trans_pf, agg_pf, n_copies = copies
        return PlacementTerms(compute, a2a, trans, agg, trans_pf, agg_pf, tokens, local_Z, n_copies)

    def _device_time(self, tokens: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """A device's forward expert time of `tokens` (elementwise: `CostModel.slowest` is then a max)."""
        return self.cm.expert_forward_time(tokens, self.shape) + self.cm.elementwise_time(tokens, self.shape)

    def _link_time(self, traffic: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Bytes on links `cols` over their bandwidth (`CostModel.link_time_from_traffic` before its max)."""
        return traffic * self.inv_bw_L[cols]

    def _spread(self, flow_WF: np.ndarray, rows_FW: np.ndarray, earlier_Q: np.ndarray) -> Spread | None:
        """The sources that spread over every holder of a state (their node holds none of them),
        summed instead of expanded (`perf.spread_pricing.Spread`); None when there are none. `earlier_Q[j]`: the step
        whose state after it is step j's before it (-1: none), computed once."""
        held_FN = self._per_node(rows_FW)
        alone_WF = ~held_FN[:, self._node_W].T & (flow_WF > 0)
        if not self.max_exchange:  # a fractional count goes whole to a single holder: `dispatch_entries`
            alone_WF &= rows_FW.sum(1) > 1
        if not alone_WF.any():
            return None
        Q = earlier_Q.size
        same_F = np.arange(2 * Q)
        same_F[Q:] = np.where(earlier_Q >= 0, earlier_Q, same_F[Q:])
        return Spread(self, flow_WF, rows_FW, alone_WF, same_F)

    def _affected(self, new_QW: np.ndarray, prev_QW: np.ndarray) -> np.ndarray:
        """`[Q, W]`: the sources whose dispatch candidates a step changes — those on a node whose
        holders it changes, or on a node with none before and after (they spread over every
        holder); a source on a node whose holders stay the same keeps its own or its node's."""
        if self._N == 1:
            return np.broadcast_to((new_QW != prev_QW).any(1)[:, None], new_QW.shape)
        changed_QN = self._per_node(new_QW != prev_QW)
        held_QN = self._per_node(new_QW | prev_QW)
        return (changed_QN | ~held_QN)[:, self._node_W]

    def _per_node(self, rows_XW: np.ndarray) -> np.ndarray:
        """`[X, N]`: whether any rank of each node is set in each row."""
        return np.logical_or.reduceat(rows_XW[:, self._by_node], self._node_start, axis=1)

    def _previous(self, experts: np.ndarray, owner_Q: np.ndarray, new_QW: np.ndarray, start: np.ndarray) -> np.ndarray:
        """Each step's expert's holders before it: its last earlier step's in the same candidate, or its owner."""
        Q = experts.size
        if self.compiled:
            prev, self._earlier = compiled_sums.previous_rows(
                experts, owner_Q, np.ascontiguousarray(new_QW), start, self.E
            )
            return prev
        prev = np.zeros((Q, self.W), dtype=bool)
        prev[np.arange(Q), owner_Q] = True
        self._earlier = np.full(Q, -1)  # the step whose holders `prev` repeats (-1: the owner's)
        candidate = np.cumsum(start)
        key = candidate * self.E + experts
        if np.unique(key).size < Q:  # an expert changed twice in one candidate
            order = np.lexsort((np.arange(Q), key))
            again = np.flatnonzero(key[order][1:] == key[order][:-1])
            prev[order[again + 1]] = new_QW[order[again]]
            self._earlier[order[again + 1]] = order[again]
        return prev

    def _link_entries(self, step: np.ndarray, src: np.ndarray, dst: np.ndarray, value: np.ndarray) -> tuple:
        """Bytes `value` from `src` to `dst` at each `step` as (step, link, bytes) on every hop of the route."""
        hops = self.topology.route_WWH[src, dst]  # [n, H], padded with L
        H, link = hops.shape[-1], hops.reshape(-1)
        keep = link < self.L
        return np.repeat(step, H)[keep], link[keep].astype(np.int64), np.repeat(value, H)[keep]

    def _on_links(self, Q: int, step: np.ndarray, src: np.ndarray, dst: np.ndarray, value: np.ndarray) -> np.ndarray:
        """Bytes `value` from `src` to `dst` at each `step`, summed on every link: `[Q, L]`."""
        hops = self.topology.route_WWH[src, dst]  # [n, H], padded with L
        index = step[:, None] * (self.L + 1) + hops
        sums = np.bincount(index.reshape(-1), weights=np.repeat(value, hops.shape[-1]), minlength=Q * (self.L + 1))
        sums = sums.astype(np.float64, copy=False)  # no entries: bincount counts in integers
        return sums.reshape(Q, self.L + 1)[:, : self.L]

    def _per_class(self, Q: int, step: np.ndarray, src: np.ndarray, dst: np.ndarray, sign: np.ndarray) -> np.ndarray:
        """The change in the number of positive entries on routes of each latency: `[Q, classes]`."""
        index = step * self.N + self.topology.latency_class_WW[src, dst]
        return np.bincount(index, weights=sign, minlength=Q * self.N).astype(np.float64, copy=False).reshape(Q, self.N)


COMPILED = True
"""Whether whole flows are priced by `perf.compiled_sums` (tests switch it off to compare the paths)."""
BY_NODE_FROM = 128
"""Ranks from which the owners' terms are summed per node (below, routing every pair costs less)."""
