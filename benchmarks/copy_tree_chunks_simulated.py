"""What a chunk pipeline in the copy trees would save, before building it (Hecate §4.1's relays
forwarding chunk j while they receive chunk j + 1), simulated on the papers' clusters.

`core.sparse_collectives` sends a partial replica set along its tree in two stages (owner → one
relay per other node, then relay → its node's holders), the second after the first has arrived
whole. With c chunks the stages overlap: stage 1's chunk r travels beside stage 2's chunk r − 1,
c + 1 rounds, each the slower of the two plus its latency. This prices both for the placements
each strategy makes on a workload (`moeflow simulate`'s planners, the same plans) — the trees of
partial sets only (sets held everywhere move by broadcast / reduce) — forward and backward, per
iteration. It is an upper bound on the end-to-end gain: under the block-wise prefetch much of the
copies' time is already hidden.

    .venv/bin/python benchmarks/copy_tree_chunks_simulated.py --out results/chunks.json

Shape suffixes: E experts, W devices, I iterations, L layers.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from moeflow.core.placement import tree_edges
from moeflow.core.registry import LayerContext
from moeflow.sim.planning import plan_replay
from moeflow.sim.simulator import routed_flow
from moeflow.sim.workload import add_workload_arguments, workload_from_args
from moeflow.strategies import PLANNERS
from moeflow.strategies.planners.base import PrefetchWindow

CHUNKS = (1, 2, 4, 8)
HELD_OUT = ["--trace", "smartmoe", "--trace-iterations", "125:"]
RUNS = {
    "johnny/smartmoe": ["--cluster", "johnny", *HELD_OUT],
    "johnny/zipf-1.2": ["--cluster", "johnny", "--trace", "zipf", "--skew", "1.2", "--iterations", "40"],
    "hecate_a@16/smartmoe": ["--cluster", "hecate_a@16", *HELD_OUT, "--experts", "64"],
    "hecate_b/smartmoe": ["--cluster", "hecate_b", *HELD_OUT, "--experts", "64"],
}


def stage_times(cm, holders_EW: np.ndarray, owner_E: np.ndarray, param_bytes: float) -> list[tuple[float, float]]:
    """(link time, latency) of each stage of the partial sets' trees (`CostModel._trees_time`'s terms)."""
    topo = cm.topology
    W = holders_EW.shape[1]
    everywhere_E = holders_EW.all(1)
    partial_EW = np.where(everywhere_E[:, None], np.eye(W, dtype=bool)[owner_E], holders_EW)
    _, src, dst, stage = tree_edges(partial_EW, owner_E, topo.node_of)
    out = []
    for s in (0, 1):
        m = stage == s
        if not m.any():
            out.append((0.0, 0.0))
            continue
        hops = topo.route_WWH[src[m], dst[m]].reshape(-1)
        traffic_L = np.bincount(hops, minlength=len(topo.links) + 1)[:-1] * param_bytes
        out.append((float(cm.stage_time_from_traffic(traffic_L)), float(topo.path_latency_WW[src[m], dst[m]].max())))
    return out


def pipelined(stages: list[tuple[float, float]], chunks: int) -> float:
    """Two stages in `chunks` rounds each (module docstring); one stage alone is sent whole."""
    (t1, l1), (t2, l2) = stages
    if not (t1 and t2) or chunks == 1:
        return t1 + l1 + t2 + l2
    a, b = t1 / chunks + l1, t2 / chunks + l2
    return a + (chunks - 1) * max(a, b) + b


def run(args: list[str], strategies: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    trace, cm, layer, _, _ = workload_from_args(parser.parse_args([*args, "--prefetch"]))
    if trace.world_size != cm.topology.num_devices:
        trace = trace.rescale(cm.topology.num_devices)
    I, L, _, E = trace.flow_ILWE.shape
    ctx = LayerContext(E, layer.top_k, layer.shape, cm)
    param_bytes = float(layer.shape.param_bytes(cm.bytes_per_element))
    flow = routed_flow(trace, cm, layer)
    out = {}
    for name in strategies:
        build = lambda name=name: PLANNERS.build(name, ctx)  # noqa: E731
        window = PrefetchWindow(layer.nonmoe_forward_s, 1.0)  # the block-wise prefetch, as `simulate` runs it
        plans = plan_replay(build, flow, cm, param_bytes, window)[0]
        total = dict.fromkeys(CHUNKS, 0.0)
        for i in range(I):
            for li in range(L):
                stages = stage_times(cm, plans.holders[i, li], plans.owners[i, li], param_bytes)
                for c in CHUNKS:
                    total[c] += 2 * pipelined(stages, c)  # forward copies and backward sums
        out[name] = {f"chunks_{c}_ms": 1e3 * v / I for c, v in total.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default="fssdp,eplb")
    parser.add_argument("--out", default="results/copy_tree_chunks.json")
    args = parser.parse_args(argv)
    result = {label: run(run_args, args.strategies.split(",")) for label, run_args in RUNS.items()}
    for label, rows in result.items():
        for name, row in rows.items():
            print(f"{label:<24}{name:<8}" + "".join(f"{k[:-3]:>11} {v:8.1f}" for k, v in row.items()))
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "trees_ms_per_iteration": result}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
