"""Parallel layouts on 4 gloo ranks (docs/parallel.md): model state and peak host memory per rank,
activation memory with and without checkpointing, and step time of each layout beside today's
(`ep 4`, everything replicated), for a MoE-GPT a hundred times `configs/tiny.toml`'s parameters
(d_model 512, 8 blocks, 16 experts of hidden 1024: 143 M parameters).

    .venv/bin/python benchmarks/parallel_memory.py --out docs/results/2026-11-26-parallel-layouts.json

Each layout runs in its own spawn of 4 processes (peak RSS, `ru_maxrss`, is a per-process maximum):
build (meta device, or the "eager build" row: the whole model on every rank, then sharded — how the
trainer built models before), one warm-up step, `--steps` timed steps. Per rank: bytes of the local
parameters, gradients (after the backward, before `zero_grad`) and AdamW state; peak RSS after the
build and after the steps; the activation memory a forward keeps for its backward — the unique
storages autograd saved (through `torch.autograd.graph.saved_tensors_hooks`) that are not
parameters, plus the inputs checkpointed regions keep (`torch.utils.checkpoint`, counted by a
wrapper): what stays allocated between forward and backward. Step times are rank 0's; with
`--rounds 2` every layout runs twice, in order, and its median step time is reported, so that a
slow phase of this shared machine does not fall on one layout only. Ratios are comparable within
one run; absolute times are this machine's (2 CPU cores shared with other work, gloo).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # inherited by the spawned ranks

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

SHAPE = [
    "model.n_layers=8",
    "model.d_model=512",
    "model.n_heads=8",
    "model.seq_len=128",
    "model.d_ff=2048",
    "moe.num_experts=16",
    "moe.d_hidden=1024",
    "moe.top_k=2",
    "data.max_bytes=2000000",
    "train.global_batch_size=16",
    "train.eval_every=0",
    "train.checkpoint_every=0",
]
SMALL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "moe.d_hidden=128", "model.seq_len=32"]
LAYOUTS = {
    "ep4 replicate (today's layout)": ["parallel.ep_size=4"],
    "ep4 replicate, eager build": ["parallel.ep_size=4"],
    "ep4 dense fsdp": ["parallel.ep_size=4", "parallel.dense=fsdp"],
    "dp2 x ep2 replicate": ["parallel.ep_size=2"],
    "dp2 x ep2 fsdp": ["parallel.ep_size=2", "parallel.dense=fsdp", "parallel.experts=fsdp"],
    "dp2 x ep2 fsdp, selective AC": [
        "parallel.ep_size=2",
        "parallel.dense=fsdp",
        "parallel.experts=fsdp",
        "train.activation_checkpointing=selective",
    ],
    "dp2 x ep2 fsdp, full AC": [
        "parallel.ep_size=2",
        "parallel.dense=fsdp",
        "parallel.experts=fsdp",
        "train.activation_checkpointing=full",
    ],
    "dp4 x ep1 replicate": ["parallel.ep_size=1"],
    "dp4 x ep1 fsdp": ["parallel.ep_size=1", "parallel.dense=fsdp", "parallel.experts=fsdp"],
}
MB = 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _trim() -> None:
    ctypes.CDLL("libc.so.6").malloc_trim(0)


class _Kept:
    """Unique storages kept for backward (non-parameters), by data pointer."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def add(self, t) -> None:
        if isinstance(t, torch.Tensor) and not (t.is_leaf and t.requires_grad) and t.device.type != "meta":
            storage = t.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t

    def counting(self, checkpoint):
        """`torch.utils.checkpoint.checkpoint` that first counts the tensors the region keeps (its inputs)."""

        def wrapped(fn, *args, **kwargs):
            for a in args:
                for t in a.values() if isinstance(a, dict) else [a]:
                    self.add(t)
            return checkpoint(fn, *args, **kwargs)

        return wrapped

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if isinstance(t, DTensor) else t
            total += t.numel() * t.element_size()
    return total


def _eager_build(cfg, layout, device):
    """How the trainer built models before the meta device: the whole model on every rank (same
    seed), then each MoE layer keeps its experts."""
    from moeflow.training.model import MoEGPT, parallelize

    torch.manual_seed(cfg.train.seed)
    model = MoEGPT(cfg.model, cfg.moe)
    return parallelize(model, layout).to(device)


def _rank(rank: int, world: int, init: str, sets: list[str], eager: bool, steps: int, out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    from moeflow.training import trainer as trainer_module
    from moeflow.training.config_files import load_config
    from moeflow.training.data import load_corpus
    from moeflow.training.optim import clip_gradients

    cfg = load_config(None, sets)
    corpus = load_corpus(cfg.data, min_tokens=cfg.model.seq_len + 1)
    if eager:
        trainer_module.build_model = lambda cfg, layout, device, cost_model=None: _eager_build(cfg, layout, device)
    t0 = time.perf_counter()
    trainer = trainer_module.Trainer(cfg, Path(out) / f"r{rank}", corpus=corpus)
    build_s = time.perf_counter() - t0
    peak_build = _peak_mb()
    model, opt = trainer.model, trainer.optimizer
    import torch.utils.checkpoint as torch_checkpoint

    from moeflow.training import model as model_module

    real_checkpoint = torch_checkpoint.checkpoint

    def step(i: int, measure: bool = False) -> dict:
        x_BT, y_BT = trainer.sampler.batch(i)
        kept = _Kept()
        torch_checkpoint.checkpoint = model_module.checkpoint = kept.counting(real_checkpoint)
        try:
            with torch.autograd.graph.saved_tensors_hooks(kept.pack, lambda t: t):
                ce = trainer._ce(x_BT, y_BT)
                loss = ce + model.aux_loss()
        finally:
            torch_checkpoint.checkpoint = model_module.checkpoint = real_checkpoint
        loss.backward()
        from moeflow.model_step import all_reduce_gradients

        all_reduce_gradients(model, trainer.layout)
        clip_gradients(model, trainer.layout, cfg.optim.grad_clip)
        opt.step()
        sizes = {}
        if measure:
            sizes = {
                "param_bytes": _local_bytes(model.parameters()),
                "grad_bytes": _local_bytes(p.grad for p in model.parameters()),
                "optim_bytes": _local_bytes(v for s in opt.state.values() for v in s.values()),
            }
        opt.zero_grad(set_to_none=True)
        _trim()
        return {"activation_mb": kept.bytes / MB, **sizes}

    model.train()
    first = step(1, measure=True)
    dist.barrier()
    times, activations = [], [first["activation_mb"]]
    for i in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        activations.append(step(2 + i)["activation_mb"])
        dist.barrier()
        times.append(time.perf_counter() - t0)
    # A block as FSDP2 gathers it (one at a time): a DTensor's numel is its global size.
    block = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.blocks)
    result = {
        "rank": rank,
        "layout": trainer.layout.describe(),
        "build_s": build_s,
        "peak_rss_build_mb": peak_build,
        "peak_rss_mb": _peak_mb(),
        "activation_mb": sum(activations[1:]) / max(1, len(activations) - 1),
        "step_s": sum(times) / len(times),
        "block_bytes_unsharded": block,
        **{k: v for k, v in first.items() if k.endswith("_bytes")},
    }
    result["state_bytes"] = result["param_bytes"] + result["grad_bytes"] + result["optim_bytes"]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out, "result.json").write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def run_layout(name: str, sets: list[str], steps: int) -> list[dict]:
    """One layout on 4 fresh processes: every rank's record."""
    with tempfile.TemporaryDirectory() as tmp:
        eager = "eager build" in name
        mp.spawn(_rank, args=(4, os.path.join(tmp, "rdzv"), sets, eager, steps, tmp), nprocs=4)
        return json.loads(Path(tmp, "result.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout (after one warm-up)")
    parser.add_argument("--small", action="store_true", help="a small model (a smoke test of this script)")
    parser.add_argument("--only", nargs="*", default=None, help="layout names to run (default: all)")
    parser.add_argument("--rounds", type=int, default=1, help="run every layout this many times, in order")
    parser.add_argument("--summarize", type=Path, default=None, help="only recompute the summary of this result file")
    parser.add_argument("--out", type=Path, default=Path("results/parallel_memory.json"))
    args = parser.parse_args()
    if args.summarize is not None:
        record = json.loads(args.summarize.read_text())
        record["summary"] = summarize(record["layouts"])
        args.summarize.write_text(json.dumps(record, indent=1))
        print(json.dumps(record["summary"], indent=1))
        return
    shape = SHAPE + (SMALL if args.small else [])
    results: dict = {}
    names = [n for n in LAYOUTS if not args.only or n in args.only]
    for name in [n for _ in range(args.rounds) for n in names]:
        sets = LAYOUTS[name]
        started = time.perf_counter()
        ranks = run_layout(name, shape + sets, args.steps)
        rounds = results.get(name, {}).get("step_s_rounds", []) + [ranks[0]["step_s"]]
        results[name] = {"sets": sets, "ranks": ranks, "step_s_rounds": rounds, "load_average": os.getloadavg()}
        r0, took = ranks[0], time.perf_counter() - started
        state = max(r["state_bytes"] for r in ranks) / MB
        build, peak = max(r["peak_rss_build_mb"] for r in ranks), max(r["peak_rss_mb"] for r in ranks)
        print(
            f"{name:32s} state/rank {state:8.1f} MB  peak build {build:7.0f} MB  peak {peak:7.0f} MB  "
            f"activations {r0['activation_mb']:7.1f} MB  step {r0['step_s']:6.2f} s  ({took:.0f} s)",
            flush=True,
        )
    summary = summarize(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"shape": shape, "steps": args.steps, "summary": summary, "layouts": results}
    args.out.write_text(json.dumps(record, indent=1))
    print(json.dumps(summary, indent=1))


def summarize(results: dict) -> dict:
    """Ratios of one run: state and memory of each layout against its replicated counterpart, and
    step time against today's layout."""
    out: dict = {}

    def worst(name: str, key: str) -> float:
        return max(r[key] for r in results[name]["ranks"])

    today = "ep4 replicate (today's layout)"
    for name in results:
        row = {
            "state_mb_per_rank": worst(name, "state_bytes") / MB,
            "peak_rss_build_mb": worst(name, "peak_rss_build_mb"),
            "peak_rss_mb": worst(name, "peak_rss_mb"),
            "activation_mb_rank0": results[name]["ranks"][0]["activation_mb"],
            "step_s": float(np.median(results[name]["step_s_rounds"])),
        }
        if today in results:
            row["step_time_vs_today"] = row["step_s"] / float(np.median(results[today]["step_s_rounds"]))
        out[name] = row
    # The target: a layout's model state per rank at most a quarter of the whole model's (every rank
    # holding everything: dp 4 × ep 1 replicated) plus one block unsharded (what FSDP2 gathers).
    whole = "dp4 x ep1 replicate"
    if whole in results:
        full = worst(whole, "state_bytes")
        for name in results:
            state, block = worst(name, "state_bytes"), results[name]["ranks"][0]["block_bytes_unsharded"]
            out[name]["state_vs_whole_model"] = state / full
            out[name]["target_quarter_plus_block_mb"] = (full / 4 + block) / MB
            out[name]["meets_target"] = state <= full / 4 + block
    if today in results and "ep4 replicate, eager build" in results:
        out[today]["peak_build_vs_eager"] = worst(today, "peak_rss_build_mb") / worst(
            "ep4 replicate, eager build", "peak_rss_build_mb"
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
