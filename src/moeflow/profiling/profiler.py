"""Micro-benchmarks on the live torch.distributed backend -> α-β fits (``moeflow profile``).

FSMoE §6.2 does it this way: sweep each operation over sizes on the real backend, average
repeated runs, fit ``t = α + β·n`` by least squares (we use ``scipy.stats.linregress``) and keep
r². Measured here: GEMM over sizes (square, or given shapes); a memory-bound kernel (exact GELU,
``elementwise``); ``all_to_all_single``, ``all_gather_single``, ``reduce_scatter_single`` (the
``*_into_tensor``/``*_tensor`` names on older torch), ``all_reduce``, ``broadcast``, ``reduce``
over sizes; ``send``/``recv`` between two ranks of one node and two ranks of different nodes
(when the job spans both); across nodes on gloo, the shadow ``copies`` of
``moeflow.core.sparse_collectives`` (every rank owning one message, forward and backward); the cost
of one more chunk of the pipelined MoE block (``chunk_forward``, ``chunk_backward``:
``profiling.chunk_profile``) and the share of its overlap the machine realises (``pipeline_overlap``). CPU ranks
that all run on one machine record ``host_cores`` (the cores they share; ``CostModel.host_cores``).

Nodes are discovered, not configured: ranks that share a host name *and* a network namespace
are one node (so ranks placed in different namespaces by ``scripts/testbed.py`` count as
different nodes). The link bandwidths of the resulting ``Topology`` come from the point-to-point
fits, which makes the profile JSON a complete ``CostModel`` (``CostModel.load``).

Conventions for n (bytes): all-to-all = bytes each rank sends in total (its input tensor);
all-gather = output buffer; reduce-scatter = input buffer; all-reduce/broadcast/reduce = the
buffer; p2p = message. Timing: barrier, then the op, then the slowest rank's elapsed time
(``all_reduce(MAX)``), ``warmup`` untimed runs then ``repeats`` timed ones per size.

    moeflow profile --nproc 2 --out results/profile.json
    torchrun --nproc-per-node 4 -m moeflow.cli profile --out results/profile.json
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from moeflow.core.checks import positive_int
from moeflow.core.launch import init_distributed, launch_local, under_torchrun
from moeflow.core.placement import Placement, copies_by_tree
from moeflow.core.sparse_collectives import materialize
from moeflow.perf.alpha_beta import CHUNK_KINDS, OP_KINDS, AlphaBeta
from moeflow.profiling.chunk_profile import chunk_fit, measure_chunks

COMM_KINDS = tuple(kind for kind in OP_KINDS if kind not in ("gemm", "elementwise", *CHUNK_KINDS))


@dataclass
class ProfileConfig:
    """What to measure."""

    comm_sizes_bytes: Sequence[int] = (1 << 16, 1 << 18, 1 << 19, 1 << 20, 3 << 19, 1 << 21, 3 << 20, 1 << 22)
    """Message sizes of the communication sweep (rounded to a multiple of 4·world_size bytes)."""
    gemm_sizes: Sequence[int] = (64, 128, 192, 256, 384, 512)
    """Square GEMM sizes m = k = n (FLOPs = 2·m³)."""
    gemm_shapes: Sequence[tuple[int, int, int]] | None = None
    """If set, ``(m, k, n)`` shapes to time instead of the squares (e.g. the expert GEMMs
    ``[tokens, d] @ [d, h]`` of a workload), FLOPs = 2·m·k·n."""
    warmup: int = 2
    """Untimed runs before each size."""
    repeats: int = 5
    """Timed runs per size (FSMoE §6.2 averages five)."""
    ops: Sequence[str] = OP_KINDS
    """Operation kinds to measure (subset of ``OP_KINDS``)."""
    dtype_bytes: int = 4
    """Element size used for messages and GEMMs (4 = float32)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form labels copied into the output (e.g. testbed bandwidth)."""
    chunk_layer: tuple[int, int, int] = (512, 128, 1024)
    """The layer whose pipelined block ``chunk_*`` times: tokens per rank, d_model, d_hidden
    (``profiling.chunk_profile``)."""
    chunk_esp_size: int = 1
    """Expert-sharding group size of that layer (consecutive ranks inside a node; 1: plain EP)."""
    chunk_degrees: Sequence[int] = (1, 2, 4, 8)
    """Pipeline degrees the ``chunk_*`` fit runs over."""

    def __post_init__(self) -> None:
        unknown = [o for o in self.ops if o not in OP_KINDS]
        if unknown:
            raise ValueError(f"ops={list(self.ops)!r}: unknown {unknown}; known {list(OP_KINDS)}")
        if not self.ops:
            raise ValueError("ops=[]: nothing to measure")
        if self.warmup < 0 or self.repeats < 2:
            raise ValueError(f"warmup={self.warmup!r}, repeats={self.repeats!r}: need warmup >= 0, repeats >= 2")
        for name in ("comm_sizes_bytes", "gemm_sizes"):
            vals = list(getattr(self, name))
            if len(set(vals)) < 2 or any(int(v) < 1 for v in vals):
                raise ValueError(f"{name}={vals!r}: need >= 2 distinct positive sizes")
        for name, values in (("chunk_layer", self.chunk_layer), ("chunk_degrees", self.chunk_degrees)):
            if any(int(v) < 1 for v in values) or (name == "chunk_layer" and len(values) != 3):
                raise ValueError(f"{name}={list(values)!r}: need positive integers (chunk_layer: 3 of them)")
        if len(set(self.chunk_degrees)) < 2:
            raise ValueError(f"chunk_degrees={list(self.chunk_degrees)!r}: need >= 2 distinct degrees")
        positive_int("chunk_esp_size", self.chunk_esp_size)
        if self.chunk_layer[2] % self.chunk_esp_size:
            raise ValueError(
                f"chunk_esp_size={self.chunk_esp_size} must divide the chunk layer's d_hidden={self.chunk_layer[2]}"
            )
        if self.dtype_bytes != 4:
            raise ValueError(f"dtype_bytes={self.dtype_bytes!r}: only float32 (4) is measured")


def _node_key() -> str:
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = ""
    return f"{socket.gethostname()}|{netns}"


def _sync(device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Any, device: Any, warmup: int, repeats: int, group: Any = None) -> np.ndarray:
    """Times of ``repeats`` runs (slowest rank of each), after ``warmup`` runs."""
    out = []
    for r in range(warmup + repeats):
        dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)  # the op ends when the slowest rank ends
        if r >= warmup:
            out.append(float(dt.item()))
    return np.asarray(out)


@dataclass
class _Sweep:
    """What one profile run measures, and the measurements so far (by operation kind)."""

    config: ProfileConfig
    device: Any
    rank: int
    world: int
    node_of: list[int]
    measurements: dict[str, Any] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)
    """Derived numbers the profile reports beside the fits (``pipeline_overlap``)."""

    def time(self, fn: Any) -> np.ndarray:
        return _timed(fn, self.device, self.config.warmup, self.config.repeats)

    def record(self, kind: str, sizes: list[int], times: list[np.ndarray], unit: str) -> None:
        mean = np.array([t.mean() for t in times])
        std = np.array([t.std(ddof=1) for t in times])
        # The fit uses the median of the repeats: on a shared CPU one descheduled run can double a
        # mean; the noise (coefficient of variation) is still reported from mean and std.
        self.measurements[kind] = {
            "sizes": sizes,
            "unit": unit,
            "median_s": [float(np.median(t)) for t in times],
            "mean_s": mean.tolist(),
            "std_s": std.tolist(),
            "noise_cv": float(np.mean(np.divide(std, mean, out=np.zeros_like(std), where=mean > 0))),
        }

    def wants(self, kind: str) -> bool:
        return kind in self.config.ops

    @property
    def comm_sizes(self) -> list[int]:
        quantum = 4 * self.world  # whole float32 elements, divisible by the ranks
        return sorted({max(quantum, int(s) // quantum * quantum) for s in self.config.comm_sizes_bytes})


def _measure_compute(sweep: _Sweep) -> None:
    """GEMMs over sizes (FLOPs = 2·m·k·n) and a memory-bound kernel (exact GELU, bytes read + written)."""
    if sweep.wants("gemm"):
        sizes, times = [], []
        for m, k, n in sweep.config.gemm_shapes or [(m, m, m) for m in sweep.config.gemm_sizes]:
            a, b = torch.randn(m, k, device=sweep.device), torch.randn(k, n, device=sweep.device)
            sizes.append(2 * m * k * n)
            times.append(sweep.time(lambda a=a, b=b: torch.matmul(a, b)))
        sweep.record("gemm", sizes, times, "flop")
    if sweep.wants("elementwise"):
        sizes, times = [], []
        for nbytes in sweep.config.comm_sizes_bytes:
            x = torch.randn(max(1, int(nbytes) // 8), device=sweep.device)
            sizes.append(2 * x.numel() * 4)
            times.append(sweep.time(lambda x=x: torch.nn.functional.gelu(x)))
        sweep.record("elementwise", sizes, times, "byte")


def _measure_collectives(sweep: _Sweep) -> None:
    """The group collectives over sizes (n: see the module docstring)."""
    # torch >= 2.13 renamed the flat-tensor collectives; same operation either way.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    for kind in ("a2a", "all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce"):
        if not sweep.wants(kind) or sweep.world < 2:
            continue
        times = []
        for nbytes in sweep.comm_sizes:
            n, d = nbytes // 4, sweep.device
            full, part = torch.randn(n, device=d), torch.randn(n // sweep.world, device=d)
            out_full, out_part = torch.empty(n, device=d), torch.empty(n // sweep.world, device=d)
            fn = {
                "a2a": lambda full=full, out=out_full: dist.all_to_all_single(out, full),
                "all_gather": lambda part=part, out=out_full: all_gather(out, part),
                "reduce_scatter": lambda full=full, out=out_part: reduce_scatter(out, full),
                "all_reduce": lambda full=full: dist.all_reduce(full),
                "broadcast": lambda full=full: dist.broadcast(full, src=0),
                "reduce": lambda full=full: dist.reduce(full, dst=0),
            }[kind]
            times.append(sweep.time(fn))
        sweep.record(kind, sweep.comm_sizes, times, "byte")


def _measure_p2p(sweep: _Sweep, nodes: list[list[int]]) -> None:
    """send/recv between two ranks of one node and two ranks of different nodes (when there are)."""
    pairs = {
        "p2p_intra": next(([g[0], g[1]] for g in nodes if len(g) >= 2), None),
        "p2p_inter": [nodes[0][0], nodes[1][0]] if len(nodes) >= 2 else None,
    }
    for kind, pair in pairs.items():
        if not sweep.wants(kind) or pair is None:
            continue
        src, dst = pair
        times = []
        for nbytes in sweep.comm_sizes:
            buf = torch.randn(nbytes // 4, device=sweep.device)

            def p2p(buf: Any = buf, src: int = src, dst: int = dst) -> None:
                if sweep.rank == src:
                    dist.send(buf, dst)
                elif sweep.rank == dst:
                    dist.recv(buf, src)

            times.append(sweep.time(p2p))
        sweep.record(kind, sweep.comm_sizes, times, "byte")


def _measure_copies(sweep: _Sweep) -> None:
    """Shadow copies as `sparse_collectives` runs them across nodes on gloo: every rank owns one
    expert of n bytes held everywhere; forward copies plus backward gradient sums, timed together
    (n = bytes per owner; `CostModel.copies_time` calibrates on it)."""
    if not sweep.wants("copies") or not copies_by_tree(sweep.node_of, dist.get_backend()):
        return
    W = sweep.world
    everywhere = Placement(np.arange(W), np.ones((W, W), dtype=bool))
    times = []
    for nbytes in sweep.comm_sizes:
        param = torch.randn(1, nbytes // 4, device=sweep.device, requires_grad=True)

        def copies(param: Any = param) -> None:
            held = materialize({"w": param}, everywhere, dist.group.WORLD, [sweep.rank], np.arange(W), sweep.node_of)
            held["w"].sum().backward()

        times.append(sweep.time(copies))
    sweep.record("copies", sweep.comm_sizes, times, "byte")


def run_profile(config: ProfileConfig, device: Any = None, progress: bool = False) -> dict[str, Any]:
    """Measure on the initialised default process group; every rank returns the same dict.
    `progress`: rank 0 shows a progress bar over the sweeps (tqdm, on stderr)."""
    if not dist.is_initialized():
        raise RuntimeError("run_profile needs an initialised torch.distributed process group")
    rank, W = dist.get_rank(), dist.get_world_size()
    device = device or torch.device("cpu")
    keys: list[Any] = [None] * W
    dist.all_gather_object(keys, _node_key())
    order = list(dict.fromkeys(keys))
    node_of = [order.index(k) for k in keys]
    nodes = [[r for r in range(W) if node_of[r] == n] for n in range(len(order))]
    sweep = _Sweep(config, device, rank, W, node_of)
    phases = [
        ("GEMM", _measure_compute),
        ("collectives", _measure_collectives),
        ("point-to-point", lambda sw: _measure_p2p(sw, nodes)),
        ("copies", _measure_copies),
        ("pipeline chunks", measure_chunks),
    ]
    with tqdm(total=len(phases), unit="sweep", disable=not progress or rank != 0, leave=False) as bar:
        for label, measure in phases:
            bar.set_description(f"profiling {label}")
            measure(sweep)
            bar.update(1)
    src = "moeflow profile"
    fits = {
        k: (
            chunk_fit(m["sizes"], m["median_s"], source=src)
            if m["unit"] == "chunk"
            else AlphaBeta.fit(m["sizes"], m["median_s"], m["unit"], source=src)
        ).to_dict()
        for k, m in sweep.measurements.items()
    }
    # CPU ranks that all live on one machine share its cores (CostModel.host_cores).
    hosts = {k.split("|")[0] for k in keys}
    host_cores = len(os.sched_getaffinity(0)) if device.type == "cpu" and len(hosts) == 1 else None
    gemm = fits.get("gemm")
    flops = 1.0 / gemm["beta_s_per_unit"] if gemm and gemm["beta_s_per_unit"] > 0 else float("nan")
    return {
        "version": 1,
        "name": f"profile-{dist.get_backend()}-{W}ranks-{len(nodes)}nodes",
        "backend": dist.get_backend(),
        "device": str(device.type),
        "world_size": W,
        "nodes": nodes,
        "torch": torch.__version__,
        "config": {"warmup": config.warmup, "repeats": config.repeats, **config.extra},
        "gemm_flops_per_s": flops,
        "bytes_per_element": 4,
        "host_cores": host_cores,
        **sweep.scalars,  # pipeline_overlap (CostModel.pipeline_overlap), chunk_exchange_s
        "topology": topology_from_fits(nodes, fits),
        "fits": fits,
        "measurements": sweep.measurements,
    }


def topology_from_fits(nodes: list[list[int]], fits: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Links from point-to-point fits: an intra-node route is 2 hops of the device link, an
    inter-node route 2 device hops + 2 network hops; the bottleneck sets 1/β."""

    def bw(kind: str) -> float | None:
        # A fit that noise dominates (r² < 0.5: a shared CPU descheduling the ranks) says nothing
        # about the bandwidth; its slope can be near zero, i.e. an absurdly fast link.
        f = fits.get(kind)
        usable = f and f["beta_s_per_unit"] > 0 and (f.get("r2") is None or f["r2"] >= 0.5)
        return 1.0 / f["beta_s_per_unit"] if usable else None

    def lat(kind: str) -> float:
        f = fits.get(kind)
        return max(f["alpha_s"], 0.0) if f else 0.0

    intra, inter = bw("p2p_intra"), bw("p2p_inter")
    # Without a usable point-to-point fit: the uniform all-to-all's, each rank sending (W-1)/W of n.
    world = sum(len(g) for g in nodes)
    uniform = bw("a2a") * world / (world - 1) if bw("a2a") and world > 1 else None
    intra = intra or (uniform if len(nodes) == 1 else None)
    if len(nodes) == 1:
        b = intra or 10e9
        return {
            "name": "profiled",
            "spec": nodes[0],
            "level_bandwidth_bytes_per_s": [b],
            "level_latency_s": [lat("p2p_intra") / 2],
            "source": "moeflow profile (p2p fits)",
        }
    intra = intra or inter or 10e9
    inter = inter or intra
    l_intra = lat("p2p_intra") / 2
    l_inter = max((lat("p2p_inter") - 2 * l_intra) / 2, 0.0)
    return {
        "name": "profiled",
        "spec": nodes,
        "level_bandwidth_bytes_per_s": [inter, intra],
        "level_latency_s": [l_inter, l_intra],
        "source": "moeflow profile (p2p fits)",
    }


def _worker(config: ProfileConfig, backend: str) -> dict[str, Any]:
    """Entry point of one rank (elastic launch or torchrun)."""
    created = not dist.is_initialized()
    device = init_distributed({"nccl": "cuda", "gloo": "cpu"}.get(backend, "auto"))
    try:
        return run_profile(config, device, progress=True)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def launch(config: ProfileConfig, nproc: int | None, backend: str) -> dict[str, Any]:
    """Run the profile: under torchrun (``RANK`` in the environment) on the given ranks, else on
    ``nproc`` local processes started by torch's elastic launcher (the one torchrun uses)."""
    if under_torchrun():
        return _worker(config, backend)
    if nproc is None or nproc < 1:
        raise ValueError(f"--nproc={nproc!r}: give a positive number of processes (or run under torchrun)")
    return launch_local(_worker, nproc, config, backend, name="moeflow-profile")[0]
