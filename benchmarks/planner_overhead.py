"""Time each planner spends on the layer's critical path per call, planning inline vs on the planning
thread (`strategies/planners/ahead.py`), side by side (docs/performance.md, "Planning off the
critical path").

    .venv/bin/python benchmarks/planner_overhead.py --out results/planner_overhead.json
    .venv/bin/python benchmarks/planner_overhead.py --scale --out results/planner_scale.json   # at scale

With `--scale` the script runs `benchmarks/planner_scale.py` (its own docstring): the same planners
at 16 to 1024 ranks on the SmartMoE trace unfolded and Zipf 1.2, beside DeepSeek's EPLB.

A call is what the layer waits for between its count exchange and its dispatch: the planner's
`__call__` on the real flow, plus, for `auto` under the block-wise prefetch, its planned-ahead
choice (`next_placement()`, which the prefetch asks for during the block before the next call).
After each call the script sleeps `--gap-ms` (the layer's exchanges and experts, the block before:
they release the GIL), so a search on the planning thread has that long to finish; beside it the
process's CPU time over the call and the gap (`cpu_ms`: the searches on the planning thread too,
which share the cores with the layer's own work). Flows: `--load dirichlet`, Dirichlet(1) loads per
source rank, or `--load even`, every expert equally likely (there, with `--hidden-share 0`, plain EP
wins every call: what `auto`'s planners cost it when nothing is to be gained), 4096 tokens per rank,
seeded; priced on two cluster presets (Pro-Prophet's LPWNV, 8 GPUs; FasterMoE's johnny, 16 GPUs), 2
experts per GPU, d = 256, h = 1024. Modes alternate call by call (each planner object keeps its own
state); medians over `--calls` calls after 5 warm-up calls; for `auto`, which planner it chose.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from moeflow.core.checks import finite_number
from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import Placement
from moeflow.core.registry import LayerContext
from moeflow.perf.costmodel import CostModel
from moeflow.strategies import PLANNERS
from moeflow.strategies.planners.auto import AutoPlanner
from moeflow.strategies.planners.base import PlanAheadPlanner, PrefetchWindow

CLUSTERS = {"prophet_lpwnv": 2, "johnny": 2}
"""Cluster presets (moeflow.perf.topology_presets) and experts per device."""
PLANNER_NAMES = ("shadow", "prophet", "eplb", "fssdp", "auto")


def _build(name: str, ctx: LayerContext, background: bool, hidden_share: float):
    planner = PLANNERS.build(name, ctx)
    inner = planner.planners.values() if isinstance(planner, AutoPlanner) else [planner]
    for p in inner:
        if isinstance(p, PlanAheadPlanner):
            p.next_plan.background = background
    if name == "auto":  # as in a layer with the prefetch
        planner.use_prefetch(PrefetchWindow(0.01, hidden_share))
    return planner


def measure(
    cluster: str, calls: int, gap_s: float, load: str = "dirichlet", hidden_share: float = 0.5, seed: int = 0
) -> dict:
    cost_model = CostModel.resolve(cluster)
    world = cost_model.topology.num_devices
    experts = CLUSTERS[cluster] * world
    ctx = LayerContext(experts // world, 2, ExpertShape(256, 1024), cost_model)
    owners = Placement.expert_parallel(experts, world)
    rng = np.random.default_rng(seed)
    even = np.full(experts, 1.0 / experts)
    flows = [
        np.stack(
            [rng.multinomial(4096, even if load == "even" else rng.dirichlet(np.ones(experts))) for _ in range(world)]
        )
        for _ in range(calls + 5)
    ]
    out = {}
    for name in PLANNER_NAMES:
        planners = {mode: _build(name, ctx, mode == "thread", hidden_share) for mode in ("inline", "thread")}
        spent: dict[str, list[float]] = {mode: [] for mode in planners}
        cpu: dict[str, list[float]] = {mode: [] for mode in planners}
        priced, chosen = [], []  # auto: candidates priced per call, and which won (thread mode)
        for flow in flows:
            for mode, planner in planners.items():
                start, cpu_start = time.perf_counter(), time.process_time()
                planner(flow, owners, cost_model)
                spent[mode].append(time.perf_counter() - start)
                time.sleep(gap_s)  # the layer's exchanges and experts; then the block before the next call
                if name == "auto":  # where the prefetch asks for the placement to send ahead
                    start = time.perf_counter()
                    planner.next_placement()
                    spent[mode][-1] += time.perf_counter() - start
                cpu[mode].append(time.process_time() - cpu_start)
            if name == "auto":
                priced.append(len(planners["thread"].last.prices_s))
                chosen.append(planners["thread"].choice())
        med = {mode: float(np.median(v[5:])) for mode, v in spent.items()}
        out[name] = {
            "inline_ms": 1e3 * med["inline"],
            "thread_ms": 1e3 * med["thread"],
            "inline/thread": med["inline"] / med["thread"],
            "cpu_ms": {mode: 1e3 * float(np.median(v[5:])) for mode, v in cpu.items()},
        }
        if priced:
            out[name] |= {"candidates_priced_mean": float(np.mean(priced[5:])), "chosen": chosen[5:]}
        print(
            f"{cluster} {name:8s} inline {out[name]['inline_ms']:6.2f} ms  thread {out[name]['thread_ms']:6.2f} ms"
            f"  cpu {out[name]['cpu_ms']['inline']:6.2f} / {out[name]['cpu_ms']['thread']:6.2f} ms"
        )
    return {"world": world, "experts": experts, "planners": out}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scale",
        action="store_true",
        help="the scale benchmark instead (benchmarks/planner_scale.py: 16x32 to 1024x1024, trace and Zipf loads)",
    )
    parser.add_argument("--out", default=None, help="the JSON (default results/planner_overhead.json)")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--gap-ms", type=float, default=30.0)
    parser.add_argument("--load", choices=("dirichlet", "even"), default="dirichlet", help="the flows (docstring)")
    parser.add_argument(
        "--hidden-share",
        type=float,
        default=0.5,
        help="auto: the share of its copies the prefetch hides (Pro-Prophet Eq. 8's h; 0: none, plain EP wins more)",
    )
    args, rest = parser.parse_known_args()
    if args.scale:
        from planner_scale import main as scale_main

        return scale_main(rest + (["--out", args.out] if args.out else []))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.out = args.out or "results/planner_overhead.json"
    finite_number("--hidden-share", args.hidden_share, 0.0, 1.0)
    result = {
        "command": " ".join(["python", *sys.argv]),
        "gap_ms": args.gap_ms,
        "load": args.load,
        "hidden_share": args.hidden_share,
        "clusters": {c: measure(c, args.calls, args.gap_ms / 1e3, args.load, args.hidden_share) for c in CLUSTERS},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
