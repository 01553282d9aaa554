"""A cost model of *this* machine and process layout, measured once at start-up and cached.

Strategies that price placements (FasterMoE's shadowing, Pro-Prophet, EPLB, Hecate's FSSDP, `auto`),
`schedule="auto"` and the topology-aware gate and loss need a cost model of the cluster they run on.
Where none is given, `moeflow train` and `moeflow advise` measure one on the live backend with the
profiler's own sweeps (`profiling.profiler.run_profile`, FSMoE §6.2's α-β fits) reduced to what the
planners price — GEMMs, the memory-bound kernel, all-to-all, the ring collectives, point-to-point and
(across nodes on gloo) the shadow copies — at five sizes each, which takes a few seconds. The result
is cached per machine and process layout (host of rank 0, backend, device type, ranks, nodes) under
`$MOEFLOW_CACHE_DIR` (default `$XDG_CACHE_HOME/moeflow` or `~/.cache/moeflow`), so the next run of
the same layout reads it instead; delete the file to measure again. It is a complete `moeflow profile`
JSON (`CostModel.load`, `moeflow simulate --cluster FILE`).

    profile, report = startup_profile(device)          # collective: every rank, same dict
    cost_model = CostModel.from_dict(profile)
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from moeflow.profiling.profiler import ProfileConfig, run_profile

STARTUP_PROFILE = ProfileConfig(
    comm_sizes_bytes=(1 << 16, 1 << 18, 1 << 20, 1 << 21, 1 << 22),
    gemm_sizes=(128, 192, 256, 384, 512),
    warmup=2,
    repeats=5,
    ops=(
        "gemm",
        "elementwise",
        "a2a",
        "all_gather",
        "reduce_scatter",
        "all_reduce",
        "broadcast",
        "reduce",
        "p2p_intra",
        "p2p_inter",
        "copies",
    ),
    extra={"measured_by": "moeflow start-up profile (profiling.startup)"},
)
"""What is measured at start-up: the operations the planners and schedules price (not the pipelined
block's chunk cost: `moeflow profile` measures that), five sizes each, five timed runs after two untimed."""


def cache_dir() -> Path:
    """Where measured cost models are kept: `$MOEFLOW_CACHE_DIR`, else `$XDG_CACHE_HOME/moeflow`,
    else `~/.cache/moeflow`."""
    if os.environ.get("MOEFLOW_CACHE_DIR"):
        return Path(os.environ["MOEFLOW_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moeflow"


def cache_path(host: str, backend: str, device: str, world: int, nodes: int) -> Path:
    """The cache file of one machine and process layout."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in host)
    return cache_dir() / "cost-models" / f"{safe}-{backend}-{device}-{world}ranks-{nodes}nodes.json"


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically (a concurrent reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _read_cached(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # absent or damaged: measured again
    return data if isinstance(data, dict) and "topology" in data and "fits" in data else None


def describe(profile: dict[str, Any]) -> str:
    """One line of what a profile measured: GEMM throughput, the all-to-all's start-up and bandwidth,
    the point-to-point bandwidths."""
    fits = profile.get("fits", {})
    parts = []
    if "gemm" in fits and fits["gemm"]["beta_s_per_unit"] > 0:
        parts.append(f"GEMM {1e-9 / fits['gemm']['beta_s_per_unit']:.1f} GFLOP/s")
    for kind, label in (("a2a", "all-to-all"), ("p2p_intra", "p2p in a node"), ("p2p_inter", "p2p across nodes")):
        fit = fits.get(kind)
        if fit and fit.get("r2") is not None and fit["r2"] < 0.5:
            parts.append(f"{label} too noisy to fit (r² {fit['r2']:.2f})")
        elif fit and fit["beta_s_per_unit"] > 0:
            parts.append(f"{label} {1e6 * max(fit['alpha_s'], 0.0):.0f} µs + {1e-9 / fit['beta_s_per_unit']:.2f} GB/s")
    links = profile.get("topology", {}).get("level_bandwidth_bytes_per_s")
    if links:
        parts.append("links " + ", ".join(f"{1e-9 * b:.2f} GB/s" for b in links))
    return "; ".join(parts) or "no fits"


def startup_profile(device: Any) -> tuple[dict[str, Any], str]:
    """Collective (every rank of the default group, or one process without a group): the cached cost
    model of this layout, or one measured now and cached. Returns (the profile dict, the same on every
    rank; one line saying where it came from and what it measured)."""
    if not dist.is_initialized():
        return _single_process(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    nodes = len(dict.fromkeys(hosts))
    path = cache_path(hosts[0], dist.get_backend(), device.type, world, nodes)
    found = [_read_cached(path) if rank == 0 else None]
    dist.broadcast_object_list(found, src=0)  # rank 0's cache decides, for every node
    if found[0] is not None:
        return found[0], f"cost model: {path} (this layout, measured {found[0].get('measured_at', '?')}): " + describe(
            found[0]
        )
    started = time.perf_counter()
    profile = run_profile(STARTUP_PROFILE, device)
    return _stamp_and_cache(profile, path, time.perf_counter() - started, rank == 0)


def _single_process(device: Any) -> tuple[dict[str, Any], str]:
    """One process: no collective to time; the GEMMs and the memory-bound kernel on a one-device
    topology (what a planner can price there: nothing moves)."""
    path = cache_path(socket.gethostname(), "none", device.type, 1, 1)
    cached = _read_cached(path)
    if cached is not None:
        return cached, f"cost model: {path} (this layout, measured {cached.get('measured_at', '?')}): " + describe(
            cached
        )
    started = time.perf_counter()
    # A group of one, in this process, for the profiler's timing (its collectives are skipped).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        profile = run_profile(STARTUP_PROFILE, device)
    finally:
        dist.destroy_process_group()
    return _stamp_and_cache(profile, path, time.perf_counter() - started, True)


def _stamp_and_cache(profile: dict[str, Any], path: Path, seconds: float, writer: bool) -> tuple[dict[str, Any], str]:
    profile["measured_at"] = datetime.datetime.now().isoformat(timespec="seconds")
    profile["measure_s"] = round(seconds, 2)
    profile["name"] = f"this machine ({profile['name']})"
    if writer:
        write_json(path, profile)
    report = (
        f"cost model: measured this machine in {seconds:.1f} s ({profile['backend']}, {profile['world_size']} "
        f"ranks, {len(profile['nodes'])} node(s)): {describe(profile)}; cached in {path}"
    )
    return profile, report


def _startup_worker() -> tuple[dict[str, Any], str]:
    from moeflow.core.launch import init_distributed

    device = init_distributed("auto")
    try:
        return startup_profile(device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def this_machine(nproc: int) -> tuple[dict[str, Any], str]:
    """The cost model of `nproc` local ranks on this machine, from outside any process group
    (`moeflow advise --cluster this`): the cache of that layout when there is one (the one
    `moeflow train` uses), else measured on `nproc` processes started here and cached."""
    import torch

    from moeflow.core.checks import positive_int
    from moeflow.core.launch import launch_local

    positive_int("--nproc", nproc)
    cuda = torch.cuda.is_available()
    backend = ("nccl" if cuda else "gloo") if nproc > 1 else "none"
    path = cache_path(socket.gethostname(), backend, "cuda" if cuda else "cpu", nproc, 1)
    cached = _read_cached(path)
    if cached is not None:
        return cached, f"cost model: {path} (this layout, measured {cached.get('measured_at', '?')}): " + describe(
            cached
        )
    if nproc == 1:
        return startup_profile(torch.device("cuda" if cuda else "cpu"))
    return launch_local(_startup_worker, nproc, name="moeflow-startup-profile")[0]
