"""What a schedule receives: the dispatch → experts → combine block of one forward (to run it) or
of a replayed trace (to price it).

A schedule orders and overlaps the same primitives — the dispatcher's exchange, the `compute`
closure that regroups and runs the held experts, the hooks — and must give the numbers of `sync`
(tested for every schedule). The simulator asks the same schedule object, by the same name, for
its predicted time (`predict`), so a schedule is priced the way it runs.

Shape suffixes: A rows this rank sends (ordered by destination, then expert), R rows received,
D d_model, S source ranks, J experts this rank holds, W ranks, E experts; ``...`` = batch dims
(iterations, layers) of a simulation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moeflow.core.exchange import ExchangeBlock
from moeflow.core.expert_shape import ExpertShape


@dataclass
class StepLoad:
    """One training step of a layer in a simulation, vectorised over ``...`` (iterations, layers)."""

    send_tokens_WW: np.ndarray
    """Tokens rank src sends to rank dst ``[..., W, W]``; the diagonal holds the rows a rank computes
    from its own tokens (held locally) and never crosses the network."""
    computed_WE: np.ndarray
    """Tokens each rank computes for each expert ``[..., W, E]``."""
    shape: ExpertShape
    """The expert."""
    node_of: Sequence[int]
    """Node of every rank (from the cost model's topology)."""

    @classmethod
    def of_plan(cls, plan_SEW: np.ndarray, shape: ExpertShape, node_of: Sequence[int]) -> StepLoad:
        """The block of a layer's global dispatch plan `[S, E, W]` (rows source s sends rank w for
        expert e; the diagonal stays local)."""
        plan = np.asarray(plan_SEW, dtype=np.float64)
        return cls(plan.sum(1), plan.sum(0).T, shape, node_of)


@dataclass
class PredictedBlock:
    """A schedule's predicted time of the block, forward + backward, ``[...]`` seconds."""

    total_s: np.ndarray
    """The block's time with the schedule's overlap."""
    compute_s: np.ndarray
    """Expert compute (forward + 2× backward) on the slowest rank."""
    comm_s: np.ndarray
    """Token exchanges (dispatch and combine, forward and backward), summed."""


class Schedule:
    """Interface of the `schedule` axis (see the module docstring). Capabilities are declared:
    `observes_time` — it learns from the layer's measured forwards (`observe_time`,
    `strategies.timing`); `choice()` names the configuration that ran the last forward (a
    composite's candidate, a pipeline's degrees; None: the schedule itself)."""

    observes_time: bool = False

    def observe_time(self, samples: list) -> None:
        """The layer's measured forwards, oldest first (`strategies.timing.Sample`)."""

    def choice(self) -> str | None:
        return None

    def state(self) -> dict | None:
        """What it learned from measured forwards, carried in checkpoints (None: nothing)."""
        return None

    def load_state(self, state: dict) -> None:
        """Take back `state()` of a schedule built with the same options (a resume)."""

    def execute(self, block: ExchangeBlock) -> torch.Tensor:
        """Outputs of this rank's sent rows, in send order (what the synchronous combine returns)."""
        raise NotImplementedError

    def predict(self, step: StepLoad, cost_model: Any, dispatcher: Any) -> PredictedBlock:
        raise NotImplementedError

    def runs_with(self, dispatcher: Any) -> bool:
        """Whether this schedule can run with `dispatcher` (default: any)."""
        return True

    def check_dispatcher(self, dispatcher: Any) -> None:
        """Refuse a dispatcher this schedule cannot run with."""
        if not self.runs_with(dispatcher):
            raise ValueError(f"{type(self).__name__} does not run with dispatch={dispatcher.name!r}")
