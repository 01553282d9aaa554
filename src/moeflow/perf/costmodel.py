"""One cost model for planners, simulator and roofline (docs/performance.md).

Two families of formulas live behind one object:

* α-β fits per operation kind, ``t = α + β·n`` with n in bytes (collectives) or FLOPs (GEMM) —
  FSMoE §4.1 Eq. 1, fitted by ``moeflow profile`` or taken from published constants
  (``moeflow.perf.alpha_beta``);
* the topology-aware link model of FasterMoE §3 (Eq. 1-2): compute time is the slowest device's
  ``4·B_w·h·d / P``; communication time is ``max_l T_l / W_l`` over *directed* links, where
  ``T_l`` is the traffic the collective puts on link l (tree routing, see ``Topology``).

Planners and the simulator price a layer with the same methods (``compute_time``, ``a2a_time``,
``copies_time``, ``count_exchange_time``), so a plan is chosen on the numbers it is simulated with.

When both a profile fit and the topology are known, the all-to-all-v time is the link model
calibrated on the fitted uniform all-to-all: ``t(flow) = α_a2a + η·max_l T_l(flow)/W_l`` with
``η = β_a2a / (max_l T_l(uniform 1 byte)/W_l)``. A uniform exchange then reproduces the fit
exactly, and a skewed one is priced by its busiest link (the FasterMoE argument).

Where a cost model comes from (presets, JSON files, a sub-cluster) is its base class
``perf.costmodel_sources.CostModelSources``; the prices of expert copies, ``perf.copies_pricing.CopiesPricing``.

Shape suffixes: W devices, E experts, L directed links and P ordered device pairs (as `Topology` names
them: public names); ``...`` = any leading batch dims
(iterations, layers), every method is vectorised over them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import copies_by_tree, tree_flows
from moeflow.perf.alpha_beta import OP_KINDS, AlphaBeta
from moeflow.perf.copies_pricing import CopiesPricing, check_copy_chunks
from moeflow.perf.costmodel_sources import GEMM_PEAK_FRACTION, GROUP_FIT_KINDS, CostModelSources
from moeflow.perf.topology import Topology

# This module's interface, some of it defined where `CostModel` takes it from.
__all__ = ["GEMM_PEAK_FRACTION", "GROUP_FIT_KINDS", "AlphaBeta", "CostModel"]


@dataclass
class CostModel(CopiesPricing, CostModelSources):
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
    ``slowest``). None: each device computes on its own hardware (GPUs)."""
    a2a_calibration: bool = True
    """With an ``a2a`` fit: scale the link model so that a uniform exchange costs exactly the fit
    (module docstring). False: FasterMoE Eq. 2 as published — link bandwidths (from the topology
    or the point-to-point fits) and route latencies only; the ``a2a`` fit is then unused."""
    backend: str = "nccl"
    """The collectives' backend the priced runs use (``moeflow profile`` records its own): it decides
    how copies of shadowed experts travel (``copies_time``)."""
    pipeline_overlap: tuple[float, float] = (1.0, 1.0)
    """η, forward and backward: the share of what FSMoE's pipelined block overlaps that this machine
    hides (``moeflow profile``'s chunk sweep, ``profiling.chunk_profile.overlap_share``; 1: the paper's
    assumption, and the default)."""
    copy_chunks: int = 1
    """Column pieces of every message in the copy trees (`core.copy_rounds`, Hecate §4.1's chunk
    pipeline: a relay forwards piece j while it receives piece j + 1), as `materialize` runs them
    (the MoE layer's `copy_chunks`); `copies_time` prices the trees with it (`pipelined_trees`).
    1: each stage sent whole, one after the other."""

    def __post_init__(self) -> None:
        check_copy_chunks("copy_chunks", self.copy_chunks)
        if not (self.gemm_flops_per_s > 0 and math.isfinite(self.gemm_flops_per_s)):
            raise ValueError(f"gemm_flops_per_s={self.gemm_flops_per_s!r}: must be a positive finite number")
        if self.host_cores is not None and (not isinstance(self.host_cores, int) or self.host_cores < 1):
            raise ValueError(f"host_cores={self.host_cores!r}: must be a positive int or None")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={self.backend!r}: expected 'gloo' or 'nccl'")
        overlap = tuple(float(v) for v in self.pipeline_overlap)
        if len(overlap) != 2 or not all(0.0 <= v <= 1.0 for v in overlap):
            raise ValueError(f"pipeline_overlap={self.pipeline_overlap!r}: expected two shares in [0, 1]")
        self.pipeline_overlap = overlap
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
        self._inv_bw_L.flags.writeable = False  # read by every pricer (`inv_bw_L`)
        self._ring_memo: dict[tuple, Any] = {}
        off = ~np.eye(W, dtype=bool)
        self._max_latency = float(topo.path_latency_WW[off].max()) if W > 1 else 0.0
        # Pro-Prophet's B̄: the mean bandwidth between two distinct devices (bottleneck of the route).
        if W > 1:
            self.mean_bandwidth_bytes_per_s = float(np.mean(topo.path_bandwidth_WW[off]))
        else:
            self.mean_bandwidth_bytes_per_s = math.inf
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
            per_byte = 2 * sum(float(self.link_time(f)) for f in tree_flows(self.topology.node_of, np.ones(W)))
            self._copies_eta = self.fits["copies"].beta_s_per_unit / per_byte

    # ---- building blocks --------------------------------------------------------------------
    def with_copy_chunks(self, chunks: int) -> CostModel:
        """This model pricing the copy trees in `chunks` pieces (itself if it already does)."""
        return self if chunks == self.copy_chunks else dataclasses.replace(self, copy_chunks=chunks)

    def link_time(self, bytes_WW: np.ndarray) -> np.ndarray:
        """FasterMoE Eq. 2: ``max_l T_l / W_l`` for flows ``[..., W, W]`` of bytes -> ``[...]`` seconds."""
        return self.link_time_from_traffic(self.topology.link_traffic(bytes_WW))

    def link_time_from_traffic(self, traffic_L: Any) -> np.ndarray:
        """``max_l T_l / W_l`` of the bytes on every link ``[..., L]`` -> ``[...]`` seconds."""
        return (np.asarray(traffic_L, dtype=np.float64) * self._inv_bw_L).max(axis=-1, initial=0.0)

    def _latency(self, bytes_WW: np.ndarray) -> np.ndarray:
        """Slowest route latency among the pairs that exchange bytes."""
        lat = np.where(np.asarray(bytes_WW) > 0, self.topology.path_latency_WW, 0.0)
        return lat.max(axis=(-2, -1))

    @property
    def prices_gemm_calls(self) -> bool:
        """Whether a GEMM's launch is priced (a fitted α): then the experts a device computes count."""
        return "gemm" in self.fits

    @property
    def compute_grows_with_tokens(self) -> bool:
        """Whether a device's forward expert time (`expert_forward_time` + `elementwise_time`, one
        launch per GEMM) never falls as its tokens grow: no fitted GEMM launch, and an elementwise
        fit with α, β >= 0. The slowest device is then the one with the most tokens, to the bit (each
        float operation rounds monotonically), which a search may find itself."""
        if self.prices_gemm_calls:
            return False
        f = self.fits.get("elementwise")
        return f is None or (f.alpha_s >= 0 and f.beta_s_per_unit >= 0)

    def gemm_time(self, flops: Any, calls: Any = 1) -> np.ndarray:
        """Time of ``calls`` GEMMs totalling ``flops``: fitted α·calls + β·flops, else flops / P."""
        flops = np.asarray(flops, dtype=np.float64)
        if "gemm" in self.fits:
            f = self.fits["gemm"]
            return f.alpha_s * np.asarray(calls) * (flops > 0) + f.beta_s_per_unit * flops
        return flops / self.gemm_flops_per_s

    def expert_forward_time(self, tokens_W: Any, shape: ExpertShape, gemm_calls: Any = None) -> np.ndarray:
        """Per-device forward expert GEMM time ``[..., W]``; FasterMoE Eq. 1 (``4·B_w·h·d / P`` for ffn).

        ``gemm_calls`` (per device) prices the α of a fitted GEMM model; default: one launch of each
        of the expert's GEMMs per device.
        """
        flops = shape.forward_flops_per_token * np.asarray(tokens_W, dtype=np.float64)
        return self.gemm_time(flops, shape.gemms if gemm_calls is None else gemm_calls)

    def elementwise_time(self, tokens_W: Any, shape: ExpertShape) -> np.ndarray:
        """Per-device forward time of the memory-bound part of the experts ``[..., W]``
        (``ExpertShape.elementwise_elements_per_token``), priced when the profile has an
        ``elementwise`` fit and 0 otherwise (GPU kernels fuse it)."""
        tokens = np.asarray(tokens_W, dtype=np.float64)
        if "elementwise" not in self.fits:
            return np.zeros_like(tokens)
        nbytes = tokens * shape.elementwise_elements_per_token * self.bytes_per_element
        return np.where(tokens > 0, self.fits["elementwise"](nbytes), 0.0)

    def device_compute_time(self, tokens_WE: Any, shape: ExpertShape) -> np.ndarray:
        """Forward expert time of every device ``[..., W]`` from the tokens it computes for each
        expert ``[..., W, E]``: GEMMs plus the memory-bound part, with a fitted GEMM's α paid once per
        GEMM of every expert that has tokens (the per-expert kernels launch one each)."""
        tokens_WE = np.asarray(tokens_WE, dtype=np.float64)
        tokens_W = tokens_WE.sum(-1)
        calls_W = (tokens_WE > 0).sum(-1) * shape.gemms
        return self.expert_forward_time(tokens_W, shape, calls_W) + self.elementwise_time(tokens_W, shape)

    def compute_time(self, tokens_WE: Any, shape: ExpertShape) -> np.ndarray:
        """FasterMoE Eq. 1, ``Lat_comp`` ``[...]``: the forward expert time of the slowest device
        (``device_compute_time``), with processor sharing when the devices share a host's cores."""
        return self.slowest(self.device_compute_time(tokens_WE, shape))

    def slowest(self, t_W: Any) -> np.ndarray:
        """``max_w t_w`` of per-device compute times ``[..., W]``; when W processes share a host's C
        cores (``host_cores``) the profiled times are "all busy" times and the busiest rank speeds up
        as the others finish (processor sharing)."""
        t_W = np.asarray(t_W, dtype=np.float64)
        W = t_W.shape[-1]
        C = self.host_cores
        if C is None or W <= C:
            return t_W.max(axis=-1)
        # Full-core work of rank w is t_w·C/W. In the phase where n ranks are still busy each runs at
        # min(1, C/n); the phases end as ranks finish in ascending order of work.
        w_W = np.sort(t_W, axis=-1) * (C / W)
        dw_W = np.diff(w_W, axis=-1, prepend=0.0)
        active_W = W - np.arange(W)
        return (dw_W * np.maximum(1.0, active_W / C)).sum(axis=-1)

    def sync_step_times(
        self, send_tokens_WW: Any, computed_WE: Any, shape: ExpertShape
    ) -> tuple[np.ndarray, np.ndarray]:
        """(compute, all-to-all) seconds ``[...]`` of one synchronous training step of a layer,
        FasterMoE §3.3: ``3·Lat_comp`` (forward + 2× backward) and four all-to-all-v (dispatch and
        combine, forward and backward). ``send_tokens_WW``: tokens each rank sends each rank
        ``[..., W, W]`` (the diagonal stays local and is ignored); ``computed_WE``: tokens each rank
        computes per expert ``[..., W, E]``. The combine is the dispatch reversed, and every link of a
        ``Topology`` is duplex with the same bandwidth both ways, so it costs what the dispatch costs.
        The shadow planner and the simulator price a step with this one function."""
        send = np.asarray(send_tokens_WW, dtype=np.float64) * shape.d_model * self.bytes_per_element
        W = send.shape[-1]
        return 3 * self.compute_time(computed_WE, shape), 4 * self.a2a_time(send * (1.0 - np.eye(W)))

    def count_exchange_time(self, num_experts: int, rows: int = 1) -> float:
        """The count exchange before every dispatch (``core.dispatch.exchange_counts``): one
        all-gather in which every rank contributes ``rows × E`` int64 counts."""
        W = self.topology.num_devices
        return self.collective_time("all_gather", 8.0 * rows * num_experts * W)

    def pair_costs(self) -> tuple[np.ndarray, np.ndarray]:
        """α_WW (s) and β_WW (s/byte) of every delivery i -> j (TA-MoE §4.1 Eq. 2), from
        ``p2p_time``: a profiled ``p2p_intra``/``p2p_inter`` fit wins over the topology's links
        (latency + bytes / bottleneck bandwidth of the route).

        The self delivery i -> i has no route; it is priced like the cheapest delivery from i to any
        other device. Why: TA-MoE §4.2 states that on a homogeneous network *every* one of the P·P
        deliveries shares the same α, β and the target is uniform; and the 2-level closed form counts
        the sender among the m devices of its node at the intra-node cost. Pricing the self copy at 0
        instead would make "keep everything local" optimal on any network.
        """
        W = self.topology.num_devices
        alpha_WW, beta_WW = np.zeros((W, W)), np.zeros((W, W))
        probe = 1e9  # bytes: β from the slope over a large message, exact for an affine model
        for i in range(W):
            for j in range(W):
                if i != j:
                    alpha_WW[i, j] = float(self.p2p_time(0.0, i, j))
                    beta_WW[i, j] = (float(self.p2p_time(probe, i, j)) - alpha_WW[i, j]) / probe
        if W > 1:
            off_WW = ~np.eye(W, dtype=bool)
            for i in range(W):
                cheapest = np.flatnonzero(off_WW[i])[np.argmin(beta_WW[i, off_WW[i]])]
                alpha_WW[i, i], beta_WW[i, i] = alpha_WW[i, cheapest], beta_WW[i, cheapest]
        return alpha_WW, beta_WW

    # ---- collectives ------------------------------------------------------------------------
    def a2a_time(self, bytes_WW: np.ndarray, peers: int | None = None) -> np.ndarray:
        """All-to-all-v where ``bytes_WW[i, j]`` bytes go from i to j -> ``[...]`` seconds.
        ``peers``: the most ranks any rank exchanges with (default all others), see
        ``a2a_time_pairs``."""
        bytes_WW = np.asarray(bytes_WW, dtype=np.float64)
        W = self.topology.num_devices
        if bytes_WW.shape[-2:] != (W, W):
            raise ValueError(f"flow shape {bytes_WW.shape}: last two dims must be ({W}, {W})")
        if W == 1:
            return np.zeros(bytes_WW.shape[:-2])
        latency = np.where(bytes_WW > 0, self.topology.path_latency_WW, 0.0).max(axis=(-2, -1))
        sends = bytes_WW.sum(axis=(-2, -1)) > 0
        return self.a2a_from_traffic(self.topology.link_traffic(bytes_WW), latency, sends, peers)

    def a2a_time_pairs(self, bytes_P: np.ndarray, pairs_P: np.ndarray, peers: int | None = None) -> np.ndarray:
        """``a2a_time`` for an exchange among a subset of ordered pairs: ``bytes_P[..., p]`` bytes
        go along pair ``pairs_P[p] = i·W + j`` (the grouped steps of FasterMoE §4.2 touch few pairs,
        so pricing only those keeps a 64-device replay cheap). With a fitted all-to-all, an exchange
        in which every rank talks to ``peers`` ranks (the stages of the hierarchical all-to-all)
        pays that share of the fit's start-up, ``α·peers/(W−1)`` (one message per peer); default:
        the whole start-up."""
        bytes_P = np.asarray(bytes_P, dtype=np.float64)
        pairs = np.asarray(pairs_P, dtype=np.int64)
        if self.topology.num_devices == 1:
            return np.zeros(bytes_P.shape[:-1])
        traffic_L = self.topology.pair_traffic(bytes_P, pairs)
        latency = np.where(bytes_P > 0, self.topology.path_latency_WW.reshape(-1)[pairs], 0.0).max(axis=-1)
        return self.a2a_from_traffic(traffic_L, latency, bytes_P.sum(axis=-1) > 0, peers)

    def a2a_from_traffic(self, traffic_L: Any, latency_s: Any, sends: Any, peers: int | None = None) -> np.ndarray:
        """The all-to-all's time from what it puts on the links ``[..., L]``, the slowest route
        latency among the pairs that exchange bytes ``[...]`` and whether anything is sent at all
        ``[...]`` (`a2a_time_pairs`; planners that re-price a changed expert give these directly)."""
        busiest = (np.asarray(traffic_L) * self._inv_bw_L).max(axis=-1, initial=0.0)
        return self.a2a_from_busiest(busiest, latency_s, sends, peers)

    def a2a_from_busiest(self, busiest_s: Any, latency_s: Any, sends: Any, peers: int | None = None) -> np.ndarray:
        """`a2a_from_traffic` from its busiest link's time ``max_l T_l / W_l`` ``[...]`` (a search that
        keeps every link's bytes as running sums takes that maximum itself)."""
        t = self._a2a_eta * np.asarray(busiest_s)
        if "a2a" in self.fits and self.a2a_calibration:
            W = self.topology.num_devices
            alpha = self.fits["a2a"].alpha_s * (1.0 if peers is None else min(peers, W - 1) / (W - 1))
        else:
            alpha = latency_s
        # An exchange with nothing to send costs nothing (no collective is launched).
        return np.where(sends, alpha + t, 0.0)

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
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes!r}: must be >= 0")
        return float(self.collective_times(kind, np.asarray([nbytes], dtype=np.float64), ranks)[0])

    def collective_times(self, kind: str, nbytes_X: Any, ranks: Sequence[int] | None = None) -> np.ndarray:
        """`collective_time` of every buffer size in ``nbytes_X`` at once (the same arithmetic)."""
        if kind not in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce"):
            raise ValueError(f"kind={kind!r}: expected all_reduce, all_gather, reduce_scatter, broadcast or reduce")
        nbytes_X = np.asarray(nbytes_X, dtype=np.float64)
        if (nbytes_X < 0).any():
            raise ValueError(f"nbytes_X={nbytes_X!r}: must be >= 0")
        group = None if ranks is None else tuple(self._ranks(ranks))  # None: every device (no check needed)
        n = self.topology.num_devices if group is None else len(group)
        if n == 1:
            return np.zeros_like(nbytes_X)
        if kind in self.fits and n == self.topology.num_devices:
            return np.where(nbytes_X == 0, 0.0, self.fits[kind](nbytes_X))
        share = {
            "all_reduce": 2 * (n - 1) / n,
            "all_gather": (n - 1) / n,
            "reduce_scatter": (n - 1) / n,
            "broadcast": 1.0,
            "reduce": 1.0,
        }[kind]
        # Latency depends on which hops carry bytes, link time is linear in them: price 1 byte once.
        key = (kind, group)
        if key not in self._ring_memo:
            unit = self._ring_flow(share, range(n) if group is None else group)
            steps = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1}.get(kind, n - 1)
            self._ring_memo[key] = (float(steps * self._latency(unit)), float(self.link_time(unit)))
        latency_s, per_byte_s = self._ring_memo[key]
        return np.where(nbytes_X == 0, 0.0, latency_s + per_byte_s * nbytes_X)

    def collective_table(self, kind: str, unit_bytes: float, count: int) -> np.ndarray:
        """`collective_times` of 0, 1, ..., `count` units of `unit_bytes` over every device
        (`[count + 1]`; an owner's broadcasts of its experts held everywhere), kept: the planners
        read it at every call. Read-only."""
        key = ("table", kind, float(unit_bytes), int(count))
        if key not in self._ring_memo:
            table = self.collective_times(kind, np.arange(count + 1) * float(unit_bytes))
            table.flags.writeable = False
            self._ring_memo[key] = table
        return self._ring_memo[key]

    @property
    def inv_bw_L(self) -> np.ndarray:
        """1 / each link's bandwidth (s per byte), read-only: a link's time is its bytes times this."""
        return self._inv_bw_L

    def collective_never_falls(self, kind: str, unit_bytes: float) -> bool:
        """Whether `collective_times` of `kind` over every device costs no less for more units of
        `unit_bytes` (kept): its time is affine in its bytes past 0, so 0, 1 and 2 units tell."""
        key = ("never_falls", kind, float(unit_bytes))
        if key not in self._ring_memo:
            self._ring_memo[key] = bool((np.diff(self.collective_table(kind, unit_bytes, 2)) >= 0).all())
        return self._ring_memo[key]

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
