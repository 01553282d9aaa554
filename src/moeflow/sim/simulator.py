"""Cluster-scale replay of routing traces through the cost model (``moeflow simulate``).

The simulator is keyed by the layer's own axes and registries: a gate or balance term that changes
routing turns the traced flow into the one it would produce (``moeflow.routing.effects``, by the
component's name); every ``strategy`` is a planner of ``moeflow.strategies.PLANNERS`` asked for a
``Placement`` per (iteration, layer), exactly as the layer asks it; the dispatch plan
(``moeflow.core.placement.dispatch_counts``) gives the per-pair sends and per-device loads; every
``schedule`` of ``moeflow.strategies.SCHEDULES`` predicts its own block time from them
(``Schedule.predict``), with the dispatcher of ``dispatch`` pricing each token exchange. On top of
the block: the count exchange before every dispatch (``CostModel.count_exchange_time``) and the
copies a planner asked for (``CostModel.copies_time``: materialize in forward, reduce-to-owner in
backward), plus the dense part of the block (``nonmoe_forward_s``, backward 2×).

A trace of another size is rescaled to the cluster (``Trace.rescale``). Planners that never copy
(``ep``) take a vectorised path, so a 64×64×1000 replay is a few numpy calls; the others are asked
call by call (a progress bar with ``progress=True``). Every row also carries plain EP's time and the
force-balanced ceiling's — plain EP, same schedule, with the same tokens routed perfectly evenly
(``Trace.balanced``) — and so its share of the ceiling (``Breakdown.share_of_ceiling``, the
``(T_ep − T) / (T_ep − T_ceiling)`` that ``moeflow bench --ceiling`` reports for measured rows).

Shape suffixes: I iterations, L layers, W ranks, E experts; ``...`` = (I, L).

    moeflow simulate --cluster trevor --trace zipf --iterations 1000 --d-model 1024 --d-hidden 4096
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from tqdm import tqdm

from moeflow.core.checks import finite_number, positive_int
from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import Placement, dispatch_loads, send_by_owner
from moeflow.core.registry import LayerContext
from moeflow.layer import AXES
from moeflow.perf.costmodel import CostModel
from moeflow.routing import BALANCES, GATES
from moeflow.routing.effects import EFFECTS
from moeflow.sim.traces import Trace, balanced_flow
from moeflow.strategies import DISPATCHERS, PLANNERS, SCHEDULES
from moeflow.strategies.planners.base import PrefetchWindow, as_planner
from moeflow.strategies.planners.ep import EPPlanner
from moeflow.strategies.planners.fssdp import plan_resharding, resharding_time
from moeflow.strategies.planners.prophet_model import overlapped_copies
from moeflow.strategies.schedules.base import StepLoad


@dataclass(frozen=True)
class SimulatedLayer:
    """The MoE layer a trace is replayed through: its expert, and its choice on each fixed axis
    (strategies and schedules are compared side by side: arguments of `simulate`)."""

    shape: ExpertShape
    """d_model, d_hidden and the expert kind."""
    top_k: int = 2
    """Experts chosen per token (the trace's)."""
    gate: str = "topk"
    """A `moeflow.routing.GATES` name; routing-changing gates act through `routing.effects`."""
    balance: str = "gshard"
    """A `moeflow.routing.BALANCES` name; routing-changing terms act through `routing.effects`."""
    dispatch: str = "a2a"
    """A `moeflow.strategies.DISPATCHERS` name."""
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Options per axis, e.g. `{"schedule": {"group_size": 2}, "strategy": {"min_gain": 0.1}}`."""
    nonmoe_forward_s: float = 0.0
    """Forward time of the dense part of one block (attention etc.), added per layer; backward = 2×."""
    prefetch: bool = False
    """Pro-Prophet §V block-wise prefetch (`strategies.prefetch`): the copies of a planner that plans ahead
    hide behind the block before (Eq. 8) in every layer but the first."""

    def __post_init__(self) -> None:
        positive_int("top_k", self.top_k)
        for axis in ("gate", "balance", "dispatch"):
            AXES[axis].get(getattr(self, axis))
        unknown = sorted(set(self.options) - set(AXES))
        if unknown:
            raise ValueError(f"options: unknown axis {unknown[0]!r}; valid: {list(AXES)}")
        finite_number("nonmoe_forward_s", self.nonmoe_forward_s, low=0.0)


@dataclass
class Breakdown:
    """Per-iteration times (seconds, summed over layers) of one (strategy, schedule)."""

    strategy: str
    schedule: str
    total_I: np.ndarray
    compute_I: np.ndarray
    a2a_I: np.ndarray
    other_comm_I: np.ndarray
    exposed_comm_I: np.ndarray
    overlapped_comm_I: np.ndarray
    layer_compute_fwd_IL: np.ndarray = field(repr=False)
    """FasterMoE Lat_comp (forward, slowest device) per layer, for the roofline."""
    layer_a2a_IL: np.ndarray = field(repr=False)
    """Mean time of one all-to-all (Lat_comm) per layer, for the roofline."""
    layer_total_IL: np.ndarray = field(repr=False)
    tokens_IL: np.ndarray = field(repr=False)
    """Assignments computed in the layer (Σ_w B_w)."""
    replicated_IL: np.ndarray = field(repr=False)
    """Expert copies beyond the owners (0 for ep)."""
    ep_total_s: float | None = None
    """Plain EP's mean iteration time on the same trace and schedule."""
    ceiling_total_s: float | None = None
    """The force-balanced ceiling: plain EP's mean iteration time, same schedule, with perfectly
    even routing of the same tokens (`Trace.balanced`)."""

    @property
    def share_of_ceiling(self) -> float | None:
        """The part of the possible gain reached, `(T_ep − T) / (T_ep − T_ceiling)` (as `moeflow bench
        --ceiling` reports it; None without a gap). Above 1: copies also keep tokens on their own
        device, which even routing under plain EP does not."""
        if self.ep_total_s is None or self.ceiling_total_s is None or self.ep_total_s <= self.ceiling_total_s:
            return None
        return (self.ep_total_s - float(self.total_I.mean())) / (self.ep_total_s - self.ceiling_total_s)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"strategy": self.strategy, "schedule": self.schedule}
        for key in ("total", "compute", "a2a", "other_comm", "exposed_comm", "overlapped_comm"):
            out[f"{key}_s"] = float(getattr(self, f"{key}_I").mean())
        out["total_p50_s"] = float(np.percentile(self.total_I, 50))
        out["total_p95_s"] = float(np.percentile(self.total_I, 95))
        out["replicated_experts_per_layer"] = float(self.replicated_IL.mean())
        if self.ep_total_s is not None:
            out["speedup_over_ep"] = self.ep_total_s / out["total_s"]
        if self.ceiling_total_s is not None:
            out["ceiling_total_s"] = self.ceiling_total_s
            out["ceiling_over_total"] = self.ceiling_total_s / out["total_s"]
            out["share_of_ceiling"] = self.share_of_ceiling
        return out


class Plans(NamedTuple):
    """What a planner decided over a replay (`_plan`)."""

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
    """Whether the placement that ran is the one planned ahead (its copies were prefetched)."""


def _plan(
    build_planner,
    flow_ILWE: np.ndarray,
    cost_model: CostModel,
    layer: SimulatedLayer,
    prefetch: bool = False,
    progress: Any = None,
) -> Plans:
    """Ask the planner for every (iteration, layer), as the layer does (`Plans`). Each layer gets its
    own planner, fed the iterations in order: one that plans ahead (`plans_ahead`: Pro-Prophet,
    FSSDP, EPLB) or keeps other state (`auto`) sees only the past ones when it decides. With
    `prefetch` (the block-wise prefetch on), such planners of every layer but the first know their
    copies are prefetched, as `strategies.prefetch.BlockPrefetch` tells them in a run, with the dense time
    given and the whole window hiding copies (a GPU's copy engines). FSSDP planners re-shard all
    layers together every `reshard_interval` iterations (`fssdp.plan_resharding`, as
    `core.resharding` does after an optimizer step). `progress`: a bar advanced once per iteration."""
    I, L, W, E = flow_ILWE.shape
    base = Placement.expert_parallel(E, W)
    planner = as_planner(build_planner())
    owners = np.broadcast_to(base.owner_E, (I, L, E))
    if isinstance(planner, EPPlanner):  # owners only, whatever the load: vectorised
        send = send_by_owner(flow_ILWE, base.owner_E)
        computed = base.holders_EW.T * flow_ILWE.sum(-2)[..., None, :]
        holders = np.broadcast_to(base.holders_EW, (I, L, E, W))
        if progress is not None:
            progress.update(I)
        return Plans(send, computed, holders, owners, np.zeros(I), np.zeros((I, L), dtype=bool))
    node_of = cost_model.topology.node_of
    planners = [planner] + [as_planner(build_planner()) for _ in range(1, L)]  # each layer its own history
    ahead = prefetch and planner.plans_ahead
    for p in planners[1:] if ahead else []:
        p.use_prefetch(PrefetchWindow(layer.nonmoe_forward_s, 1.0))
    current = [base] * L
    send = np.zeros((I, L, W, W), dtype=np.int64)
    computed = np.zeros((I, L, W, E), dtype=np.int64)
    holders = np.zeros((I, L, E, W), dtype=bool)
    owners, reshard_I, prefetched = owners.copy(), np.zeros(I), np.zeros((I, L), dtype=bool)
    resharding = planner.reshards_owners and planner.reshard_interval > 0
    for i in range(I):
        for li in range(L):
            planned = planners[li].next_placement() if ahead and li else None
            placement = planners[li](flow_ILWE[i, li], current[li], cost_model)
            prefetched[i, li] = planned is not None and placement == planned
            send[i, li], computed[i, li] = dispatch_loads(flow_ILWE[i, li], placement, node_of)
            holders[i, li] = placement.holders_EW
            owners[i, li] = placement.owner_E
        new_LE = plan_resharding(planners, cost_model, W, node_of, i + 1) if resharding else None
        if new_LE is not None:
            reshard_I[i] = resharding_time(
                cost_model, owners[i], new_LE, layer.shape.param_bytes(cost_model.bytes_per_element)
            )
            current = [Placement.owners_only(new_E, W) for new_E in new_LE]
            for p, moved in zip(planners, current):
                p.owners_changed(moved, cost_model)
        if progress is not None:
            progress.update(1)
    return Plans(send, computed, holders, owners, reshard_I, prefetched)


def _copies_time_IL(
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


def routed_flow(trace: Trace, cost_model: CostModel, layer: SimulatedLayer) -> np.ndarray:
    """The trace's flow as `layer.gate` and `layer.balance` would route it (`routing.effects`)."""
    flow = trace.flow_ILWE
    ctx = LayerContext(trace.num_experts, layer.top_k, layer.shape, cost_model, balance_weight=1.0)
    for axis, registry in (("gate", GATES), ("balance", BALANCES)):
        name = getattr(layer, axis)
        if name in EFFECTS:
            flow = EFFECTS[name](flow, ctx, registry.options(name, layer.options.get(axis)))
    return flow


def _strategy_options(strategies: Sequence[str], raw: Mapping[str, Any] | None) -> dict[str, dict]:
    """Each strategy's share of the strategy options (strategies are compared side by side: an
    option goes to those that have it); an option none of them has is an error naming it."""
    raw = dict(raw or {})
    known = {s: {f.name for f in dataclasses.fields(PLANNERS.get(s).options)} for s in strategies}
    for key in raw:
        if not any(key in names for names in known.values()):
            raise ValueError(f"strategy option {key!r}: none of the strategies {list(strategies)} has it")
    return {s: {k: v for k, v in raw.items() if k in known[s]} for s in strategies}


def simulate(
    trace: Trace,
    cost_model: CostModel,
    layer: SimulatedLayer,
    strategies: Sequence[str] = ("ep",),
    schedules: Sequence[str] = ("sync",),
    progress: bool = False,
    ceiling: bool = True,
) -> list[Breakdown]:
    """Replay ``trace`` (rescaled to the cluster when its size differs); one ``Breakdown`` per
    (strategy, schedule). See the module docstring. `progress`: a bar (tqdm, on stderr) over the
    strategies' iterations. `ceiling`: also plain EP on the force-balanced trace, each schedule, so
    that every row carries its share of the ceiling (`Breakdown.share_of_ceiling`)."""
    W = cost_model.topology.num_devices
    if trace.world_size != W:
        trace = trace.rescale(W)
    I, L, _, E = trace.flow_ILWE.shape
    if E % W:
        raise ValueError(
            f"trace num_experts={E}: must be a multiple of the cluster's {W} devices "
            f"(rescale it: `moeflow simulate --experts {math.lcm(E, W)}`, or Trace.rescale)"
        )
    ctx = LayerContext(E, layer.top_k, layer.shape, cost_model)
    options = _strategy_options(strategies, layer.options.get("strategy"))
    for s in strategies:  # built once here so that bad names and options fail before any work
        PLANNERS.build(s, ctx, options[s])
    built = {s: SCHEDULES.build(s, ctx, layer.options.get("schedule")) for s in schedules}
    dispatcher = DISPATCHERS.build(layer.dispatch, ctx, layer.options.get("dispatch"))
    for schedule in built.values():
        schedule.check_dispatcher(dispatcher)
    flow = routed_flow(trace, cost_model, layer)
    pricing = _Pricing(cost_model, layer, built, dispatcher, E, I, L)
    bar = tqdm(
        total=len(strategies) * I, desc=f"simulate {cost_model.name}", unit="it", disable=not progress, leave=False
    )
    results = []
    for name in strategies:
        bar.set_postfix_str(name)
        build = lambda name=name: PLANNERS.build(name, ctx, options[name])  # noqa: E731
        results += pricing.breakdowns(name, _plan(build, flow, cost_model, layer, layer.prefetch, bar))
    bar.close()
    if ceiling:
        ep = {r.schedule: r for r in results if r.strategy == "ep"}
        if not ep:
            ep = {r.schedule: r for r in pricing.breakdowns("ep", _plan(EPPlanner, flow, cost_model, layer))}
        even = pricing.breakdowns("ep", _plan(EPPlanner, balanced_flow(flow), cost_model, layer))
        for r in results:
            r.ep_total_s = float(ep[r.schedule].total_I.mean())
            r.ceiling_total_s = float(next(c for c in even if c.schedule == r.schedule).total_I.mean())
    return results


class _Pricing:
    """What one strategy's plans cost under every schedule (`simulate`)."""

    def __init__(self, cost_model: CostModel, layer: SimulatedLayer, built: dict, dispatcher, E: int, I: int, L: int):
        self.cm, self.layer, self.built, self.dispatcher = cost_model, layer, built, dispatcher
        self.t_counts = cost_model.count_exchange_time(E)
        self.param_bytes = layer.shape.param_bytes(cost_model.bytes_per_element)
        self.nonmoe_IL = np.full((I, L), 3.0 * layer.nonmoe_forward_s)
        self.E = E

    def breakdowns(self, name: str, plans: Plans) -> list[Breakdown]:
        cost_model, layer, param_bytes, nonmoe_IL = self.cm, self.layer, self.param_bytes, self.nonmoe_IL
        send, computed, holders, owners, reshard_I, prefetched_IL = plans
        W = cost_model.topology.num_devices
        # The workload's Lat_comp and Lat_comm (FasterMoE §3.3), whatever the schedule: the roofline's R_CC.
        lat_comp_IL = cost_model.compute_time(computed, layer.shape)
        trans_IL, agg_IL = _copies_time_IL(cost_model, param_bytes, holders, owners)
        copies_IL = trans_IL + agg_IL
        if prefetched_IL.any():
            # Pro-Prophet Eq. 8: a layer that runs the placement planned ahead (every layer after
            # the first) has its copies prefetched in the block before, as `strategies.prefetch` sends
            # them; a GPU's copy engines hide them behind the whole window (hidden share 1).
            sent_IL = _copies_time_IL(cost_model, param_bytes, holders, owners, tree=False)
            hidden_IL = overlapped_copies(sent_IL[0], sent_IL[1], lat_comp_IL, layer.nonmoe_forward_s)
            copies_IL = np.where(prefetched_IL, hidden_IL, copies_IL)
        other_IL = self.t_counts + copies_IL
        other_IL[:, -1] += reshard_I  # moving shards (FSSDP), after the iteration's last layer
        replicated_IL = holders.sum(axis=(-2, -1)) - self.E
        step = StepLoad(send, computed, layer.shape, cost_model.topology.node_of)
        bytes_WW = send * (1.0 - np.eye(W)) * layer.shape.d_model * cost_model.bytes_per_element
        lat_comm_IL = self.dispatcher.price(cost_model, bytes_WW)  # one exchange (the combine costs the same)
        out = []
        for schedule_name, schedule in self.built.items():
            block = schedule.predict(step, cost_model, self.dispatcher)
            total_IL = block.total_s + other_IL + nonmoe_IL
            exposed_IL = total_IL - nonmoe_IL - block.compute_s
            out.append(
                Breakdown(
                    name,
                    schedule_name,
                    total_IL.sum(1),
                    block.compute_s.sum(1),
                    block.comm_s.sum(1),
                    other_IL.sum(1),
                    exposed_IL.sum(1),
                    np.maximum(block.comm_s + other_IL - exposed_IL, 0.0).sum(1),
                    lat_comp_IL,
                    lat_comm_IL,
                    total_IL,
                    computed.sum(axis=(-2, -1)).astype(np.float64),
                    replicated_IL.astype(np.float64),
                )
            )
        return out


def speedup_bound(comm_s: Any, comp_s: Any) -> np.ndarray:
    """FasterMoE §4.2: the best any overlap of comm and comp can do, ``(comm+comp)/max(comm,comp)``."""
    comm, comp = np.asarray(comm_s, dtype=np.float64), np.asarray(comp_s, dtype=np.float64)
    return (comm + comp) / np.maximum(np.maximum(comm, comp), 1e-300)


def format_table(results: Sequence[Breakdown]) -> str:
    """Fixed-width table of the mean per-iteration breakdown (milliseconds), the speedup over plain
    EP (same schedule) and the share of the force-balanced ceiling (`Breakdown.share_of_ceiling`)."""
    keys = ("total_s", "compute_s", "a2a_s", "other_comm_s", "exposed_comm_s", "overlapped_comm_s", "total_p95_s")
    head = f"{'strategy':<14}{'schedule':<10}" + "".join(
        f"{k:>10}" for k in ("total", "compute", "a2a", "other", "exposed", "overlap", "p95", "vs EP", "ceiling")
    )
    lines = [head + "   (ms per iteration; ceiling: share of EP's gap to even routing closed)"]
    for r in results:
        s = r.summary()
        row = f"{r.strategy:<14}{r.schedule:<10}" + "".join(f"{1e3 * s[k]:>10.3f}" for k in keys)
        row += f"{s['speedup_over_ep']:>9.2f}x" if "speedup_over_ep" in s else f"{'-':>10}"
        share = s.get("share_of_ceiling")
        row += f"{100 * share:>9.1f}%" if share is not None else f"{'-':>10}"
        lines.append(row)
    ceilings = {r.schedule: r.ceiling_total_s for r in results if r.ceiling_total_s is not None}
    if ceilings:
        lines.append("ceiling (ep, even routing): " + ", ".join(f"{k} {1e3 * v:.3f} ms" for k, v in ceilings.items()))
    return "\n".join(lines)
