"""TA-MoE dispatch-only benchmark (TA-MoE §4): all-to-all-v with the even pattern vs the
TA-MoE target pattern, real gloo processes on the network testbed, measured and predicted.

The testbed (`scripts/testbed.py`, needs root) puts ranks 0,1 and 2,3 into two network namespaces
("nodes") joined by a `tc`-shaped veth link, so the topology is [[0,1],[2,3]] with a slow
inter-node link. Every rank then
  1. profiles p2p (intra and inter node) and the all-to-all on the live backend (`moeflow profile`'s
     `run_profile`) -> a `CostModel` with α-β fits (TA-MoE §4.1 Eq. 2: α, β of every pair, here
     measured rather than assumed);
  2. solves the TA-MoE LP for the layer shape (E experts, top-k, S tokens of d_model fp32 per rank;
     `moeflow.routing.topology_aware.target_dispatch_pattern`) -> target ĉ, smoothed with λ;
     turns it into per-destination row counts;
  3. times `moeflow.core.dispatch.all_to_all_v` (gloo `all_to_all_single` with uneven splits) for the
     even pattern, TA-MoE Table 1's uneven pattern and the TA-MoE target(s), interleaved, slowest
     rank per run, median of the repeats;
  4. prices the same byte matrices with the cost model (link model `CostModel.a2a_time`, and the
     pair model of TA-MoE Eq. 2 that the LP minimises, `CostModel.pair_costs`) for the side-by-side
     predicted ratios.
Rank 0 writes one JSON file.

    .venv/bin/python benchmarks/ta_moe_dispatch.py --out results/ta_moe_dispatch.json   # as root
    .venv/bin/python benchmarks/ta_moe_dispatch.py --bandwidth-mbit 0 ...                # unshaped
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from moeflow.routing.topology_aware import TABLE1_UNEVEN
from testbed_run import run_workers, write_result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/ta_moe_dispatch.json")
    p.add_argument("--bandwidth-mbit", type=float, default=800.0, help="inter-node link; 0 = unshaped")
    p.add_argument("--latency-ms", type=float, default=0.0, help="one-way inter-node latency (needs netem)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens-per-rank", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--smoothing", type=float, nargs="+", default=[0.1], help="λ values to measure")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from moeflow.bench.interleave import balanced_order
    from moeflow.core.dispatch import all_to_all_v
    from moeflow.core.placement import cross_node_share, plain_ep_owners
    from moeflow.perf.costmodel import CostModel
    from moeflow.profiling.profiler import ProfileConfig, run_profile
    from moeflow.routing.topology_aware import flow_from_target, target_dispatch_pattern

    torch.set_num_threads(1)  # 4 ranks share 2 cores (torchrun's default policy)
    dist.init_process_group("gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg = ProfileConfig(
        comm_sizes_bytes=(1 << 16, 1 << 18, 1 << 20, 1 << 21, 1 << 22, 1 << 23),
        warmup=1,
        repeats=5,
        ops=("a2a", "p2p_intra", "p2p_inter"),
        extra={"bandwidth_mbit": args.bandwidth_mbit, "latency_ms": args.latency_ms},
    )
    profile = run_profile(cfg)
    # GEMMs are not profiled here (dispatch only), so the profile has gemm_flops_per_s = nan, which
    # CostModel rejects; the value is never used by the communication formulas below.
    if not np.isfinite(profile["gemm_flops_per_s"]):
        profile["gemm_flops_per_s"] = 1.0
    cm = CostModel.from_dict(profile)
    node_of = cm.topology.node_of
    E, k, S, d = args.experts, args.top_k, args.tokens_per_rank, args.d_model
    owner_E = plain_ep_owners(E, W)
    onehot_EW = np.eye(W)[owner_E]

    patterns: dict[str, np.ndarray] = {"even": np.full((W, W), 1.0 / W)}
    if W == 4 and cm.topology.nodes == [[0, 1], [2, 3]]:
        patterns["table1_uneven"] = TABLE1_UNEVEN
    targets = {}
    for lam in args.smoothing:
        c_WE = target_dispatch_pattern(cm, E, k, S, d, owner_E=owner_E, smoothing=lam)
        targets[f"ta_moe_lambda{lam:g}"] = c_WE
        patterns[f"ta_moe_lambda{lam:g}"] = c_WE @ onehot_EW / k  # share of a rank's bytes per peer

    rows = k * S  # every assignment is one row of d_model fp32 (dropless)
    row_bytes = d * 4
    counts = {name: flow_from_target(frac, rows) for name, frac in patterns.items()}  # rows per peer
    x_RD = torch.randn(rows, d)
    group = dist.group.WORLD

    def one(name: str) -> float:
        c = counts[name]
        dist.barrier()
        t0 = time.perf_counter()
        all_to_all_v(x_RD, c[rank].tolist(), c[:, rank].tolist(), group)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the exchange ends when the slowest rank is done
        return float(dt.item())

    names = list(patterns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.warmup + args.repeats):
        for name in balanced_order(names, r):  # drift and position in the round hit all patterns alike
            t = one(name)
            if r >= args.warmup:
                times[name].append(t)

    alpha_WW, beta_WW = cm.pair_costs()
    result_patterns = {}
    even_med = float(np.median(times["even"]))
    even_link = float(cm.a2a_time(counts["even"] * row_bytes))
    for name in names:
        bytes_WW = counts[name] * row_bytes
        link = float(cm.a2a_time(bytes_WW))
        pair = float((alpha_WW + beta_WW * bytes_WW).max())
        med = float(np.median(times[name]))
        flow_WE = None if name not in targets else flow_from_target(targets[name], S)
        result_patterns[name] = {
            "share_WW": patterns[name].tolist(),
            "rows_WW": counts[name].tolist(),
            "cross_node_share": cross_node_share(patterns[name], node_of),  # share_WW is rank -> rank
            "measured_median_s": med,
            "measured_s": times[name],
            "measured_speedup_vs_even": even_med / med,
            "predicted_link_model_s": link,
            "predicted_link_speedup_vs_even": even_link / link,
            "predicted_pair_model_s": pair,
            "target_c_WE": None if name not in targets else targets[name].tolist(),
            "target_flow_WE": None if flow_WE is None else flow_WE.tolist(),
        }
    even_pair = result_patterns["even"]["predicted_pair_model_s"]
    for v in result_patterns.values():
        v["predicted_pair_speedup_vs_even"] = even_pair / v["predicted_pair_model_s"]

    if rank == 0:
        out = {
            "benchmark": "ta_moe_dispatch",
            "testbed": {
                "nodes": cm.topology.nodes,
                "bandwidth_mbit": args.bandwidth_mbit or None,
                "latency_ms": args.latency_ms,
            },
            "shape": {
                "experts": E,
                "top_k": k,
                "tokens_per_rank": S,
                "d_model": d,
                "bytes_per_rank": rows * row_bytes,
            },
            "repeats": args.repeats,
            "warmup": args.warmup,
            "torch": torch.__version__,
            "cost_model": cm.to_dict(),
            "alpha_WW": alpha_WW.tolist(),
            "beta_WW": beta_WW.tolist(),
            "patterns": result_patterns,
            "published_table1": {"even_us": 14019, "uneven_us": 10765, "speedup": 14019 / 10765},
        }
        write_result(__file__, args.out, out)
        print(f"{'pattern':<20}{'x-node':>8}{'measured ms':>13}{'speedup':>9}{'link-model':>12}{'pair-model':>12}")
        for name, v in result_patterns.items():
            print(
                f"{name:<20}{v['cross_node_share']:>8.3f}{1e3 * v['measured_median_s']:>13.1f}"
                f"{v['measured_speedup_vs_even']:>8.2f}x{v['predicted_link_speedup_vs_even']:>11.2f}x"
                f"{v['predicted_pair_speedup_vs_even']:>11.2f}x"
            )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    testbed = {"bandwidth_mbit": args.bandwidth_mbit or None, "latency_ms": args.latency_ms}
    return run_workers(__file__, argv, nodes=2, ranks_per_node=2, **testbed)


if __name__ == "__main__":
    sys.exit(main())
