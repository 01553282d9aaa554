"""What the chunk pipeline in the copy trees saves (Hecate §4.1's relays forwarding chunk j while
they receive chunk j + 1, `core.copy_rounds`), simulated on the papers' clusters.

`core.sparse_collectives` sends a partial replica set along its tree in two stages (owner → one
relay per other node, then relay → its node's holders); with `moe.copy_chunks` c > 1 the stages
overlap: stage 1's piece r travels beside stage 2's piece r − 1, c + 1 rounds, each the slower of
the two plus its latency. This prices the trees with the cost model's own pricing
(`CostModel.tree_stage_terms`, `copies_pricing.pipelined_trees`: the numbers `copies_time` and the
planners use with `copy_chunks` c) for the placements each strategy makes on a workload
(`moeflow simulate`'s planners with the block-wise prefetch's window, planned with c = 1 so that
every c prices the same placements) — the trees of partial sets only (sets held everywhere move by
broadcast / reduce) — forward and backward, per iteration. It is an upper bound on the end-to-end
gain: under the block-wise prefetch (which sends each stage whole) much of the copies' time is
already hidden. Beside it, the whole iteration as `moeflow simulate --schedule sync --copy-chunks c`
prices it without the prefetch (copies on the critical path, the planners choosing on the
pipelined prices).

    .venv/bin/python benchmarks/copy_tree_chunks_simulated.py --out results/chunks.json

Shape suffixes: E experts, W devices, I iterations, L layers.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from moeflow.core.registry import LayerContext
from moeflow.perf.copies_pricing import pipelined_trees
from moeflow.sim.planning import plan_replay
from moeflow.sim.simulator import routed_flow, simulate
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


def trees_time(cm, holders_EW: np.ndarray, owner_E: np.ndarray, param_bytes: float, chunks: int) -> float:
    """One direction of the partial sets' trees in `chunks` pieces, as the cost model prices them."""
    W = holders_EW.shape[1]
    everywhere_E = holders_EW.all(1)
    partial_EW = np.where(everywhere_E[:, None], np.eye(W, dtype=bool)[owner_E], holders_EW)
    return float(pipelined_trees(*cm.tree_stage_terms(param_bytes, partial_EW, owner_E), chunks))


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
                for c in CHUNKS:  # forward copies and backward sums (the same links reversed)
                    total[c] += 2 * trees_time(cm, plans.holders[i, li], plans.owners[i, li], param_bytes, c)
        out[name] = {f"chunks_{c}_ms": 1e3 * v / I for c, v in total.items()}
    return out


def iterations(args: list[str], strategies: list[str]) -> dict:
    """Mean simulated iteration (ms) per strategy and c, `moeflow simulate --schedule sync
    --copy-chunks c` without the prefetch: the copies on the critical path, the planners choosing
    them on the pipelined prices."""
    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    out: dict = {name: {} for name in strategies}
    for c in CHUNKS:
        argv = [*args, "--strategy", ",".join(strategies), "--schedule", "sync", "--copy-chunks", str(c)]
        trace, cm, layer, names, schedules = workload_from_args(parser.parse_args(argv))
        for result in simulate(trace, cm, layer, names, schedules):
            out[result.strategy][f"chunks_{c}_ms"] = 1e3 * float(result.total_I.mean())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default="fssdp,eplb")
    parser.add_argument("--out", default="results/copy_tree_chunks.json")
    args = parser.parse_args(argv)
    strategies = args.strategies.split(",")
    result = {label: run(run_args, strategies) for label, run_args in RUNS.items()}
    whole = {label: iterations(run_args, strategies) for label, run_args in RUNS.items()}
    for title, table in (("copy trees, ms per iteration", result), ("iteration (sync), ms", whole)):
        print(title)
        for label, rows in table.items():
            for name, row in rows.items():
                print(f"{label:<24}{name:<8}" + "".join(f"{k[:-3]:>11} {v:8.1f}" for k, v in row.items()))
    document = {"command": " ".join(sys.argv), "trees_ms_per_iteration": result, "iteration_ms_sync": whole}
    with open(args.out, "w") as f:
        json.dump(document, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
