"""moeflow: Mixture-of-Experts training across many devices, for skewed loads and uneven networks.

The package is layered; each layer imports only those below it (docs/architecture.md, checked by
`make test`):

    core/        mechanisms with no names in them: placement, sparse collectives, dispatch,
                 experts, the exchange block, hooks, the parallel layout, registries
    perf/        pricing: topology, cost model and its fits, offline solvers
    routing/     gates and balance terms (the `gate` and `balance` axes)
    strategies/  planners, schedules, dispatchers, the block-wise prefetch, `auto`
    layer.py     MoELayer: names → components, the step sequence
    model_step.py  once per optimizer step over a model's MoE layers
    sim/         the simulator, workloads, roofline, routing traces
    profiling/   the profiler that fits a cost model on the live backend
    hf/          Hugging Face conversion
    training/    the MoE-GPT trainer behind `moeflow train` / `generate`
    bench/       layer and strategy benchmarks behind `moeflow bench`
    commands/    one module per CLI command

    from moeflow import MoELayer, ParallelLayout, all_reduce_gradients, CostModel, Topology
"""

from __future__ import annotations

import importlib
from typing import Any

from moeflow.core.hooks import MoEHook
from moeflow.core.parallel import ParallelLayout
from moeflow.core.placement import Placement
from moeflow.core.registry import Component
from moeflow.core.stats import MoEStats
from moeflow.layer import MoELayer
from moeflow.model_step import all_reduce_gradients, maybe_reshard
from moeflow.routing import BALANCES, GATES
from moeflow.routing.routing import Routing
from moeflow.strategies import DISPATCHERS, PLANNERS, SCHEDULES, Dispatcher
from moeflow.strategies.planners.base import PlanAheadPlanner, Planner
from moeflow.strategies.prefetch import BlockPrefetch
from moeflow.strategies.schedules.base import Schedule

__all__ = [
    "BALANCES",
    "DISPATCHERS",
    "GATES",
    "PLANNERS",
    "SCHEDULES",
    "BlockPrefetch",
    "Component",
    "Dispatcher",
    "CostModel",
    "MoEHook",
    "MoELayer",
    "MoEStats",
    "ParallelLayout",
    "PlanAheadPlanner",
    "Placement",
    "Planner",
    "Routing",
    "Schedule",
    "Topology",
    "all_reduce_gradients",
    "maybe_reshard",
]
__version__ = "0.3.0"

_LAZY = {"CostModel": "moeflow.perf.costmodel", "Topology": "moeflow.perf.topology"}


def __getattr__(name: str) -> Any:
    """`CostModel` and `Topology` on first use (they import SciPy)."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moeflow' has no attribute {name!r}")
