"""The exchange block: the dispatch → experts → combine part of one forward, as the layer hands
it to its schedule (`strategies.schedules`), which orders and overlaps its exchanges and computes.

Shape suffixes: A rows this rank sends (ordered by destination, then expert), R rows received,
D d_model, S source ranks, J experts this rank holds, W ranks, E experts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


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
    plan_SEW: np.ndarray | None = None
    """The layer's global dispatch plan: rows source s sends rank w for expert e (identical
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
