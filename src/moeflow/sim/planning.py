"""What a planner decides over a replay, as the layer asks it (`moeflow simulate`'s first half).

Every (iteration, layer) the planner of the strategy is asked for a `Placement` on the flow the
layer plans on, and each rank's own tokens are dispatched under it (`core.placement.dispatch_loads`).
With data-parallel replicas of the experts (`sim.data_parallel`), the flow planned on is the mean of
the replicas' flows in whole tokens (as `MoELayer` all-reduces and rounds it, docs/parallel.md) and
every replica dispatches its own rows under the one placement; without replicas both are the
trace's flow.

The copies a placement asks for are priced here too (`copies_time_IL`): materialize in forward,
reduce-to-owner in backward (Hecate §3.1's spAG / spRS, as `core.sparse_collectives` runs them).

Shape suffixes: Z data-parallel replicas, I iterations, L layers, W ranks of the expert-parallel
group, E experts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from moeflow.core.placement import Placement, dispatch_loads, send_by_owner
from moeflow.perf.costmodel import CostModel
from moeflow.strategies.planners.base import PrefetchWindow, as_planner
from moeflow.strategies.planners.ep import EPPlanner
from moeflow.strategies.planners.fssdp import plan_resharding, resharding_time


class Plans(NamedTuple):
    """What a planner decided over a replay (`plan_replay`), for one replica's tokens."""

    send: np.ndarray
    """Tokens each rank sends each rank ``[I, L, W, W]`` (diagonal: computed locally)."""
    computed: np.ndarray
    """Tokens each rank computes per expert ``[I, L, W, E]``."""
    holders: np.ndarray
    """``[I, L, E, W]``."""
    owners: np.ndarray
    """``[I, L, E]``."""
    reshard_I: np.ndarray
    """Time of re-sharding after each iteration ``[I]``."""
    prefetched_IL: np.ndarray
    """Whether the placement that ran is the one planned ahead (its copies could travel ahead)."""
    rematerializes: bool = False
    """The planner frees copies after forward and gathers them again for backward (`Planner.rematerializes`)."""
    reads_flow: bool = True
    """The planner's placement depends on the flow (`Planner.reads_flow`; off for plain EP)."""


def plan_replay(
    build_planner: Callable[[], Any],
    flow_ILWE: np.ndarray,
    cost_model: CostModel,
    param_bytes: float,
    window: PrefetchWindow | None = None,
    first_layer_ahead: bool = False,
    progress: Any = None,
    dispatched: Sequence[np.ndarray] | None = None,
) -> list[Plans]:
    """Ask the planner for every (iteration, layer) on `flow_ILWE`, as the layer does; one `Plans`
    per flow of `dispatched` (default: `flow_ILWE` itself), each dispatched under the placements.

    Each layer gets its own planner, fed the iterations in order: one that plans ahead (`plans_ahead`:
    Pro-Prophet, FSSDP, EPLB) or keeps other state (`auto`) sees only the past ones when it decides.
    `window`: the copies of planners that plan ahead travel ahead of their layer (the block-wise
    prefetch, or Hecate §3.2's overlap with the attention) and the planners price them so
    (`Planner.use_prefetch`); every layer but the first, or every layer with `first_layer_ahead`.
    FSSDP planners re-shard all layers together every `reshard_interval` iterations
    (`fssdp.plan_resharding`, as `core.resharding` does after an optimizer step); `param_bytes`: one
    expert's parameter bytes, for the shards' moves. `progress`: a bar advanced once per iteration."""
    I, L, W, E = flow_ILWE.shape
    flows = [flow_ILWE] if dispatched is None else list(dispatched)
    base = Placement.expert_parallel(E, W)
    planner = as_planner(build_planner())
    owners = np.broadcast_to(base.owner_E, (I, L, E))
    flags = {"rematerializes": bool(planner.rematerializes), "reads_flow": bool(planner.reads_flow)}
    if isinstance(planner, EPPlanner):  # owners only, whatever the load: vectorised
        holders = np.broadcast_to(base.holders_EW, (I, L, E, W))
        if progress is not None:
            progress.update(I)
        no_ahead = np.zeros((I, L), dtype=bool)
        return [
            Plans(
                send_by_owner(f, base.owner_E),
                base.holders_EW.T * f.sum(-2)[..., None, :],
                holders,
                owners,
                np.zeros(I),
                no_ahead,
                **flags,
            )
            for f in flows
        ]
    node_of = cost_model.topology.node_of
    planners = [planner] + [as_planner(build_planner()) for _ in range(1, L)]  # each layer its own history
    ahead = window is not None and planner.plans_ahead
    first = 0 if first_layer_ahead else 1
    for p in planners[first:] if ahead else []:
        p.use_prefetch(window)
    current = [base] * L
    send = [np.zeros((I, L, W, W), dtype=np.int64) for _ in flows]
    computed = [np.zeros((I, L, W, E), dtype=np.int64) for _ in flows]
    holders = np.zeros((I, L, E, W), dtype=bool)
    owners, reshard_I, prefetched = owners.copy(), np.zeros(I), np.zeros((I, L), dtype=bool)
    resharding = planner.reshards_owners and planner.reshard_interval > 0
    for i in range(I):
        for li in range(L):
            planned = planners[li].next_placement() if ahead and li >= first else None
            placement = planners[li](flow_ILWE[i, li], current[li], cost_model)
            prefetched[i, li] = planned is not None and placement == planned
            for z, f in enumerate(flows):
                send[z][i, li], computed[z][i, li] = dispatch_loads(f[i, li], placement, node_of)
            holders[i, li] = placement.holders_EW
            owners[i, li] = placement.owner_E
        new_LE = plan_resharding(planners, cost_model, W, node_of, i + 1) if resharding else None
        if new_LE is not None:
            reshard_I[i] = resharding_time(cost_model, owners[i], new_LE, param_bytes)
            current = [Placement.owners_only(new_E, W) for new_E in new_LE]
            for p, moved in zip(planners, current):
                p.owners_changed(moved, cost_model)
        if progress is not None:
            progress.update(1)
    return [Plans(s, c, holders, owners, reshard_I, prefetched, **flags) for s, c in zip(send, computed)]


def copies_time_IL(
    cost_model: CostModel,
    param_bytes: float,
    holders_ILEW: np.ndarray,
    owners_ILE: np.ndarray,
    tree: bool | None = None,
) -> np.ndarray:
    """Materialize in forward and reduce-to-owner in backward, as the sparse collectives run them,
    per (iteration, layer) ``[2, I, L]``; placements repeat, so each distinct one is priced once.
    ``tree``: as `CostModel.copies_time` (False: as the block-wise prefetch sends them)."""
    memo: dict[bytes, list[float]] = {}
    out = np.zeros((2, *holders_ILEW.shape[:2]))
    for index in np.ndindex(*out.shape[1:]):
        holders_EW, owner_E = holders_ILEW[index], owners_ILE[index]
        key = holders_EW.tobytes() + owner_E.tobytes()
        if key not in memo:
            memo[key] = [
                cost_model.copies_time(param_bytes, holders_EW, owner_E, d, tree) for d in ("materialize", "reduce")
            ]
        out[(slice(None), *index)] = memo[key]
    return out
