"""Run a moeflow command, or a benchmark script's own workers, on the network testbed
(scripts/testbed.py), for the benchmark drivers.

Needs root (network namespaces, tc). The testbed tears its namespaces down even on failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # scripts/testbed.py: a root-only tool, not part of the package
MOEFLOW = str(Path(sys.executable).with_name("moeflow"))


def on_testbed(
    args: list[str],
    nodes: int = 2,
    ranks_per_node: int = 2,
    bandwidth_mbit: float = 800.0,
    latency_ms: float = 0.0,
    timeout_s: float = 1800.0,
) -> None:
    """`moeflow ARGS...` on every rank of an emulated `nodes` × `ranks_per_node` cluster."""
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "testbed.py"),
        "--nodes",
        str(nodes),
        "--ranks-per-node",
        str(ranks_per_node),
        "--bandwidth-mbit",
        str(bandwidth_mbit),
        "--latency-ms",
        str(latency_ms),
        "--timeout-s",
        str(timeout_s),
        "--",
        MOEFLOW,
        *args,
    ]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def ensure_profile(
    path: Path,
    bandwidth_mbit: float,
    nodes: int = 2,
    ranks_per_node: int = 2,
    latency_ms: float = 0.0,
    options: tuple[str, ...] = (),
) -> Path:
    """The testbed's own α-β profile (measured once, reused): planners and losses price with it.
    `options`: more `moeflow profile` flags (e.g. which ops)."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        on_testbed(["profile", "--out", str(path), *options], nodes, ranks_per_node, bandwidth_mbit, latency_ms)
    return path


def bench_on_testbed(script: str, args, blocks: int, variants: list[str], extra: tuple[str, ...] = ()) -> dict:
    """`moeflow bench` of `variants` (`--blocks`, the Zipf `args.skews` and the SmartMoE trace
    replayed; `extra`: more `moeflow bench` arguments) on the 2-node testbed with its own profile
    (`args`: out, ranks_per_node, bandwidth_mbit, iterations, skews, profile); writes `args.out` with
    the command and returns it."""
    suffix = "" if args.ranks_per_node == 2 else f"-2x{args.ranks_per_node}"
    profile = ensure_profile(
        Path(args.profile or f"results/profile-testbed{suffix}.json"), args.bandwidth_mbit, 2, args.ranks_per_node
    )
    bench = ["bench", "--cost-model", str(profile), "--tokens", "2048", "--d-model", "256", "--d-hidden", "1024"]
    bench += ["--experts", "2", "--blocks", str(blocks), "--iterations", str(args.iterations), "--skews"]
    bench += [f"{s:g}" for s in args.skews] + ["--trace", "smartmoe", "--trace-replay", *extra, "--variants", *variants]
    raw = Path(args.out).with_suffix(".raw.json")
    on_testbed([*bench, "--out", str(raw)], 2, args.ranks_per_node, args.bandwidth_mbit)
    result = {"command": user_command(script), **json.loads(raw.read_text())}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def run_workers(script: str, argv: list[str] | None, **testbed) -> int:
    """Start `script --worker ARGV...` on every rank of an emulated cluster (`testbed`: TestbedConfig
    fields) — for a script that is both the launcher and, with --worker, each rank; `argv` None =
    this process's own arguments."""
    from testbed import TestbedConfig, run_on_testbed

    forwarded = sys.argv[1:] if argv is None else list(argv)
    config = TestbedConfig(**{"timeout_s": 900, **testbed})
    return run_on_testbed(config, [sys.executable, os.path.abspath(script), "--worker", *forwarded])


def write_result(script: str, path: str | Path, result: dict) -> None:
    """Rank 0's JSON: `result` after the command the user typed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"command": user_command(script), **result}, indent=2) + "\n")
    print(f"wrote {path}", flush=True)


def user_command(script: str) -> str:
    """The command the user typed, for a worker's JSON (without the --worker the launcher added)."""
    return f"python benchmarks/{Path(script).name} " + " ".join(a for a in sys.argv[1:] if a != "--worker")


def time_copies(
    weights: dict, placement, expert_ids, held_J, layouts: dict, warmup: int, repeats: int, chunks: dict | None = None
) -> dict:
    """On a worker: the slowest rank's seconds of `materialize` forward and its gradient sums back,
    for each node layout of `layouts` (name -> `node_of`, or None: copies straight from the owner),
    the variants interleaved in a balanced order each iteration, `warmup` untimed first. `chunks`:
    name -> the copy trees' pieces of that variant (`materialize`'s `chunks`; 1 where not named)."""
    import time

    import torch
    import torch.distributed as dist

    from moeflow.bench.interleave import balanced_order
    from moeflow.core.sparse_collectives import materialize

    times = {name: [] for name in layouts}
    for it in range(warmup + repeats):
        for variant, layout in balanced_order(tuple(layouts.items()), it):
            dist.barrier()
            start = time.perf_counter()
            pieces = (chunks or {}).get(variant, 1)
            out = materialize(weights, placement, dist.group.WORLD, expert_ids, held_J, layout, pieces)
            sum(w.sum() for w in out.values()).backward()
            dist.barrier()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if it >= warmup:
                times[variant].append(float(elapsed))
            for w in weights.values():
                w.grad = None
    return times
