"""Where experts live: `Placement` (owner + holders) and the dispatch plan derived from it.

Every strategy in moeflow is a planner that returns a `Placement` (docs/architecture.md): plain expert
parallelism materializes each expert only on its owner; FasterMoE shadowing, Pro-Prophet and
Hecate add holders. The dispatch plan (`dispatch_counts`) then decides, for each source rank and
expert, how many assignments go to each holder — local first, then the same node, then remote,
spread evenly (Hecate §4.4). Both are pure functions of numbers: every rank computes the same
plan from the same global flow matrix, so no extra communication is needed. The plan's nonzero
entries (`dispatch_entries`) grow with the copies, not with W·E·W: the pricers use those entries;
the simulator the plan's sums (`dispatch_loads`) and the layer the dense plan of its few ranks
(`dispatch_counts`), both compiled (`core.dispatch_kernels`: one pass over the flow, no entries).

Shape suffixes: W ranks in the expert-parallel group (in a plan `[S, E, W]`: the destination), E experts,
S source rank, X any leading dims.
    owner_E     home rank of each expert (holds its optimizer state)
    holders_EW  True where expert e is materialized on rank w this iteration (owner included)
    flow_WE     assignments rank w sends to expert e (global, after the count exchange)
    plan_SEW    assignments source s sends for expert e to destination d
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from moeflow.core import dispatch_kernels
from moeflow.core.checks import positive_int


def plain_ep_owners(num_experts: int, world_size: int) -> np.ndarray:
    """owner_E of plain expert parallelism: rank r owns experts `[r·E/W, (r+1)·E/W)` (the one
    formula every planner, gate, balance term and simulator uses)."""
    positive_int("num_experts", num_experts)
    positive_int("world_size", world_size)
    if num_experts % world_size:
        raise ValueError(
            f"num_experts={num_experts} must be a positive multiple of the expert-parallel size {world_size}"
        )
    return np.arange(num_experts, dtype=np.int64) // (num_experts // world_size)


def owners_alone(owner_E: np.ndarray, world_size: int) -> np.ndarray:
    """bool `[E, W]`: every expert held by its owner alone — a new array, to add holders to before
    making a `Placement` of it (a placement's own holders are read-only)."""
    owner = np.asarray(owner_E, dtype=np.int64)
    holders = np.zeros((owner.size, world_size), dtype=bool)
    holders[np.arange(owner.size), owner] = True
    return holders


def send_by_owner(flow_WE: np.ndarray, owner_E: np.ndarray) -> np.ndarray:
    """Tokens `[..., W, W]` each rank sends to each rank when every expert is computed by its owner
    alone (plain EP): the flow summed over each rank's experts."""
    flow = np.asarray(flow_WE)
    owner = np.asarray(owner_E, dtype=np.int64)
    W = flow.shape[-2]
    E = owner.size
    if E and E % W == 0 and np.array_equal(owner, np.arange(E) // (E // W)):  # plain EP: blocks of columns
        return flow.reshape(*flow.shape[:-1], W, E // W).sum(-1)
    order = np.argsort(owner, kind="stable")
    per_owner = np.bincount(owner, minlength=W)
    dtype = np.int64 if flow.dtype == bool else flow.dtype  # a mask's entries are counted
    send = np.zeros((*flow.shape[:-1], W), dtype=dtype)
    if owner.size:  # each owner's experts summed as one run of columns (exact sums)
        owning = np.flatnonzero(per_owner)
        starts = (np.cumsum(per_owner) - per_owner)[owning]
        send[..., owning] = np.add.reduceat(flow[..., order], starts, axis=-1, dtype=dtype)
    return send


def cross_node_share(send_WW: np.ndarray, node_of: Sequence[int] | None) -> float:
    """Share of the rank-to-rank traffic `send_WW[src, dst]` (tokens, or a pattern such as TA-MoE's
    target) that crosses nodes; 0.0 without a node layout or without traffic. What the layer reports
    as `stats.cross_node_share` (its dispatch plan); for a flow under plain EP use `send_by_owner`."""
    send = np.asarray(send_WW, dtype=np.float64)
    total = send.sum()
    if node_of is None or total == 0:
        return 0.0
    node_W = np.asarray(node_of)
    if send.shape != (node_W.size, node_W.size):
        raise ValueError(f"send_WW shape {send.shape}: expected one row and column per rank of node_of={list(node_of)}")
    return float(send[node_W[:, None] != node_W[None, :]].sum() / total)


@dataclass(frozen=True, eq=False)
class Placement:
    """Owner of every expert plus the ranks where each expert is materialized this iteration."""

    owner_E: np.ndarray
    """Home rank of each expert, int64 `[E]`; it holds the master weights and optimizer state."""
    holders_EW: np.ndarray
    """bool `[E, W]`: where each expert is materialized; always includes the owner."""

    def __post_init__(self) -> None:
        owner = np.asarray(self.owner_E, dtype=np.int64)
        holders = np.array(self.holders_EW, dtype=bool)  # its own, read-only: what is kept of it stays true
        if owner.ndim != 1 or holders.ndim != 2 or holders.shape[0] != owner.shape[0]:
            raise ValueError(
                f"Placement: owner_E must be [E] and holders_EW [E, W]; got owner_E shape "
                f"{tuple(owner.shape)} and holders_EW shape {tuple(holders.shape)}"
            )
        world = holders.shape[1]
        if owner.size and (owner.min() < 0 or owner.max() >= world):
            raise ValueError(f"Placement: owner_E={owner.tolist()} has ranks outside [0, {world})")
        missing = np.flatnonzero(~holders[np.arange(owner.size), owner])
        if missing.size:
            raise ValueError(f"Placement: experts {missing.tolist()} are not held by their owner")
        holders.flags.writeable = False
        object.__setattr__(self, "owner_E", owner)
        object.__setattr__(self, "holders_EW", holders)

    @property
    def num_experts(self) -> int:
        return int(self.owner_E.shape[0])

    @property
    def world_size(self) -> int:
        return int(self.holders_EW.shape[1])

    @classmethod
    def expert_parallel(cls, num_experts: int, world_size: int) -> Placement:
        """Plain EP: rank r owns experts [r·E_local, (r+1)·E_local) and holds nothing else."""
        return cls.owners_only(plain_ep_owners(num_experts, world_size), world_size)

    @classmethod
    def owners_only(cls, owner_E: np.ndarray, world_size: int) -> Placement:
        return cls(np.asarray(owner_E, dtype=np.int64), owners_alone(owner_E, world_size))

    def with_holders(self, extra_EW: np.ndarray) -> Placement:
        """The same owners with additional materializations (e.g. shadowed experts)."""
        return Placement(self.owner_E, self.holders_EW | np.asarray(extra_EW, dtype=bool))

    def materialized_EW(self) -> np.ndarray:
        """bool `[E, W]`: copies that are not the owner's, i.e. what `materialize` must send."""
        extra = self.holders_EW.copy()
        extra[np.arange(self.num_experts), self.owner_E] = False
        return extra

    @classmethod
    def held_everywhere(cls, owner_E: np.ndarray, world_size: int, experts: Sequence[int]) -> Placement:
        """The owners, and `experts` held by every rank (FasterMoE's shadows)."""
        holders = owners_alone(owner_E, world_size)
        holders[list(experts)] = True
        placement = cls(np.asarray(owner_E, dtype=np.int64), holders)
        if world_size > 1:  # `copied_E` known: no pass over the holders to find it
            placement.__dict__["copied_E"] = np.unique(np.asarray(experts, dtype=np.int64))
        return placement

    def __getstate__(self) -> dict:
        """Copies and checkpoints carry the owners and holders (and `copied_E`), not the memo."""
        return {k: v for k, v in self.__dict__.items() if k != "memo"}

    @cached_property
    def memo(self) -> dict:
        """What other layers derive from this placement alone and keep (its holders are not changed
        once it is made): the placement pricer's steps and copies (`perf.placement_compiled`)."""
        return {}

    @cached_property
    def copied_E(self) -> np.ndarray:
        """The experts held by any rank besides their owner, ascending (kept: a placement's holders
        are not changed once it is made)."""
        if self.is_owners_only():
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(np.count_nonzero(self.holders_EW, axis=1) > 1)

    def is_owners_only(self) -> bool:
        # Every owner holds its expert (checked on construction): owners only = one holder each.
        return int(np.count_nonzero(self.holders_EW)) == self.num_experts

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Placement)
            and np.array_equal(self.owner_E, other.owner_E)
            and np.array_equal(self.holders_EW, other.holders_EW)
        )

    def __repr__(self) -> str:
        extra = int(self.materialized_EW().sum())
        return f"Placement(E={self.num_experts}, W={self.world_size}, extra_copies={extra})"


def dispatch_entries(
    flow_WK: np.ndarray, holders_KW: np.ndarray, node_of: Sequence[int] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The dispatch of K experts, each with its own holders: `flow_WK[s, k]` assignments source s
    sends to the expert of column k, held where `holders_KW[k]` says → the plan's nonzero entries
    as four int64 arrays `(k, src, dst, count)`.

    Hecate §4.4 order (`dispatch_counts`): the source itself if it holds the expert; else the
    holders on the source's node, spread evenly; only if there are none, every holder. The
    remainder of an uneven split goes to the candidates that follow the source in ring order. Every
    candidate set is a run of holders sorted by rank, so a source's place in the ring is one binary
    search, and each (source, expert) pair expands into as many entries as it has candidates: the
    work grows with the entries, never with W·E·W. Counts keep the flow's dtype; a split over several
    candidates needs integer counts (a fractional count goes whole to a single candidate or holder).
    """
    flow = np.asarray(flow_WK)
    holders = np.asarray(holders_KW, dtype=bool)
    W, K = flow.shape
    node = np.zeros(W, dtype=np.int64) if node_of is None else np.asarray(node_of, dtype=np.int64)
    if node.shape != (W,):
        raise ValueError(f"node_of has {node.size} entries, expected one per rank ({W})")
    # One pass over the flow and one over the holders; the rest reads their nonzero entries.
    src, k = np.nonzero(flow > 0)
    held = holders[k, src]
    local_s, local_k = src[held], k[held]
    src, k = src[~held], k[~held]
    local = (local_k, local_s, local_s, flow[local_s, local_k])
    if src.size == 0:
        return local
    all_k, all_w = np.nonzero(holders)  # every expert's holders by rank, expert after expert
    count_K = np.bincount(all_k, minlength=K)
    if not count_K[k].all():
        raise ValueError(f"dispatch: experts {sorted(set(k[count_K[k] == 0].tolist()))} have tokens and no holder")
    # An expert with one holder takes every other source's tokens whole.
    single = count_K[k] == 1
    sole_K = np.zeros(K, dtype=np.int64)
    sole_K[count_K > 0] = all_w[(np.cumsum(count_K) - count_K)[count_K > 0]]  # its lowest holder
    remote = (k[single], src[single], sole_K[k[single]], flow[src[single], k[single]])
    src, k = src[~single], k[~single]
    if src.size == 0:
        return tuple(np.concatenate([a, b]) for a, b in zip(local, remote))
    # Candidate runs of the experts with several holders: every holder of k sorted by rank (segment
    # k), then those of k on node n (segment K + k·N + n); `key` orders the members of every run,
    # the runs one after the other.
    N = int(node.max()) + 1
    several = count_K[all_k] > 1
    hold_k, hold_w = all_k[several], all_w[several]
    near = np.lexsort((hold_w, node[hold_w], hold_k))
    members = np.concatenate([hold_w, hold_w[near]])
    segment = np.concatenate([hold_k, K + hold_k[near] * N + node[hold_w[near]]])
    key = segment * W + members
    near_n = np.bincount(hold_k * N + node[hold_w], minlength=K * N)[k * N + node[src]]
    seg = np.where(near_n > 0, K + k * N + node[src], k)
    n = np.where(near_n > 0, near_n, count_K[k])
    start = np.searchsorted(key, seg * W)
    first = np.searchsorted(key, seg * W + src) - start  # candidates before the source: its ring start
    # A pair's split: `f // n` to each candidate and one more to the `f % n` that follow the source
    # in ring order; one candidate takes the count as it is. Only the candidates that get something
    # are expanded: all n when f >= n, else the first ceil(f) in ring order.
    f = flow[src, k]
    one = n == 1
    base = np.where(one, f, f // n)
    rem = np.where(one, 0, f % n)
    expand = np.where(one | (base > 0), n, np.ceil(rem).astype(np.int64))
    pair = np.repeat(np.arange(src.size), expand)
    t = np.arange(pair.size) - np.repeat(np.cumsum(expand) - expand, expand)  # place after the ring start
    m = first[pair] + t
    m -= np.where(m >= n[pair], n[pair], 0)  # place in the run
    spread = (k[pair], src[pair], members[start[pair] + m], base[pair] + (t < rem[pair]))
    return tuple(np.concatenate(parts) for parts in zip(local, remote, spread))


def _check_flow(flow_WE: np.ndarray, placement: Placement) -> np.ndarray:
    flow = np.asarray(flow_WE, dtype=np.int64)
    world, num_experts = placement.world_size, placement.num_experts
    if flow.shape != (world, num_experts):
        raise ValueError(
            f"flow_WE shape {tuple(flow.shape)} does not match the placement's (W, E) = ({world}, {num_experts})"
        )
    return flow


def _node_indices(node_of: Sequence[int] | None, world: int) -> tuple[np.ndarray, int]:
    """Each rank's node as a dense index `[W]` int64 and the number of nodes (the kernels' scratch
    has one slot per node); the same check and error as `dispatch_entries`."""
    if node_of is None:
        return np.zeros(world, dtype=np.int64), 1
    node = np.asarray(node_of, dtype=np.int64)
    if node.shape != (world,):
        raise ValueError(f"node_of has {node.size} entries, expected one per rank ({world})")
    names, index = np.unique(node, return_inverse=True)
    return index.astype(np.int64).reshape(world), int(names.size)


def dispatch_counts(flow_WE: np.ndarray, placement: Placement, node_of: Sequence[int] | None = None) -> np.ndarray:
    """Split every (source, expert) flow over the expert's holders → `plan_SEW` int64 `[W, E, W]`
    (Hecate §4.4 order, `dispatch_entries`; compiled: `dispatch_kernels.plan`): what the layer's
    exchange runs."""
    flow = _check_flow(flow_WE, placement)
    world, num_experts = placement.world_size, placement.num_experts
    if placement.is_owners_only():
        plan = np.zeros((world, num_experts, world), dtype=np.int64)
        plan[:, np.arange(num_experts), placement.owner_E] = flow
        return plan
    node, nodes = _node_indices(node_of, world)
    holders, owner = np.ascontiguousarray(placement.holders_EW), np.ascontiguousarray(placement.owner_E)
    orphan = ~holders.any(1)  # only a placement changed after construction: the owner holds its expert
    if orphan.any() and (flow[:, orphan] > 0).any():
        fed = np.flatnonzero(orphan & (flow > 0).any(0))
        raise ValueError(f"dispatch: experts {fed.tolist()} have tokens and no holder")
    return dispatch_kernels.plan(np.ascontiguousarray(flow), holders, owner, node, nodes)


def dispatch_loads(
    flow_WE: np.ndarray, placement: Placement, node_of: Sequence[int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """What the dispatch plan sends and computes, without the plan: tokens rank s sends rank d
    `[W, W]` (the diagonal stays local) and tokens each rank computes per expert `[W, E]`
    (`dispatch_counts(...).sum(1)` and `.sum(0).T`; compiled: `dispatch_kernels.loads`, one pass
    over the flow instead of the plan's entries)."""
    flow = _check_flow(flow_WE, placement)
    world, num_experts = placement.world_size, placement.num_experts
    owner = placement.owner_E
    if not (placement.holders_EW.sum(1) > 1).any():  # no copies: plain EP's column sums
        computed = np.zeros((world, num_experts), dtype=np.int64)
        computed[owner, np.arange(num_experts)] = flow.sum(0)
        return send_by_owner(flow, owner), computed
    node, nodes = _node_indices(node_of, world)
    holders = np.ascontiguousarray(placement.holders_EW)
    return dispatch_kernels.loads(np.ascontiguousarray(flow), holders, np.ascontiguousarray(owner), node, nodes)


def copies_by_tree(node_of: Sequence[int] | None, backend: str) -> bool:
    """Whether copies of experts held everywhere travel `broadcast_tree` rather than one broadcast /
    reduce per owner: when the ranks span several nodes and the backend is gloo, whose broadcast
    sends the whole buffer from the root to every rank (on the 2 × 2 testbed it ran at half the
    inter-node link rate). NCCL's broadcast is already a pipelined ring that crosses each link once.
    """
    return backend == "gloo" and node_of is not None and len(set(node_of)) > 1


def broadcast_tree(owner: int, node_of: Sequence[int]) -> list[list[tuple[int, int]]]:
    """Routes of a two-level broadcast from `owner` to every rank: `copy_tree` to all the others.

    Each inter-node link carries the parameters once (FasterMoE Eq. 8's `2·r·size/W_net` assumes
    this; a flat broadcast that sends from the root to every rank — gloo's — puts them on the
    inter-node link once per remote rank)."""
    return copy_tree(owner, [r for r in range(len(node_of)) if r != owner], node_of)


def copy_tree(owner: int, holders: Sequence[int], node_of: Sequence[int] | None) -> list[list[tuple[int, int]]]:
    """Routes that copy an expert from `owner` to `holders` (other ranks, ascending): `[stage 1
    edges, stage 2 edges]`, each edge `(src, dst)` (Hecate §4.1's sparse all-gather as a
    topology-aware tree). A reduction to `owner` runs the same edges reversed, stages in reverse:
    holders sum into their node's relay, relays into the owner.

    Stage 1: the owner sends to the holders on its own node and to one *relay* among the holders of
    every other node, so each node is entered once whatever its number of holders. Stage 2: each
    relay forwards to its node's other holders. Without a node layout (`node_of` None) every edge is
    in stage 1: one message per holder, straight from the owner. The relay is the node's holder at
    the owner's local index shifted by the owner's node (modulo the node's holders): with every rank
    a holder (`broadcast_tree`) owners on different local indices use different relays, and two
    owners do not use one pair of ranks in opposite directions (gloo serves a pair's two directions
    poorly: on the 2 × 2 testbed, four owners took 174 ms with rail-aligned relays, 144 ms shifted;
    `benchmarks/shadow_copies.py`).
    """
    if node_of is None:
        return [[(owner, int(h)) for h in holders], []]
    members: dict[int, list[int]] = {}
    for h in holders:
        members.setdefault(int(node_of[h]), []).append(int(h))
    home = int(node_of[owner])
    local_index = [r for r in range(len(node_of)) if int(node_of[r]) == home].index(owner)
    first = [(owner, r) for r in members.pop(home, [])]
    second = []
    for ranks in members.values():
        relay = ranks[(local_index + home) % len(ranks)]
        first.append((owner, relay))
        second += [(relay, r) for r in ranks if r != relay]
    return [first, second]


def tree_edges(
    holders_KW: np.ndarray, owner_K: np.ndarray, node_of: Sequence[int] | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The edges of `copy_tree` for K holder sets at once, vectorised: `holders_KW[k]` (the owner's
    column ignored) copied from `owner_K[k]` → int64 arrays `(k, src, dst, stage)`, stage 0 or 1.
    The same edges as `copy_tree` row by row (tested), for pricing placements by the thousand."""
    holders = np.asarray(holders_KW, dtype=bool)
    owner = np.asarray(owner_K, dtype=np.int64)
    K, W = holders.shape
    extra = holders.copy()
    extra[np.arange(K), owner] = False
    k, w = np.nonzero(extra)
    if node_of is None or k.size == 0:
        return k, owner[k], w, np.zeros(k.size, dtype=np.int64)
    node = np.asarray(node_of, dtype=np.int64)
    by_node = np.lexsort((np.arange(W), node))
    first_W = np.searchsorted(node[by_node], node)  # first position of each rank's node
    local_W = np.empty(W, dtype=np.int64)
    local_W[by_node] = np.arange(W) - first_W[by_node]  # index among its node's ranks
    remote = node[w] != node[owner[k]]
    rk, rw = k[remote], w[remote]
    key = rk * (int(node.max()) + 1) + node[rw]
    o = np.lexsort((rw, key))
    rk, rw, key = rk[o], rw[o], key[o]
    start = np.r_[True, key[1:] != key[:-1]] if key.size else np.zeros(0, dtype=bool)
    group = np.cumsum(start) - 1
    group_start = np.flatnonzero(start)
    count = np.diff(np.r_[group_start, key.size])[group]
    ow = owner[rk]
    relay_pos = (local_W[ow] + node[ow]) % count
    relay = rw[group_start[group] + relay_pos]
    is_relay = np.arange(key.size) - group_start[group] == relay_pos
    near = ~remote
    return (
        np.concatenate([k[near], rk[is_relay], rk[~is_relay]]),
        np.concatenate([owner[k[near]], ow[is_relay], relay[~is_relay]]),
        np.concatenate([w[near], rw[is_relay], rw[~is_relay]]),
        np.concatenate([np.zeros(near.sum() + is_relay.sum(), dtype=np.int64), np.ones((~is_relay).sum(), np.int64)]),
    )


def tree_stage_bytes(holders_XEW: np.ndarray, owner_E: np.ndarray, node_of, param_bytes: float) -> np.ndarray:
    """Bytes `[..., 2, W, W]` on each stage of the copy trees of placements `holders_XEW[..., E, W]`
    (one owner map): every edge of `tree_edges` carries one expert's `param_bytes`."""
    holders = np.asarray(holders_XEW, dtype=bool)
    lead, (E, W) = holders.shape[:-2], holders.shape[-2:]
    R = int(np.prod(lead, dtype=np.int64))
    k, src, dst, stage = tree_edges(holders.reshape(R * E, W), np.tile(np.asarray(owner_E), R), node_of)
    index = (((k // E) * 2 + stage) * W + src) * W + dst
    out = np.bincount(index, minlength=R * 2 * W * W).astype(np.float64) * param_bytes
    return out.reshape(*lead, 2, W, W)


def tree_flows(node_of: Sequence[int], bytes_per_owner_W: np.ndarray) -> list[np.ndarray]:
    """Bytes `[W, W]` on each stage of `broadcast_tree` when owner o sends `bytes_per_owner_W[o]` to
    every rank, all owners at once (the reduce runs the same edges reversed)."""
    W = len(node_of)
    flows = [np.zeros((W, W)), np.zeros((W, W))]
    for o in np.flatnonzero(bytes_per_owner_W):
        for flow, edges in zip(flows, broadcast_tree(int(o), node_of)):
            for src, dst in edges:
                flow[src, dst] += bytes_per_owner_W[o]
    return flows
