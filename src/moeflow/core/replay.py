"""Replaying a MoE layer's decisions when activation checkpointing recomputes its block.

`torch.utils.checkpoint` (non-reentrant) runs a block's forward a second time in backward to
rebuild the tensors it did not keep. A MoE layer's forward is not a pure function of its input: it
exchanges counts, plans a placement from the flow (planners keep a history), tags its messages with
a call counter, records statistics and balance choices. Recomputed as is, it would plan again (a
planner that learns from history may decide otherwise), count its stats and the balance choices
twice, and exchange counts once more. So the checkpoint's `context_fn` hands the two passes one
`Tape`: the first pass records each layer's `Decision` (the routing it chose, the flow, the
placement, the dispatch plan, the message tag), the recomputation takes it back — it checks that it
routed the same way (deterministic kernels and the restored RNG state make it so), skips the count
exchange, the planner and every record, and runs the same exchanges with the same plan, which every
rank reaches at the same point of the same backward: the same collectives in the same order.

    tape = Tape()
    checkpoint(block, x, use_reentrant=False, context_fn=lambda: (tape.recording(), tape.replaying()))

Shape suffixes: A assignments, W ranks of the expert-parallel group, E experts, S source ranks.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

RECOMPUTE_MODES = ("none", "selective", "full")
"""Activation checkpointing per block (docs/parallel.md)."""

_STATE: contextvars.ContextVar[tuple[str, Tape | None]] = contextvars.ContextVar("moeflow_replay", default=("", None))


@dataclass
class Decision:
    """What one MoE layer decided in the first pass of a checkpointed block."""

    expert_A: torch.Tensor
    """The routing: expert of every kept assignment (checked again on recomputation)."""
    flow_WE: np.ndarray
    """The expert-parallel group's flow."""
    placement: Any
    """The planner's placement."""
    plan_SEW: np.ndarray
    """The dispatch plan."""
    call_id: int
    """The layer's forward counter (message tags of asynchronous schedules)."""


class Tape:
    """The decisions of one checkpointed block's first pass, one per MoE layer in it."""

    def __init__(self) -> None:
        self._decisions: dict[int, Decision] = {}

    def put(self, layer: Any, decision: Decision) -> None:
        self._decisions[id(layer)] = decision

    def take(self, layer: Any, expert_A: torch.Tensor) -> Decision:
        """The recorded decision of `layer`, after checking that recomputation routed the same way."""
        decision = self._decisions.get(id(layer))
        if decision is None:
            raise RuntimeError("activation checkpointing: a MoE layer is recomputed without a recorded first pass")
        if not torch.equal(decision.expert_A, expert_A.detach()):
            raise RuntimeError(
                "activation checkpointing: the recomputed routing differs from the first pass (a gate with "
                "randomness outside torch's RNG, or non-deterministic kernels: set train.deterministic=true)"
            )
        return decision

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        token = _STATE.set(("record", self))
        try:
            yield
        finally:
            _STATE.reset(token)

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        token = _STATE.set(("replay", self))
        try:
            yield
        finally:
            _STATE.reset(token)

    def contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """`context_fn` of `torch.utils.checkpoint.checkpoint`: (first pass, recomputation)."""
        return self.recording(), self.replaying()


def replay_state() -> tuple[str, Tape | None]:
    """("record", tape) in a checkpointed block's first pass, ("replay", tape) in its
    recomputation, ("", None) elsewhere."""
    return _STATE.get()
