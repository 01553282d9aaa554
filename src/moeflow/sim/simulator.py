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
backward), plus the dense part of the block (``nonmoe_forward_s``, backward 2×). Planning and
pricing live in ``sim.planning`` and ``sim.pricing``; copies that travel ahead hide behind the
block before (Pro-Prophet Eq. 8, ``prefetch``) or behind the attention (Hecate §3.2 / §4.2,
``overlap_attention``, ``sim.attention_overlap``).

``layout`` (``sim.data_parallel.MeshLayout``) lays the ranks out as training does: by default one
expert-parallel group of every rank; with ``ep_size`` below the world, each EP group a replica of
the experts on its own rows of the trace, planned on the replicas' mean flow, the slowest replica
setting the pace, and the experts' gradients all-reduced over the replicas (Hecate's baselines, §3
Eq. 2); with ``experts="fsdp"`` FSSDP owns each expert once over every rank (Hecate §3).

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
from typing import Any

import numpy as np
from tqdm import tqdm

from moeflow.core.checks import finite_number, positive_int
from moeflow.core.expert_shape import ExpertShape
from moeflow.core.registry import LayerContext
from moeflow.layer import AXES
from moeflow.perf.costmodel import CostModel
from moeflow.routing import BALANCES, GATES
from moeflow.routing.effects import EFFECTS
from moeflow.sim.data_parallel import (
    MeshLayout,
    expert_collectives_time,
    flow_mean_time,
    hidden_behind_backward,
    replica_flows,
    restricted_models,
    slowest_replica,
)
from moeflow.sim.planning import plan_replay
from moeflow.sim.pricing import LAYER_TERMS, GroupPricing
from moeflow.sim.traces import Trace, balanced_flow
from moeflow.strategies import PLANNERS


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
    overlap_attention: bool = False
    """Hecate §3.2 / §4.2: the sparse collectives of a planner that plans ahead hide behind the
    attention alone — spAG behind the forward, spRS and the next re-gather behind the backward
    (`sim.attention_overlap`); exclusive with `prefetch`."""

    def __post_init__(self) -> None:
        positive_int("top_k", self.top_k)
        for axis in ("gate", "balance", "dispatch"):
            AXES[axis].get(getattr(self, axis))
        unknown = sorted(set(self.options) - set(AXES))
        if unknown:
            raise ValueError(f"options: unknown axis {unknown[0]!r}; valid: {list(AXES)}")
        finite_number("nonmoe_forward_s", self.nonmoe_forward_s, low=0.0)
        if self.prefetch and self.overlap_attention:
            raise ValueError("prefetch=True and overlap_attention=True: two models of the same copies; choose one")


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
    expert_dp_I: np.ndarray | None = None
    """With data-parallel replicas (`sim.data_parallel`): the experts' collectives over the dp groups
    per iteration — the gradient all-reduce (`replicate`) or FSDP2's all-gathers and reduce-scatter."""
    expert_dp_exposed_I: np.ndarray | None = None
    """The part of `expert_dp_I` on the critical path (in `total_I` and `exposed_comm_I`)."""

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
        if self.expert_dp_I is not None:
            out["expert_dp_s"] = float(self.expert_dp_I.mean())
            out["expert_dp_exposed_s"] = float(self.expert_dp_exposed_I.mean())
        if self.ep_total_s is not None:
            out["speedup_over_ep"] = self.ep_total_s / out["total_s"]
        if self.ceiling_total_s is not None:
            out["ceiling_total_s"] = self.ceiling_total_s
            out["ceiling_over_total"] = self.ceiling_total_s / out["total_s"]
            out["share_of_ceiling"] = self.share_of_ceiling
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
    layout: MeshLayout | None = None,
) -> list[Breakdown]:
    """Replay ``trace`` (rescaled to the cluster when its size differs); one ``Breakdown`` per
    (strategy, schedule). See the module docstring. `progress`: a bar (tqdm, on stderr) over the
    strategies' iterations. `ceiling`: also plain EP on the force-balanced trace, each schedule, so
    that every row carries its share of the ceiling (`Breakdown.share_of_ceiling`). `layout`: the
    ranks' data-parallel layout (`sim.data_parallel.MeshLayout`; default: one EP group of every rank)."""
    layout = MeshLayout() if layout is None else layout
    W = cost_model.topology.num_devices
    if trace.world_size != W:
        trace = trace.rescale(W)
    I, L, _, E = trace.flow_ILWE.shape
    ep = layout.group_size(W, E)
    if E % W and any(layout.whole_cluster(s, W, E) for s in strategies):
        raise ValueError(
            f"trace num_experts={E}: must be a multiple of the cluster's {W} devices "
            f"(rescale it: `moeflow simulate --experts {math.lcm(E, W)}`, or Trace.rescale)"
        )
    replica_models = restricted_models(cost_model, ep) if ep < W else []
    pricing = {id(cm): GroupPricing(cm, layer, schedules, E, I, L) for cm in [cost_model, *replica_models]}
    options = _strategy_options(strategies, layer.options.get("strategy"))
    for s in strategies:  # built once here so that bad names and options fail before any work
        models = [cost_model] if layout.whole_cluster(s, W, E) else replica_models[:1]
        for cm in models:
            PLANNERS.build(s, pricing[id(cm)].ctx, options[s])
    flow = routed_flow(trace, cost_model, layer)
    bar = tqdm(
        total=len(strategies) * I, desc=f"simulate {cost_model.name}", unit="it", disable=not progress, leave=False
    )
    replay = _Replay(cost_model, replica_models, pricing, layer, layout, ep)
    results = []
    for name in strategies:
        bar.set_postfix_str(name)
        results += replay.breakdowns(name, flow, options[name], bar)
    bar.close()
    if ceiling:
        ep_rows = {r.schedule: r for r in results if r.strategy == "ep"}
        if not ep_rows:
            ep_rows = {r.schedule: r for r in replay.breakdowns("ep", flow, {})}
        even = {r.schedule: r for r in replay.breakdowns("ep", balanced_flow(flow), {})}
        for r in results:
            r.ep_total_s = float(ep_rows[r.schedule].total_I.mean())
            r.ceiling_total_s = float(even[r.schedule].total_I.mean())
    return results


class _Replay:
    """One strategy replayed on the layout: on the whole cluster, or on every EP group's replica
    (`sim.data_parallel`), priced under every schedule (`simulate`)."""

    def __init__(self, cost_model, replica_models, pricing, layer, layout, ep) -> None:
        self.cm, self.replica_models, self.pricing = cost_model, replica_models, pricing
        self.layer, self.layout, self.ep = layer, layout, ep

    def breakdowns(self, name: str, flow_ILWE: np.ndarray, options: dict, bar: Any = None) -> list[Breakdown]:
        W, E = self.cm.topology.num_devices, flow_ILWE.shape[-1]
        whole = self.layout.whole_cluster(name, W, E)
        pricing = self.pricing[id(self.cm if whole else self.replica_models[0])]
        build = lambda: PLANNERS.build(name, pricing.ctx, options)  # noqa: E731
        window, first = pricing.window, self.layer.overlap_attention
        if whole:
            plans = plan_replay(build, flow_ILWE, self.cm, pricing.param_bytes, window, first, bar)[0]
            rows = [_breakdown(name, s, layers) for s, layers in pricing.layers(plans).items()]
            if self.ep < W:  # FSSDP over the dp × ep mesh: no collective over replicas
                for r in rows:
                    r.expert_dp_I, r.expert_dp_exposed_I = np.zeros_like(r.total_I), np.zeros_like(r.total_I)
            return rows
        plan_flow, flows_Z = replica_flows(flow_ILWE, self.ep)
        planning_model = self.replica_models[0]  # every replica plans alike, on the mean flow
        plans_Z = plan_replay(build, plan_flow, planning_model, pricing.param_bytes, window, first, bar, flows_Z)
        layers_Z = [self.pricing[id(cm)].layers(p) for cm, p in zip(self.replica_models, plans_Z)]
        reads_flow = plans_Z[0].reads_flow
        sync_s = flow_mean_time(self.cm, self.ep, E) if reads_flow else 0.0
        expert_bytes = E // self.ep * pricing.param_bytes
        dp_s = expert_collectives_time(self.cm, self.ep, expert_bytes, self.layout.experts)
        nonmoe = self.layer.nonmoe_forward_s
        rows = []
        for schedule in pricing.built:
            terms = {k: np.stack([lz[schedule][k] for lz in layers_Z]) for k in LAYER_TERMS}
            slowest_IL = slowest_replica(terms["total"], per_layer=reads_flow)
            layers = {k: np.take_along_axis(v, slowest_IL[None], 0)[0] for k, v in terms.items()}
            for k in ("total", "other", "exposed"):
                layers[k] = layers[k] + sync_s
            L = layers["total"].shape[1]
            grad_I = np.full(layers["total"].shape[0], L * dp_s["grad"])
            if self.layout.overlap_allreduce:
                grad_exposed_I = hidden_behind_backward(layers["total"] + dp_s["gather"], nonmoe, dp_s["grad"])
            else:
                grad_exposed_I = grad_I
            r = _breakdown(name, schedule, layers)
            r.expert_dp_I = grad_I + L * dp_s["gather"]
            r.expert_dp_exposed_I = grad_exposed_I + L * dp_s["gather"]
            r.total_I = r.total_I + r.expert_dp_exposed_I
            r.exposed_comm_I = r.exposed_comm_I + r.expert_dp_exposed_I
            r.overlapped_comm_I = r.overlapped_comm_I + grad_I - grad_exposed_I
            rows.append(r)
        return rows


def _breakdown(name: str, schedule: str, layers: dict[str, np.ndarray]) -> Breakdown:
    """A row from the per-layer terms of `GroupPricing.layers`."""
    return Breakdown(
        name,
        schedule,
        layers["total"].sum(1),
        layers["compute"].sum(1),
        layers["a2a"].sum(1),
        layers["other"].sum(1),
        layers["exposed"].sum(1),
        layers["overlapped"].sum(1),
        layers["lat_comp"],
        layers["lat_comm"],
        layers["total"],
        layers["tokens"],
        layers["replicated"],
    )


def speedup_bound(comm_s: Any, comp_s: Any) -> np.ndarray:
    """FasterMoE §4.2: the best any overlap of comm and comp can do, ``(comm+comp)/max(comm,comp)``."""
    comm, comp = np.asarray(comm_s, dtype=np.float64), np.asarray(comp_s, dtype=np.float64)
    return (comm + comp) / np.maximum(np.maximum(comm, comp), 1e-300)


def format_table(results: Sequence[Breakdown]) -> str:
    """Fixed-width table of the mean per-iteration breakdown (milliseconds), the speedup over plain
    EP (same schedule) and the share of the force-balanced ceiling (`Breakdown.share_of_ceiling`);
    with data-parallel replicas also the experts' collectives over them and their exposed part."""
    keys = ["total_s", "compute_s", "a2a_s", "other_comm_s", "exposed_comm_s", "overlapped_comm_s", "total_p95_s"]
    names = ["total", "compute", "a2a", "other", "exposed", "overlap", "p95"]
    if any(r.expert_dp_I is not None for r in results):
        keys += ["expert_dp_s", "expert_dp_exposed_s"]
        names += ["dp comm", "dp exp."]
    head = f"{'strategy':<14}{'schedule':<10}" + "".join(f"{k:>10}" for k in (*names, "vs EP", "ceiling"))
    lines = [head + "   (ms per iteration; ceiling: share of EP's gap to even routing closed)"]
    for r in results:
        s = r.summary()
        row = f"{r.strategy:<14}{r.schedule:<10}" + "".join(f"{1e3 * s.get(k, 0.0):>10.3f}" for k in keys)
        row += f"{s['speedup_over_ep']:>9.2f}x" if "speedup_over_ep" in s else f"{'-':>10}"
        share = s.get("share_of_ceiling")
        row += f"{100 * share:>9.1f}%" if share is not None else f"{'-':>10}"
        lines.append(row)
    ceilings = {r.schedule: r.ceiling_total_s for r in results if r.ceiling_total_s is not None}
    if ceilings:
        lines.append("ceiling (ep, even routing): " + ", ".join(f"{k} {1e3 * v:.3f} ms" for k, v in ceilings.items()))
    return "\n".join(lines)
