"""Today's planner loops, kept verbatim as the reference the vectorised planners are tested against.

Copied from the source tree at commit 5d57491 ("One mechanism per idea") before the planners were
restated over arrays: `core.placement.dispatch_counts`, `prophet_model.placement_times` and
`price_placement`, the shadow planner's `cost`/`decide`, Pro-Prophet's `prophet_search`, Hecate's
Algorithms 1-2, FSSDP's and EPLB's plans, `auto`'s `layer_terms`. Only the imports changed (the
functions call each other here) and the shadow planner's three methods sit in `ShadowReference`;
the cost model is the current one (its formulas are shared by both sides). `search_steps` came
later: Pro-Prophet's steps as NumPy ran them before `strategies/planners/prophet_steps.py` compiled
them, from the commit that replaced it.

Shape suffixes: W ranks, E experts, S source ranks, Z candidate shadow sets, L layers, N nodes.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np

from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import Placement, dispatch_entries
from moeflow.strategies.planners.auto import Terms
from moeflow.strategies.planners.base import PrefetchWindow
from moeflow.strategies.planners.fssdp import FSSDPDecision
from moeflow.strategies.planners.prophet import ProphetDecision, ProphetOptions
from moeflow.strategies.planners.prophet_model import Pricing, overlapped_copies, prophet_layer_times
from moeflow.strategies.planners.shadow import ShadowDecision


# ---- core/placement.py -------------------------------------------------------------------------
def dispatch_counts(flow_WE: np.ndarray, placement: Placement, node_of: Sequence[int] | None = None) -> np.ndarray:
    """Split every (source, expert) flow over the expert's holders → `plan_SEW` int64 `[W, E, W]`.

    Hecate §4.4 order: the source itself if it holds the expert; else the holders on the source's
    node, spread evenly; only if there are none, every holder, spread evenly. The remainder of an
    uneven split goes to the candidates that follow the source in ring order, so that remainders
    from different sources land on different holders.
    """
    flow = np.asarray(flow_WE, dtype=np.int64)
    world, num_experts = placement.world_size, placement.num_experts
    if flow.shape != (world, num_experts):
        raise ValueError(
            f"flow_WE shape {tuple(flow.shape)} does not match the placement's (W, E) = ({world}, {num_experts})"
        )
    holders_SEW = np.broadcast_to(placement.holders_EW[None, :, :], (world, num_experts, world))
    if placement.is_owners_only():
        plan = np.zeros((world, num_experts, world), dtype=np.int64)
        plan[:, np.arange(num_experts), placement.owner_E] = flow
        return plan

    node = np.zeros(world, dtype=np.int64) if node_of is None else np.asarray(node_of, dtype=np.int64)
    if node.shape != (world,):
        raise ValueError(f"node_of has {node.size} entries, expected one per rank ({world})")
    eye_SW = np.eye(world, dtype=bool)
    same_node_SW = node[:, None] == node[None, :]
    local_SE = placement.holders_EW.T  # [W, E]: source s holds e itself
    near_SEW = holders_SEW & same_node_SW[:, None, :]
    any_near_SE = near_SEW.any(-1)
    cand_SEW = np.where(
        local_SE[:, :, None],
        eye_SW[:, None, :],
        np.where(any_near_SE[:, :, None], near_SEW, holders_SEW),
    )

    # Rotate destinations so that index j means rank (s + j) mod W, split evenly, un-rotate.
    rot_SW = (np.arange(world)[:, None] + np.arange(world)[None, :]) % world
    cand_rot = np.take_along_axis(cand_SEW, rot_SW[:, None, :], axis=2)
    n_cand = cand_rot.sum(-1)
    base = flow // n_cand
    rem = flow % n_cand
    rank_among = np.cumsum(cand_rot, axis=-1) - 1
    share_rot = cand_rot * (base[:, :, None] + (rank_among < rem[:, :, None]))
    plan = np.zeros_like(share_rot)
    np.put_along_axis(plan, rot_SW[:, None, :], share_rot, axis=2)
    return plan.astype(np.int64)


# ---- strategies/planners/prophet_model.py -------------------------------------------------------
def placement_times(
    cost_model: Any,
    plan_SEW: np.ndarray,
    holders_EW: np.ndarray,
    owner_E: np.ndarray,
    shape: ExpertShape,
    prefetched: bool = False,
) -> dict[str, float]:
    """Eq. 6's terms for a dispatch plan ``plan_SEW`` (`core.placement.dispatch_counts`) and the
    placement it runs on, priced with the shared cost-model functions (module docstring): ``a2a``
    (the four exchanges), ``fec`` (one forward expert compute, slowest device), ``trans`` and
    ``agg`` (the sparse collectives' copies and gradient sums; ``prefetched``: as the block-wise
    prefetch sends them — one asynchronous broadcast / reduce per owner, never the two-stage tree)."""
    compute, a2a = cost_model.sync_step_times(plan_SEW.sum(1), plan_SEW.sum(0).T, shape)
    size = shape.param_bytes(cost_model.bytes_per_element)
    tree = False if prefetched else None
    trans = cost_model.copies_time(size, holders_EW, owner_E, "materialize", tree)
    agg = cost_model.copies_time(size, holders_EW, owner_E, "reduce", tree)
    return {"a2a": float(a2a), "fec": float(compute) / 3, "trans": trans, "agg": agg}


def price_placement(
    flow_WE: np.ndarray, placement: Placement, cost_model, shape: ExpertShape, pricing: Pricing, node_of=None
) -> float:
    """The predicted time (seconds, forward + backward) of one layer running `flow_WE` on
    `placement`: Eq. 6, or Eq. 8 with `pricing.overlap`."""
    plan_SEW = dispatch_counts(np.rint(flow_WE).astype(np.int64), placement, node_of)
    if pricing.model == "paper":
        recv_W = plan_SEW.sum((0, 1)) - np.einsum("ses->s", plan_SEW)  # tokens from other devices
        copies = int(placement.materialized_EW().sum())
        t = prophet_layer_times(cost_model, recv_W, plan_SEW.sum((0, 1)), copies, shape, pricing.nonmoe_forward_s)
        return float(t["overlapped" if pricing.overlap else "total"])
    t = placement_times(cost_model, plan_SEW, placement.holders_EW, placement.owner_E, shape, pricing.overlap)
    copies = (
        overlapped_copies(
            t["trans"], t["agg"], t["fec"], pricing.nonmoe_forward_s, pricing.hidden_share, pricing.experts_hide
        )
        if pricing.overlap
        else t["trans"] + t["agg"]
    )
    return t["a2a"] + 3 * t["fec"] + float(copies)


# ---- strategies/planners/shadow.py ----------------------------------------------------------------
class ShadowReference:
    """`ShadowPlanner.cost`, `_copies` and `decide` as they were."""

    def __init__(self, shape, options):
        self.shape = shape
        self.options = options
        self._copies_memo: dict[tuple, float] = {}

    def cost(self, flow_WE, owner_E, shadowed_ZE, cost_model) -> np.ndarray:
        """T(S) for boolean shadow masks `[..., E]` -> `[...]` seconds (module docstring)."""
        shadowed_ZE = np.asarray(shadowed_ZE, dtype=bool)
        world = flow_WE.shape[0]
        owner_onehot_EW = np.eye(world)[owner_E]
        # Tokens for a shadowed expert stay on their source; the rest go to the owner.
        to_owner_ZWE = np.where(shadowed_ZE[..., None, :], 0.0, flow_WE)
        local_ZWE = np.where(shadowed_ZE[..., None, :], flow_WE, 0.0)
        computed_ZWE = owner_onehot_EW.T * to_owner_ZWE.sum(-2)[..., None, :] + local_ZWE
        sent_ZWW = to_owner_ZWE @ owner_onehot_EW
        compute, a2a = cost_model.sync_step_times(sent_ZWW, computed_ZWE, self.shape)
        param_bytes = self.shape.param_bytes(cost_model.bytes_per_element)
        flat_ZE = shadowed_ZE.reshape(-1, shadowed_ZE.shape[-1])
        copies = np.array([self._copies(owner_E, m, param_bytes, cost_model) for m in flat_ZE])
        return compute + a2a + copies.reshape(shadowed_ZE.shape[:-1])

    def _copies(self, owner_E, shadowed_E, param_bytes, cost_model) -> float:
        """Parameters out in forward, gradients back in backward, as the sparse collectives run
        them. It depends only on how many experts each owner shadows: memoised per cost model."""
        world = cost_model.topology.num_devices
        key = (id(cost_model), param_bytes, np.bincount(owner_E[shadowed_E], minlength=world).tobytes())
        if key not in self._copies_memo:
            holders_EW = np.eye(world, dtype=bool)[owner_E] | shadowed_E[:, None]
            self._copies_memo[key] = cost_model.copies_time(
                param_bytes, holders_EW, owner_E, "materialize"
            ) + cost_model.copies_time(param_bytes, holders_EW, owner_E, "reduce")
        return self._copies_memo[key]

    def decide(self, flow_WE: np.ndarray, placement: Placement, cost_model) -> ShadowDecision:
        owner_E = placement.owner_E
        if cost_model.topology.num_devices != placement.world_size:
            raise ValueError(
                f"cost model has {cost_model.topology.num_devices} devices, the expert-parallel group "
                f"{placement.world_size}"
            )
        received_E = flow_WE.sum(0)  # column sums: tokens each expert receives from all senders
        order = [int(e) for e in np.argsort(-received_E, kind="stable") if received_E[e] > 0]
        candidates = order[: self.options.max_shadowed]
        # prefixes_ZE[i]: the first i candidates shadowed (row 0: plain EP).
        prefixes_ZE = np.zeros((len(candidates) + 1, flow_WE.shape[1]), dtype=bool)
        for i, e in enumerate(candidates):
            prefixes_ZE[i + 1 :, e] = True
        predicted = self.cost(flow_WE, owner_E, prefixes_ZE, cost_model)
        if self.options.search == "prefix":
            chosen = int(np.argmin(predicted))  # the first of equal minima: fewest copies
        else:
            worse = np.flatnonzero(np.diff(predicted) >= 0)  # Algorithm 1 stops at the first
            chosen = int(worse[0]) if worse.size else len(candidates)
        if predicted[chosen] > (1.0 - self.options.min_gain) * predicted[0]:
            chosen = 0  # not worth the model's error
        return ShadowDecision(candidates[:chosen], candidates, [float(t) for t in predicted])


# ---- strategies/planners/prophet.py -----------------------------------------------------------------
def prophet_search(
    flow_WE: np.ndarray,
    placement: Placement,
    cost_model,
    shape: ExpertShape,
    options: ProphetOptions | None = None,
) -> tuple[Placement, ProphetDecision]:
    """Algorithm 1 (module docstring) on `flow_WE` from the owners of `placement`."""
    options = options or ProphetOptions()
    flow = np.asarray(flow_WE, dtype=np.float64)
    owner_E, W = placement.owner_E, placement.world_size
    if cost_model.topology.num_devices != W:
        raise ValueError(f"cost model has {cost_model.topology.num_devices} devices, the expert-parallel group {W}")
    node_of = cost_model.topology.node_of
    base = Placement.owners_only(owner_E, W)

    pricing = options.pricing()

    def price(holders_EW: np.ndarray) -> float:
        return price_placement(flow, Placement(owner_E, holders_EW), cost_model, shape, pricing, node_of)

    def device_loads(holders_EW: np.ndarray) -> np.ndarray:
        plan_SEW = dispatch_counts(np.rint(flow).astype(np.int64), Placement(owner_E, holders_EW), node_of)
        return plan_SEW.sum(0)  # [E, W]: tokens each device computes for each expert

    holders = base.holders_EW.copy()
    predicted, steps, states = [price(holders)], [], [holders]
    threshold = options.balance_alpha * flow.sum() / flow.shape[1]
    while True:
        load_EW = device_loads(holders)
        H_W = load_EW.sum(0)
        if H_W.max() - H_W.min() < threshold:
            break  # Eq. 7: balanced
        candidate = _relief(flow, holders, load_EW, H_W, owner_E)
        if candidate is None:
            break  # no device can be relieved further
        expert, senders = candidate
        to = senders[: max(1, len(senders) - options.keep_out)]
        holders = holders.copy()
        holders[expert, to] = True
        steps.append((expert, to))
        predicted.append(price(holders))
        states.append(holders)
    accepted = int(np.argmin(predicted))  # the best prefix (first of equal minima: fewest copies)
    if predicted[accepted] > (1.0 - options.min_gain) * predicted[0]:
        accepted = 0  # not worth the model's error
    decision = ProphetDecision(steps, [float(t) for t in predicted], accepted, flow)
    return Placement(owner_E, states[accepted]), decision


def _relief(flow_WE, holders_EW, load_EW, H_W, owner_E) -> tuple[int, list[int]] | None:
    """The next step of the search: on the heaviest device that can still be relieved, its heaviest
    own expert that has senders without a copy, with those senders by descending tokens sent."""
    for device in np.argsort(-H_W, kind="stable"):
        for e in np.argsort(-load_EW[:, device], kind="stable"):
            if owner_E[e] != device or load_EW[e, device] <= 0:
                continue
            senders = np.argsort(-flow_WE[:, e], kind="stable")
            senders = [int(d) for d in senders if flow_WE[d, e] > 0 and not holders_EW[e, d]]
            if senders:
                return int(e), senders
    return None


# ---- strategies/planners/prophet.py: the steps before they were compiled ----------------------------
def search_steps(
    flow_WE: np.ndarray, tokens_WE: np.ndarray, owner_E: np.ndarray, node_of, options: ProphetOptions
) -> tuple[list[tuple[int, list[int]]], np.ndarray]:
    """Algorithm 1's steps: (expert, devices it is sent to) and the expert's holders after each.

    The NumPy version that `strategies/planners/prophet_steps.py` compiled (kept verbatim from
    `prophet._search_steps` before it called the kernel; only the name changed): the compiled steps
    are tested against it.

    The state is kept per expert and updated for the one expert a step changes: its computed tokens
    per device (the dispatch plan's column, `dispatch_entries`; the owner's alone until a step
    changes it), hence every device's load H; its load on its owner; whether it still has senders
    without a copy ("open"). A step takes the heaviest device that owns an open expert with load
    (ties: the lower device), and on it the heaviest such expert (ties: the lower id: each device's
    open experts in a heap) — what `_relief` of the loop version finds by scanning every device and
    expert. `tokens_WE`: the flow rounded to whole assignments (what the plan sends)."""
    W, E = tokens_WE.shape
    experts = np.arange(E)
    holders = np.zeros((E, W), dtype=bool)
    holders[experts, owner_E] = True
    waiting_WE = flow_WE > 0  # senders without a copy (a step reads its expert's column)
    waiting_WE[owner_E, experts] = False
    total_E = tokens_WE.sum(0).astype(np.int64)  # whole counts: exact
    H_W = np.bincount(owner_E, weights=total_E, minlength=W).astype(np.int64)  # every expert on its owner
    computed: dict[int, np.ndarray] = {}  # the experts a step changed: tokens each device computes of it
    at_owner = total_E.tolist()
    open_E = (waiting_WE.any(0) & (total_E > 0)).tolist()
    heaps: list[list[tuple[int, int]]] = [[] for _ in range(W)]
    for e in np.flatnonzero(open_E).tolist():
        heaps[owner_E[e]].append((-at_owner[e], e))
    for heap in heaps:
        heapq.heapify(heap)
    closed_W = np.array([0.0 if h else -np.inf for h in heaps])  # -inf: no open expert on the device
    open_devices = int(np.isfinite(closed_W).sum())
    threshold = options.balance_alpha * flow_WE.sum() / E
    steps = []
    while open_devices and H_W.max() - H_W.min() >= threshold:  # some device can be relieved; Eq. 7
        device = int((H_W + closed_W).argmax())
        _, e = heapq.heappop(heaps[device])
        waiting_now = waiting_WE[:, e].nonzero()[0]  # by rank
        senders = waiting_now[(-flow_WE[waiting_now, e]).argsort(kind="stable")]  # most tokens first
        to = senders[: max(1, senders.size - options.keep_out)]
        waiting = senders[to.size :]  # the senders still without a copy
        if waiting.size:  # the expert stays open: its holders and waiting senders are read again
            holders[e, to] = True
            waiting_WE[to, e] = False
        tokens_W = np.rint(flow_WE[:, e]).astype(np.int64)
        if waiting.size and (tokens_W[waiting] > 0).any():
            # Some senders still send it away: the plan's column for the new holders.
            _, _, dst, count = dispatch_entries(tokens_W[:, None], holders[[e]], node_of)
            column = np.bincount(dst, weights=count, minlength=W).astype(np.int64)
        else:  # every sender holds it: each computes its own
            column = tokens_W
        H_W += column
        if e in computed:
            H_W -= computed[e]
        else:
            H_W[owner_E[e]] -= total_E[e]
        computed[e] = column
        at_owner[e] = int(column[owner_E[e]])
        if waiting.size and at_owner[e] > 0:  # still open: back on its device's heap
            heapq.heappush(heaps[device], (-at_owner[e], e))
        elif not heaps[device]:
            closed_W[device] = -np.inf
            open_devices -= 1
        steps.append((e, to.tolist()))
    # Each step's expert's holders after it: its owner and every device an earlier step of it reached.
    rows = np.zeros((len(steps), W), dtype=bool)
    reached: dict[int, list[int]] = {}
    for j, (e, to) in enumerate(steps):
        reached.setdefault(e, [int(owner_E[e])]).extend(to)
        rows[j, reached[e]] = True
    return steps, rows


# ---- strategies/planners/hecate.py ---------------------------------------------------------------
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


# ---- strategies/planners/fssdp.py ----------------------------------------------------------------
def fssdp_plan(
    flow_WE: np.ndarray,
    placement: Placement,
    cost_model,
    shape: ExpertShape,
    overlap: int,
    memory: int,
    pricing: Pricing,
    min_gain: float,
) -> tuple[Placement, FSSDPDecision]:
    """Algorithm 1 on `flow_WE` with overlap degree t = `overlap` and memory m = `memory`, then the
    best-priced prefix of its copies, heaviest expert first (module docstring, deviation 1): none
    unless `min_gain` faster than the owners alone. Pure: runs on the planning thread."""
    flow = np.asarray(flow_WE, dtype=np.float64)
    world = placement.world_size
    load_E, node_of = flow.sum(0), cost_model.topology.node_of
    base = Placement.owners_only(placement.owner_E, world)
    holders = sparse_materialization(load_E, placement.owner_E, world, node_of, overlap, memory)
    copied = [e for e in np.argsort(-load_E, kind="stable") if holders[e].sum() > 1]
    candidates = [base]
    for k in range(1, len(copied) + 1):
        extra = np.zeros_like(holders)
        extra[copied[:k]] = holders[copied[:k]]
        candidates.append(base.with_holders(extra))
    predicted = [price_placement(flow, c, cost_model, shape, pricing, node_of) for c in candidates]
    best = int(np.argmin(predicted))
    if predicted[best] > (1.0 - min_gain) * predicted[0]:
        best = 0
    return candidates[best], FSSDPDecision(overlap, memory, predicted, best, load_E=load_E)


# ---- strategies/planners/eplb.py -----------------------------------------------------------------
def replicate_experts(load_E: np.ndarray, extra: int) -> list[int]:
    """EPLB's `replicate_experts`: the expert that gets each of `extra` copies, in order — each to the
    one with the largest load per copy so far (ties: lower id)."""
    load = np.asarray(load_E, dtype=np.float64)
    count = np.ones(load.size)
    order = []
    for _ in range(extra):
        e = int(np.argmax(load / count))
        order.append(e)
        count[e] += 1
    return order


def pack_copies(
    copies: Sequence[int], load_E: np.ndarray, owner_E: np.ndarray, world: int, slots: int, node_of=None
) -> list[tuple[int, int]]:
    """(expert, device) of each copy that fits, in `copies` order: each on the lightest node with a
    free slot and a device that does not hold the expert, then that node's lightest such device
    (EPLB's balanced packing of copies at load/count each, nodes first when there are several);
    device loads start from the owners' experts. Copies that fit nowhere are left out."""
    load = np.asarray(load_E, dtype=np.float64)
    owner = np.asarray(owner_E, dtype=np.int64)
    node_W = np.zeros(world, dtype=np.int64) if node_of is None else np.asarray(node_of, dtype=np.int64)
    count = np.bincount(np.asarray(list(copies), dtype=np.int64), minlength=load.size) + 1
    share = load / count  # each copy and the owner serve load / count
    holds = np.zeros((load.size, world), dtype=bool)
    holds[np.arange(load.size), owner] = True
    device_load = np.bincount(owner, weights=share, minlength=world)
    free = np.full(world, slots)
    placed = []
    for e in copies:
        open_W = ~holds[e] & (free > 0)
        if not open_W.any():
            continue
        nodes = np.unique(node_W[open_W])
        node_load = np.array([device_load[node_W == n].sum() for n in nodes])
        n = nodes[np.lexsort((nodes, node_load))[0]]
        devices = np.flatnonzero(open_W & (node_W == n))
        d = int(devices[np.lexsort((devices, device_load[devices]))[0]])
        holds[e, d], free[d] = True, free[d] - 1
        device_load[d] += share[e]
        placed.append((int(e), d))
    return placed


def eplb_plan(
    flow_WE: np.ndarray,
    placement: Placement,
    cost_model,
    shape: ExpertShape,
    redundant_slots: int,
    pricing: Pricing,
    min_gain: float,
) -> tuple[Placement, list[float]]:
    """EPLB's copies for `flow_WE` (`replicate_experts`, `pack_copies`) and the best-priced prefix
    of them (module docstring): none unless `min_gain` faster than the owners alone. Returns the
    placement and every prefix's predicted time. Pure: runs on the planning thread."""
    flow = np.asarray(flow_WE, dtype=np.float64)
    world, load_E = placement.world_size, flow.sum(0)
    node_of = cost_model.topology.node_of
    copies = replicate_experts(load_E, world * redundant_slots)
    placed = pack_copies(copies, load_E, placement.owner_E, world, redundant_slots, node_of)
    base = Placement.owners_only(placement.owner_E, world)
    candidates = [base]
    for e, d in placed:
        extra = candidates[-1].holders_EW.copy()
        extra[e, d] = True
        candidates.append(Placement(base.owner_E, extra))
    predicted_s = [price_placement(flow, c, cost_model, shape, pricing, node_of) for c in candidates]
    best = int(np.argmin(predicted_s))
    if predicted_s[best] > (1.0 - min_gain) * predicted_s[0]:
        best = 0
    return candidates[best], predicted_s


# ---- strategies/planners/auto.py -----------------------------------------------------------------
def layer_terms(
    flow_WE: np.ndarray,
    placement: Placement,
    cost_model,
    shape: ExpertShape,
    node_of=None,
    window: PrefetchWindow | None = None,
) -> Terms:
    """The terms of one forward + backward of `placement` on `flow_WE`; `window`: its copies were
    sent ahead by the prefetch, hidden as Eq. 8 with the measured window says."""
    plan_SEW = dispatch_counts(np.rint(flow_WE).astype(np.int64), placement, node_of)
    t = placement_times(cost_model, plan_SEW, placement.holders_EW, placement.owner_E, shape, window is not None)
    if window is None:
        return Terms(t["fec"], t["a2a"] / 2, t["trans"] + t["agg"], t["trans"])
    hidden = overlapped_copies(
        t["trans"], t["agg"], t["fec"], window.nonmoe_forward_s, window.hidden_share, window.experts_hide
    )
    return Terms(t["fec"], t["a2a"] / 2, float(hidden), 0.0)
