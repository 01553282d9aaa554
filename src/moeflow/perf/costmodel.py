"""One cost model for planners, simulator and roofline (SPEC §1.1, §3.2, §4.3; DESIGN.md §2).

Three families of formulas live behind one object:

* α-β fits per operation kind, ``t = α + β·n`` with n in bytes (collectives) or FLOPs (GEMM) —
  FSMoE §4.1 Eq. 1, fitted by ``moeflow profile`` or taken from published constants;
* the topology-aware link model of FasterMoE §3 (Eq. 1-2): compute time is the slowest device's
  ``4·B_w·h·d / P``; communication time is ``max_l T_l / W_l`` over *directed* links, where
  ``T_l`` is the traffic the collective puts on link l (tree routing, see ``Topology``);
* Pro-Prophet's planner model (§IV-B Eq. 1-8) and FasterMoE's shadowing model (Eq. 7-8).

When both a profile fit and the topology are known, the all-to-all-v time is the link model
calibrated on the fitted uniform all-to-all: ``t(flow) = α_a2a + η·max_l T_l(flow)/W_l`` with
``η = β_a2a / (max_l T_l(uniform 1 byte)/W_l)``. A uniform exchange then reproduces the fit
exactly, and a skewed one is priced by its busiest link (the FasterMoE argument).

Shape suffixes: W devices, E experts, L directed links; ``...`` = any leading batch dims
(iterations, layers), every method is vectorised over them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy import optimize

from moeflow.core.placement import broadcast_tree, copies_by_tree
from moeflow.perf.topology import Topology, preset_peak_flops

OP_KINDS = (
    "a2a",
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "broadcast",
    "reduce",
    "p2p_intra",
    "p2p_inter",
    "copies",
    "gemm",
    "elementwise",
)
"""Operation kinds the profiler measures and the cost model prices."""

# FasterMoE §3.1: "a V100 GPU can achieve more than 90% of its peak throughput when running
# GeMMs"; the paper's model uses 90% of peak as P.
GEMM_PEAK_FRACTION = 0.9

# GEMMs per expert and FLOPs per token, forward (SPEC notation: 2-layer FFN = 4·d·h FLOPs/token;
# gated SwiGLU FFN has three d×h matrices = 6·d·h).
_EXPERT_GEMMS = {"ffn": 2, "swiglu": 3}
_EXPERT_FLOPS_PER_DH = {"ffn": 4, "swiglu": 6}


# Memory-bound work per assignment outside the GEMMs, forward, in elements: dispatch copy
# (read+write d), bias + activation on the hidden (read+write h, twice), second bias and the
# weighted combine (read+write d, twice). Backward touches about twice as much. FasterMoE's model
# leaves this out (GPU kernels fuse it and GEMMs dominate); on CPU it is 10-40% of a layer, so it
# is priced when the profile has an ``elementwise`` fit and ignored otherwise.
def elementwise_elements_per_assignment(d_model: int, d_hidden: int) -> int:
    return 6 * d_model + 4 * d_hidden


@dataclass(frozen=True)
class AlphaBeta:
    """``t = α + β·n`` for one operation kind (FSMoE §4.1 Eq. 1; TA-MoE Eq. 2)."""

    alpha_s: float
    """Start-up time in seconds."""
    beta_s_per_unit: float
    """Seconds per byte (collectives) or per FLOP (GEMM)."""
    unit: str = "byte"
    """``byte`` or ``flop``."""
    r2: float | None = None
    """Coefficient of determination of the least-squares fit (None for published constants)."""
    source: str = ""
    """Where the constants come from (profile file, paper figure)."""

    def __post_init__(self) -> None:
        if self.unit not in ("byte", "flop"):
            raise ValueError(f"AlphaBeta unit={self.unit!r}: expected 'byte' or 'flop'")
        for name in ("alpha_s", "beta_s_per_unit"):
            v = getattr(self, name)
            if not math.isfinite(v):
                raise ValueError(f"AlphaBeta {name}={v!r}: must be finite")

    def __call__(self, n: Any) -> Any:
        return self.alpha_s + self.beta_s_per_unit * np.asarray(n, dtype=np.float64)

    @classmethod
    def fit(cls, sizes: Sequence[float], times_s: Sequence[float], unit: str = "byte", source: str = "") -> AlphaBeta:
        """Least-squares line through (size, time) with an intercept, constrained to α, β >= 0
        (``scipy.optimize.lsq_linear``): a start-up time or a cost per byte cannot be negative, and
        an unconstrained fit on noisy small sizes can give α < 0 and negative predictions.
        r² is the coefficient of determination of the fitted line."""
        x, y = np.asarray(sizes, dtype=np.float64), np.asarray(times_s, dtype=np.float64)
        if x.shape != y.shape or x.size < 2 or np.unique(x).size < 2:
            raise ValueError(f"AlphaBeta.fit: need >= 2 distinct sizes with one time each, got sizes={x.tolist()}")
        scale = float(np.abs(x).max())  # columns of similar magnitude for the solver
        A = np.stack([np.ones_like(x), x / scale], axis=1)
        res = optimize.lsq_linear(A, y, bounds=(0.0, np.inf))
        alpha, beta = float(res.x[0]), float(res.x[1] / scale)
        ss_tot = float(np.sum((y - y.mean()) ** 2))
        r2 = 1.0 - float(np.sum((y - A @ res.x) ** 2)) / ss_tot if ss_tot > 0 else 1.0
        return cls(alpha, beta, unit, r2, source)

    def to_dict(self) -> dict[str, Any]:
        return {
            "alpha_s": self.alpha_s,
            "beta_s_per_unit": self.beta_s_per_unit,
            "unit": self.unit,
            "r2": self.r2,
            "source": self.source,
        }


# FSMoE Fig. 5 (§6.2): published fits, α in ms, β in ms per float32 element (comm) or per FLOP
# (GEMM). Converted below to seconds and seconds per byte.
_FSMOE_FIG5 = {
    "fsmoe_a": {
        "gemm": (4.26e-2, 2.29e-11),
        "a2a": (2.87e-1, 2.21e-7),
        "all_gather": (3.37e-1, 2.32e-6),
        "reduce_scatter": (3.95e-1, 2.34e-7),
        "all_reduce": (5.11e-1, 4.95e-6),
    },
    "fsmoe_b": {
        "gemm": (9.24e-2, 4.42e-11),
        "a2a": (1.75e-1, 3.06e-7),
        "all_gather": (3.20e-2, 1.68e-7),
        "reduce_scatter": (3.91e-2, 1.67e-7),
        "all_reduce": (8.37e-2, 5.99e-7),
    },
}


def _published_fits(preset: str) -> dict[str, AlphaBeta]:
    out = {}
    for kind, (a_ms, b_ms) in _FSMOE_FIG5.get(preset, {}).items():
        unit = "flop" if kind == "gemm" else "byte"
        beta = b_ms * 1e-3 if unit == "flop" else b_ms * 1e-3 / 4  # per element of 4 bytes
        out[kind] = AlphaBeta(a_ms * 1e-3, beta, unit, None, f"FSMoE Fig. 5 ({preset})")
    return out


@dataclass
class CostModel:
    """Prices compute and communication on a topology; see the module docstring."""

    topology: Topology
    """Devices, links and routes."""
    gemm_flops_per_s: float
    """P of FasterMoE Eq. 1: sustained GEMM throughput of one device (used without a ``gemm`` fit)."""
    fits: dict[str, AlphaBeta] = field(default_factory=dict)
    """α-β fits by operation kind (``OP_KINDS``); a missing kind is derived from the link model."""
    bytes_per_element: int = 4
    """Bytes of one activation/parameter element (4 = fp32, 2 = bf16)."""
    name: str = "custom"
    """Label for reports."""
    host_cores: int | None = None
    """CPU runs only: every device is a process on one host with this many cores (gloo on one
    machine, the netns testbed). Profiled compute times were measured with all ranks busy at once;
    with uneven loads the busiest rank speeds up as the others finish (processor sharing, see
    ``layer_compute_time``). None: each device computes on its own hardware (GPUs)."""
    a2a_calibration: bool = True
    """With an ``a2a`` fit: scale the link model so that a uniform exchange costs exactly the fit
    (module docstring). False: FasterMoE Eq. 2 as published — link bandwidths (from the topology
    or the point-to-point fits) and route latencies only; the ``a2a`` fit is then unused."""
    backend: str = "nccl"
    """The collectives' backend the priced runs use (``moeflow profile`` records its own): it decides
    how copies of shadowed experts travel (``copies_time``)."""

    def __post_init__(self) -> None:
        if not (self.gemm_flops_per_s > 0 and math.isfinite(self.gemm_flops_per_s)):
            raise ValueError(f"gemm_flops_per_s={self.gemm_flops_per_s!r}: must be a positive finite number")
        if self.host_cores is not None and (not isinstance(self.host_cores, int) or self.host_cores < 1):
            raise ValueError(f"host_cores={self.host_cores!r}: must be a positive int or None")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={self.backend!r}: expected 'gloo' or 'nccl'")
        if self.bytes_per_element not in (1, 2, 4, 8):
            raise ValueError(f"bytes_per_element={self.bytes_per_element!r}: expected 1, 2, 4 or 8")
        unknown = set(self.fits) - set(OP_KINDS)
        if unknown:
            raise ValueError(f"fits: unknown operation kinds {sorted(unknown)}; known {list(OP_KINDS)}")
        for k, f in self.fits.items():
            if not isinstance(f, AlphaBeta):
                raise TypeError(f"fits[{k!r}]={f!r}: expected AlphaBeta")
        topo, W = self.topology, self.topology.num_devices
        self._inv_bw_L = 1.0 / topo.bandwidth_L
        off = ~np.eye(W, dtype=bool)
        self._max_latency = float(topo.path_latency_WW[off].max()) if W > 1 else 0.0
        # Pro-Prophet's B̄: the mean bandwidth between two distinct devices (bottleneck of the route).
        if W > 1:
            bw = [topo.path_bandwidth(i, j) for i in range(W) for j in range(W) if i != j]
            self.mean_bandwidth_bytes_per_s = float(np.mean(bw))
            self.net_bandwidth_bytes_per_s = float(topo.bandwidth_L.min())
        else:
            self.mean_bandwidth_bytes_per_s = self.net_bandwidth_bytes_per_s = math.inf
        # Calibration of the link model on the fitted uniform all-to-all (module docstring).
        self._a2a_eta = 1.0
        if "a2a" in self.fits and W > 1 and self.a2a_calibration:
            unit_flow = np.full((W, W), 1.0 / W)
            per_byte = float(self.link_time(unit_flow))
            self._a2a_eta = self.fits["a2a"].beta_s_per_unit / per_byte
        # The same for copies through `broadcast_tree`: the profile's ``copies`` fit times one
        # message of n bytes from every owner at once, forward and back (``copies_time``).
        self._copies_eta = 1.0
        if "copies" in self.fits and copies_by_tree(topo.node_of, self.backend):
            per_byte = 2 * sum(float(self.link_time(f)) for f in self._tree_flows(np.ones(W)))
            self._copies_eta = self.fits["copies"].beta_s_per_unit / per_byte

    # ---- building blocks --------------------------------------------------------------------
    def link_time(self, bytes_WW: np.ndarray) -> np.ndarray:
        """FasterMoE Eq. 2: ``max_l T_l / W_l`` for flows ``[..., W, W]`` of bytes -> ``[...]`` seconds."""
        traffic_L = self.topology.link_traffic(bytes_WW)
        if traffic_L.shape[-1] == 0:
            return np.zeros(traffic_L.shape[:-1])
        return (traffic_L * self._inv_bw_L).max(axis=-1)

    def _latency(self, bytes_WW: np.ndarray) -> np.ndarray:
        """Slowest route latency among the pairs that exchange bytes."""
        lat = np.where(np.asarray(bytes_WW) > 0, self.topology.path_latency_WW, 0.0)
        return lat.max(axis=(-2, -1))

    def gemm_time(self, flops: Any, calls: Any = 1) -> np.ndarray:
        """Time of ``calls`` GEMMs totalling ``flops``: fitted α·calls + β·flops, else flops / P."""
        flops = np.asarray(flops, dtype=np.float64)
        if "gemm" in self.fits:
            f = self.fits["gemm"]
            return f.alpha_s * np.asarray(calls) * (flops > 0) + f.beta_s_per_unit * flops
        return flops / self.gemm_flops_per_s

    def expert_forward_time(
        self, tokens_W: Any, d_model: int, d_hidden: int, expert: str = "ffn", gemm_calls: Any = None
    ) -> np.ndarray:
        """Per-device forward expert time ``[..., W]``; FasterMoE Eq. 1 (``4·B_w·h·d / P`` for ffn).

        ``gemm_calls`` (per device) prices the α of a fitted GEMM model; default: one launch of each
        of the expert's GEMMs per device.
        """
        if expert not in _EXPERT_GEMMS:
            raise ValueError(f"expert={expert!r}: expected one of {sorted(_EXPERT_GEMMS)}")
        tokens = np.asarray(tokens_W, dtype=np.float64)
        flops = _EXPERT_FLOPS_PER_DH[expert] * d_model * d_hidden * tokens
        calls = _EXPERT_GEMMS[expert] if gemm_calls is None else gemm_calls
        return self.gemm_time(flops, calls)

    def elementwise_time(self, tokens_W: Any, d_model: int, d_hidden: int) -> np.ndarray:
        """Per-device forward time of the memory-bound part of the experts ``[..., W]`` (0 without an
        ``elementwise`` fit; see ``elementwise_elements_per_assignment``)."""
        tokens = np.asarray(tokens_W, dtype=np.float64)
        if "elementwise" not in self.fits:
            return np.zeros_like(tokens)
        nbytes = tokens * elementwise_elements_per_assignment(d_model, d_hidden) * self.bytes_per_element
        return np.where(tokens > 0, self.fits["elementwise"](nbytes), 0.0)

    def layer_compute_time(
        self, tokens_W: Any, d_model: int, d_hidden: int, expert: str = "ffn", gemm_calls: Any = None
    ) -> np.ndarray:
        """FasterMoE Eq. 1: ``Lat_comp = max_w`` forward expert time -> ``[...]`` (GEMMs, plus the
        memory-bound part when profiled)."""
        t_W = self.expert_forward_time(tokens_W, d_model, d_hidden, expert, gemm_calls)
        t_W = t_W + self.elementwise_time(tokens_W, d_model, d_hidden)
        W = t_W.shape[-1]
        C = self.host_cores
        if C is None or W <= C:
            return t_W.max(axis=-1)
        # W processes share C cores. The profiled times t_w are "all W busy" times, i.e. full-core
        # work w = t·C/W. Processor sharing: in the phase where n ranks are still busy each runs at
        # min(1, C/n); the phases end as ranks finish in ascending order of work.
        w_W = np.sort(t_W, axis=-1) * (C / W)
        dw_W = np.diff(w_W, axis=-1, prepend=0.0)
        active_W = W - np.arange(W)
        return (dw_W * np.maximum(1.0, active_W / C)).sum(axis=-1)

    # ---- collectives ------------------------------------------------------------------------
    def a2a_time(self, bytes_WW: np.ndarray) -> np.ndarray:
        """All-to-all-v where ``bytes_WW[i, j]`` bytes go from i to j -> ``[...]`` seconds."""
        bytes_WW = np.asarray(bytes_WW, dtype=np.float64)
        W = self.topology.num_devices
        if bytes_WW.shape[-2:] != (W, W):
            raise ValueError(f"flow shape {bytes_WW.shape}: last two dims must be ({W}, {W})")
        return self.a2a_time_pairs(bytes_WW.reshape(*bytes_WW.shape[:-2], W * W), np.arange(W * W))

    def a2a_time_pairs(self, bytes_P: np.ndarray, pairs_P: np.ndarray) -> np.ndarray:
        """``a2a_time`` for an exchange among a subset of ordered pairs: ``bytes_P[..., p]`` bytes
        go along pair ``pairs_P[p] = i·W + j`` (the grouped steps of FasterMoE §4.2 touch few pairs,
        so pricing only those keeps a 64-device replay cheap)."""
        bytes_P = np.asarray(bytes_P, dtype=np.float64)
        pairs = np.asarray(pairs_P, dtype=np.int64)
        if self.topology.num_devices == 1:
            return np.zeros(bytes_P.shape[:-1])
        traffic_L = bytes_P @ self.topology.routes_PL[pairs]
        t = self._a2a_eta * (traffic_L * self._inv_bw_L).max(axis=-1)
        calibrated = "a2a" in self.fits and self.a2a_calibration
        if calibrated:
            alpha = self.fits["a2a"].alpha_s
        else:
            alpha = np.where(bytes_P > 0, self.topology.path_latency_WW.reshape(-1)[pairs], 0.0).max(axis=-1)
        # An exchange with nothing to send costs nothing (no collective is launched).
        return np.where(bytes_P.sum(axis=-1) > 0, alpha + t, 0.0)

    def _ring_flow(self, per_hop_bytes: float, ranks: Sequence[int]) -> np.ndarray:
        W = self.topology.num_devices
        flow = np.zeros((W, W))
        n = len(ranks)
        for k in range(n):
            flow[ranks[k], ranks[(k + 1) % n]] += per_hop_bytes
        return flow

    def _ranks(self, ranks: Sequence[int] | None) -> list[int]:
        W = self.topology.num_devices
        ranks = list(range(W)) if ranks is None else [int(r) for r in ranks]
        if not ranks or any(not 0 <= r < W for r in ranks) or len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks={ranks!r}: expected distinct device ids in [0, {W})")
        return ranks

    def collective_time(self, kind: str, nbytes: float, ranks: Sequence[int] | None = None) -> float:
        """A ring collective of a buffer of ``nbytes`` (the full buffer, as NCCL/gloo size it).

        Over the whole group with a profile fit: the fit (FSMoE §4.1). Otherwise the link model
        (FasterMoE Eq. 2): ring all-reduce puts ``2·(n−1)/n·S`` on every ring hop, all-gather and
        reduce-scatter ``(n−1)/n·S``, pipelined broadcast/reduce ``S``.
        """
        if kind not in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce"):
            raise ValueError(f"kind={kind!r}: expected all_reduce, all_gather, reduce_scatter, broadcast or reduce")
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes!r}: must be >= 0")
        ranks = self._ranks(ranks)
        n = len(ranks)
        if n == 1 or nbytes == 0:
            return 0.0
        if kind in self.fits and n == self.topology.num_devices:
            return float(self.fits[kind](nbytes))
        share = {
            "all_reduce": 2 * (n - 1) / n,
            "all_gather": (n - 1) / n,
            "reduce_scatter": (n - 1) / n,
            "broadcast": 1.0,
            "reduce": 1.0,
        }[kind]
        flow = self._ring_flow(share * nbytes, ranks)
        steps = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1}.get(kind, n - 1)
        return float(steps * self._latency(flow) + self.link_time(flow))

    def p2p_time(self, nbytes: Any, src: int, dst: int) -> np.ndarray:
        """Point-to-point: fit of the matching kind (intra/inter node) or latency + S / bottleneck bw."""
        topo = self.topology
        if src == dst:
            return np.zeros_like(np.asarray(nbytes, dtype=np.float64))
        kind = "p2p_intra" if topo.node_of[src] == topo.node_of[dst] else "p2p_inter"
        if kind in self.fits:
            return self.fits[kind](nbytes)
        return topo.path_latency_WW[src, dst] + np.asarray(nbytes, dtype=np.float64) / topo.path_bandwidth(src, dst)

    def op_time(self, kind: str, n: Any) -> np.ndarray:
        """FSMoE §4.1 α-β form ``α_x + β_x·n`` for one op kind over the whole group (vectorised in n)."""
        if kind not in OP_KINDS:
            raise ValueError(f"kind={kind!r}: expected one of {list(OP_KINDS)}")
        if kind in self.fits:
            return self.fits[kind](n)
        n = np.asarray(n, dtype=np.float64)
        W = self.topology.num_devices
        if kind == "gemm":
            return n / self.gemm_flops_per_s
        if kind == "elementwise":
            return np.zeros(n.shape)
        if kind == "a2a":
            return self.a2a_time(np.multiply.outer(n / W, np.ones((W, W))))
        if kind in ("p2p_intra", "p2p_inter"):
            pair = self._probe_pair(kind == "p2p_inter")
            return self.p2p_time(n, *pair) if pair else np.full(n.shape, np.nan)
        return np.vectorize(lambda v: self.collective_time(kind, float(v)))(n)

    def _probe_pair(self, inter: bool) -> tuple[int, int] | None:
        node_of = self.topology.node_of
        for j in range(1, self.topology.num_devices):
            if (node_of[j] != node_of[0]) == inter:
                return 0, j
        return None

    def chunk_time(self, kind: str, n: Any, degree: Any) -> np.ndarray:
        """FSMoE §4.1: one of r pipeline chunks, ``t_x,r = α_x + (n_x / r)·β_x``."""
        degree = np.asarray(degree, dtype=np.float64)
        if np.any(degree < 1):
            raise ValueError(f"degree={degree.tolist()!r}: pipeline degree must be >= 1")
        return self.op_time(kind, np.asarray(n, dtype=np.float64) / degree)

    def materialize_time(self, param_bytes: float, holders_EW: np.ndarray, owner_E: np.ndarray) -> np.ndarray:
        """Sparse all-gather (Hecate §3) / Trans (Pro-Prophet) / shadow broadcast (FasterMoE §4.1):
        every non-owner holder of expert e receives ``param_bytes`` from its owner, all at once.
        ``holders_EW`` bool ``[..., E, W]`` -> ``[...]`` seconds. The reduce back is the same traffic
        reversed, priced by ``materialize_time`` on the transposed flow (symmetric links here)."""
        holders = np.asarray(holders_EW, dtype=bool)
        owner = np.asarray(owner_E, dtype=np.int64)
        W = self.topology.num_devices
        onehot_EW = np.zeros((owner.size, W))
        onehot_EW[np.arange(owner.size), owner] = 1.0
        extra = holders & ~onehot_EW.astype(bool)
        flow_WW = np.einsum("eo,...ej->...oj", onehot_EW, extra.astype(np.float64)) * param_bytes
        t = self.link_time(flow_WW) + self._latency(flow_WW)
        return np.where(extra.any(axis=(-2, -1)), t, 0.0)

    def copies_time(
        self, param_bytes: float, holders_EW: np.ndarray, owner_E: np.ndarray, direction: str = "materialize"
    ) -> float:
        """The sparse collectives as ``moeflow.core.sparse_collectives`` runs them, one direction
        (``"materialize"``: forward copies, ``"reduce"``: gradients back). Experts held by *every*
        device move as one message per owner: one broadcast / reduce per owner (FasterMoE Eq. 8: a
        pipelined ring carries the parameters once per link), or, where ``placement.copies_by_tree``
        says so (gloo across nodes), the two stages of ``broadcast_tree`` for all owners at once
        (the reduce runs the same links in reverse: equal time on symmetric links), scaled by η
        when the profile has a ``copies`` fit: the link model calibrated on every owner copying at
        once, as the all-to-all's is on the uniform exchange (concurrent messages on a CPU backend
        reach less than the links' rates). Partial replica sets go point-to-point
        (``materialize_time``; the gradients retrace the same routes reversed)."""
        if direction not in ("materialize", "reduce"):
            raise ValueError(f"direction={direction!r}: expected 'materialize' or 'reduce'")
        holders = np.asarray(holders_EW, dtype=bool)
        owner = np.asarray(owner_E, dtype=np.int64)
        W = holders.shape[1]
        owner_onehot_EW = np.eye(W, dtype=bool)[owner]
        everywhere_E = holders.all(axis=1) & (holders & ~owner_onehot_EW).any(axis=1)
        per_owner = np.bincount(owner[everywhere_E], minlength=W)
        node_of = self.topology.node_of
        if copies_by_tree(node_of, self.backend):
            flows = [f for f in self._tree_flows(per_owner * param_bytes) if f.any()]
            t = sum(float(self._copies_eta * self.link_time(f) + self._latency(f)) for f in flows)
        else:
            kind = "broadcast" if direction == "materialize" else "reduce"
            t = sum(self.collective_time(kind, int(n) * param_bytes) for n in per_owner[per_owner > 0])
        partial_EW = np.where(everywhere_E[:, None], owner_onehot_EW, holders)
        return float(t + self.materialize_time(param_bytes, partial_EW, owner))

    def _tree_flows(self, bytes_per_owner_W: np.ndarray) -> list[np.ndarray]:
        """Bytes `[W, W]` on each stage of `placement.broadcast_tree` when owner o sends
        `bytes_per_owner_W[o]` to every rank, all owners at once."""
        W = self.topology.num_devices
        flows = [np.zeros((W, W)), np.zeros((W, W))]
        for o in np.flatnonzero(bytes_per_owner_W):
            for flow, edges in zip(flows, broadcast_tree(int(o), self.topology.node_of)):
                for src, dst in edges:
                    flow[src, dst] += bytes_per_owner_W[o]
        return flows

    # ---- paper formulas for planners ------------------------------------------------------------
    def fastermoe_imbalance_time(self, tokens_W: Any, d_model: int, d_hidden: int) -> np.ndarray:
        """FasterMoE Eq. 7: ``max_w (3·4·B_w·h·d/P + 4·B_w·d·bytes/W_net)``."""
        B = np.asarray(tokens_W, dtype=np.float64)
        comp = 3 * self.expert_forward_time(B, d_model, d_hidden)
        comm = 4 * B * d_model * self.bytes_per_element / self.net_bandwidth_bytes_per_s
        return (comp + comm).max(axis=-1)

    def fastermoe_shadow_time(self, tokens_W: Any, num_shadowed: Any, d_model: int, d_hidden: int) -> np.ndarray:
        """FasterMoE Eq. 8: ``max_w 3·4·B'_w·h·d/P + 2·r·(2·h·d·bytes)/W_net`` (broadcast params
        forward, reduce grads backward; an expert has 2·h·d parameters)."""
        comp = 3 * self.layer_compute_time(tokens_W, d_model, d_hidden)
        param_bytes = 2 * d_model * d_hidden * self.bytes_per_element
        return comp + 2 * np.asarray(num_shadowed) * param_bytes / self.net_bandwidth_bytes_per_s

    def prophet_times(
        self,
        recv_tokens_W: Any,
        compute_tokens_W: Any,
        num_transferred: Any,
        num_not_transferred: Any,
        d_model: int,
        d_hidden: int,
        nonmoe_forward_s: float = 0.0,
        nonmoe_backward_s: float = 0.0,
    ) -> dict[str, np.ndarray]:
        """Pro-Prophet §IV-B Eq. 1-8 for one layer. Returns every term and both totals:

        ``a2a = max_i R_i·tok_bytes/B̄`` (Eq. 1), ``fec = max_i H_i/t`` with t tokens/s (Eq. 2),
        ``bec = 2·fec`` (Eq. 3), ``trans = s·(D−n)·size/(D·B̄)`` (Eq. 4), ``agg`` likewise (Eq. 5),
        ``total = 4·a2a + 3·fec + trans + agg`` (Eq. 6), ``overlapped`` with
        ``max(0, trans − fec − fnec)`` and ``max(0, agg − bec − bnec)`` (Eq. 7-8).
        """
        D = self.topology.num_devices
        bbar = self.mean_bandwidth_bytes_per_s
        tok_bytes = d_model * self.bytes_per_element
        size = 2 * d_model * d_hidden * self.bytes_per_element
        a2a = np.asarray(recv_tokens_W, dtype=np.float64).max(axis=-1) * tok_bytes / bbar
        fec = self.layer_compute_time(compute_tokens_W, d_model, d_hidden)
        bec = 2 * fec
        s, n = (
            np.asarray(num_transferred, dtype=np.float64),
            np.asarray(num_not_transferred, dtype=np.float64),
        )
        trans = s * (D - n) * size / (D * bbar)
        agg = trans
        total = 4 * a2a + 3 * fec + trans + agg
        ptrans = np.maximum(0.0, trans - fec - nonmoe_forward_s)
        pagg = np.maximum(0.0, agg - bec - nonmoe_backward_s)
        return {
            "a2a": a2a,
            "fec": fec,
            "bec": bec,
            "trans": trans,
            "agg": agg,
            "total": total,
            "overlapped": 4 * a2a + 3 * fec + ptrans + pagg,
        }

    # ---- construction and JSON --------------------------------------------------------------------
    @classmethod
    def from_preset(
        cls, name: str, gemm_flops_per_s: float | None = None, with_published_fits: bool = True
    ) -> CostModel:
        """A paper cluster; P defaults to 90% of the device's peak (FasterMoE §3.1). FSMoE testbeds
        also carry the α-β constants of FSMoE Fig. 5 unless ``with_published_fits=False``."""
        topo = Topology.preset(name)
        flops = gemm_flops_per_s if gemm_flops_per_s is not None else GEMM_PEAK_FRACTION * preset_peak_flops(name)
        fits = _published_fits(topo.name) if with_published_fits else {}
        return cls(topo, flops, fits, name=topo.name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "topology": self.topology.to_dict(),
            "gemm_flops_per_s": self.gemm_flops_per_s,
            "bytes_per_element": self.bytes_per_element,
            "a2a_calibration": self.a2a_calibration,
            "host_cores": self.host_cores,
            "backend": self.backend,
            "fits": {k: f.to_dict() for k, f in self.fits.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        """From ``to_dict`` output or a ``moeflow profile`` JSON (which has these keys and more)."""
        for key in ("topology", "gemm_flops_per_s"):
            if key not in data:
                raise ValueError(f"cost model JSON: missing key {key!r}")
        fits = {}
        for k, f in data.get("fits", {}).items():
            fits[k] = AlphaBeta(
                float(f["alpha_s"]),
                float(f["beta_s_per_unit"]),
                f.get("unit", "byte"),
                f.get("r2"),
                f.get("source", ""),
            )
        return cls(
            Topology.from_dict(data["topology"]),
            float(data["gemm_flops_per_s"]),
            fits,
            int(data.get("bytes_per_element", 4)),
            data.get("name", "profile"),
            data.get("host_cores"),
            bool(data.get("a2a_calibration", True)),
            data.get("backend", "nccl"),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"cost model file {str(path)!r} does not exist")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"cost model file {str(path)!r}: not JSON ({exc.msg})") from None
        return cls.from_dict(data)

    @classmethod
    def resolve(cls, value: str, gemm_flops_per_s: float | None = None) -> CostModel:
        """CLI helper: a topology preset name or a profile/cost-model JSON file."""
        from moeflow.perf.topology import PRESETS

        if value.lower().replace("-", "_") in PRESETS:
            return cls.from_preset(value, gemm_flops_per_s)
        if Path(value).is_file():
            if gemm_flops_per_s is None:
                return cls.load(value)
            # override before validation: a profile without a GEMM sweep has no P of its own
            return cls.from_dict({**json.loads(Path(value).read_text()), "gemm_flops_per_s": gemm_flops_per_s})
        raise ValueError(f"--cluster={value!r}: not a preset ({sorted(PRESETS)}) nor a profile JSON file")
