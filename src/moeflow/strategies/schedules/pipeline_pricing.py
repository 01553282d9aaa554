"""Pricing of FSMoE's pipelined block (`schedule="pipeline"`, `schedules/pipeline.py`): FSMoE Eq. 1's
per-chunk coefficients of a block from the shared cost model and the dispatcher's price
(`pass_models`, what Algorithm 1 and the schedule's `predict` run on), and the agreement of an
expert-sharding group on the degrees it chose (`agree_over_esp`).

Shape suffixes: W ranks, E experts; ``...`` = batch dims of a simulation.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moeflow.perf.pipeline_degree import PassModel
from moeflow.perf.pipeline_inputs import chunk_cost_ms
from moeflow.strategies.schedules.base import StepLoad


def pass_models(step: StepLoad, cost_model: Any, dispatcher: Any) -> tuple[PassModel, PassModel]:
    """FSMoE Eq. 1's coefficients of the block (forward, backward), in ms, ``[...]`` arrays: the
    all-to-all α from the dispatcher's price of one byte per exchanging pair and its volume from the
    price of the whole exchange; the experts' α from a fitted GEMM (one launch per GEMM of the
    slowest rank's experts with tokens, else 0) and their volume from the slowest rank's compute;
    backward doubles the experts (§4.4). The measured cost of one more chunk (``chunk_*`` fits of
    ``moeflow profile``, ``profiling.chunk_profile``; it includes an ESP layer's per-chunk collectives
    when profiled with that layout) is added to the experts' α of its pass, and the overlap the
    machine realises (``CostModel.pipeline_overlap``, η) goes with each pass. All-gather and
    reduce-scatter cost 0: under ESP they run inside each chunk's compute (``_intra_node`` in
    `schedules/pipeline.py`), their volume the same for every degree, their per-chunk start-up in
    the chunk fit."""
    send = np.asarray(step.send_tokens_WW, dtype=np.float64)
    W = send.shape[-1]
    off_WW = send * (1.0 - np.eye(W))
    bytes_WW = off_WW * step.shape.d_model * cost_model.bytes_per_element
    a2a = np.asarray(dispatcher.price(cost_model, bytes_WW), dtype=np.float64)
    a2a_alpha = np.minimum(np.asarray(dispatcher.price(cost_model, (off_WW > 0) * 1.0), dtype=np.float64), a2a)
    exp = np.asarray(cost_model.compute_time(step.computed_WE, step.shape), dtype=np.float64)
    exp_alpha = np.zeros_like(exp)
    if "gemm" in getattr(cost_model, "fits", {}):
        experts = (np.asarray(step.computed_WE) > 0).sum(-1).max(-1)
        exp_alpha = np.minimum(cost_model.fits["gemm"].alpha_s * step.shape.gemms * experts, exp)
    zero = np.zeros_like(a2a)

    def model(scale: float, chunk_ms: float, overlap: float) -> PassModel:
        return PassModel(
            (1e3 * a2a_alpha, zero, zero, 1e3 * scale * exp_alpha + chunk_ms),
            (1e3 * (a2a - a2a_alpha), zero, zero, 1e3 * scale * (exp - exp_alpha)),
            overlap,
        )

    (chunk_f, chunk_b), (overlap_f, overlap_b) = chunk_cost_ms(cost_model), cost_model.pipeline_overlap
    return model(1.0, chunk_f, overlap_f), model(2.0, chunk_b, overlap_b)


def agree_over_esp(choices: list[Any], esp_group: Any) -> list[int]:
    """One degree per pass for the whole ESP group. Its members run every chunk's all-gather and
    reduction together, so they must cut the block into the same number of chunks; each priced its
    own expert-parallel group's flow, which differs. The block runs in lockstep, as slow as its
    slowest group: the choice of the member whose predicted pass is slowest is taken (ties: the lower
    rank). One all-gather of 4 numbers, once (the degrees are chosen at the first forward)."""
    degrees = [c.degree for c in choices]
    if esp_group is None or dist.get_world_size(esp_group) == 1:
        return degrees
    mine = torch.tensor([[c.time_ms, c.degree] for c in choices], dtype=torch.float64)  # [pass, (time, r)]
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(esp_group))]
    dist.all_gather(gathered, mine, group=esp_group)
    all_M2 = torch.stack(gathered)  # [member, pass, (time, r)]
    slowest = torch.argmax(all_M2[:, :, 0], dim=0)  # first maximum per pass
    return [int(all_M2[m, p, 1]) for p, m in enumerate(slowest.tolist())]


def scalar_model(model: PassModel) -> PassModel:
    """The first element of a batched model (``[...]`` arrays): what Algorithm 1 solves for one block."""
    return PassModel(
        tuple(float(np.asarray(a).reshape(-1)[0]) for a in model.alpha_ms),
        tuple(float(np.asarray(v).reshape(-1)[0]) for v in model.volume_ms),
        model.overlap,
    )
