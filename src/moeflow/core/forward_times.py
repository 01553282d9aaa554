"""What a layer measures of its own training forwards for `strategy="auto"`'s online correction
(`strategies/planners/auto_correction.py`): the forward's wall time on this rank and, within it, the
wait for its held copies (the sparse all-gather, or the prefetched copies' arrival). They travel with
the next forward's count exchange — two more rows of the all-gather the layer runs anyway, no extra
synchronisation — so that every rank hands the planner every rank's times.

Shape suffixes: W ranks, E experts.
"""

from __future__ import annotations

import numpy as np
import torch


class ForwardTimes:
    """The last training forward's times on this rank (0: evaluation, nothing to learn from)."""

    def __init__(self) -> None:
        self.forward_s = 0.0
        self.copies_s = 0.0

    def rows(self, num_experts: int, device) -> list[torch.Tensor]:
        """The two rows for the count exchange: each time in microseconds, E-wide like the counts."""
        return [torch.full((num_experts,), int(1e6 * s), device=device) for s in (self.forward_s, self.copies_s)]

    @staticmethod
    def report(planner, forward_WE: np.ndarray, copies_WE: np.ndarray, schedule: str | None) -> None:
        """Every rank's times of the previous forward, gathered, to the planner (with the schedule
        that ran it)."""
        planner.observe_time(forward_WE[:, 0] / 1e6, copies_WE[:, 0] / 1e6, schedule)
