"""moeflow: Mixture-of-Experts training across many devices, for skewed loads and uneven networks.

The package is layered (docs/architecture.md):

    core/        the layer's step sequence and its parts: experts, dispatch, placement, sparse
                 collectives, parallel layout, hooks, registries of named components
    routing/     gates and balance terms (the `gate` and `balance` axes)
    strategies/  planners, schedules, dispatchers (the `strategy`, `schedule`, `dispatch` axes)
    perf/        topology, cost model, profiler, simulator, roofline, routing traces
    training/    the MoE-GPT trainer behind `moeflow train` / `generate`
    bench/       layer and strategy benchmarks behind `moeflow bench`
    commands/    one module per CLI command

    from moeflow import MoELayer, ParallelLayout, all_reduce_gradients, CostModel, Topology
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

from moeflow.core.hooks import MoEHook
from moeflow.core.layer import MoELayer
from moeflow.core.parallel import ParallelLayout, all_reduce_gradients
from moeflow.core.placement import Placement
from moeflow.core.stats import MoEStats
from moeflow.routing.gates import Routing

__all__ = [
    "CostModel",
    "MoEHook",
    "MoELayer",
    "MoEStats",
    "ParallelLayout",
    "Placement",
    "Routing",
    "Topology",
    "all_reduce_gradients",
]
__version__ = "0.2.0"

_LAZY = {"CostModel": "moeflow.perf.costmodel", "Topology": "moeflow.perf.topology"}


def __getattr__(name: str) -> Any:
    """`CostModel` and `Topology` on first use (they import SciPy)."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moeflow' has no attribute {name!r}")


# Modules of moeflow 0.1 that moved into the layered packages unchanged: `import moeflow.parallel`
# and friends keep working and give the very same module objects.
_MOVED = {
    "moeflow.layer": "moeflow.core.layer",
    "moeflow.experts": "moeflow.core.experts",
    "moeflow.dispatch": "moeflow.core.dispatch",
    "moeflow.placement": "moeflow.core.placement",
    "moeflow.sparse_collectives": "moeflow.core.sparse_collectives",
    "moeflow.parallel": "moeflow.core.parallel",
    "moeflow.hooks": "moeflow.core.hooks",
    "moeflow.gates": "moeflow.routing.gates",
    "moeflow.balance": "moeflow.routing.balance",
    "moeflow.topology": "moeflow.perf.topology",
    "moeflow.config": "moeflow.training.config",
    "moeflow.model": "moeflow.training.model",
    "moeflow.data": "moeflow.training.data",
    "moeflow.checkpoint": "moeflow.training.checkpoint",
    "moeflow.generate": "moeflow.training.generate",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old module path to its new module (the same object, not a copy)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in _MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        module = importlib.import_module(_MOVED[spec.name])
        self._specs = getattr(self, "_specs", {})
        self._specs[spec.name] = module.__spec__  # the import machinery overwrites it with the alias's
        return module

    def exec_module(self, module):
        # Already executed under its new name: restore its own spec, register the alias.
        alias = module.__spec__.name
        module.__spec__ = self._specs.pop(alias)
        sys.modules[alias] = module


sys.meta_path.append(_MovedModules())
