"""Hugging Face MoE models before and after `moeflow.hf.convert_moe_blocks`: forward + backward time
on one process, and the converted model's training throughput on 2 processes with and without
FasterMoE shadowing under skewed routing.

    .venv/bin/python benchmarks/hf_convert.py --out results/hf_convert.json

Models (random weights, nothing downloaded): Mixtral-shaped and Qwen2-MoE-shaped (with its shared
expert), 2 layers, hidden 256, expert intermediate 512, top-2, with 8 and 32 experts; a batch of
4 × 256 tokens. Single process: the original and the converted model measured alternately (`--rounds`
rounds, median). Two processes: the converted Mixtral-shaped model, 32 experts, expert parallel, its
routers skewed so that two experts take every token's first choice (rows ±v of one router), `ep` vs
`shadow` (cost model: this machine's `moeflow profile` if given, else a 2-device preset-like
homogeneous model), tokens per second of forward + backward + gradient all-reduce.
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


def build(arch: str, experts: int, seed: int = 0):
    import transformers

    cfg_name, model_name, count_key, extra = SHAPES[arch]
    config = getattr(transformers, cfg_name)(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=512,
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
        for experts in (8, 32):
            original = build(arch, experts)
            converted = copy.deepcopy(original)
            convert_moe_blocks(converted)
            times = {"original": [], "converted": []}
            for r in range(rounds + 1):
                for name, model in (("original", original), ("converted", converted))[:: 1 if r % 2 else -1]:
                    t = step_time(model, ids)
                    if r:  # round 0 warms up
                        times[name].append(t)
            med = {k: float(np.median(v)) for k, v in times.items()}
            rows.append({"arch": arch, "experts": experts, **{f"{k}_s": v for k, v in med.items()}})
            rows[-1]["speedup"] = med["original"] / med["converted"]
            print(f"{arch:<10} E={experts:<3} original {1e3 * med['original']:7.1f} ms  converted "
                  f"{1e3 * med['converted']:7.1f} ms  {rows[-1]['speedup']:.2f}x", flush=True)  # fmt: skip
    return rows


def _worker(rank: int, world: int, init: str, cost_model: str, steps: int, out: str) -> None:
    import torch.distributed as dist

    from moeflow.core.parallel import ParallelLayout, all_reduce_gradients
    from moeflow.perf.costmodel import CostModel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    cm = CostModel.resolve(cost_model)
    layout = ParallelLayout(ep_size=world)
    result = {}
    ids = torch.randint(0, 1024, (2, 256), generator=torch.Generator().manual_seed(rank))
    for strategy in ("ep", "shadow", "ep", "shadow"):
        model = build("mixtral", 32)
        with torch.no_grad():  # skew: experts 0 and 1 take every token's first choice
            for layer in model.model.layers:
                v = torch.randn(256, generator=torch.Generator().manual_seed(7))
                layer.mlp.gate.weight[0], layer.mlp.gate.weight[1] = 3 * v, -3 * v
        convert_moe_blocks(model, group=dist.group.WORLD, strategy=strategy, cost_model=cm)
        times = []
        for _ in range(steps + 1):
            dist.barrier()
            start = time.perf_counter()
            model(ids, labels=ids).loss.backward()
            all_reduce_gradients(model, layout)
            model.zero_grad(set_to_none=True)
            dist.barrier()
            times.append(time.perf_counter() - start)
        copies = sum(int(m.mlp.moe.stats.placement.materialized_EW().sum()) for m in model.model.layers)
        result.setdefault(strategy, []).append({"step_s": float(np.median(times[1:])), "copies": copies})
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def two_processes(cost_model: str, steps: int) -> dict:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "r.json")
        mp.spawn(_worker, args=(2, f"file://{tmp}/rdzv", cost_model, steps, out), nprocs=2)
        result = json.loads(Path(out).read_text())
    tokens = 2 * 2 * 256
    summary = {
        k: {"tokens_per_s": tokens / float(np.median([r["step_s"] for r in v])), "copies": v[0]["copies"]}
        for k, v in result.items()
    }
    summary["shadow_over_ep"] = summary["shadow"]["tokens_per_s"] / summary["ep"]["tokens_per_s"]
    print(f"2 processes, E=32, skewed: ep {summary['ep']['tokens_per_s']:.0f} tok/s, shadow "
          f"{summary['shadow']['tokens_per_s']:.0f} tok/s ({summary['shadow_over_ep']:.2f}x, "
          f"{summary['shadow']['copies']} copies)", flush=True)  # fmt: skip
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/hf_convert.json")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--cost-model", default="results/profile.json", help="a profile, or a preset name")
    args = parser.parse_args()
    cost_model = args.cost_model
    if not Path(cost_model).is_file() and cost_model.endswith(".json"):
        from moeflow.perf.costmodel import CostModel
        from moeflow.perf.topology import Topology

        cost_model = str(Path(args.out).with_suffix(".costmodel.json"))
        Path(cost_model).parent.mkdir(parents=True, exist_ok=True)
        CostModel(Topology.homogeneous(2, 5e9), gemm_flops_per_s=2e10).save(cost_model)
    result = {
        "command": " ".join(["python", *sys.argv]),
        "single_process": single_process(args.rounds),
        "two_processes": two_processes(cost_model, args.steps),
        "cost_model": cost_model,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
