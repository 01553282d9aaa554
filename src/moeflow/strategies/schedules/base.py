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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moeflow.core.expert_shape import ExpertShape


@dataclass
class ExchangeBlock:
    """The block of one forward, as the layer hands it to its schedule."""

    x_sent_AD: torch.Tensor
    """Rows to send, ordered by destination rank, then expert."""
    send_WW: np.ndarray
    """Rows every rank sends every rank (global, from the dispatch plan; identical on every rank)."""
    me: int
    """This rank's index in the group."""
    counts_SJ: np.ndarray
    """Rows source s sends this rank for held expert j (source-major, held experts in order)."""
    compute: Callable[[torch.Tensor, np.ndarray], torch.Tensor]
    """`compute(x_RD, counts_SJ)`: the held experts on rows in that layout, outputs in the same layout."""
    group: Any
    """Expert-parallel process group (None: one process)."""
    node_of: Sequence[int] | None
    """Node of every rank of the group (None: unknown)."""
    dispatcher: Any
    """The `dispatch` axis object: `exchange(x, send_WW, me, group, node_of)`."""
    hooks: Callable[..., torch.Tensor]
    """`hooks(point, tensor, first=True, last=True)` runs the layer's hooks at a named point (FSMoE
    §3.1); a schedule exchanging in pieces says which piece is the first and the last
    (`core.hooks`, "Pieces")."""
    call_id: int
    """Forward calls of the layer so far (message tags of asynchronous schedules)."""
    plan_SED: np.ndarray | None = None
    """The layer's global dispatch plan: rows source s sends destination d for expert e (identical
    on every rank; `schedule="auto"` prices the candidates on it)."""
    esp_group: Any = None
    """The layer's expert-sharding group (None: none): its members compute every chunk of a
    pipelined block together, each with its own expert-parallel group's flow."""

    @property
    def send_splits(self) -> list[int]:
        """Rows this rank sends to each rank."""
        return self.send_WW[self.me].tolist()

    @property
    def recv_splits(self) -> list[int]:
        """Rows this rank receives from each rank."""
        return self.send_WW[:, self.me].tolist()

    def exchange(self, x: torch.Tensor, back: bool = False) -> torch.Tensor:
        """The dispatcher's exchange of this block's rows (`back`: the combine, the reverse)."""
        send_WW = self.send_WW.T if back else self.send_WW
        return self.dispatcher.exchange(x, send_WW, self.me, self.group, self.node_of)


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
    """Interface of the `schedule` axis (see the module docstring)."""

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
            raise ValueError(
                f"{type(self).__name__} does not run with dispatch={getattr(dispatcher, 'name', dispatcher)!r}"
            )
