"""What a gate or balance term does to routing, as a simulation sees it (`moeflow simulate --gate
... --balance ...`).

A recorded trace holds the routing of the gate that produced it. A routing-changing component
(TA-MoE's loss, FasterMoE's topology-aware gate) would have produced another flow; its entry here
turns the traced flow into that one (expert choice and SoftMoE: a uniform flow, their balance by
construction), keyed by the component's own name on its axis (the same name
as in `moeflow.routing.GATES` / `BALANCES`). Components without an entry leave the trace as
recorded. Each entry is `effect(flow_ILWE, ctx, options) -> flow_ILWE`.

Shape suffixes: I iterations, L layers, W ranks, E experts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from moeflow.core.placement import plain_ep_owners
from moeflow.core.registry import LayerContext
from moeflow.routing.hierarchical import HierarchicalOptions, cross_node_ratios
from moeflow.routing.soft import SoftOptions
from moeflow.routing.ta_moe import TAMoEOptions
from moeflow.routing.topology_aware import flow_from_target, target_dispatch_pattern


def ta_moe_routing(flow_ILWE: np.ndarray, ctx: LayerContext, options: TAMoEOptions) -> np.ndarray:
    """TA-MoE (§4): every rank sends its S tokens' k choices in the target pattern ĉ that the loss
    (with steering) drives the gate to — the best case of the loss: dispatch exactly on target."""
    I, L, W, E = flow_ILWE.shape
    out = np.empty_like(flow_ILWE)
    targets: dict[int, np.ndarray] = {}
    for index in np.ndindex(I, L):
        tokens = int(flow_ILWE[index].sum() // (W * ctx.top_k))  # S: tokens per rank
        if tokens not in targets:
            targets[tokens] = target_dispatch_pattern(
                ctx.cost_model, E, ctx.top_k, max(tokens, 1), ctx.d_model, smoothing=options.smoothing
            )
        out[index] = flow_from_target(targets[tokens], tokens)
    return out


def hierarchical_routing(flow_ILWE: np.ndarray, ctx: LayerContext, options: HierarchicalOptions) -> np.ndarray:
    """FasterMoE §4.3's gate on a trace: rank w keeps at most `floor(ratio_w · k·S)` assignments to
    experts of other nodes; the excess is cut from each remote expert in proportion to its share and
    handed to the node's own experts in proportion to theirs (evenly when they had none) — the
    gate's "re-select within the local node", at the level of counts."""
    I, L, W, E = flow_ILWE.shape
    topology = ctx.cost_model.topology
    ratios = cross_node_ratios(topology) if options.cross_node_ratio is None else [options.cross_node_ratio] * W
    node = np.asarray(topology.node_of)
    owner_E = plain_ep_owners(E, W)
    out = flow_ILWE.astype(np.int64).copy()
    for w in range(W):
        if math.isinf(ratios[w]):
            continue
        local_E = node[owner_E] == node[w]
        row = out[:, :, w, :]  # view [I, L, E]
        remote = np.where(local_E, 0, row)
        total_remote = remote.sum(-1)
        limit = np.floor(ratios[w] * row.sum(-1)).astype(np.int64)
        excess = np.maximum(total_remote - limit, 0)
        if not excess.any():
            continue
        cut = _largest_remainder(remote, excess)
        local = np.where(local_E, row, 0)
        weights = np.where(local.sum(-1, keepdims=True) > 0, local, local_E.astype(np.int64))
        row -= cut
        row += _largest_remainder(weights, excess)
    return out


def _largest_remainder(weights_IE: np.ndarray, amount_I: np.ndarray) -> np.ndarray:
    """Integer shares of `amount` proportional to `weights` along the last axis, summing exactly."""
    weights = weights_IE.astype(np.float64)
    total = weights.sum(-1, keepdims=True)
    raw = np.where(total > 0, weights / np.where(total > 0, total, 1) * amount_I[..., None], 0.0)
    share = np.floor(raw).astype(np.int64)
    short = amount_I - share.sum(-1)
    order = np.argsort(-(raw - share), axis=-1, kind="stable")
    ranks = np.argsort(order, axis=-1, kind="stable")
    return share + (ranks < short[..., None])


def _uniform_flow(flow_ILWE: np.ndarray, rows_per_expert_IL: np.ndarray) -> np.ndarray:
    """Every rank sends every expert the same number of rows."""
    return np.broadcast_to(rows_per_expert_IL[..., None, None], flow_ILWE.shape).astype(np.int64)


def _tokens_per_rank_IL(flow_ILWE: np.ndarray, top_k: int) -> np.ndarray:
    """S: tokens per rank of each (iteration, layer), from the traced k·S assignments per rank."""
    W = flow_ILWE.shape[2]
    return flow_ILWE.sum(axis=(-1, -2)) // (W * top_k)


def expert_choice_routing(flow_ILWE: np.ndarray, ctx: LayerContext, options: None) -> np.ndarray:
    """Expert choice (Zhou et al. 2022): each expert takes C = min(S, ceil(c·k·S/E)) tokens of every
    rank, whatever the scores — the trace's skew disappears by construction (c = the context's
    capacity factor; the simulator models dropless layers, so c = 1 there)."""
    del options
    E = flow_ILWE.shape[-1]
    c = 1.0 if ctx.capacity_factor is None else ctx.capacity_factor
    tokens_IL = _tokens_per_rank_IL(flow_ILWE, ctx.top_k)
    return _uniform_flow(flow_ILWE, np.minimum(tokens_IL, np.ceil(c * ctx.top_k * tokens_IL / E)))


def soft_routing(flow_ILWE: np.ndarray, ctx: LayerContext, options: SoftOptions) -> np.ndarray:
    """SoftMoE: every rank sends each expert its `slots_per_expert` mixed slots, whatever the batch."""
    del ctx
    rows_IL = np.full(flow_ILWE.shape[:2], options.slots_per_expert, dtype=np.int64)
    return _uniform_flow(flow_ILWE, rows_IL)


def switch_routing(flow_ILWE: np.ndarray, ctx: LayerContext, options: None) -> np.ndarray:
    """Switch is top-1: only a top-1 trace replays through it (one choice of k cannot be recovered
    from a recorded count)."""
    del options
    if ctx.top_k != 1:
        raise ValueError(f"gate='switch' is top-1; the trace routes top_k={ctx.top_k} (replay a top-1 trace)")
    return flow_ILWE


EFFECTS: dict[str, Callable[[np.ndarray, LayerContext, Any], np.ndarray]] = {
    "ta_moe": ta_moe_routing,
    "hierarchical": hierarchical_routing,
    "expert_choice": expert_choice_routing,
    "soft": soft_routing,
    "switch": switch_routing,
}
"""Routing effects by component name (a `balance` or `gate` name)."""
