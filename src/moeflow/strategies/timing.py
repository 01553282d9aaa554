"""What `strategy="auto"` and `schedule="auto"` learn from: the layer's measured forwards, agreed
across ranks.

`LayerTimer` is a hook (`core.hooks`) the layer installs when its planner or schedule observes time.
Per forward it measures on this rank the wait for the held copies (`wrap_copies`: the sparse
all-gather, or the prefetched copies' arrival), the expert computes (`wrap_compute`: every call the
schedule makes) and the exchange block from its first dispatch to its last combine
(`before_dispatch` → `after_combine`); the block less its computes is the exposed token exchange.
Every `AGREE_EVERY` forwards, at the start of the next, one all-reduce (max) over the layer's group
gives every rank the slowest rank's times of each of those forwards, handed to the observers in
order: every rank then corrects, and decides, identically. On CUDA the spans are CUDA events, read
when agreed (long done by then).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from moeflow.core.hooks import MoEHook

AGREE_EVERY = 8
"""Forwards between two agreements: one small all-reduce per this many forwards of a layer."""


class Sample(NamedTuple):
    """One forward's times on the slowest rank (seconds)."""

    copies_s: float
    """The wait for the held copies."""
    compute_s: float
    """The expert computes."""
    block_s: float
    """The exchange block, first dispatch to last combine."""

    @property
    def exchange_s(self) -> float:
        """The block's exposed token exchanges: the block less its computes."""
        return max(self.block_s - self.compute_s, 0.0)


class Ratio:
    """An exponentially weighted mean of measured / predicted: each new ratio weighs `smoothing`
    (the first sets it); None until one was observed."""

    def __init__(self, smoothing: float) -> None:
        self.smoothing = smoothing
        self.value: float | None = None

    def update(self, measured_s: float, predicted_s: float) -> None:
        if predicted_s <= 0.0:
            return
        ratio = measured_s / predicted_s
        self.value = ratio if self.value is None else (1.0 - self.smoothing) * self.value + self.smoothing * ratio


class _Forward:
    """One forward's spans on this rank: wall clock on the CPU, CUDA events on a GPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.spans: dict[str, list] = {"copies": [], "compute": [], "block": []}
        self._block_start: Any = None

    def stamp(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def timed(self, name: str, run: Callable, *args: Any) -> Any:
        start = self.stamp()
        out = run(*args)
        self.spans[name].append((start, self.stamp()))
        return out

    def seconds(self, name: str) -> float:
        if not self.cuda:
            return sum(end - start for start, end in self.spans[name])
        total = 0.0
        for start, end in self.spans[name]:
            end.synchronize()
            total += start.elapsed_time(end) / 1e3
        return total


class LayerTimer(MoEHook):
    """Times a layer's forwards for its `observers` (module docstring); the layer puts it first
    among its hooks, so that its copies' span holds every wait for them."""

    replayable = False  # a recomputed forward would be timed twice

    def __init__(self, observers: list) -> None:
        self.observers = observers
        self.forwards = 0
        self._current: _Forward | None = None
        self._done: list[_Forward] = []

    def before_moe_start(self, layer, x):
        if self._done and self.forwards % AGREE_EVERY == 0:
            self._agree([layer.group, layer.replica_group], x.device)
        self._current = _Forward(x.is_cuda)
        self.forwards += 1

    def wrap_copies(self, layer, gather):
        return lambda *args: self._current.timed("copies", gather, *args)

    def wrap_compute(self, layer, compute):
        return lambda *args: self._current.timed("compute", compute, *args)

    def before_dispatch(self, layer, x):
        self._current._block_start = self._current.stamp()

    def after_combine(self, layer, y):
        self._current.spans["block"].append((self._current._block_start, self._current.stamp()))

    def before_moe_end(self, layer, y):
        self._done.append(self._current)

    def _agree(self, groups: list, device: torch.device) -> None:
        """The slowest rank's times of the forwards done (one all-reduce per group: the layer's
        expert-parallel group, then its data-parallel replicas, which plan alike), to every observer."""
        done, self._done = self._done, []
        times_N3 = torch.tensor([[f.seconds(n) for n in ("copies", "compute", "block")] for f in done])
        for group in groups:
            if group is None:
                continue
            times_N3 = times_N3.to(device)  # nccl reduces device tensors
            dist.all_reduce(times_N3, op=dist.ReduceOp.MAX, group=group)
        samples = [Sample(*row) for row in times_N3.tolist()]
        for observer in self.observers:
            observer.observe_time(samples)
