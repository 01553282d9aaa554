"""Copy trees measured on the network testbed (2 nodes × 2 ranks, 800 Mbit/s between the nodes):
one expert of rank 0 copied to 1, 2 and 3 other ranks, and every rank's expert copied at once to
both ranks of the other node — through the topology-aware trees of `core.sparse_collectives`
(Hecate §4.1: one transfer into each node, a relay fans out inside it; gradients summed back the
same way reversed) and straight from the owner (point-to-point per holder; an expert held by every
rank then goes by gloo's broadcast / reduce). Forward copies plus backward sums, slowest rank,
median of the repeats, the two variants interleaved. Rank 0 writes one JSON file.

    sudo .venv/bin/python benchmarks/copy_trees_testbed.py --out results/copy_trees_testbed.json
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from testbed_run import run_workers, time_copies, write_result

CASES = {
    "1 holder, other node": [(0, [2])],
    "2 holders, other node": [(0, [2, 3])],
    "3 holders (every rank)": [(0, [1, 2, 3])],
    "every owner to the other node": [(0, [2, 3]), (2, [1, 3]), (4, [0, 1]), (6, [0, 2])],
}
"""Case -> (expert, its extra holders) pairs; experts 2r, 2r + 1 are rank r's."""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/copy_trees_testbed.json")
    p.add_argument("--bandwidth-mbit", type=float, default=800.0)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-hidden", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from moeflow.core.experts import GroupedExperts
    from moeflow.core.launch import init_distributed
    from moeflow.core.placement import Placement

    init_distributed("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    node_of = [r // 2 for r in range(world)]
    experts = GroupedExperts(2 * world, args.d_model, args.d_hidden, "ffn")
    experts.shard_(range(2 * rank, 2 * rank + 2))
    weights = experts.weights()
    param_bytes = sum(int(np.prod(w.shape[1:])) for w in weights.values()) * 4
    base = Placement.expert_parallel(2 * world, world)
    rows = []
    for case, copies in CASES.items():
        extra = np.zeros_like(base.holders_EW)
        for e, holders in copies:
            extra[e, holders] = True
        placement = base.with_holders(extra)
        held = np.flatnonzero(placement.holders_EW[:, rank])
        layouts = {"tree": node_of, "owner": None}
        times = time_copies(weights, placement, experts.expert_ids, held, layouts, args.warmup, args.repeats)
        row = {
            "case": case,
            "copies": int(extra.sum()),
            "param_bytes_per_expert": param_bytes,
            "tree_ms": 1e3 * float(np.median(times["tree"])),
            "owner_ms": 1e3 * float(np.median(times["owner"])),
        }
        rows.append(row)
        if rank == 0:
            print(f"{case}: tree {row['tree_ms']:.1f} ms, from the owner {row['owner_ms']:.1f} ms", flush=True)
    if rank == 0:
        write_result(__file__, args.out, {"world_size": world, "bandwidth_mbit": args.bandwidth_mbit, "rows": rows})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    return run_workers(__file__, argv, nodes=2, ranks_per_node=2, bandwidth_mbit=args.bandwidth_mbit or None)


if __name__ == "__main__":
    sys.exit(main())
