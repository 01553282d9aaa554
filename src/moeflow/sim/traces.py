"""Routing traces: record, load, rescale and generate them (the input of ``moeflow simulate``).

A trace is the global flow matrix of every (iteration, layer): ``flow[i, l, w, e]`` = assignments
(all k choices) that rank w sends to expert e (format: docs/traces.md). Sources:

* ``moeflow train --record-routing`` (``TraceRecorder``) writes ``.npz`` with ``flow`` int32
  [steps, layers, W, E], ``steps`` int64 [steps] and ``meta`` (JSON: num_experts, top_k,
  world_size, d_model, d_hidden, expert, tokens_per_rank, layers);
* the SmartMoE excerpt shipped with the package (``SMARTMOE_TRACE``, ``--trace smartmoe``): a real
  GPT-MoE training run, 16 ranks × 32 experts, in the same format (docs/traces.md: source, licence);
* SmartMoE's own ``counts`` arrays [iteration, layer, source_rank, micro_batch, expert], summed over
  micro-batches;
* synthetic: ``uniform``, ``zipf`` (skew s), ``drift`` (hot experts that move over time).

``Trace.rescale`` replays a trace at another scale: source ranks and experts are folded (summed in
contiguous blocks) or unfolded (split evenly), so a 16-rank trace prices a 4-rank testbed or a
64-device cluster.

Shape suffixes: I iterations, L layers, W ranks, E experts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moeflow.core.checks import positive_int

SYNTHETIC = ("uniform", "zipf", "drift")
"""Names of the synthetic generators."""

SMARTMOE_TRACE = Path(__file__).resolve().parents[1] / "data" / "smartmoe_gpt_excerpt.npz"
"""The real 16-rank SmartMoE trace excerpt that ships with the package (docs/traces.md)."""


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

    def rescale(self, world_size: int, num_experts: int | None = None) -> Trace:
        """The same routing at another scale (docs/traces.md): source ranks folded (contiguous blocks
        of W/W' ranks summed, as their tokens would be batched together) or unfolded (each rank's
        counts split evenly over W'/W ranks, remainders to the first), and experts likewise when
        `num_experts` is given. The expert load shares are kept exactly when folding and up to
        rounding when unfolding; `tokens_per_rank` follows."""
        positive_int("world_size", world_size)
        num_experts = self.num_experts if num_experts is None else positive_int("num_experts", num_experts)
        flow = _resize_axis(self.flow_ILWE, 2, world_size, "world_size")
        flow = _resize_axis(flow, 3, num_experts, "num_experts")
        meta = dict(self.meta, world_size=world_size, num_experts=num_experts)
        meta.setdefault("rescaled_from", [self.world_size, self.num_experts])
        if "tokens_per_rank" in meta:
            meta["tokens_per_rank"] = int(meta["tokens_per_rank"]) * self.world_size // world_size
        return Trace(flow, self.steps_I.copy(), meta)

    def balanced(self) -> Trace:
        """The force-balanced trace: every rank's assignments of every (iteration, layer) spread
        evenly over the experts (`balanced_flow`) — what perfectly even routing of the same tokens
        sends, the ceiling a placement's share is measured against."""
        return Trace(balanced_flow(self.flow_ILWE), self.steps_I.copy(), dict(self.meta, balanced=True))

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


def balanced_flow(flow_WE: np.ndarray) -> np.ndarray:
    """Each rank's assignments `flow[..., w, :].sum()` spread evenly over the E experts: T // E each,
    the remainder one more each to the experts w, w + 1, ... (mod E), so that no expert gets more
    than one assignment above another's."""
    flow = np.asarray(flow_WE, dtype=np.int64)
    W, E = flow.shape[-2:]
    total = flow.sum(-1, keepdims=True)
    rank_of_expert = (np.arange(E)[None, :] - np.arange(W)[:, None]) % E  # expert e's turn for rank w
    return total // E + (rank_of_expert < total % E)


def _resize_axis(flow: np.ndarray, axis: int, size: int, name: str) -> np.ndarray:
    """Fold (sum contiguous blocks) or unfold (split evenly) one axis of a flow to `size`."""
    n = flow.shape[axis]
    if size == n:
        return flow
    moved = np.moveaxis(flow, axis, -1)
    if n % size == 0:
        out = moved.reshape(*moved.shape[:-1], size, n // size).sum(-1)
    elif size % n == 0:
        parts = size // n
        base, rem = moved // parts, moved % parts
        pieces = base[..., None] + (np.arange(parts) < rem[..., None])
        out = pieces.reshape(*moved.shape[:-1], size)
    else:
        raise ValueError(
            f"{name}={size}: a trace with {n} cannot be folded or unfolded onto it (one must divide the other)"
        )
    return np.moveaxis(out, -1, axis)


def load_trace(path: str | Path) -> Trace:
    """Load a moeflow (``flow``) or SmartMoE (``counts``) trace; see the module docstring."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"trace {str(path)!r} does not exist")
    try:
        return _read_trace(p)
    except (OSError, ValueError, KeyError, EOFError, json.JSONDecodeError) as exc:
        if str(p) in str(exc):
            raise
        # numpy reads a file that is not an .npz archive as a pickle and refuses it: say what it is not.
        why = "not a NumPy .npz archive" if "pickled" in str(exc) else str(exc)
        raise ValueError(f"trace {str(path)!r}: not a routing trace ({why}; format: docs/traces.md)") from None


def _read_trace(p: Path) -> Trace:
    path = p
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
            # SmartMoE's GPT-MoE traces are top-2 (SmartMoE §6); their meta does not carry top_k.
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
        positive_int(name, v)
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k}: must be <= num_experts={num_experts}")
    if not 0 <= hot_share <= 1 or not 1 <= hot_experts <= num_experts:
        raise ValueError(f"hot_share={hot_share!r}, hot_experts={hot_experts!r}: need 0<=share<=1, 1<=hot<=E")
    if skew < 0:
        raise ValueError(f"skew={skew!r}: must be >= 0")
    rng = np.random.default_rng(seed)
    E = num_experts
    p_ILE = _expert_probabilities(kind, iterations, layers, E, skew, hot_experts, hot_share, drift_period, rng)
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


def _expert_probabilities(kind, iterations, layers, E, skew, hot_experts, hot_share, drift_period, rng) -> np.ndarray:
    """p `[I, L, E]` of a synthetic trace (see `synthetic_trace`)."""
    if kind == "uniform":
        return np.full((iterations, layers, E), 1.0 / E)
    if kind == "zipf":
        base_E = 1.0 / np.arange(1, E + 1) ** skew
        base_E /= base_E.sum()
        order_LE = np.argsort(rng.random((layers, E)), axis=1)  # random popularity order per layer
        return np.broadcast_to(base_E[np.argsort(order_LE, axis=1)], (iterations, layers, E))
    shift_I = np.arange(iterations) // drift_period
    hot_IH = (shift_I[:, None] + np.arange(hot_experts)[None, :]) % E
    p_IE = np.full((iterations, E), (1 - hot_share) / E)
    np.add.at(p_IE, (np.arange(iterations)[:, None], hot_IH), hot_share / hot_experts)
    return np.broadcast_to(p_IE[:, None, :], (iterations, layers, E))


class TraceRecorder:
    """Per-step, per-MoE-layer flow matrices `[L, W, E]` of a training run (`moeflow train
    --record-routing`), written as one `.npz` in the format above. Flows are global (identical on
    every rank), so one rank records."""

    def __init__(self, meta: dict[str, Any]) -> None:
        self.meta = meta
        self.steps: list[int] = []
        self.flows: list[np.ndarray] = []

    def append(self, step: int, flow_LWE: np.ndarray) -> None:
        self.steps.append(step)
        self.flows.append(np.asarray(flow_LWE).astype(np.int32))

    def write(self, path: str | Path) -> None:
        """Atomically replace `path` with the trace so far."""
        L, W, E = len(self.meta["layers"]), self.meta["world_size"], self.meta["num_experts"]
        flow = np.stack(self.flows) if self.flows else np.zeros((0, L, W, E), np.int32)
        Trace(flow, np.asarray(self.steps, np.int64), dict(self.meta)).save(path)

    def load_until(self, path: str | Path, last_step: int) -> None:
        """On resume: keep the recorded steps up to the checkpoint's. A trace recorded with other
        dimensions (a different world size) is kept aside as `<name>.until_step<N>.npz`."""
        path = Path(path)
        if not path.exists():
            return
        trace = load_trace(path)
        if trace.meta != self.meta:
            os.replace(path, path.with_name(f"{path.stem}.until_step{last_step}{path.suffix}"))
            return
        keep = trace.steps_I <= last_step
        self.steps = trace.steps_I[keep].tolist()
        self.flows = list(trace.flow_ILWE[keep].astype(np.int32))


def resolve_trace(value: str) -> Trace:
    """CLI helper: `smartmoe` (the shipped excerpt) or a trace `.npz` path."""
    return load_trace(SMARTMOE_TRACE if value == "smartmoe" else Path(value))
