"""FSMoE's published degree tool runs the forward unpipelined (degree 1) whenever one unchunked
all-to-all takes < 1 ms; moeflow's solver does not (`moeflow.perf.pipeline_degree`). Measured on
this machine: a layer whose all-to-all is that short, its pipelined forward (and forward +
backward) at degrees 1, 2, 4 and 8, interleaved round by round on 2 gloo ranks, next to the
degree `moeflow tune` picks for it with this machine's profile.

    .venv/bin/python benchmarks/fsmoe_short_all_to_all.py \\
        --cost-model docs/results/2026-11-26-fsmoe-tool-agreement.profile.json \\
        --out docs/results/2026-11-26-fsmoe-short-all-to-all.json

The layer: `--tokens` per rank, d_model, d_hidden, ffn experts (2 GEMMs), 2 experts per rank,
top-2, plain expert parallelism over the 2 ranks (ESP 1). A round times every degree once, in a
balanced order (`moeflow.bench.interleave`); each time is the slowest rank's. Reported: medians
and, per degree, the per-round ratio to degree 1 (median, min, max).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

DEGREES = (1, 2, 4, 8)


def worker(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    from moeflow.bench.interleave import balanced_order
    from moeflow.core.launch import init_distributed
    from moeflow.core.parallel import ParallelLayout
    from moeflow.layer import MoELayer

    init_distributed("cpu")
    world = dist.get_world_size()
    layout = ParallelLayout(ep_size=world, esp_size=1, d_hidden=args.d_hidden)
    layers = {}
    for r in DEGREES:
        torch.manual_seed(0)  # identical weights and routing at every degree
        layer = MoELayer(
            args.d_model, args.d_hidden, 2 * world, top_k=2, schedule="pipeline", schedule_options={"degree": r}
        )
        layer.to_expert_parallel(layout.ep_group)
        layers[r] = layer
    x_TD = torch.randn(args.tokens, args.d_model, generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    rows = torch.randn(2 * args.tokens, args.d_model)
    received = torch.empty_like(rows)

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    def forward(r: int) -> None:
        with torch.no_grad():
            layers[r](x_TD)

    def step(r: int) -> None:
        layers[r](x_TD).sum().backward()

    times = {pass_: {r: [] for r in DEGREES} for pass_ in ("forward", "step")}
    a2a = []
    for it in range(args.warmup + args.rounds):
        for r in balanced_order(list(DEGREES), it):
            f, s = timed(lambda r=r: forward(r)), timed(lambda r=r: step(r))
            if it >= args.warmup:
                times["forward"][r].append(f)
                times["step"][r].append(s)
        t = timed(lambda: dist.all_to_all_single(received, rows))  # one unchunked dispatch (top-2 rows)
        if it >= args.warmup:
            a2a.append(t)
    dist.destroy_process_group()
    return {"times_s": times, "a2a_s": a2a}


def summarize(times: dict) -> dict:
    out = {}
    for pass_, per in times.items():
        out[pass_] = {
            str(r): {
                "median_ms": 1e3 * statistics.median(t),
                "ratio_to_1": {
                    "median": statistics.median(a / b for a, b in zip(t, per[1], strict=True)),
                    "min": min(a / b for a, b in zip(t, per[1], strict=True)),
                    "max": max(a / b for a, b in zip(t, per[1], strict=True)),
                },
            }
            for r, t in per.items()
        }
    return out


def tune_degrees(args: argparse.Namespace) -> dict:
    """`moeflow tune --cost-model` for this layer (B = 1, L = tokens, F = top-2, S = 1, one layer)."""
    from moeflow.perf.costmodel import CostModel
    from moeflow.perf.grad_partition import partition_gradients
    from moeflow.perf.pipeline_degree import pass_model, plan_degrees, priced_time
    from moeflow.perf.pipeline_inputs import PipelineFits, PipelineWorkload

    w = PipelineWorkload(1, args.tokens, args.d_model, args.d_hidden, 2, 2.0, 1, 1, 0.0)
    fits = PipelineFits.from_cost_model(CostModel.load(args.cost_model), w)
    plan = plan_degrees(w, fits, partition_gradients(w, fits).moe_gar_ms)
    forward = pass_model(w, fits, False)
    return {
        "forward_degree": plan.forward_degree,
        "backward_degrees": plan.backward_degrees,
        "unchunked_a2a_ms_priced": fits.alpha("a2a") + fits.beta("a2a") * w.elements("a2a"),
        "forward_priced_ms": {str(r): float(priced_time(forward, r, 0.0)) for r in DEGREES},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cost-model", required=True, help="moeflow profile JSON of this machine")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--d-hidden", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from moeflow.core.launch import launch_local

    measured = launch_local(worker, 2, args, name="fsmoe-short-a2a")[0]
    result = {
        "command": " ".join(["python benchmarks/fsmoe_short_all_to_all.py", *(sys.argv[1:] if argv is None else argv)]),
        "layer": {"tokens_per_rank": args.tokens, "d_model": args.d_model, "d_hidden": args.d_hidden, "ranks": 2},
        "rounds": args.rounds,
        "unchunked_a2a_ms_measured": 1e3 * statistics.median(measured["a2a_s"]),
        "tune": tune_degrees(args),
        "measured": summarize(measured["times_s"]),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "command"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
