"""Hecate's two placement algorithms (FSSDP, §4.2-4.3) as pure functions of numbers.

`sparse_materialization` is Algorithm 1: from the shard owners P, an estimate of every expert's
load F, the overlap degree t (experts whose copies fit in the preceding non-MoE compute, Eq. 1:
``t = T_nonMoE · bw / expert_size``) and the memory m (copies one device has room for), the holders
P' ⊇ P of this iteration. With t ≤ m the t heaviest experts go everywhere; otherwise the W·m
slots are shared among the t heaviest in proportion to their loads, each expert's replicas spread
over nodes first (nodes without it, then those with more free slots), then over the devices of a
node (more free slots first).

`heterogeneous_sharding` is Algorithm 2: every R iterations all MoE layers are re-sharded at once
with the same number of slots per device (L·E/W), so a device may own any number of one layer's
experts (0 included) while memory stays balanced. The experts Algorithm 1 will not replicate (J',
all but each layer's top t) are placed first — layers with the heaviest such expert first, experts
heaviest first, each on the least-loaded node, then its least-loaded device (ties: fewer free
slots) — then the top-t experts fill the remaining slots (most free slots first, spreading them).

Both are greedy — each placement depends on the slots and loads the previous ones left — so they
run step by step, with heaps keyed as the algorithms order nodes and devices (O(log W) a step
instead of a scan of every device; the same choices, ties included, as the scans: tested).

Recorded readings of the pseudocode: a replica count n (Algorithm 1, line 12) counts copies beyond
the owner, at least 1 and at most W − 1, and never more than the free slots; a node's or device's
"load" in Algorithm 2 is the load placed on it so far *in the layer being placed* (each layer's
all-to-all is balanced on its own), while slots are shared by all layers.

Shape suffixes: E experts of one layer, L MoE layers, W devices, N nodes.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np


def _nodes(node_of: Sequence[int] | None, world: int) -> np.ndarray:
    node_W = np.zeros(world, dtype=np.int64) if node_of is None else np.asarray(node_of, dtype=np.int64)
    if node_W.shape != (world,):
        raise ValueError(f"node_of has {node_W.size} entries, expected one per device ({world})")
    return node_W


def overlap_degree(nonmoe_s: float, expert_copy_s: float, num_experts: int) -> int:
    """Eq. 1 of Hecate: how many experts' copies fit in `nonmoe_s` of dense compute when one takes
    `expert_copy_s` over the slowest link a copy crosses (inter-node where nodes are slower)."""
    if expert_copy_s <= 0:
        return num_experts
    return int(min(num_experts, np.floor(nonmoe_s / expert_copy_s)))


def replica_counts(load_E: np.ndarray, top_E: np.ndarray, total_slots: int, world: int) -> np.ndarray:
    """Algorithm 1, line 12 (assignSlotsByLoad): copies of each top expert in proportion to its
    share of the top experts' load, at least 1, at most W − 1 (module docstring)."""
    load = np.asarray(load_E, dtype=np.float64)[top_E]
    share = load / load.sum() if load.sum() > 0 else np.full(load.size, 1.0 / max(load.size, 1))
    return np.clip(np.floor(share * total_slots + 0.5).astype(np.int64), 1, world - 1)


def sparse_materialization(
    load_E: np.ndarray,
    owner_E: np.ndarray,
    world: int,
    node_of: Sequence[int] | None,
    overlap: int,
    memory: int,
) -> np.ndarray:
    """Algorithm 1 → holders_EW (bool `[E, W]`, the owners included); module docstring.

    `load_E`: tokens per expert (estimated); `overlap`: t; `memory`: m, copies per device.
    """
    load = np.asarray(load_E, dtype=np.float64)
    owner = np.asarray(owner_E, dtype=np.int64)
    num_experts = load.size
    node_W = _nodes(node_of, world)
    holders = np.zeros((num_experts, world), dtype=bool)
    holders[np.arange(num_experts), owner] = True
    t = int(min(max(overlap, 0), num_experts))
    m = int(min(max(memory, 0), t))
    if world == 1 or t == 0 or m == 0:
        return holders
    order = np.argsort(-load, kind="stable")
    top = order[:t][load[order[:t]] > 0]  # an expert nobody routes to needs no copy
    if t <= m:
        holders[top] = True
        return holders
    slots = _Slots(np.full(world, m, dtype=np.int64), node_W)
    for e, n in zip(top.tolist(), replica_counts(load, top, world * m, world).tolist()):
        holders[e, slots.replicas(int(owner[e]), n)] = True
    return holders


class _Slots:
    """Algorithm 1's free slots and the choice of the device that takes the next replica of an
    expert (`assignSlotsByLoad`'s placement): first a node that does not hold the expert yet, the
    one with the most free slots (ties: the lower node); once every node with room holds it, the
    node with the most free slots on devices without it; on the node, the device without it with
    the most free slots (ties: the lower device). Heaps keep nodes and devices by free slots, so a
    replica costs O(log W) plus the few holders of its expert, not a scan of every device."""

    def __init__(self, free_W: np.ndarray, node_W: np.ndarray) -> None:
        self.free = free_W.tolist()
        self.node = node_W.tolist()
        members: dict[int, list[int]] = {}
        for d, n in enumerate(self.node):
            members.setdefault(n, []).append(d)
        self.members = members
        self.node_free = {n: sum(self.free[d] for d in ds) for n, ds in members.items()}
        self.nodes = [(-f, n) for n, f in self.node_free.items() if f > 0]
        heapq.heapify(self.nodes)
        self.devices = {n: [(-self.free[d], d) for d in ds if self.free[d] > 0] for n, ds in members.items()}
        for heap in self.devices.values():
            heapq.heapify(heap)

    def replicas(self, owner: int, n: int) -> list[int]:
        """Slots for up to `n` replicas of an expert owned by `owner`: the devices that take them."""
        held, held_free = {owner}, {self.node[owner]: self.free[owner]}  # free slots on its holders, per node
        placed = []
        for _ in range(n):
            node = self._free_node(held_free)
            if node is None:
                # Every node with room holds the expert: the most free slots on devices without it.
                room = [(-(self.node_free[m] - f), m) for m, f in held_free.items() if self.node_free[m] > f]
                if not room:
                    break
                node = min(room)[1]
            d = self._free_device(node, held)
            self.free[d] -= 1
            self.node_free[node] -= 1
            if self.free[d]:
                heapq.heappush(self.devices[node], (-self.free[d], d))
            if self.node_free[node]:
                heapq.heappush(self.nodes, (-self.node_free[node], node))
            held.add(d)
            held_free[node] = held_free.get(node, 0) + self.free[d]
            placed.append(d)
        return placed

    def _free_node(self, held_nodes: dict[int, int]) -> int | None:
        """The node without the expert with the most free slots (entries of other counts are stale)."""
        skipped, found = [], None
        while self.nodes:
            neg, n = self.nodes[0]
            if -neg != self.node_free[n]:
                heapq.heappop(self.nodes)  # stale
            elif n in held_nodes:
                skipped.append(heapq.heappop(self.nodes))
            else:
                found = n
                break
        for entry in skipped:
            heapq.heappush(self.nodes, entry)
        return found

    def _free_device(self, node: int, held: set[int]) -> int:
        """The device of `node` without the expert with the most free slots."""
        heap, skipped = self.devices[node], []
        while True:
            neg, d = heapq.heappop(heap)
            if -neg != self.free[d]:
                continue  # stale
            if d in held:
                skipped.append((neg, d))
                continue
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return d


def heterogeneous_sharding(
    load_LE: np.ndarray, overlap: int, world: int, node_of: Sequence[int] | None = None
) -> np.ndarray:
    """Algorithm 2 → owner_LE (int64 `[L, E]`); module docstring. `load_LE`: tokens per expert and
    layer (estimated); `overlap`: t, the experts per layer that Algorithm 1 may replicate."""
    load = np.asarray(load_LE, dtype=np.float64)
    num_layers, num_experts = load.shape
    if (num_layers * num_experts) % world:
        raise ValueError(f"{num_layers} layers x {num_experts} experts do not fill {world} devices' slots equally")
    node_W = _nodes(node_of, world)
    slots = [num_layers * num_experts // world] * world
    owner = np.full((num_layers, num_experts), -1, dtype=np.int64)
    t = int(min(max(overlap, 0), num_experts))
    order_LE = np.argsort(-load, axis=1, kind="stable")
    top_LE = order_LE[:, :t]
    rest = [order_LE[layer, t:] for layer in range(num_layers)]  # J', heaviest first per layer

    # Underloaded experts first, the layer with the heaviest of them first.
    heaviest_L = np.array([load[layer, r].max() if r.size else -np.inf for layer, r in enumerate(rest)])
    for layer in np.argsort(-heaviest_L, kind="stable"):
        placing = _LeastLoaded(slots, node_W)
        for e in rest[layer].tolist():
            owner[layer, e] = placing.place(float(load[layer, e]))
    # The overlappable (top-t) experts fill what is left, spread over the freest devices.
    freest = [(-s, d) for d, s in enumerate(slots) if s > 0]
    heapq.heapify(freest)
    for layer in range(num_layers):
        for e in top_LE[layer].tolist():
            _, d = heapq.heappop(freest)
            owner[layer, e] = d
            slots[d] -= 1
            if slots[d]:
                heapq.heappush(freest, (-slots[d], d))
    return owner


class _LeastLoaded:
    """Algorithm 2's choice for one layer's underloaded experts (lines 12-13): the node with the
    least load placed on it so far in this layer (ties: fewer free slots, then the lower node), on
    it the device with the least load (ties: fewer free slots, then the lower device); only devices
    with a free slot (`slots`, shared by all layers, updated in place). Heaps keyed by those
    tuples; a placement changes one node's and one device's key."""

    def __init__(self, slots: list[int], node_W: np.ndarray) -> None:
        self.slots = slots
        self.node = node_W.tolist()
        self.placed = np.zeros(len(slots))
        members: dict[int, list[int]] = {}
        for d, n in enumerate(self.node):
            members.setdefault(n, []).append(d)
        self.members = {n: np.array(ds) for n, ds in members.items()}
        self.node_load = {n: 0.0 for n in members}
        self.node_slots = {n: sum(slots[d] for d in ds) for n, ds in members.items()}
        self.nodes = [(0.0, s, n) for n, s in self.node_slots.items() if s > 0]
        heapq.heapify(self.nodes)
        self.devices = {n: [(0.0, slots[d], d) for d in ds if slots[d] > 0] for n, ds in members.items()}
        for heap in self.devices.values():
            heapq.heapify(heap)

    def place(self, load: float) -> int:
        while True:  # the least-loaded node (stale entries skipped)
            node_load, node_slots, n = heapq.heappop(self.nodes)
            if node_load == self.node_load[n] and node_slots == self.node_slots[n]:
                break
        heap = self.devices[n]
        while True:
            placed, slots, d = heapq.heappop(heap)
            if placed == self.placed[d] and slots == self.slots[d]:
                break
        self.placed[d] += load
        self.slots[d] -= 1
        self.node_slots[n] -= 1
        # The node's load as the loop version sums it: over its devices, in rank order.
        self.node_load[n] = float(self.placed[self.members[n]].sum())
        if self.slots[d]:
            heapq.heappush(heap, (float(self.placed[d]), self.slots[d], d))
        if self.node_slots[n]:
            heapq.heappush(self.nodes, (self.node_load[n], self.node_slots[n], n))
        return d
