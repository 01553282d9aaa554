"""Routing traces: load recorded ones, generate synthetic ones (input of ``moeflow simulate``).

A trace is the global flow matrix of every (iteration, layer): ``flow[i, l, w, e]`` = assignments
(all k choices) that rank w sends to expert e. Sources:

* ``moeflow train --record-routing`` writes ``.npz`` with ``flow`` int32 [steps, layers, W, E],
  ``steps`` int64 [steps] and ``meta`` (JSON: num_experts, top_k, world_size, d_model, d_hidden,
  tokens_per_rank);
* the SmartMoE trace (``../shared/traces/smartmoe-gpt-16ranks-32experts.npz``): ``counts`` uint16
  [iteration, layer, source_rank, micro_batch, expert] — summed over micro_batch here;
* synthetic: ``uniform``, ``zipf`` (skew s), ``drift`` (hot experts that move over time).

Shape suffixes: I iterations, L layers, W ranks, E experts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SYNTHETIC = ("uniform", "zipf", "drift")
"""Names of the synthetic generators."""

SMARTMOE_TRACE = Path("../shared/traces/smartmoe-gpt-16ranks-32experts.npz")
"""The real 16-rank trace, relative to the repository root (read in place, never copied)."""


@dataclass
class Trace:
    """Flow matrices of a run and what is known about the model that produced them."""

    flow_ILWE: np.ndarray
    """int64 [iterations, layers, W, E]: assignments rank w sent to expert e."""
    steps_I: np.ndarray
    """int64 [iterations]: training step of each row."""
    meta: dict[str, Any] = field(default_factory=dict)
    """num_experts, top_k, world_size, tokens_per_rank (and d_model, d_hidden when recorded)."""

    def __post_init__(self) -> None:
        self.flow_ILWE = np.asarray(self.flow_ILWE)
        if self.flow_ILWE.ndim != 4:
            raise ValueError(f"trace flow shape {self.flow_ILWE.shape}: expected [iterations, layers, W, E]")
        if np.any(self.flow_ILWE < 0):
            raise ValueError("trace flow: negative counts")
        self.flow_ILWE = self.flow_ILWE.astype(np.int64)
        self.steps_I = np.asarray(self.steps_I, dtype=np.int64)
        if self.steps_I.shape != (self.flow_ILWE.shape[0],):
            raise ValueError(f"trace steps shape {self.steps_I.shape}: expected ({self.flow_ILWE.shape[0]},)")
        I, L, W, E = self.flow_ILWE.shape
        self.meta.setdefault("world_size", W)
        self.meta.setdefault("num_experts", E)
        if self.meta["world_size"] != W or self.meta["num_experts"] != E:
            raise ValueError(f"trace meta {self.meta}: disagrees with flow shape W={W}, E={E}")

    @property
    def flow(self) -> np.ndarray:
        """Alias of ``flow_ILWE`` ([iters, layers, W, E])."""
        return self.flow_ILWE

    @property
    def world_size(self) -> int:
        return self.flow_ILWE.shape[2]

    @property
    def num_experts(self) -> int:
        return self.flow_ILWE.shape[3]

    def load_imbalance(self) -> np.ndarray:
        """max/mean expert load per (iteration, layer) -> [I, L]."""
        load_ILE = self.flow_ILWE.sum(axis=2)
        return load_ILE.max(-1) / np.maximum(load_ILE.mean(-1), 1e-12)

    def save(self, path: str | Path) -> None:
        """Write the format ``moeflow train --record-routing`` writes, atomically (a reader, or a
        resume after a kill, never sees a half-written file)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("wb") as fh:
            np.savez_compressed(
                fh,
                flow=self.flow_ILWE.astype(np.int32),
                steps=self.steps_I,
                meta=np.array(json.dumps(self.meta, sort_keys=True)),
            )
        os.replace(tmp, path)


def load_trace(path: str | Path) -> Trace:
    """Load a moeflow (``flow``) or SmartMoE (``counts``) trace; see the module docstring."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"trace {str(path)!r} does not exist")
    with np.load(p, allow_pickle=False) as data:
        meta = json.loads(str(data["meta"])) if "meta" in data.files else {}
        if "flow" in data.files:
            flow = data["flow"]
            steps = data["steps"] if "steps" in data.files else np.arange(flow.shape[0])
        elif "counts" in data.files:
            counts = data["counts"]  # [iteration, layer, source_rank, micro_batch, expert]
            if counts.ndim != 5:
                raise ValueError(f"trace {str(path)!r}: counts shape {counts.shape}, expected 5 dims")
            flow = counts.astype(np.int64).sum(axis=3)  # one iteration = all its micro-batches
            steps = data["iterations"] if "iterations" in data.files else np.arange(flow.shape[0])
            meta = {k: v for k, v in meta.items() if isinstance(v, (int, float, str))}
            # The SmartMoE trace's README (../shared/traces/README.md) states top-2 routing; its meta
            # JSON does not carry top_k as a field.
            meta.setdefault("top_k", 2)
            meta.setdefault("tokens_per_rank", int(flow[0, 0, 0].sum()) // int(meta.get("top_k", 2)))
        else:
            raise ValueError(f"trace {str(path)!r}: has neither 'flow' nor 'counts' (keys {data.files})")
    meta["world_size"], meta["num_experts"] = int(flow.shape[2]), int(flow.shape[3])
    return Trace(flow, steps, meta)


def synthetic_trace(
    kind: str,
    iterations: int,
    layers: int,
    world_size: int,
    num_experts: int,
    tokens_per_rank: int,
    top_k: int = 2,
    skew: float = 1.2,
    hot_experts: int = 2,
    hot_share: float = 0.5,
    drift_period: int = 50,
    seed: int = 0,
) -> Trace:
    """Synthetic flows. Each rank's k·T assignments are drawn multinomially from a per-(iteration,
    layer) expert distribution (a real top-k gate cannot give one token the same expert twice; at
    trace level that only caps an expert's count at T, which these distributions stay far below
    unless skew is extreme).

    * ``uniform``: p_e = 1/E.
    * ``zipf``: p_e ∝ 1/rank(e)^skew, with a random expert order per layer (fixed over iterations).
    * ``drift``: ``hot_experts`` experts share ``hot_share`` of the load, the rest is uniform; the hot
      set moves to the next experts every ``drift_period`` iterations (slowly drifting popularity,
      the locality Pro-Prophet §III and Hecate §5 exploit).
    """
    if kind not in SYNTHETIC:
        raise ValueError(f"trace kind={kind!r}: expected one of {list(SYNTHETIC)}")
    for name, v in (
        ("iterations", iterations),
        ("layers", layers),
        ("world_size", world_size),
        ("num_experts", num_experts),
        ("tokens_per_rank", tokens_per_rank),
        ("top_k", top_k),
        ("drift_period", drift_period),
    ):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name}={v!r}: must be a positive int")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k}: must be <= num_experts={num_experts}")
    if not 0 <= hot_share <= 1 or not 1 <= hot_experts <= num_experts:
        raise ValueError(f"hot_share={hot_share!r}, hot_experts={hot_experts!r}: need 0<=share<=1, 1<=hot<=E")
    if skew < 0:
        raise ValueError(f"skew={skew!r}: must be >= 0")
    rng = np.random.default_rng(seed)
    E = num_experts
    if kind == "uniform":
        p_ILE = np.full((iterations, layers, E), 1.0 / E)
    elif kind == "zipf":
        base_E = 1.0 / np.arange(1, E + 1) ** skew
        base_E /= base_E.sum()
        order_LE = np.argsort(rng.random((layers, E)), axis=1)  # random popularity order per layer
        p_LE = base_E[np.argsort(order_LE, axis=1)]
        p_ILE = np.broadcast_to(p_LE, (iterations, layers, E))
    else:
        shift_I = np.arange(iterations) // drift_period
        hot_IH = (shift_I[:, None] + np.arange(hot_experts)[None, :]) % E
        p_IE = np.full((iterations, E), (1 - hot_share) / E)
        np.add.at(p_IE, (np.arange(iterations)[:, None], hot_IH), hot_share / hot_experts)
        p_ILE = np.broadcast_to(p_IE[:, None, :], (iterations, layers, E))
    p_ILWE = np.broadcast_to(p_ILE[:, :, None, :], (iterations, layers, world_size, E))
    flow = rng.multinomial(top_k * tokens_per_rank, p_ILWE)
    meta = {
        "source": f"synthetic:{kind}",
        "num_experts": E,
        "top_k": top_k,
        "world_size": world_size,
        "tokens_per_rank": tokens_per_rank,
        "skew": skew if kind == "zipf" else None,
        "seed": seed,
    }
    return Trace(flow, np.arange(iterations), meta)
