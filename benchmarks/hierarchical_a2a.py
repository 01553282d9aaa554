"""Plain vs 2D-hierarchical all-to-all on the network testbed (FSMoE §3.1; Tutel's 2DH): measured
vs the cost model's price.

Every rank sends every rank the same number of d_model-wide fp32 rows, from 1 KiB to 16 MiB per
pair, through `dispatch="a2a"` (one all-to-all-v) and `dispatch="hierarchical"` (intra-node
all-to-all, layout transforms, inter-node all-to-all among equal local indices), forward only, the
two interleaved. Each size is timed on the slowest rank (median of the repeats) and priced by the
dispatchers' own `price` with the testbed's profile — the numbers the simulator and the planners
use. With `--latency-ms` the inter-node links also get a delay (tc netem: needs the kernel's
sch_netem module, which the machine of docs/fsmoe.md lacks): the regime (many small messages
over a slow, high-latency network) in which hierarchical exchange is meant to win.

    sudo .venv/bin/python benchmarks/hierarchical_a2a.py --cost-model results/profile-testbed.json \
        --out results/hierarchical_a2a.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from testbed_run import ensure_profile, run_workers, write_result

SIZES_KIB = [1, 4, 16, 64, 256, 1024, 4096, 16384]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cost-model", required=True, help="profile JSON of the same testbed (profiled if missing)")
    p.add_argument("--out", default="results/hierarchical_a2a.json")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--bandwidth-mbit", type=float, default=800.0)
    p.add_argument("--latency-ms", type=float, default=0.0, help="one-way delay added on every inter-node link")
    p.add_argument("--d-model", type=int, default=256, help="row width (fp32): 1 KiB rows by default")
    p.add_argument("--sizes-kib", type=int, nargs="+", default=SIZES_KIB, help="KiB each rank sends each rank")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from moeflow.bench.interleave import balanced_order
    from moeflow.core.launch import init_distributed
    from moeflow.perf.costmodel import CostModel
    from moeflow.strategies import DISPATCHERS

    init_distributed("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    cost_model = CostModel.load(args.cost_model)
    node_of = cost_model.topology.node_of
    dispatchers = {name: DISPATCHERS.build(name, None) for name in ("a2a", "hierarchical")}
    row_bytes = args.d_model * 4
    rows = []
    for kib in args.sizes_kib:
        per_pair = max(1, kib * 1024 // row_bytes)
        send_WW = np.full((world, world), per_pair, dtype=np.int64)
        x = torch.randn(per_pair * world, args.d_model)
        times: dict[str, list[float]] = {name: [] for name in dispatchers}
        for it in range(args.warmup + args.repeats):
            for name in balanced_order(list(dispatchers), it):
                dispatcher = dispatchers[name]
                dist.barrier()
                start = time.perf_counter()
                dispatcher.exchange(x, send_WW, rank, dist.group.WORLD, node_of)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if it >= args.warmup:
                    times[name].append(float(elapsed))
        bytes_WW = (send_WW * row_bytes).astype(np.float64)
        np.fill_diagonal(bytes_WW, 0.0)
        row = {"bytes_per_pair": per_pair * row_bytes}
        for name, dispatcher in dispatchers.items():
            row[f"{name}_ms"] = 1e3 * float(np.median(times[name]))
            row[f"{name}_predicted_ms"] = 1e3 * float(dispatcher.price(cost_model, bytes_WW))
        row["speedup"] = row["a2a_ms"] / row["hierarchical_ms"]
        row["predicted_speedup"] = row["a2a_predicted_ms"] / row["hierarchical_predicted_ms"]
        rows.append(row)
        if rank == 0:
            print(
                f"{row['bytes_per_pair'] / 1024:8.0f} KiB/pair: a2a {row['a2a_ms']:8.2f} ms "
                f"(pred {row['a2a_predicted_ms']:8.2f}), hierarchical {row['hierarchical_ms']:8.2f} ms "
                f"(pred {row['hierarchical_predicted_ms']:8.2f}), speedup {row['speedup']:.2f} "
                f"(pred {row['predicted_speedup']:.2f})",
                flush=True,
            )
    if rank == 0:
        result = {
            "world_size": world,
            "nodes": cost_model.topology.spec,
            "bandwidth_mbit": args.bandwidth_mbit,
            "latency_ms": args.latency_ms,
            "cost_model": args.cost_model,
            "rows": rows,
        }
        write_result(__file__, args.out, result)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    testbed = {
        "nodes": args.nodes,
        "ranks_per_node": args.ranks_per_node,
        "bandwidth_mbit": args.bandwidth_mbit,
        "latency_ms": args.latency_ms,
    }
    ensure_profile(Path(args.cost_model), **testbed)  # the same testbed, latency included
    return run_workers(__file__, argv, **testbed)


if __name__ == "__main__":
    sys.exit(main())
