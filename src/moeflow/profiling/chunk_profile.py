"""The cost of one more chunk of FSMoE's pipelined block, measured on the live backend
(``moeflow profile``, op kinds ``chunk_forward`` and ``chunk_backward``).

FSMoE Eq. 1 prices one of r chunks as ``α_x + (n_x/r)·β_x`` per operation, with α fitted from
each collective alone on an idle device. What a chunk really adds is more than that where the
transfers share the computing cores (CPU ranks on gloo: every chunk posts two more all-to-alls
whose threads and the kernel's TCP stack run beside the expert GEMMs; under expert sharding also
an all-gather of counts and rows and an all-reduce of outputs, synchronous inside the chunk's
compute), plus the chunk's own Python and autograd work. On the 2 × 2 network testbed one more
chunk measured 3.5–4.5 ms per block and pass without ESP and 5.5–8 ms with it, where the
collectives' fitted α are ≤ 5 µs (docs/fsmoe.md).

So it is measured as the pipeline pays it: one `MoELayer` (``ProfileConfig.chunk_layer``: tokens
per rank, d_model, d_hidden; 2 experts per expert-parallel rank, top-2, ffn) with
``schedule="pipeline"`` at each degree of ``chunk_degrees``, expert parallelism over the world,
or with ``chunk_esp_size`` > 1 FSMoE's layout (ESP groups of consecutive ranks inside a node,
expert parallelism across them). Timed: the forward without autograd and the forward + backward
(backward = step − forward, floored at 0). Fitted over the degrees: ``t(r) = a + b/r + c·r`` by non-negative
least squares (`chunk_fit`) — the shape of FSMoE's Case 2, ``2·t_a2a,r + r·t_exp,r``, where b/r
is the exchange the chunks overlap and c what every chunk adds; a line in r alone would net the
overlap gained against the chunks' cost and understate c. Kept: c as β (seconds per chunk) of
``chunk_forward`` / ``chunk_backward``, a as α; b goes into η (below; the cost model prices the
exchange itself from its own all-to-all fit).
`moeflow.strategies.schedules.pipeline_pricing.pass_models` and `moeflow tune` add β to the per-chunk
start-up of the experts' term (it runs on the computing cores, r times in FSMoE's Case 2).

Overlap realised (η, `overlap_share`): FSMoE's case formulas assume the overlapped stages hidden.
Priced ``η·overlapped + (1 − η)·serial`` (`perf.pipeline_degree`), the layer's time is
``t(r) = const + η·H/r + c·r`` with H the hideable time at r → ∞, the smaller of the exchange
(dispatch + combine) and the rest of the block: so η = b / H. The exchange is timed alone
(two all-to-alls of the layer's rows over the expert-parallel group, ``chunk_exchange_s``) and the rest
is t(1) minus it; η is clipped to [0, 1] per pass (the backward's exchanges move as many rows). The
profile writes η as ``pipeline_overlap`` (``CostModel.pipeline_overlap``); 1 where nothing was
measured. On GPUs η should come out near 1 (FSMoE's design point); on the 2 × 2 CPU testbed it is
far below (docs/fsmoe.md).

Shape suffixes: T tokens of this rank, D d_model.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from scipy import optimize

from moeflow.core.expert_sharding import to_expert_sharding
from moeflow.core.parallel import ParallelLayout
from moeflow.layer import MoELayer
from moeflow.perf.alpha_beta import CHUNK_KINDS, AlphaBeta


def check_chunk_layout(world: int, node_of: list[int], esp_size: int) -> int:
    """The expert-parallel size of the measured layout; raises where ``chunk_esp_size`` does not fit."""
    if world % esp_size:
        raise ValueError(f"chunk_esp_size={esp_size} does not divide the {world} ranks")
    for g in range(world // esp_size):
        members = node_of[g * esp_size : (g + 1) * esp_size]
        if len(set(members)) != 1:
            raise ValueError(
                f"chunk_esp_size={esp_size}: ranks {g * esp_size}..{(g + 1) * esp_size - 1} span nodes "
                f"{sorted(set(members))}; an ESP group must lie inside one node (FSMoE §3)"
            )
    return world // esp_size


def _fit_abc(degrees: Any, times_s: Any) -> tuple[np.ndarray, float]:
    """(a, b, c) ≥ 0 of ``t(r) = a + b/r + c·r`` (``scipy.optimize.lsq_linear``) and its r²."""
    r, y = np.asarray(degrees, dtype=np.float64), np.asarray(times_s, dtype=np.float64)
    if r.shape != y.shape or np.unique(r).size < 3:
        raise ValueError(f"chunk_fit: need >= 3 distinct degrees with one time each, got degrees={r.tolist()}")
    A = np.stack([np.ones_like(r), 1.0 / r, r], axis=1)
    res = optimize.lsq_linear(A, y, bounds=(0.0, np.inf))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((y - A @ res.x) ** 2)) / ss_tot if ss_tot > 0 else 1.0
    return res.x, r2


def chunk_fit(degrees: Any, times_s: Any, source: str = "moeflow profile") -> AlphaBeta:
    """``t(r) = a + b/r + c·r`` with a, b, c ≥ 0 -> α = a, β = c per chunk (module docstring); r²
    of that fit."""
    (a, _, c), r2 = _fit_abc(degrees, times_s)
    return AlphaBeta(float(a), float(c), "chunk", r2, source)


def overlap_share(degrees: Any, times_s: Any, exchange_s: float) -> float:
    """η = b / H of one pass (module docstring): b of the chunk fit, H the smaller of the exchange
    (`exchange_s`) and the rest of the unchunked block (the time at the smallest degree, minus the
    exchange); clipped to [0, 1]; 0 where nothing is hideable."""
    (_, b, _), _ = _fit_abc(degrees, times_s)
    at_one = float(np.asarray(times_s, dtype=np.float64)[int(np.argmin(degrees))])
    hideable = min(exchange_s, at_one - exchange_s)
    return float(np.clip(b / hideable, 0.0, 1.0)) if hideable > 0 else 0.0


def _layers(config: Any, layout: ParallelLayout, degrees: list[int]) -> list[MoELayer]:
    """One layer per degree, identical weights (same seed) and so identical routing."""
    tokens, d_model, d_hidden = config.chunk_layer
    layers = []
    for r in degrees:
        torch.manual_seed(0)
        layer = MoELayer(
            d_model, d_hidden, 2 * layout.ep_size, top_k=2, schedule="pipeline", schedule_options={"degree": r}
        )
        layer.to_expert_parallel(layout.ep_group)
        to_expert_sharding(layer, layout.esp_group)
        layers.append(layer)
    return layers


def measure_chunks(sweep: Any) -> None:
    """Record ``chunk_forward`` / ``chunk_backward`` in `sweep` (module docstring); nothing when the
    expert-parallel group has one rank (no chunked exchange to measure)."""
    config = sweep.config
    if not any(sweep.wants(k) for k in CHUNK_KINDS):
        return
    ep_size = check_chunk_layout(sweep.world, sweep.node_of, config.chunk_esp_size)
    if ep_size < 2:
        return
    layout = ParallelLayout(ep_size=ep_size, esp_size=config.chunk_esp_size, d_hidden=config.chunk_layer[2])
    degrees = list(config.chunk_degrees)
    generator = torch.Generator().manual_seed(1 + sweep.rank)
    x_TD = torch.randn(config.chunk_layer[0], config.chunk_layer[1], generator=generator, device=sweep.device)
    forward, backward = [], []
    for layer in _layers(config, layout, degrees):
        layer.to(sweep.device)

        def run_forward(layer: MoELayer = layer) -> None:
            with torch.no_grad():
                layer(x_TD)

        def run_step(layer: MoELayer = layer) -> None:
            layer(x_TD).sum().backward()

        fwd, step = sweep.time(run_forward), sweep.time(run_step)
        forward.append(fwd)
        backward.append(np.maximum(step - np.median(fwd), 0.0))  # a tiny layer's can drown in the noise
    sweep.record("chunk_forward", degrees, forward, "chunk")
    sweep.record("chunk_backward", degrees, backward, "chunk")
    # The layer's exchange alone: dispatch + combine of its rows (top-2) over the EP group.
    rows_RD = torch.randn(2 * config.chunk_layer[0], config.chunk_layer[1], generator=generator, device=sweep.device)
    rows_RD = rows_RD[: rows_RD.shape[0] // ep_size * ep_size]
    received_RD = torch.empty_like(rows_RD)

    def run_exchange() -> None:
        for _ in range(2):
            dist.all_to_all_single(received_RD, rows_RD, group=layout.ep_group)

    exchange_s = float(np.median(sweep.time(run_exchange)))
    medians = [[float(np.median(t)) for t in times] for times in (forward, backward)]
    sweep.scalars["chunk_exchange_s"] = exchange_s
    sweep.scalars["pipeline_overlap"] = [overlap_share(degrees, m, exchange_s) for m in medians]
