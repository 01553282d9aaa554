"""One rank's training state: MoE-GPT with expert parallelism over all ranks, AdamW, warmup +
cosine LR, sharded checkpoints, routing traces.

Every rank is a data-parallel rank for the dense parameters (it trains on its own rows of the
global batch) and owns num_experts / ep_size experts of every MoE layer: the layout is
`ParallelLayout(ep_size=world / moe.esp_size, esp_size=moe.esp_size)`, so with expert sharding
(FSMoE §3) each of the `esp_size` consecutive ranks of a group holds a hidden slice of the same
experts, and with `esp_size` 1 it is plain EP over all ranks. Per step:
forward → loss = CE + Σ aux → backward → all_reduce_gradients (also each layer's balance state) →
clip (global norm over dense + sharded expert gradients) → AdamW → LR schedule step. Rank 0 writes
the routing trace; every rank writes its shard of each checkpoint. The loop around it is
`moeflow.training.loop`, the processes `moeflow.training.entry`.

Shape suffixes: B batch rows on this rank, T sequence, V vocabulary, L MoE layers, W ranks, E experts.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import random
import types
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moeflow.core.parallel import ParallelLayout
from moeflow.core.resharding import reshard_experts
from moeflow.model_step import all_reduce_gradients, fssdp_layers, maybe_reshard
from moeflow.perf.costmodel import CostModel
from moeflow.sim.traces import TraceRecorder
from moeflow.training import checkpoint, faults
from moeflow.training.config import RunConfig
from moeflow.training.config_files import config_to_dict
from moeflow.training.data import BatchSampler, Corpus, load_corpus, validation_batches
from moeflow.training.metrics import StepResult, placement_fields
from moeflow.training.model import MoEGPT, build_model, parallelize
from moeflow.training.optim import build_optimizer, clip_gradients, lr_factor
from moeflow.training.run_dir import TRACE_FILE


def _grad_buckets(model, layout, cfg, cost_model, world_size: int):
    """``train.grad_sync``: None (after_backward) or the overlapped buckets (docs/training.md)."""
    from moeflow.training.grad_buckets import (
        GradBuckets,
        backward_order,
        ddp_buckets,
        partition_buckets,
        solve_partition,
    )

    mode = cfg.train.grad_sync
    if mode == "after_backward":
        return None
    params = backward_order(model)
    if mode == "ddp":
        return GradBuckets(model, layout, ddp_buckets(params, cfg.train.grad_bucket_mb))
    partition = solve_partition(model, cfg, cost_model, cfg.train.global_batch_size // world_size)
    return GradBuckets(model, layout, partition_buckets(params, list(partition.layer_elements[::-1])))


# Model-defining config sections: a checkpoint only resumes into a run with the same values,
# except the layout keys (checkpoints hold full experts by global id, `training.expert_keys`).
SHAPE_SECTIONS = ("model", "moe")
LAYOUT_KEYS = {("moe", "esp_size")}


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _seed_rank(seed: int, rank: int, step: int) -> None:
    # Per-rank streams for anything random during training (noisy gates): distinct per rank, and a
    # pure function of (seed, rank, step) so a resume onto a different world size is reproducible.
    mixed = int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])
    torch.manual_seed(mixed)
    np.random.seed(mixed)
    random.seed(mixed)


def routing_meta(model: MoEGPT, world_size: int, tokens_per_rank: int) -> dict[str, Any]:
    """The `meta` of a training run's routing trace (docs/traces.md)."""
    layers = model.moe_layers()
    first = layers[0][1]
    return {
        "num_experts": first.num_experts,
        "top_k": first.top_k,
        "world_size": world_size,
        "d_model": first.d_model,
        "d_hidden": first.d_hidden,
        "expert": first.experts.kind,
        "tokens_per_rank": tokens_per_rank,
        "layers": [i for i, _ in layers],
    }


class Trainer:
    """One rank's training state. Build on every rank (after init_process_group), then
    `moeflow.training.loop.run`. `corpus`: the text, when the caller already loaded it."""

    def __init__(
        self, cfg: RunConfig, out_dir: str | Path, device: torch.device | None = None, corpus: Corpus | None = None
    ) -> None:
        self.cfg = cfg
        self.out = Path(out_dir)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        # The launcher's ranks per node (torchrun, the testbed); one process: none.
        node_size = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None
        node_size = node_size if self.distributed else None
        self.device = device or torch.device("cpu")

        # warn_only: an op without a deterministic kernel warns instead of stopping the run.
        torch.use_deterministic_algorithms(cfg.train.deterministic, warn_only=True)
        torch.manual_seed(cfg.train.seed)  # identical full model on every rank before sharding
        cost_model = CostModel.resolve(cfg.moe.cost_model) if cfg.moe.cost_model else None  # read once
        model = build_model(cfg, cost_model)
        first = model.moe_layers()[0][1]
        cfg.validate_world_size(self.world_size, node_size, num_experts=first.num_experts)
        esp_size = cfg.moe.esp_size
        self.layout = ParallelLayout(
            ep_size=self.world_size // esp_size, esp_size=esp_size, node_size=node_size, d_hidden=first.d_hidden
        )
        self.model = parallelize(model, self.layout).to(self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.grad_buckets = _grad_buckets(self.model, self.layout, cfg, cost_model, self.world_size)
        self.grad_sync_wait_s = 0.0  # total time waiting for outstanding bucket all-reduces
        min_ratio = cfg.optim.min_lr / cfg.optim.lr
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda done: lr_factor(done, cfg.optim.warmup_steps, cfg.train.steps, min_ratio)
        )

        corpus = corpus or load_corpus(cfg.data, min_tokens=cfg.model.seq_len + 1)
        self.corpus_source = corpus.source
        self.sampler = BatchSampler(
            corpus.train, cfg.model.seq_len, cfg.train.global_batch_size, self.rank, self.world_size, cfg.train.seed
        )
        self.val_batches = validation_batches(
            corpus.val,
            cfg.model.seq_len,
            cfg.train.global_batch_size,
            cfg.train.eval_batches,
            self.rank,
            self.world_size,
        )
        self.step = 0  # completed optimizer steps
        self.skipped_steps = 0  # non-finite loss or gradient norm (train.on_nonfinite=skip), whole run
        # Flows are global (identical on every rank): rank 0 alone records them. With expert sharding
        # they are those of rank 0's EP group (ESP index 0: 1 / esp_size of the batch; docs/training.md).
        tokens_per_rank = self.sampler.local_batch_size * cfg.model.seq_len
        self.trace = (
            TraceRecorder(routing_meta(self.model, self.layout.ep_size, tokens_per_rank))
            if cfg.train.record_routing and self.rank == 0
            else None
        )
        _seed_rank(cfg.train.seed, self.rank, 0)

    # ---- collectives on scalars -------------------------------------------------------------
    def _mean_over_ranks(self, values: list[float | torch.Tensor]) -> list[float]:
        t = torch.stack([torch.as_tensor(v, dtype=torch.float64).detach().cpu() for v in values])
        t = t.to(self.device)
        if self.distributed:
            dist.all_reduce(t)
            t /= self.world_size
        return t.tolist()

    def _autocast(self):
        if self.cfg.train.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _ce(self, x_BT: torch.Tensor, y_BT: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            logits_BTV = self.model(x_BT.to(self.device))
        return F.cross_entropy(logits_BTV.float().flatten(0, 1), y_BT.to(self.device).flatten())

    def grad_sync_summary(self) -> dict:
        """train.grad_sync, its buckets' bytes (backward order) and the time waited for their
        all-reduces after the backward, summed over this run's steps on this rank."""
        out = {"grad_sync": self.cfg.train.grad_sync}
        if self.grad_buckets is not None:
            out.update(grad_bucket_bytes=self.grad_buckets.bucket_bytes, grad_sync_wait_s=self.grad_sync_wait_s)
        return out

    # ---- one step ---------------------------------------------------------------------------
    def train_step(self) -> StepResult:
        step = self.step + 1
        self.model.train()
        x_BT, y_BT = self.sampler.batch(step)
        lr = self.optimizer.param_groups[0]["lr"]
        ce = self._ce(x_BT, y_BT)
        if faults.before_step(step, self.rank):  # test-only fault injection (MOEFLOW_FAULT)
            ce = ce * float("nan")
        aux = self.model.aux_loss()
        loss = ce + aux.to(ce.device)
        # Every rank sees the same global values, so all ranks take the same branch (no hang).
        g_ce, g_aux = self._mean_over_ranks([ce, aux])
        stats = [layer.stats for _, layer in self.model.moe_layers()]
        skipped = not (math.isfinite(g_ce) and math.isfinite(g_aux))
        grad_norm = float("nan")
        if skipped and self.cfg.train.on_nonfinite == "stop":
            raise FloatingPointError(
                f"non-finite loss at step {step} (loss={g_ce}, aux_loss={g_aux}); set "
                f"train.on_nonfinite=skip to skip such steps"
            )
        if not skipped:
            if self.grad_buckets is None:
                loss.backward()
                all_reduce_gradients(self.model, self.layout)
            else:
                self.grad_buckets.arm()
                loss.backward()
                self.grad_buckets.finish()
                self.grad_sync_wait_s += self.grad_buckets.waited_s
            grad_norm = clip_gradients(self.model, self.layout, self.cfg.optim.grad_clip)
            # The norm is global (every rank the same value): all ranks skip or step together.
            skipped = not math.isfinite(grad_norm)
            if skipped and self.cfg.train.on_nonfinite == "stop":
                raise FloatingPointError(
                    f"non-finite gradient norm at step {step} ({grad_norm}); set train.on_nonfinite=skip "
                    f"to skip such steps"
                )
            if not skipped:
                self.optimizer.step()
        self.skipped_steps += skipped
        self.optimizer.zero_grad(set_to_none=True)
        maybe_reshard(self.model, self.optimizer, step)  # Hecate's heterogeneous sharding (fssdp)
        with warnings.catch_warnings():
            # A skipped step still advances the schedule (it is a function of the step number);
            # torch warns when that happens before any optimizer.step().
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()
        self.step = step
        return StepResult(
            step=step,
            loss=g_ce,
            aux_loss=g_aux,
            lr=lr,
            grad_norm=grad_norm,
            skipped=skipped,
            counts_LE=[s.expert_counts.tolist() for s in stats],
            imbalance_L=[s.load_imbalance for s in stats],
            load_std_L=[s.load_std for s in stats],
            dropped=sum(s.dropped for s in stats),
            cross_node_share_L=[s.cross_node_share for s in stats],
            extra_copies_L=[int(s.placement.materialized_EW().sum()) for s in stats],
            redirected=sum(s.redirected for s in stats),
            remote_nodes_per_token_L=[s.remote_nodes_per_token for s in stats],
            flow_LWE=np.stack([s.flow.numpy() for s in stats]) if self.trace is not None else None,
            **placement_fields(stats),
        )

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        losses = [self._ce(x_BT, y_BT) for x_BT, y_BT in self.val_batches]
        self.model.train()
        # Equal rows per rank and per batch: the mean of rank means is the global mean.
        return self._mean_over_ranks([torch.stack(losses).mean()])[0]

    # ---- checkpoints ------------------------------------------------------------------------
    @property
    def ckpt_dir(self) -> Path:
        return self.out / "checkpoints"

    def _extra_state(self) -> dict[str, Any]:
        return {
            "train": {
                "step": self.step,
                "sampler": self.sampler.state_dict(self.step + 1),
                "scheduler": self.scheduler.state_dict(),
                "world_size": self.world_size,
                "config": json.dumps({s: config_to_dict(self.cfg)[s] for s in SHAPE_SECTIONS}, sort_keys=True),
            },
            "faults": {"skipped_steps": self.skipped_steps},
            "planners": self._planner_state(),
            # One key per rank: a resume onto more ranks finds no stream for the new ones.
            f"rng.rank{self.rank}": _rng_state(),
        }

    def _planner_state(self) -> dict[str, bytes]:
        """Each MoE layer's planner, pickled: Pro-Prophet's, EPLB's and FSSDP's windows of past
        flows and the placement each planned ahead, `auto`'s calibration, what the prefetch measured.
        Restored, the next steps are placed as the uninterrupted run would have placed them. (Plain
        EP is a function: nothing to keep. Planners see global flows: the same on every rank.)"""
        state = {
            f"layer{i}": pickle.dumps(layer.planner)
            for i, layer in self.model.moe_layers()
            if not isinstance(layer.planner, types.FunctionType)
        }
        # Hecate's re-sharded owners: the restored planners planned ahead on them.
        state["fssdp_owners"] = pickle.dumps([layer.placement.owner_E for layer in fssdp_layers(self.model)])
        return state

    def _load_planner_state(self, state: dict[str, bytes], saved_world_size: int) -> None:
        if saved_world_size != self.world_size:
            return  # flows and placements of another group size: the planners start afresh
        for i, layer in self.model.moe_layers():
            if f"layer{i}" in state:
                # In place: hooks (the block-wise prefetch) hold the planner itself.
                layer.planner.__dict__.update(pickle.loads(state[f"layer{i}"]).__dict__)
        layers = [m for m in fssdp_layers(self.model) if m.group is not None]
        owners = pickle.loads(state["fssdp_owners"]) if "fssdp_owners" in state else []
        if layers and len(owners) == len(layers):  # the weights loaded onto the initial shards: move them
            reshard_experts(layers, np.stack(owners), self.optimizer)

    def _check_finite(self) -> None:
        """Collective: refuse to save weights or balance state that hold NaN/Inf (all ranks agree)."""
        tensors = self.model.state_dict().items()
        bad = next((n for n, t in tensors if t.is_floating_point() and not t.isfinite().all()), None)
        flag = torch.tensor([0.0 if bad is None else 1.0], device=self.device)
        if self.distributed:
            dist.all_reduce(flag)
        if flag.item():
            where = f"{bad!r} on rank {self.rank}" if bad is not None else "a tensor on another rank"
            raise FloatingPointError(
                f"not saving the checkpoint of step {self.step}: {where} is not finite; the previous "
                f"checkpoint is intact (train.on_nonfinite=skip skips steps with a non-finite loss or gradient)"
            )

    def save(self) -> Path:
        self._check_finite()  # never a poisoned checkpoint
        path = checkpoint.save_checkpoint(
            self.ckpt_dir,
            self.step,
            self.model,
            self.optimizer,
            self._extra_state(),
            keep=self.cfg.train.keep_checkpoints,
        )
        if self.trace is not None and self.rank == 0:
            self.trace.write(self.out / TRACE_FILE)
        return path

    def resume(self, path: str | Path) -> None:
        """Load a checkpoint (possibly written by a different number of ranks or another `esp_size`)
        and continue from it."""
        # Compare the model-defining config first: "moe.num_experts=8, this run has 4" is a clearer
        # message than the tensor-level mismatch the full load would report.
        saved = json.loads(checkpoint.load_extra(path, {"train": self._extra_state()["train"]})["train"]["config"])
        ours = {s: config_to_dict(self.cfg)[s] for s in SHAPE_SECTIONS}
        for section in SHAPE_SECTIONS:
            for key in sorted(set(saved[section]) | set(ours[section])):
                if (section, key) in LAYOUT_KEYS:
                    continue
                if saved[section].get(key) != ours[section].get(key):
                    raise ValueError(
                        f"checkpoint {str(path)!r} has {section}.{key}="
                        f"{saved[section].get(key)!r}, this run has {ours[section].get(key)!r}"
                    )
        extra = checkpoint.load_checkpoint(path, self.model, self.optimizer, self._extra_state())
        state = extra["train"]
        self.step = int(state["step"])
        if self.sampler.check_resume(state["sampler"]) != self.step + 1:
            raise ValueError(f"checkpoint {str(path)!r}: sampler state does not match step {self.step}")
        self.scheduler.load_state_dict(state["scheduler"])
        # The schedule is a function of train.steps: rebuild the lr from the (possibly new) total.
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * self.scheduler.lr_lambdas[0](self.step)
        self.skipped_steps = int(extra.get("faults", {}).get("skipped_steps", 0))
        self._load_planner_state(extra.get("planners", {}), int(state["world_size"]))
        if f"rng.rank{self.rank}" in extra:
            _set_rng_state(extra[f"rng.rank{self.rank}"])
        else:  # different world size: this rank had no stream in the checkpoint
            _seed_rank(self.cfg.train.seed, self.rank, self.step)
        if self.trace is not None:
            self.trace.load_until(self.out / TRACE_FILE, self.step)
