"""`schedule="sync"`: one exchange out, the experts, one exchange back; nothing overlaps."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moeflow.core.exchange import ExchangeBlock
from moeflow.strategies.schedules.base import PredictedBlock, Schedule, StepLoad


class SyncSchedule(Schedule):
    """The synchronous block (FasterMoE §3.3: a step costs `3·Lat_comp + 4·Lat_comm`)."""

    def execute(self, block: ExchangeBlock) -> torch.Tensor:
        x_sent_AD = block.hooks("before_dispatch", block.x_sent_AD)
        x_recv_RD = block.exchange(x_sent_AD)
        x_recv_RD = block.hooks("after_dispatch", x_recv_RD)
        y_recv_RD = block.hooks("before_combine", block.compute(x_recv_RD, block.counts_SJ))
        y_back_AD = block.exchange(y_recv_RD, back=True)
        return block.hooks("after_combine", y_back_AD)

    def predict(self, step: StepLoad, cost_model: Any, dispatcher: Any) -> PredictedBlock:
        """`3·Lat_comp + 4·Lat_comm`: four exchanges priced by the dispatcher (the combine is the
        dispatch reversed; a topology's links are duplex with the same bandwidth both ways)."""
        send = np.asarray(step.send_tokens_WW, dtype=np.float64)
        W = send.shape[-1]
        bytes_WW = send * (1.0 - np.eye(W)) * step.shape.d_model * cost_model.bytes_per_element
        comm = 4 * dispatcher.price(cost_model, bytes_WW)
        compute = 3 * cost_model.compute_time(step.computed_WE, step.shape)
        return PredictedBlock(compute + comm, compute, comm)
