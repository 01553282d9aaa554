"""The run's cost model: which settings depend on one, checking a given one before any process
starts, and measuring this machine's at start-up where none is given (`profiling.startup`).

    users = cost_model_users(cfg)        # ["moe.strategy='shadow'"]: what would run without it
    note = check_cost_model(cfg, world=2, out=out, resume=False)   # before processes start
    provide_cost_model(cfg, out, device)  # in every rank: measure or read the cache, if needed

A cost model describes a cluster. One that describes another number of devices than the run's
expert-parallel group would leave every setting that depends on it in its topology-free form
(planners as plain EP): for a fresh run that is an error before any process starts; when resuming on
another process count it is a notice (the run continues as the user asked), and a cost model that
was measured at start-up is measured again for the new layout instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from moeflow.perf.costmodel import CostModel
from moeflow.profiling.profiler import topology_from_fits
from moeflow.profiling.startup import startup_profile, write_json
from moeflow.routing import BALANCES, GATES
from moeflow.strategies import PLANNERS, SCHEDULES
from moeflow.training.config import RunConfig

MEASURED_FILE = "cost_model.json"
"""In the run folder: the cost model measured at start-up (its path is the run's `moe.cost_model`)."""


def cost_model_users(cfg: RunConfig) -> list[str]:
    """The settings of `cfg` that price the network or the GEMMs with the cost model (each as
    `key='value'`), from what the components declare (`Component.needs_cost_model`) and their options."""
    moe = cfg.moe
    users = []
    for axis, registry in (("strategy", PLANNERS), ("schedule", SCHEDULES), ("balance", BALANCES)):
        name = getattr(moe, axis)
        if registry.get(name).needs_cost_model:
            users.append(f"moe.{axis}={name!r}")
    if moe.gate == "hierarchical" and GATES.options("hierarchical", moe.gate_options).cross_node_ratio is None:
        users.append("moe.gate='hierarchical'")
    if moe.schedule == "pipeline":
        options = SCHEDULES.options("pipeline", moe.schedule_options)
        if "auto" in (options.forward, options.backward):
            users.append("moe.schedule_options.degree='auto'")
    if cfg.train.grad_sync == "fsmoe":
        users.append("train.grad_sync='fsmoe'")
    return users


def relocate_measured(cfg: RunConfig, run_dir: Path) -> None:
    """A run folder that moved: its measured cost model is the one in the folder now."""
    source, here = cfg.moe.cost_model, run_dir / MEASURED_FILE
    if source and Path(source).name == MEASURED_FILE and not Path(source).exists() and here.is_file():
        cfg.moe.cost_model = str(here)


def is_measured(cfg: RunConfig, out: Path) -> bool:
    """The run's cost model is the one measured at start-up (in the run folder)."""
    return cfg.moe.cost_model is not None and Path(cfg.moe.cost_model) == out / MEASURED_FILE


def check_cost_model(cfg: RunConfig, world: int, out: Path, resume: bool) -> str | None:
    """Before processes start: read a given cost model (errors name the file) and compare it with
    the run's expert-parallel group. Returns a notice to print, or None; may clear a measured cost
    model of another layout (measured again at start-up). Raises where a fresh run would silently
    run a strategy as plain EP."""
    if cfg.moe.cost_model is None:
        return None
    relocate_measured(cfg, out)
    cost_model = CostModel.resolve(cfg.moe.cost_model)
    ep_size = planning_group_size(cfg, world)
    devices = cost_model.topology.num_devices
    if devices == ep_size:
        return None
    # The MoE layers run without a cost model of another size; FSMoE's gradient partition
    # (train.grad_sync='fsmoe') prices the collectives of whatever cluster it is given.
    users = [u for u in cost_model_users(cfg) if u.startswith("moe.")]
    if is_measured(cfg, out):  # measured for another layout (a resume on another process count)
        cfg.moe.cost_model = None
        return None
    if not users:
        return None  # nothing prices with it; the layers run without it
    what = ", ".join(users)
    if not resume:
        raise ValueError(
            f"--cost-model {cfg.moe.cost_model!r} describes {devices} devices but this run has {ep_size} "
            f"expert-parallel ranks: {what} would run without it (as plain EP). Leave --cost-model out to "
            f"measure this machine at start-up, or give a profile of {ep_size} ranks "
            f"(moeflow profile --nproc {ep_size} --out FILE)"
        )
    return (
        f"note: the cost model {cfg.moe.cost_model!r} describes {devices} devices and this resumed run has "
        f"{ep_size} expert-parallel ranks: {what} run without it (as plain EP); --cost-model FILE gives one "
        f"of this size"
    )


def provide_cost_model(cfg: RunConfig, out: Path, device: Any, say: bool) -> None:
    """In every rank, collectively: where a setting needs a cost model and none is given, use this
    machine's (cached, or measured now: `profiling.startup`), written to the run folder as
    `cost_model.json` and set as `moe.cost_model` (so a resume reads the same one). `say`: print
    where it came from and what it measured (rank 0)."""
    if cfg.moe.cost_model is not None or not cost_model_users(cfg):
        return
    profile, report = startup_profile(device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    ep_size = planning_group_size(cfg, world)
    if ep_size < world:
        profile = expert_group_profile(profile, ep_size, cfg.parallel.layout_sizes(world)[2])
    path = out / MEASURED_FILE
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        write_json(path, profile)
    if dist.is_initialized():
        dist.barrier()  # the file exists before any rank reads it
    cfg.moe.cost_model = str(path)
    if say:
        users = ", ".join(cost_model_users(cfg))
        print(f"{report}\n  used by {users} as {path} (--cost-model PRESET|FILE overrides)", flush=True)


def planning_group_size(cfg: RunConfig, world: int) -> int:
    """Ranks of the group the MoE layers dispatch and plan over: the expert-parallel group, or the
    whole dp × ep mesh for Hecate's FSSDP with `parallel.experts="fsdp"` (one owner per expert over
    it: docs/parallel.md)."""
    dp, ep, _ = cfg.parallel.layout_sizes(world)
    return cfg.owner_ranks(dp, ep)


def expert_group_profile(profile: dict[str, Any], ep_size: int, esp_size: int) -> dict[str, Any]:
    """The measured profile of every rank narrowed to the first group the MoE layers plan over
    (`planning_group_size` ranks): ranks `0, esp, 2·esp, ...` in `ParallelLayout`'s order (every group
    sits alike in the nodes), renumbered from 0, their links from the same fits."""
    members = [r * esp_size for r in range(ep_size)]
    nodes = [[members.index(r) for r in node if r in members] for node in profile["nodes"]]
    nodes = [node for node in nodes if node]
    return {
        **profile,
        "name": f"{profile['name']}-ep{ep_size}",
        "world_size": ep_size,
        "nodes": nodes,
        "topology": topology_from_fits(nodes, profile["fits"]),
    }
