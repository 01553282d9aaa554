"""The `dispatch` axis: how token rows travel between ranks (`dispatch="a2a"`, `"hierarchical"`
in `hierarchical_a2a.py`).

A dispatcher moves rows with uneven splits inside autograd (`exchange(x, send_WW, me, group,
node_of)`, where `send_WW` is the global count of rows every rank sends every rank; its backward
is the reverse exchange) and prices that exchange for planners and the simulator (`price`), so a
transport is simulated the way it runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moeflow.core import dispatch


class Dispatcher:
    """Interface of the `dispatch` axis (module docstring); `name` is what schedules check."""

    name: str = ""

    def exchange(self, x_AD: torch.Tensor, send_WW: np.ndarray, me: int, group: Any, node_of=None) -> torch.Tensor:
        raise NotImplementedError

    def price(self, cost_model: Any, bytes_WW: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class A2ADispatcher(Dispatcher):
    """`dispatch="a2a"`: one `all_to_all_single` with uneven splits each way (FSMoE §3.1's plain
    all-to-all), priced by the cost model's link model (FasterMoE Eq. 2)."""

    name = "a2a"

    def exchange(self, x_AD: torch.Tensor, send_WW: np.ndarray, me: int, group: Any, node_of=None) -> torch.Tensor:
        """Rows of `send_WW[me]` out, rows of `send_WW[:, me]` in (by source rank)."""
        if group is None:  # one process: the rows stay (`all_to_all_v`), the splits are not needed
            return x_AD
        return dispatch.all_to_all_v(x_AD, send_WW[me].tolist(), send_WW[:, me].tolist(), group)

    def price(self, cost_model: Any, bytes_WW: np.ndarray) -> np.ndarray:
        """Seconds ``[...]`` of one exchange of ``bytes_WW[..., src, dst]``."""
        return cost_model.a2a_time(bytes_WW)
