"""Starting ranks: torch's own elastic launcher for `--nproc N`, or the ranks an outer `torchrun`
(or the network testbed) started. Every command that runs on several processes goes through here.

    moeflow train --nproc 4                       # launch_local(worker, 4, ...)
    torchrun --nproc-per-node 4 -m moeflow.cli train   # resolve_world_size sees RANK/WORLD_SIZE
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def under_torchrun() -> bool:
    """True when an outer launcher described this process's rank in the environment."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def resolve_world_size(nproc: int | None) -> tuple[int, bool]:
    """(processes, already started by an outer torchrun: RANK and WORLD_SIZE are set)."""
    if under_torchrun():
        if nproc is not None and nproc != 1:
            raise ValueError(
                f"--nproc {nproc}: already running under torchrun (WORLD_SIZE={os.environ['WORLD_SIZE']}); "
                f"leave --nproc out"
            )
        return int(os.environ["WORLD_SIZE"]), True
    if nproc is not None and (not isinstance(nproc, int) or nproc < 1):
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    return nproc or 1, False


def init_distributed(
    requested: str = "auto", deterministic: bool = False, timeout_s: float | None = None, needs_group: bool = False
) -> torch.device:
    """Pick this rank's device and join the process group that torchrun / the elastic launcher
    described in the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT): nccl on CUDA,
    gloo on CPU. One process without that environment runs without a process group, unless
    `needs_group` (FSDP2 shards over a device mesh even of one rank: a group of one, in memory).
    `timeout_s`: how long a collective may wait before it fails (None: torch's default, 30 minutes)."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={requested!r} must be 'auto', 'cpu' or 'cuda'")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available")
    use_cuda = requested == "cuda" or (requested == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        if deterministic:
            # cuBLAS reads this at initialisation; deterministic GEMMs need it (torch docs,
            # "Reproducibility"). Set only when the user has not chosen a value.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(cpu_threads_per_rank())
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if use_cuda else "gloo"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout, **_attempt_store(timeout))
    elif needs_group and not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return device


def _attempt_store(timeout: datetime.timedelta | None) -> dict:
    """Under torch's elastic agent, the process group's store, keyed by restart attempt: the agent's
    store outlives a failed attempt, and the keys its process groups left there (the same group
    names every attempt) would send a restarted group's connections to the dead processes."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return {}
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timeout or datetime.timedelta(minutes=30),
    )
    return {"store": dist.PrefixStore(f"moeflow/attempt{restart_count()}", store), "rank": rank, "world_size": world}


def cpu_threads_per_rank() -> int:
    """Intra-op threads of one CPU rank: MOEFLOW_CPU_THREADS when a launcher set it (the network
    testbed gives each rank its share of the *host's* cores, since its LOCAL_WORLD_SIZE counts only
    the ranks of one emulated node), else the cores divided among the local ranks — without this
    every rank would start an all-core thread pool. (Not OMP_NUM_THREADS: torchrun sets that to 1
    for every multi-process run.)"""
    value = os.environ.get("MOEFLOW_CPU_THREADS")
    if value is not None:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"MOEFLOW_CPU_THREADS={value!r}: expected a positive integer")
        return int(value)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, (os.cpu_count() or 1) // local_world)


def launch_local(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    name: str = "moeflow",
    max_restarts: int = 0,
    ranks_handle_interrupts: bool = False,
) -> list[Any]:
    """Run `fn(*args)` on `nproc` local processes with torch's elastic launcher (what
    `torchrun --standalone` does); returns every rank's result, rank 0 first. When a process dies,
    the agent restarts the whole group up to `max_restarts` times (`fn` sees the attempt in
    `TORCHELASTIC_RESTART_COUNT`, see `restart_count`). `ranks_handle_interrupts`: the agent leaves
    SIGINT and SIGTERM to the caller and the ranks (which stop gracefully) instead of stopping the
    ranks on the first one."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"{name}-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        **_signal_options(LaunchConfig, ranks_handle_interrupts),
    )
    results = elastic_launch(config, fn)(*args)
    return [results[r] for r in sorted(results)]


def _signal_options(config_class: type, ranks_handle_interrupts: bool) -> dict[str, str]:
    """`LaunchConfig.signals_to_handle` (torch >= 2.7) without SIGINT/SIGTERM when the ranks handle
    them; an older agent has no such field and stops the ranks on the first signal."""
    import dataclasses

    known = {f.name for f in dataclasses.fields(config_class)}
    return {"signals_to_handle": "SIGHUP,SIGQUIT"} if ranks_handle_interrupts and "signals_to_handle" in known else {}


def restart_count() -> int:
    """How many times torch's elastic agent has restarted this worker group (0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def timed_out_collective(exc: BaseException) -> str | None:
    """`"all_reduce (called at training/trainer.py:184 in _mean_over_ranks)"`: the torch.distributed
    operation that raised `exc` and moeflow's call to it, read from the traceback (gloo's own
    message names only its transport: "Timed out waiting 5000ms for recv operation")."""
    op = site = None
    for frame in traceback.extract_tb(exc.__traceback__):
        path = frame.filename.replace(os.sep, "/")
        if path.endswith("torch/distributed/distributed_c10d.py") and not frame.name.startswith("_"):
            op = frame.name  # the outermost one: the call moeflow made (or DCP made for it)
            break
        if "/moeflow/" in path:
            site = f"{path.rsplit('/moeflow/', 1)[1]}:{frame.lineno} in {frame.name}"
    if op is None:
        return None
    return op + (f" (called at {site})" if site else "")


def ranks_not_timed_out(grace_s: float) -> list[int] | None:
    """After a collective timed out on this rank: the ranks that have not reported the same within
    `grace_s` (through the process group's store, which outlives the collectives) — the stalled or
    dead ones when only some ranks stopped answering. None when the store cannot tell."""
    if not dist.is_initialized():
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=max(grace_s, 1.0)))  # a stalled store host
        store.set(f"moeflow/timed_out/{rank}", "1")
        deadline = time.monotonic() + grace_s
        while True:
            missing = [r for r in range(world) if not store.check([f"moeflow/timed_out/{r}"])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store is gone too: nothing more to learn
        return None
