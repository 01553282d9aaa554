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

Recorded readings of the pseudocode: a replica count n (Algorithm 1, line 12) counts copies beyond
the owner, at least 1 and at most W − 1, and never more than the free slots; a node's or device's
"load" in Algorithm 2 is the load placed on it so far *in the layer being placed* (each layer's
all-to-all is balanced on its own), while slots are shared by all layers.

Shape suffixes: E experts of one layer, L MoE layers, W devices, N nodes.
"""

from __future__ import annotations

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
    free_W = np.full(world, m, dtype=np.int64)
    for e, n in zip(top, replica_counts(load, top, world * m, world)):
        for _ in range(int(n)):
            d = _next_holder(holders[e], free_W, node_W)
            if d is None:
                break
            holders[e, d] = True
            free_W[d] -= 1
    return holders


def _next_holder(holds_W: np.ndarray, free_W: np.ndarray, node_W: np.ndarray) -> int | None:
    """The device that takes the next replica: on a node that does not hold the expert yet, then
    on the node with the most free slots; on it, the device with the most free slots."""
    open_W = ~holds_W & (free_W > 0)
    if not open_W.any():
        return None
    nodes = np.unique(node_W[open_W])
    node_holds = np.array([holds_W[node_W == n].any() for n in nodes])
    node_free = np.array([free_W[(node_W == n) & open_W].sum() for n in nodes])
    best = nodes[np.lexsort((nodes, -node_free, node_holds))[0]]
    devices = np.flatnonzero(open_W & (node_W == best))
    return int(devices[np.lexsort((devices, -free_W[devices]))[0]])


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
    slots_W = np.full(world, num_layers * num_experts // world, dtype=np.int64)
    owner = np.full((num_layers, num_experts), -1, dtype=np.int64)
    t = int(min(max(overlap, 0), num_experts))
    order_LE = np.argsort(-load, axis=1, kind="stable")
    top_LE = order_LE[:, :t]
    rest = [order_LE[layer, t:] for layer in range(num_layers)]  # J', heaviest first per layer

    # Underloaded experts first, the layer with the heaviest of them first.
    heaviest_L = np.array([load[layer, r].max() if r.size else -np.inf for layer, r in enumerate(rest)])
    for layer in np.argsort(-heaviest_L, kind="stable"):
        placed_W = np.zeros(world)
        for e in rest[layer]:
            d = _least_loaded(placed_W, slots_W, node_W)
            owner[layer, e] = d
            placed_W[d] += load[layer, e]
            slots_W[d] -= 1
    # The overlappable (top-t) experts fill what is left, spread over the freest devices.
    for layer in range(num_layers):
        for e in top_LE[layer]:
            d = int(np.lexsort((np.arange(world), -slots_W))[0])
            owner[layer, e] = d
            slots_W[d] -= 1
    return owner


def _least_loaded(placed_W: np.ndarray, slots_W: np.ndarray, node_W: np.ndarray) -> int:
    """Least-loaded node, then its least-loaded device; ties to fewer free slots (Algorithm 2,
    lines 12-13); only devices with a free slot."""
    open_W = slots_W > 0
    nodes = np.unique(node_W[open_W])
    node_load = np.array([placed_W[(node_W == n)].sum() for n in nodes])
    node_free = np.array([slots_W[(node_W == n) & open_W].sum() for n in nodes])
    best = nodes[np.lexsort((nodes, node_free, node_load))[0]]
    devices = np.flatnonzero(open_W & (node_W == best))
    return int(devices[np.lexsort((devices, slots_W[devices], placed_W[devices]))[0]])
