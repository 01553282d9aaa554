"""Hugging Face MoE models before and after `moeflow.hf.convert_moe_blocks`: forward + backward time
on one process, and the converted model's training throughput on 2 processes with and without
FasterMoE shadowing under skewed routing.

    .venv/bin/python benchmarks/hf_convert.py --out results/hf_convert.json

Models (random weights, nothing downloaded): Mixtral-shaped and Qwen2-MoE-shaped (with its shared
expert), 2 layers, hidden 256, expert intermediate 512, top-2, with 8, 32 and 64 experts; a batch
of 4 × 256 tokens. Single process (`--threads` torch threads, default 1), three variants measured
alternately (`--rounds` rounds after a warm-up, median): the original with `transformers`' default
experts (`grouped_mm`: one grouped GEMM per projection), the original with
`experts_implementation="eager"` (the per-expert Python loop, as every 4.x release ran), and the
converted model. Two processes (one thread each): the converted Mixtral-shaped model, 32 experts,
expert parallel, its routers skewed so that experts 0 and 1 (both on rank 0) take every token's
first choice (rows ±v of each router), expert intermediate 512 and 2048, `ep` vs `shadow` (cost model: `--cost-model`, a
`moeflow profile` JSON of this machine or a preset via `CostModel.resolve`; a 2-device homogeneous
model where the file is absent), tokens per second of forward + backward + gradient all-reduce +
SGD step, the slower rank, median of `--steps` after a warm-up, the two strategies alternated
twice. The JSON records the machine's load average before and after (other processes distort it).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from moeflow.hf import convert_moe_blocks

SHAPES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "num_local_experts", {}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "num_experts", {"shared_expert_intermediate_size": 512}),
}


def build(arch: str, experts: int, seed: int = 0, expert_intermediate: int = 512):
    import transformers

    cfg_name, model_name, count_key, extra = SHAPES[arch]
    config = getattr(transformers, cfg_name)(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=expert_intermediate,
        moe_intermediate_size=expert_intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts_per_tok=2,
        **{count_key: experts},
        **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.05)
    return model


def step_time(model, ids) -> float:
    start = time.perf_counter()
    model(ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def single_process(rounds: int) -> list[dict]:
    rows = []
    ids = torch.randint(0, 1024, (4, 256), generator=torch.Generator().manual_seed(0))
    for arch in SHAPES:
        for experts in (8, 32, 64):
            original = build(arch, experts)
            eager = copy.deepcopy(original)
            eager.set_experts_implementation("eager")
            converted = copy.deepcopy(original)
            convert_moe_blocks(converted)
            variants = {"original": original, "original_eager": eager, "converted": converted}
            times = {name: [] for name in variants}
            for r in range(rounds + 1):
                order = list(variants.items())
                for name, model in order[r % 3 :] + order[: r % 3]:  # rotate who goes first
                    t = step_time(model, ids)
                    if r:  # round 0 warms up
                        times[name].append(t)
            med = {k: float(np.median(v)) for k, v in times.items()}
            rows.append({"arch": arch, "experts": experts, **{f"{k}_s": v for k, v in med.items()}})
            rows[-1]["speedup"] = med["original"] / med["converted"]
            rows[-1]["speedup_vs_eager"] = med["original_eager"] / med["converted"]
            print(f"{arch:<10} E={experts:<3} original {1e3 * med['original']:7.1f} ms  eager "
                  f"{1e3 * med['original_eager']:7.1f} ms  converted {1e3 * med['converted']:7.1f} ms  "
                  f"{rows[-1]['speedup']:.2f}x / {rows[-1]['speedup_vs_eager']:.2f}x", flush=True)  # fmt: skip
    return rows


def _worker(rank: int, world: int, init: str, cost_model: str, steps: int, inter: int, out: str) -> None:
    import torch.distributed as dist

    from moeflow.core.parallel import ParallelLayout
    from moeflow.model_step import all_reduce_gradients
    from moeflow.perf.costmodel import CostModel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    cm = CostModel.resolve(cost_model)
    layout = ParallelLayout(ep_size=world)
    result = {}
    ids = torch.randint(0, 1024, (2, 256), generator=torch.Generator().manual_seed(rank))
    for strategy in ("ep", "shadow", "ep", "shadow"):
        model = build("mixtral", 32, expert_intermediate=inter)
        with torch.no_grad():  # skew: experts 0 and 1 take every token's first choice
            for layer in model.model.layers:
                v = torch.randn(256, generator=torch.Generator().manual_seed(7))
                layer.mlp.gate.weight[0], layer.mlp.gate.weight[1] = 3 * v, -3 * v
        convert_moe_blocks(model, group=dist.group.WORLD, strategy=strategy, cost_model=cm)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        times = []
        for _ in range(steps + 1):
            dist.barrier()
            start = time.perf_counter()
            model(ids, labels=ids).loss.backward()
            all_reduce_gradients(model, layout)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slower rank's step
            times.append(float(elapsed))
        copies = sum(int(m.mlp.moe.stats.placement.materialized_EW().sum()) for m in model.model.layers)
        # Expert rows each rank computed in the last step, summed over the layers: the balance bought.
        rows_W = sum(m.mlp.moe.stats.device_loads for m in model.model.layers).tolist()
        result.setdefault(strategy, []).append(
            {"step_s": float(np.median(times[1:])), "copies": copies, "expert_rows_per_rank": rows_W}
        )
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def two_processes(cost_model: str, steps: int, inter: int) -> dict:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "r.json")
        mp.spawn(_worker, args=(2, f"file://{tmp}/rdzv", cost_model, steps, inter, out), nprocs=2)
        result = json.loads(Path(out).read_text())
    tokens = 2 * 2 * 256
    summary = {
        k: {
            "tokens_per_s": tokens / float(np.median([r["step_s"] for r in v])),
            "copies": v[0]["copies"],
            "expert_rows_per_rank": v[0]["expert_rows_per_rank"],
        }
        for k, v in result.items()
    }
    summary["shadow_over_ep"] = summary["shadow"]["tokens_per_s"] / summary["ep"]["tokens_per_s"]
    summary["expert_intermediate"] = inter
    print(f"2 processes, E=32, I={inter}, skewed: ep {summary['ep']['tokens_per_s']:.0f} tok/s, shadow "
          f"{summary['shadow']['tokens_per_s']:.0f} tok/s ({summary['shadow_over_ep']:.2f}x, "
          f"{summary['shadow']['copies']} copies; expert rows per rank {summary['ep']['expert_rows_per_rank']} -> "
          f"{summary['shadow']['expert_rows_per_rank']})", flush=True)  # fmt: skip
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/hf_convert.json")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--cost-model", default="results/profile.json", help="a profile, or a preset name")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the single process (each rank: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None
    cost_model = args.cost_model
    if not Path(cost_model).is_file() and cost_model.endswith(".json"):
        from moeflow.perf.costmodel import CostModel
        from moeflow.perf.topology import Topology

        cost_model = str(Path(args.out).with_suffix(".costmodel.json"))
        Path(cost_model).parent.mkdir(parents=True, exist_ok=True)
        CostModel(Topology.homogeneous(2, 5e9), gemm_flops_per_s=2e10).save(cost_model)
    result = {
        "command": " ".join(["python", *sys.argv]),
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "single_process": single_process(args.rounds),
        # Expert intermediate 512 (the models above) and 2048 (experts dominate the step).
        "two_processes": [two_processes(cost_model, args.steps, inter) for inter in (512, 2048)],
        "cost_model": cost_model,
        "threads": args.threads,
        # Other processes on the machine distort the timings: the 1-minute load before and after.
        "loadavg_before_after": [load_before, Path("/proc/loadavg").read_text().split()[:3] if load_before else None],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
