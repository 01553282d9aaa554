"""Copies of shadowed experts on the network testbed (FasterMoE §4.1): measured vs the planner's price.

FasterMoE shadowing trades token traffic for parameter traffic; the planner decides with
`CostModel.copies_time`. This times the real sparse collectives (`moeflow.core.sparse_collectives`:
parameters out in forward, gradients summed back to the owners in backward) for k experts held
everywhere, through the two-level tree (gloo across nodes) and through one flat broadcast /
reduce per owner, and prices each with the testbed's profile. Slowest rank, median of the repeats,
the variants interleaved. Rank 0 writes one JSON file.

    sudo .venv/bin/python benchmarks/shadow_copies.py --cost-model results/profile-testbed.json \
        --out results/shadow_copies.json
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from testbed_run import run_workers, time_copies, write_result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cost-model", required=True, help="profile JSON of the same testbed")
    p.add_argument("--out", default="results/shadow_copies.json")
    p.add_argument("--bandwidth-mbit", type=float, default=800.0)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-hidden", type=int, default=1024)
    p.add_argument("--experts-per-rank", type=int, default=2)
    p.add_argument("--shadowed", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from moeflow.core.experts import GroupedExperts
    from moeflow.core.launch import init_distributed
    from moeflow.core.placement import Placement
    from moeflow.perf.costmodel import CostModel

    init_distributed("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    cost_model = CostModel.load(args.cost_model)
    node_of = cost_model.topology.node_of
    num_experts = args.experts_per_rank * world
    experts = GroupedExperts(num_experts, args.d_model, args.d_hidden, "ffn")
    experts.shard_(range(rank * args.experts_per_rank, (rank + 1) * args.experts_per_rank))
    weights = experts.weights()
    param_bytes = sum(int(np.prod(w.shape[1:])) for w in weights.values()) * 4
    base = Placement.expert_parallel(num_experts, world)
    # Shadow the k experts in an order that alternates owners, as skewed routing tends to.
    order = np.argsort(np.arange(num_experts) % args.experts_per_rank * world + base.owner_E, kind="stable")
    rows = []
    for k in args.shadowed:
        extra = np.zeros_like(base.holders_EW)
        extra[order[:k]] = True
        placement = base.with_holders(extra)
        held = np.flatnonzero(placement.holders_EW[:, rank])
        layouts = {"tree": node_of, "flat": None}
        times = time_copies(weights, placement, experts.expert_ids, held, layouts, args.warmup, args.repeats)
        predicted = cost_model.copies_time(param_bytes, placement.holders_EW, base.owner_E, "materialize")
        predicted += cost_model.copies_time(param_bytes, placement.holders_EW, base.owner_E, "reduce")
        row = {
            "shadowed": k,
            "param_bytes_per_expert": param_bytes,
            "tree_ms": 1e3 * float(np.median(times["tree"])),
            "flat_ms": 1e3 * float(np.median(times["flat"])),
            "predicted_ms": 1e3 * predicted,
        }
        rows.append(row)
        if rank == 0:
            print(
                f"shadowed {k}: tree {row['tree_ms']:.1f} ms, flat {row['flat_ms']:.1f} ms, "
                f"predicted {row['predicted_ms']:.1f} ms",
                flush=True,
            )
    if rank == 0:
        result = {
            "world_size": world,
            "nodes": cost_model.topology.spec,
            "bandwidth_mbit": args.bandwidth_mbit,
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
    return run_workers(__file__, argv, nodes=2, ranks_per_node=2, bandwidth_mbit=args.bandwidth_mbit or None)


if __name__ == "__main__":
    sys.exit(main())
