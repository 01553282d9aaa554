"""Strategies: where experts are materialized (`strategy`), the order and overlap of a layer's
block (`schedule`) and how tokens travel (`dispatch`) — three axes of a MoE layer.

Every name in these registries works unchanged in `MoELayer(strategy=..., schedule=...,
dispatch=...)`, the config (`moe.strategy`, `moe.strategy_options`, ...), `moeflow train | bench |
simulate` and the docs. Planners are pure functions of numbers (testable without processes);
schedules run a block and predict its time; dispatchers move rows and price the exchange.
"""

from __future__ import annotations

from moeflow.core.registry import Component, Registry
from moeflow.strategies.dispatchers import A2ADispatcher, Dispatcher
from moeflow.strategies.hierarchical_a2a import HierarchicalDispatcher
from moeflow.strategies.planners.auto import AutoOptions, AutoPlanner
from moeflow.strategies.planners.base import Planner
from moeflow.strategies.planners.ep import EPPlanner
from moeflow.strategies.planners.eplb import EPLBOptions, EPLBPlanner
from moeflow.strategies.planners.fssdp import FSSDPOptions, FSSDPPlanner
from moeflow.strategies.planners.prophet import ProphetOptions, ProphetPlanner
from moeflow.strategies.planners.shadow import ShadowGreedyOptions, ShadowOptions, ShadowPlanner
from moeflow.strategies.schedules.auto import AutoSchedule, AutoScheduleOptions
from moeflow.strategies.schedules.base import Schedule
from moeflow.strategies.schedules.pairwise import PairwiseOptions, PairwiseSchedule
from moeflow.strategies.schedules.pipeline import PipelineOptions, PipelineSchedule
from moeflow.strategies.schedules.sync import SyncSchedule

PLANNERS = Registry(
    "strategy",
    [
        Component("ep", lambda ctx, o: EPPlanner(), summary="plain expert parallelism: every expert only on its owner"),
        Component(
            "shadow",
            lambda ctx, o: ShadowPlanner(ctx.expert, o),
            ShadowOptions,
            "FasterMoE dynamic shadowing: hot experts replicated on every rank (cheapest prefix, 5% margin)",
            needs_cost_model=True,
        ),
        Component(
            "shadow_greedy",
            lambda ctx, o: ShadowPlanner(ctx.expert, o),
            ShadowGreedyOptions,
            "FasterMoE shadowing with Algorithm 1 as published (stop rule, no margin)",
            needs_cost_model=True,
        ),
        Component(
            "prophet",
            lambda ctx, o: ProphetPlanner(ctx.expert, o),
            ProphetOptions,
            "Pro-Prophet: hot experts replicated on the devices that send them most, planned a step ahead",
            needs_cost_model=True,
        ),
        Component(
            "eplb",
            lambda ctx, o: EPLBPlanner(ctx.expert, o),
            EPLBOptions,
            "DeepSeek EPLB baseline: redundant slots to the heaviest load per copy, balanced packing, priced",
            needs_cost_model=True,
        ),
        Component(
            "fssdp",
            lambda ctx, o: FSSDPPlanner(ctx.expert, o),
            FSSDPOptions,
            "Hecate FSSDP: experts sharded with their optimizer state, materialized where the load needs them",
            needs_cost_model=True,
        ),
        Component(
            "auto",
            lambda ctx, o: AutoPlanner(ctx.expert, {n: PLANNERS.build(n, ctx) for n in o.names()}, o),
            AutoOptions,
            "the cheapest of the planners' placements under the cost model, corrected by measured times",
            needs_cost_model=True,
        ),
    ],
    is_object=callable,
)
"""The `strategy` axis: planners by name."""

SCHEDULES = Registry(
    "schedule",
    [
        Component("sync", lambda ctx, o: SyncSchedule(), summary="one exchange out, the experts, one back"),
        Component(
            "pairwise",
            lambda ctx, o: PairwiseSchedule(o),
            PairwiseOptions,
            "FasterMoE smart schedule: grouped pairwise steps overlapping exchanges with expert compute",
        ),
        Component(
            "pipeline",
            lambda ctx, o: PipelineSchedule(o, ctx.cost_model, ctx.expert),
            PipelineOptions,
            "FSMoE pipeline: the block in r chunks, each chunk's experts overlapping the next dispatch",
        ),
    ],
    is_object=lambda value: isinstance(value, Schedule),
)
"""The `schedule` axis: schedules by name."""


def _auto_schedule(ctx, options: AutoScheduleOptions) -> AutoSchedule:
    names = options.names() or [n for n in SCHEDULES.names() if n != "auto"]
    unknown = [n for n in names if n not in SCHEDULES or n == "auto"]
    if unknown:
        raise ValueError(
            f"schedule_options candidates={options.candidates!r}: unknown {unknown}; valid: "
            f"{[n for n in SCHEDULES.names() if n != 'auto']}"
        )
    return AutoSchedule({n: SCHEDULES.build(n, ctx) for n in names}, ctx.expert, ctx.cost_model, options)


SCHEDULES.register(
    Component(
        "auto",
        _auto_schedule,
        AutoScheduleOptions,
        "the cheapest schedule per forward: each candidate's predicted time times its measured factor",
        needs_cost_model=True,
    )
)

DISPATCHERS = Registry(
    "dispatch",
    [
        Component("a2a", lambda ctx, o: A2ADispatcher(), summary="one all-to-all-v each way"),
        Component(
            "hierarchical",
            lambda ctx, o: HierarchicalDispatcher(),
            summary="2D-hierarchical all-to-all: inside nodes, then across nodes among equal local ranks",
        ),
    ],
    is_object=lambda value: isinstance(value, Dispatcher),
)
"""The `dispatch` axis: token transports by name."""

__all__ = ["DISPATCHERS", "PLANNERS", "SCHEDULES", "Dispatcher", "Planner", "Schedule"]
