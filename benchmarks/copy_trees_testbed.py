"""Copy trees measured on the network testbed (2 nodes × 2 ranks, 800 Mbit/s between the nodes):
one expert of rank 0 copied to 1, 2 and 3 other ranks, and every rank's expert copied at once to
both ranks of the other node — through the topology-aware trees of `core.sparse_collectives`
(Hecate §4.1: one transfer into each node, a relay fans out inside it; gradients summed back the
same way reversed) and straight from the owner (point-to-point per holder; an expert held by every
rank then goes by gloo's broadcast / reduce). Forward copies plus backward sums, slowest rank,
median of the repeats, the variants interleaved. Rank 0 writes one JSON file.

With `--chunks 1,4,8` the trees run at each of those chunk counts side by side (Hecate §4.1's chunk
pipeline, `core.copy_rounds`: a relay forwards piece j while it receives piece j + 1), interleaved
with the owner's point-to-point; each variant's median with its quartiles. The testbed's second
stage is inside a node (loopback), so the pipeline has little to overlap there.

    sudo .venv/bin/python benchmarks/copy_trees_testbed.py --out results/copy_trees_testbed.json
    .venv/bin/python benchmarks/copy_trees_testbed.py --chunks 1,4,8 --repeats 20 --out results/chunks_testbed.json
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
    p.add_argument(
        "--chunks",
        default=None,
        help="comma list of chunk counts (e.g. 1,4,8): time the trees at each, side by side (default: 1 only)",
    )
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
    chunks = None if args.chunks is None else [int(c) for c in args.chunks.split(",")]
    rows = []
    for case, copies in CASES.items():
        extra = np.zeros_like(base.holders_EW)
        for e, holders in copies:
            extra[e, holders] = True
        placement = base.with_holders(extra)
        held = np.flatnonzero(placement.holders_EW[:, rank])
        if chunks is None:
            layouts, pieces = {"tree": node_of, "owner": None}, None
        else:
            layouts = {**{f"tree_c{c}": node_of for c in chunks}, "owner": None}
            pieces = {f"tree_c{c}": c for c in chunks}
        times = time_copies(weights, placement, experts.expert_ids, held, layouts, args.warmup, args.repeats, pieces)
        row = {"case": case, "copies": int(extra.sum()), "param_bytes_per_expert": param_bytes}
        for name, seconds in times.items():
            row[f"{name}_ms"] = 1e3 * float(np.median(seconds))
            if chunks is not None:  # the noise beside the medians
                row[f"{name}_quartiles_ms"] = [1e3 * float(q) for q in np.percentile(seconds, [25, 75])]
        rows.append(row)
        if rank == 0:
            print(f"{case}: " + ", ".join(f"{n} {row[f'{n}_ms']:.1f} ms" for n in layouts), flush=True)
    if rank == 0:
        meta = {"world_size": world, "bandwidth_mbit": args.bandwidth_mbit, "repeats": args.repeats}
        write_result(__file__, args.out, {**meta, "chunks": chunks, "rows": rows})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.chunks is not None:
        values = args.chunks.split(",")
        if not all(v.strip().isdigit() and int(v) >= 1 for v in values):
            raise SystemExit(f"--chunks must be a comma list of integers >= 1, got {args.chunks!r}")
    if args.worker:
        worker(args)
        return 0
    return run_workers(__file__, argv, nodes=2, ranks_per_node=2, bandwidth_mbit=args.bandwidth_mbit or None)


if __name__ == "__main__":
    sys.exit(main())
