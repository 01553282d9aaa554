"""Planners at scale: the time a layer waits for its decision and the search time of the planners
that plan ahead, at (ranks, experts) = (16, 32), (64, 256), (256, 256), (1024, 1024), beside
DeepSeek's EPLB (`benchmarks/deepseek_eplb.py`) on the same loads and replica budget.

    .venv/bin/python benchmarks/planner_overhead.py --scale --out results/planner_scale.json
    .venv/bin/python benchmarks/planner_scale.py --sizes 16x32,64x256 --reference --out results/p.json

Clusters: a preset's link classes at each size (`--preset`, default johnny: nodes of 8 GPUs on
PCIe 3.0, 50 Gb/s between nodes; `topology_presets.resolve_preset("johnny@N")`). Loads, one layer:
the SmartMoE trace's held-out half (iterations 126-251 of the shipped excerpt, layer `--layer`)
unfolded to the size (`Trace.rescale`), and Zipf 1.2 (`synthetic_trace`), 8192 tokens per rank,
top-2, consecutive iterations so the planners that plan ahead meet the trace's locality; int64
counts, as the layer's count exchange hands them to its planner; with `--replicas R`, each call's
flow the mean of R data-parallel replicas' flows in whole tokens, as a layer with replicas hands it
to its planner (`MoELayer._replicas_flow`, docs/parallel.md), R consecutive iterations of the load
standing for the replicas; with `--gemm-launch-us T`, the cost model has a fitted GEMM launching
in T µs (the preset's throughput), as `moeflow profile` fits one, so the experts each device
computes are priced too. Expert:
d = 1024, h = 4096 (FasterMoE's GPT; as `moeflow simulate` prices the trace).

Per planner and load, medians over `--calls` calls after `--warmup`:

- `critical_ms`: what the layer waits between its count exchange and its dispatch: `call_ms`, the
  calling thread's CPU time in the planner's call on the real flow (shadow decides then; a planner
  that plans ahead collects the placement its planning thread searched, adjusts and submits the
  next search; `auto` also prices every proposal and answers the prefetch), plus the part of the
  searches queued on the planning thread that the gap between two calls (`--gap-ms`: the layer's
  exchanges and experts, the block before) does not hide: `max(0, search − gap)`, call by call.
  CPU times, so that a shared machine's other load (a load average of 10 on 2 cores here) does not
  count; `measured_wait_ms` is the wall time the call and the prefetch's question took, with that
  load in it.
- `search_ms`: a planner that plans ahead: its search (`PlanAheadPlanner.search`) run inline on
  the same estimate, CPU time; `auto`: `queued_searches_ms`, the searches it started that call
  (`AutoPlanner.replanned`: every candidate's, or one in turn from `TURNS_FROM` ranks × experts).
- `dispatch_ms`: the dispatch plan of the placement chosen (`core.placement.dispatch_loads`: the
  layer's sends and per-device tokens), process CPU time.
- `reference_*_ms` (`--reference`, sizes up to 64 x 256): the loop versions
  (tests/reference_planners.py) on the same flows, process CPU time.

DeepSeek's EPLB on each load (the window mean moeflow's `eplb` balances for), replica budget E + W
(one redundant slot per GPU, moeflow `eplb`'s default), groups = nodes (its hierarchical policy:
each node replicates only the experts packed onto it) and one group (its global policy):
its time, and the max per-GPU load it reaches — each expert's load split evenly over its replicas,
EPLB's own objective — beside moeflow `eplb`'s copies (all packed; and the prefix its pricing
keeps), plain EP and the ideal (total / W); also the max per-GPU tokens under moeflow's dispatch
plan (locality first, `dispatch_loads`), with DeepSeek's layout as holders (the GPU of an expert's
first replica its owner).

Targets checked (written to the JSON as `targets`): critical path ≤ 1 ms for every planner at
(64, 256); planned-ahead searches ≤ 5 ms at (64, 256); nothing above 50 ms at (1024, 1024).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import Placement, dispatch_loads
from moeflow.core.registry import LayerContext
from moeflow.perf.alpha_beta import AlphaBeta
from moeflow.perf.costmodel import CostModel
from moeflow.sim.traces import Trace, resolve_trace, synthetic_trace
from moeflow.strategies import PLANNERS
from moeflow.strategies.planners.auto import AutoPlanner
from moeflow.strategies.planners.base import PlanAheadPlanner, PrefetchWindow
from moeflow.strategies.planners.eplb import pack_copies, replicate_experts

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepseek_eplb import gpu_loads, rebalance_experts  # noqa: E402

SHAPE = ExpertShape(1024, 4096)
PLANNER_NAMES = ("shadow", "shadow_greedy", "prophet", "eplb", "fssdp", "auto")
TOKENS_PER_RANK = 8192
HELD_OUT = slice(125, None)
"""The SmartMoE excerpt's held-out half: iterations 126-251 (steps 1251-2501)."""
PREFETCH = PrefetchWindow(nonmoe_forward_s=0.005, hidden_share=1.0)
"""`auto` under the block-wise prefetch on a GPU: 5 ms of dense forward, copy engines hide all of it."""


def loads(kind: str, world: int, experts: int, iterations: int, layer: int) -> np.ndarray:
    """Flows `[I, W, E]` of one layer: the trace's held-out half unfolded, or Zipf 1.2 — int64, as
    the layer's count exchange hands them to its planner (`core.dispatch.exchange_counts`)."""
    if kind == "smartmoe":
        full = resolve_trace("smartmoe")
        part = Trace(
            full.flow_ILWE[HELD_OUT][:iterations, [layer]], full.steps_I[HELD_OUT][:iterations], dict(full.meta)
        )
        return np.rint(part.rescale(world, experts).flow_ILWE[:, 0]).astype(np.int64)
    trace = synthetic_trace("zipf", iterations, 1, world, experts, TOKENS_PER_RANK, 2, skew=1.2, seed=layer)
    return np.rint(trace.flow_ILWE[:, 0]).astype(np.int64)


def _build(name: str, ctx: LayerContext):
    planner = PLANNERS.build(name, ctx)
    if isinstance(planner, AutoPlanner):
        planner.use_prefetch(PREFETCH)
    return planner


def _cpu(fn) -> tuple[float, object]:
    start = time.process_time()
    out = fn()
    return time.process_time() - start, out


def measure_planner(name: str, flows: np.ndarray, cm: CostModel, warmup: int, gap_s: float) -> dict:
    """Two passes over the flows: the layer's calls as it makes them (the planning thread beside),
    then the searches and dispatch plans inline, each timed alone (module docstring)."""
    world, experts = flows.shape[1:]
    ctx = LayerContext(experts, 2, SHAPE, cm)
    owners = Placement.expert_parallel(experts, world)
    planner = _build(name, ctx)
    wall, call, placements, turns = [], [], [], []
    for flow in flows:
        start, cpu = time.perf_counter(), time.thread_time()
        placements.append(planner(flow, owners, cm))
        turns.append(list(planner.replanned) if isinstance(planner, AutoPlanner) else None)
        if isinstance(planner, AutoPlanner):  # the prefetch asks for the placement to send ahead (after
            time.sleep(gap_s)  # the layer's exchanges and experts), then the block before the next call
            planner.next_placement()
        else:
            time.sleep(gap_s)
        wall.append(time.perf_counter() - start - gap_s)
        call.append(time.thread_time() - cpu)  # this thread's work: not the planning thread's, not waits
    # The searches the planning thread ran (for `auto`: those of its candidates that plan ahead),
    # inline on the same estimates, one after the other as they queue on the one planning thread.
    inner = planner.planners.values() if isinstance(planner, AutoPlanner) else [planner]
    searchers = [_build(p.name, ctx) for p in inner if isinstance(p, PlanAheadPlanner)]
    search, dispatch = [], []
    for flow, placement, turn in zip(flows, placements, turns):
        dispatch.append(_cpu(lambda p=placement, f=flow: dispatch_loads(np.rint(f), p, cm.topology.node_of))[0])
        queued = 0.0
        for searcher in searchers:
            searcher.observe(flow)
            if turn is not None and searcher.name not in turn:
                continue  # `auto` in turns: one candidate's search per call
            fn, inputs = searcher.search(searcher.estimate(), owners, cm)
            queued += _cpu(lambda fn=fn, inputs=inputs: fn(*inputs))[0]
        search.append(queued)
    wall, call, dispatch, search = wall[warmup:], call[warmup:], dispatch[warmup:], search[warmup:]
    out = {
        "call_ms": 1e3 * float(np.median(call)),
        "measured_wait_ms": 1e3 * float(np.median(wall)),
        "dispatch_ms": 1e3 * float(np.median(dispatch)),
    }
    if searchers:
        key = "queued_searches_ms" if isinstance(planner, AutoPlanner) else "search_ms"
        out[key] = 1e3 * float(np.median(search))
        out[key.replace("_ms", "_max_ms")] = 1e3 * float(np.max(search))
    # What the layer waits: its own work, and whatever of the searches its gap did not hide.
    out["critical_ms"] = 1e3 * float(np.median(np.asarray(call) + np.maximum(0.0, np.asarray(search or [0.0]) - gap_s)))
    if isinstance(planner, AutoPlanner):
        out["chosen"] = planner.choice()
    return out


def measure_reference(flows: np.ndarray, cm: CostModel, calls: int) -> dict:
    """The loop versions (tests/reference_planners.py) on the same flows: the searches, inline."""
    from tests import reference_planners as ref

    from moeflow.strategies.planners.prophet import ProphetOptions
    from moeflow.strategies.planners.prophet_model import Pricing
    from moeflow.strategies.planners.shadow import ShadowGreedyOptions, ShadowOptions

    world, experts = flows.shape[1:]
    owners = Placement.expert_parallel(experts, world)
    runs = {
        "shadow": lambda f: ref.ShadowReference(SHAPE, ShadowOptions()).decide(f, owners, cm),
        "shadow_greedy": lambda f: ref.ShadowReference(SHAPE, ShadowGreedyOptions()).decide(f, owners, cm),
        "prophet": lambda f: ref.prophet_search(f, owners, cm, SHAPE, ProphetOptions()),
        "eplb": lambda f: ref.eplb_plan(f, owners, cm, SHAPE, 1, Pricing(), 0.05),
        "fssdp": lambda f: ref.fssdp_plan(f, owners, cm, SHAPE, experts, experts // world, Pricing(), 0.05),
    }
    out = {}
    for name, run in runs.items():
        times = [_cpu(lambda f=f, run=run: run(f))[0] for f in flows[:calls]]
        out[f"reference_{name}_ms"] = 1e3 * float(np.median(times))
    return out


def compare_deepseek(flows: np.ndarray, cm: CostModel, window: int = 10) -> dict:
    """DeepSeek's EPLB beside moeflow's `eplb` on the window mean, replica budget E + W."""
    world, experts = flows.shape[1:]
    nodes = cm.topology.num_nodes
    estimate = flows[-window:].mean(0)
    load = estimate.sum(0)
    weight = torch.as_tensor(load[None, :])
    groups = nodes if experts % nodes == 0 else 1
    cpu, (phy2log, _, count) = _cpu(lambda: rebalance_experts(weight, experts + world, groups, nodes, world))
    deepseek = gpu_loads(weight, phy2log, count, world)[0].numpy()
    # Its global policy too (one group: replicas may go to any node), where the hierarchical one
    # keeps every node's replicas among its own experts.
    cpu_global, (g_phy2log, _, g_count) = _cpu(lambda: rebalance_experts(weight, experts + world, 1, nodes, world))
    deepseek_global = gpu_loads(weight, g_phy2log, g_count, world)[0].numpy()
    # DeepSeek's layout as moeflow holders (an expert's first replica's GPU its owner) for the dispatch plan.
    slot_gpu = np.arange(experts + world) // ((experts + world) // world)
    logical = phy2log[0].numpy()
    holders = np.zeros((experts, world), dtype=bool)
    holders[logical, slot_gpu] = True
    first = np.full(experts, -1)
    for slot in range(logical.size - 1, -1, -1):
        first[logical[slot]] = slot_gpu[slot]
    deepseek_layout = Placement(first, holders)
    owners = Placement.expert_parallel(experts, world)
    cpu_moeflow, copies = _cpu(lambda: replicate_experts(load, world))
    cpu_pack, placed = _cpu(lambda: pack_copies(copies, load, owners.owner_E, world, 1, cm.topology.node_of))
    packed = owners.holders_EW.copy()
    for e, d in placed:
        packed[e, d] = True
    planner = PLANNERS.build("eplb", LayerContext(experts, 2, SHAPE, cm))
    fn, inputs = planner.search(estimate, owners, cm)
    chosen = fn(*inputs)[0]

    def even_split(holders: np.ndarray) -> float:
        return float((holders * (load / holders.sum(1))[:, None]).sum(0).max())

    def dispatched(placement: Placement) -> float:
        return float(dispatch_loads(np.rint(estimate), placement, cm.topology.node_of)[1].sum(1).max())

    return {
        "replica_budget": experts + world,
        "groups": groups,
        "deepseek_ms": 1e3 * cpu,
        "deepseek_global_ms": 1e3 * cpu_global,
        "moeflow_replicate_pack_ms": 1e3 * (cpu_moeflow + cpu_pack),
        "max_gpu_load": {
            "ideal": float(load.sum() / world),
            "ep": even_split(owners.holders_EW),
            "deepseek": float(deepseek.max()),
            "deepseek_global": float(deepseek_global.max()),
            "moeflow_eplb_packed": even_split(packed),
            "moeflow_eplb_chosen": even_split(chosen.holders_EW),
        },
        "max_gpu_tokens_dispatched": {
            "ep": dispatched(owners),
            "deepseek": dispatched(deepseek_layout),
            "moeflow_eplb_packed": dispatched(Placement(owners.owner_E, packed)),
            "moeflow_eplb_chosen": dispatched(chosen),
        },
        "moeflow_eplb_chosen_copies": int(chosen.materialized_EW().sum()),
    }


def _machine() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "commit": commit,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/planner_scale.json")
    parser.add_argument("--sizes", default="16x32,64x256,256x256,1024x1024", help="comma list of RANKSxEXPERTS")
    parser.add_argument(
        "--preset", default="johnny", help="the link classes (a preset of moeflow.perf.topology_presets)"
    )
    parser.add_argument("--loads", default="smartmoe,zipf1.2", help="comma list of smartmoe, zipf1.2")
    parser.add_argument("--planners", default=",".join(PLANNER_NAMES), help="comma list of the planners timed")
    parser.add_argument("--calls", type=int, default=12, help="timed calls per planner (at 1024 ranks: half)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--gap-ms", type=float, default=5.0, help="the layer's work between two calls")
    parser.add_argument("--layer", type=int, default=1, help="the trace's layer (0-3 of the excerpt)")
    parser.add_argument("--reference", action="store_true", help="also the loop versions, sizes up to 64x256")
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="each call's flow the mean of this many data-parallel replicas' flows in whole tokens, as a "
        "layer with replicas plans on (R consecutive iterations of the load stand for the replicas)",
    )
    parser.add_argument(
        "--gemm-launch-us",
        type=float,
        default=None,
        help="a fitted GEMM with this launch cost (µs; β from the preset's GEMM throughput), as "
        "`moeflow profile` fits one: the experts each device computes are then priced too",
    )
    args = parser.parse_args(argv)
    if args.gemm_launch_us is not None and not args.gemm_launch_us >= 0:
        parser.error(f"--gemm-launch-us={args.gemm_launch_us}: expected microseconds >= 0")
    if args.replicas < 1:
        parser.error(f"--replicas={args.replicas}: expected a positive number of replicas")
    sizes = [tuple(int(v) for v in s.lower().split("x")) for s in args.sizes.split(",") if s.strip()]
    result = {
        "command": " ".join(["python", *sys.argv]),
        "machine": _machine(),
        "loadavg_start": os.getloadavg(),
        "preset": args.preset,
        "gap_ms": args.gap_ms,
        "replicas": args.replicas,
        "gemm_launch_us": args.gemm_launch_us,
        "expert": {"d_model": SHAPE.d_model, "d_hidden": SHAPE.d_hidden},
        "sizes": {},
    }
    for world, experts in sizes:
        cm = CostModel.from_preset(f"{args.preset}@{world}")
        if args.gemm_launch_us is not None:  # a profiled cluster's fitted GEMM
            gemm = AlphaBeta(args.gemm_launch_us * 1e-6, 1.0 / cm.gemm_flops_per_s, "flop", source="planner_scale")
            cm = dataclasses.replace(cm, fits={**cm.fits, "gemm": gemm})
        calls = max(3, args.calls // 2) if world >= 1024 else args.calls
        entry = {"cluster": cm.name, "world": world, "experts": experts, "loads": {}}
        for kind in [k.strip() for k in args.loads.split(",") if k.strip()]:
            R = args.replicas
            flows = loads(
                "smartmoe" if kind == "smartmoe" else "zipf", world, experts, args.warmup + calls + R - 1, args.layer
            )
            if R > 1:  # the mean of R replicas' flows in whole tokens, as `MoELayer._replicas_flow` gives it
                flows = np.stack([np.rint(flows[i : i + R].mean(axis=0)) for i in range(args.warmup + calls)])
                flows = flows.astype(np.int64)
            row = {"planners": {}}
            for name in [n.strip() for n in args.planners.split(",") if n.strip()]:
                row["planners"][name] = measure_planner(name, flows, cm, args.warmup, args.gap_ms / 1e3)
                print(f"{world}x{experts} {kind:9s} {name:14s} {json.dumps(row['planners'][name])}", flush=True)
            if args.reference and world * experts <= 64 * 256:
                row["reference"] = measure_reference(flows[args.warmup :], cm, min(calls, 3))
                print(f"{world}x{experts} {kind:9s} reference {json.dumps(row['reference'])}", flush=True)
            row["deepseek_eplb"] = compare_deepseek(flows, cm)
            print(f"{world}x{experts} {kind:9s} deepseek {json.dumps(row['deepseek_eplb'])}", flush=True)
            entry["loads"][kind] = row
        result["sizes"][f"{world}x{experts}"] = entry
    result["loadavg_end"] = os.getloadavg()
    result["targets"] = targets(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["targets"], indent=2))
    print("wrote", args.out)
    return 0


def targets(result: dict) -> dict:
    """The issue's three targets, met or not, with the worst number behind each."""
    out = {}
    mid = result["sizes"].get("64x256")
    if mid:
        rows = [p for load in mid["loads"].values() for p in load["planners"].values()]
        worst_critical = max(p["critical_ms"] for p in rows)  # `auto`'s queued searches: in its critical path
        worst_search = max((p["search_ms"] for p in rows if "search_ms" in p), default=0.0)
        out["critical_le_1ms_at_64x256"] = {"met": worst_critical <= 1.0, "worst_ms": worst_critical}
        out["search_le_5ms_at_64x256"] = {"met": worst_search <= 5.0, "worst_ms": worst_search}
    big = result["sizes"].get("1024x1024")
    if big:
        values = [
            v
            for load in big["loads"].values()
            for p in load["planners"].values()
            for k, v in p.items()
            if k in ("critical_ms", "search_ms", "queued_searches_ms", "dispatch_ms")
        ]
        out["nothing_above_50ms_at_1024x1024"] = {"met": max(values) <= 50.0, "worst_ms": max(values)}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
