"""What a layer measures of its own training steps for `strategy="auto"`'s online correction
(`strategies/planners/auto_correction.py`): the forward's wall time on this rank, within it the wait
for its held copies (the sparse all-gather, or the prefetched copies' arrival), and the layer's
backward (from its output's gradient arriving to its input's gradient leaving, `hooks.time_backward`) and
within it the copies' gradient sums going back to their owners (`sparse_collectives.materialize`),
and the forward's expert computes (every call of the schedule's `compute`, wherever the schedule
puts them). Copies the block-wise prefetch sent ahead may be waited on inside the block before
(`core.prefetch`: part of them before that layer's combine, their gradients in its backward): those
waits count as the layer's whose copies they are — out of the waiting layer's times, into this
one's and its copies' (`lend`, `borrow`) — so that a prefetched placement is measured at what its
copies cost, wherever the wait falls. They travel with the next forward's count exchange — five
more rows of the all-gather the layer runs anyway, no extra synchronisation — so that every rank
hands the planner every rank's times.

Shape suffixes: W ranks, E experts, T tokens.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from moeflow.core import dispatch
from moeflow.core.hooks import time_backward


class LayerTimes:
    """The last training forward's times on this rank, and its backward's (0: evaluation or no
    backward, nothing to learn from)."""

    def __init__(self) -> None:
        self.forward_s = 0.0
        self.copies_s = 0.0
        self.backward_s = 0.0
        self.copies_backward_s = 0.0
        self.compute_s = 0.0  # of the forward: its expert computes (every call of the schedule's compute)
        self._compute_events: list = []  # on CUDA: (start, end) events of each compute, read when taken
        self._lent_s = [0.0, 0.0]  # (forward, backward): waits inside this layer for a later layer's copies
        self._borrowed_s = 0.0  # waits elsewhere for this forward's prefetched copies (before it ran)

    def record_forward(self, seconds: float, training: bool) -> None:
        """The forward's wall time (0 outside training: nothing to learn from), less the waits it
        lent, plus those borrowed."""
        self.forward_s = seconds - self._lent_s[0] + self._borrowed_s if training else 0.0
        self._lent_s[0] = self._borrowed_s = 0.0

    def record_copies(self, seconds: float, training: bool) -> None:
        """The forward's wait for its copies, plus the waits for them borrowed from the block before."""
        self.copies_s = seconds + self._borrowed_s if training else 0.0

    def lend(self, seconds: float, backward: bool) -> None:
        """This layer's forward (or backward) waited `seconds` for another layer's prefetched copies."""
        self._lent_s[backward] += seconds

    def borrow(self, seconds: float, backward: bool) -> None:
        """Another layer's span (or the step's end) waited `seconds` for this layer's prefetched copies
        (forward: before this forward runs; backward: their gradients, after this backward ran)."""
        if backward:
            self.backward_s += seconds
            self.copies_backward_s += seconds
        else:
            self._borrowed_s += seconds

    def record_copies_backward(self, seconds: float) -> None:
        """The copies' gradient sums of the last backward (`sparse_collectives.materialize`'s timer)."""
        self.copies_backward_s = seconds

    def exchange_counts(self, counts: list[torch.Tensor], group, planner, schedule: str | None) -> list[np.ndarray]:
        """The layer's count exchange (`dispatch.exchange_counts`) of `counts`; with a `planner`
        that learns from times, the last forward's and backward's ride along as five more rows and
        reach it (with the `schedule` that ran them). This forward's computes are counted from here."""
        extra = self.take_rows(counts[0].numel(), counts[0].device) if planner is not None else []
        rows = dispatch.exchange_counts(counts + extra, group)
        if planner is not None:
            self.report(planner, rows[len(counts) :], schedule)
        self.computes_from_here()
        return rows[: len(counts)]

    def take_rows(self, num_experts: int, device) -> list[torch.Tensor]:
        """The five rows for the count exchange: each time in microseconds, E-wide like the counts.
        The backward's times are taken (0 until the next backward: a forward without one sends 0)."""
        for start, end in self._compute_events:  # done long since (a backward ran): no wait
            end.synchronize()
            self.compute_s += start.elapsed_time(end) / 1e3
        self._compute_events.clear()
        times = (self.forward_s, self.copies_s, self.backward_s, self.copies_backward_s, self.compute_s)
        self.backward_s = self.copies_backward_s = 0.0
        return [torch.full((num_experts,), int(1e6 * s), device=device) for s in times]

    def computes_from_here(self) -> None:
        """This forward's computes are counted from here (after the last ones were taken)."""
        self.compute_s = 0.0
        self._compute_events.clear()

    def timed_compute(self, compute, x_RD: torch.Tensor, counts_SJ: np.ndarray) -> torch.Tensor:
        """`compute(x_RD, counts_SJ)`, its time added to the forward's computes: wall time on the CPU,
        CUDA events on a GPU (kernels run asynchronously; read when the times are taken)."""
        if x_RD.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            y_RD = compute(x_RD, counts_SJ)
            end.record()
            self._compute_events.append((start, end))
            return y_RD
        started = time.perf_counter()
        y_RD = compute(x_RD, counts_SJ)
        self.compute_s += time.perf_counter() - started
        return y_RD

    def time_backward(self, x_TD: torch.Tensor, training: bool):
        """At the start of a forward: `x_TD` marked so that the backward that follows is timed, and
        the function that marks the layer's output (`hooks.time_backward`). Outside training or
        under `torch.no_grad()` nothing is marked."""
        if not (training and torch.is_grad_enabled()):
            return x_TD, lambda y_TD: y_TD

        def record(seconds: float) -> None:
            self.backward_s = seconds - self._lent_s[1]
            self._lent_s[1] = 0.0

        return time_backward(x_TD, record)

    @staticmethod
    def report(planner, rows_WE: list[np.ndarray], schedule: str | None) -> None:
        """Every rank's times of the previous forward and backward (the five rows, gathered) to the
        planner, with the schedule that ran them."""
        forward_W, copies_W, backward_W, copies_backward_W, compute_W = (row_WE[:, 0] / 1e6 for row_WE in rows_WE)
        planner.observe_time(forward_W, copies_W, schedule, backward_W, copies_backward_W, compute_W)
