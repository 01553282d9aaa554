"""One rank's training state: MoE-GPT on the `[parallel]` mesh, AdamW, warmup + cosine LR, sharded
checkpoints, routing traces.

Every rank is a data-parallel rank for the dense parameters (it trains on its own rows of the
global batch) and holds num_experts / ep_size experts of every MoE layer: the layout is
`ParallelLayout(ep_size, esp_size, dense, experts)` from `[parallel]` (docs/parallel.md) — with
expert sharding (FSMoE §3) each of the `esp_size` consecutive ranks of a group holds a hidden slice
of the same experts, with `ep_size` below world / esp_size the experts have data-parallel replicas
(whole, or FSDP2-sharded over them), and dense parameters are replicated or FSDP2-sharded. The model
is built on the meta device and each rank materializes only what it keeps (`training.init`). Per
step, for each of its micro-steps (`train.micro_batch_size`): forward → loss = (CE + Σ aux) / n →
backward; then all_reduce_gradients (also each layer's balance state) → clip (global norm over
dense + sharded expert gradients) → AdamW → LR schedule step. Rank 0 writes the routing trace;
every rank writes its shard of each checkpoint. The loop around it is `moeflow.training.loop`, the
processes `moeflow.training.entry`. Checkpoints and resume are the base class
`moeflow.training.trainer_checkpoints.TrainerCheckpoints`.

Shape suffixes: B batch rows on this rank, T sequence, V vocabulary, L MoE layers, W ranks, E experts.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moeflow.core.parallel import ParallelLayout
from moeflow.model_step import all_reduce_gradients, finish_prefetch, maybe_reshard, set_gradient_sync
from moeflow.perf.costmodel import CostModel
from moeflow.sim.traces import TraceRecorder
from moeflow.training import faults
from moeflow.training.config import RunConfig
from moeflow.training.data import BatchSampler, Corpus, load_corpus, validation_batches
from moeflow.training.init import init_weights
from moeflow.training.metrics import StepResult, placement_fields
from moeflow.training.model import MoEGPT, build_full_model, parallelize
from moeflow.training.optim import build_optimizer, clip_gradients, lr_factor
from moeflow.training.trainer_checkpoints import LAYOUT_KEYS, SHAPE_SECTIONS, TrainerCheckpoints, seed_rank

__all__ = ["LAYOUT_KEYS", "SHAPE_SECTIONS", "Trainer", "build_model", "routing_meta"]


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


def routing_meta(model: MoEGPT, tokens_per_rank: int) -> dict[str, Any]:
    """The `meta` of a training run's routing trace (docs/traces.md): `world_size` is the size of
    the expert-parallel group whose flows it records (rank 0's)."""
    layers = model.moe_layers()
    first = layers[0][1]
    return {
        "num_experts": first.num_experts,
        "top_k": first.top_k,
        "world_size": first.placement.world_size,
        "d_model": first.d_model,
        "d_hidden": first.d_hidden,
        "expert": first.experts.kind,
        "tokens_per_rank": tokens_per_rank,
        "layers": [i for i, _ in layers],
    }


def build_model(cfg: RunConfig, layout: ParallelLayout, device: torch.device, cost_model=None) -> MoEGPT:
    """MoE-GPT on `layout`: built on the meta device, parallelized (EP, ESP, FSDP2 units), allocated
    on `device` — only what this rank keeps — and initialised from `train.seed` by parameter name
    and global expert id (`training.init`): the same function on every layout, one process included.
    Activation checkpointing per `train.activation_checkpointing`. A Hugging Face model (`[model]`
    hf_architecture / hf_pretrained) is built whole from the seed by `transformers`' own
    initialisation, then parallelized the same way (EP, ESP, FSDP2 units of its decoder layers and
    MoE layers) and recomputed as `training.hf_model` says."""
    if cfg.model.is_hf:
        torch.manual_seed(cfg.train.seed)  # the same full model on every rank before sharding
        model = parallelize(build_full_model(cfg, cost_model), layout).to(device)
        model.set_recompute(cfg.train.activation_checkpointing)
        return model
    with torch.device("meta"):
        model = MoEGPT(cfg.model, cfg.moe, cost_model)
    parallelize(model, layout)
    model.set_recompute(cfg.train.activation_checkpointing)
    model.to_empty(device=device)
    init_weights(model, cfg.train.seed, model.init_module)
    return model


class Trainer(TrainerCheckpoints):
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
        cost_model = CostModel.resolve(cfg.moe.cost_model) if cfg.moe.cost_model else None  # read once
        if cost_model is not None:  # one model for every layer, pricing the trees as they run
            cost_model = cost_model.with_copy_chunks(cfg.moe.copy_chunks)
        num_experts, d_hidden = cfg.moe.num_experts, cfg.moe.d_hidden
        if cfg.model.is_hf:  # the model's blocks decide (`training.hf_model`)
            from moeflow.training.hf_model import hf_experts

            num_experts, d_hidden = hf_experts(cfg.model)
        cfg.validate_world_size(self.world_size, node_size, num_experts=num_experts)
        _, ep_size, esp_size = cfg.parallel.layout_sizes(self.world_size)
        self.layout = ParallelLayout(
            ep_size=ep_size,
            esp_size=esp_size,
            node_size=node_size,
            d_hidden=d_hidden,
            dense=cfg.parallel.dense,
            experts=cfg.parallel.experts,
            device_type=self.device.type,
        )
        self.model = build_model(cfg, self.layout, self.device, cost_model)
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
        local = self.sampler.local_batch_size
        self.micro_steps = local // (cfg.train.micro_batch_size or local)
        self.trace = (
            TraceRecorder(routing_meta(self.model, tokens_per_rank))
            if cfg.train.record_routing and self.rank == 0
            else None
        )
        seed_rank(cfg.train.seed, self.rank, 0)

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
        if self.micro_steps == 1:
            ce, aux, stats, skipped = self._whole_batch(step, x_BT, y_BT)
        else:
            ce, aux, stats, skipped = self._micro_steps(step, x_BT, y_BT)
        grad_norm = float("nan")
        if not skipped:
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
        return self._result(step, ce, aux, lr, grad_norm, skipped, stats)

    def _check_loss(self, step: int, g_ce: float, g_aux: float) -> bool:
        """Whether the step is skipped for a non-finite global loss (raises under `stop`). Every
        rank sees the same global values, so all ranks take the same branch (no hang)."""
        skipped = not (math.isfinite(g_ce) and math.isfinite(g_aux))
        if skipped and self.cfg.train.on_nonfinite == "stop":
            raise FloatingPointError(
                f"non-finite loss at step {step} (loss={g_ce}, aux_loss={g_aux}); set "
                f"train.on_nonfinite=skip to skip such steps"
            )
        return skipped

    def _forward(self, step: int, x_BT: torch.Tensor, y_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ce = self._ce(x_BT, y_BT)
        if faults.before_step(step, self.rank):  # test-only fault injection (MOEFLOW_FAULT)
            ce = ce * float("nan")
        return ce, self.model.aux_loss()

    def _sync_gradients(self) -> None:
        if self.grad_buckets is None:
            all_reduce_gradients(self.model, self.layout)
        else:
            self.grad_buckets.finish()
            self.grad_sync_wait_s += self.grad_buckets.waited_s

    def _whole_batch(self, step: int, x_BT: torch.Tensor, y_BT: torch.Tensor):
        """One forward and backward on the whole local batch (no accumulation)."""
        ce, aux = self._forward(step, x_BT, y_BT)
        g_ce, g_aux = self._mean_over_ranks([ce, aux])
        stats = [[layer.stats for _, layer in self.model.moe_layers()]]
        skipped = self._check_loss(step, g_ce, g_aux)
        if not skipped:
            if self.grad_buckets is not None:
                self.grad_buckets.arm()
            (ce + aux.to(ce.device)).backward()
            self._sync_gradients()
        return g_ce, g_aux, stats, skipped

    def _micro_steps(self, step: int, x_BT: torch.Tensor, y_BT: torch.Tensor):
        """Gradient accumulation (`train.micro_batch_size`): each micro-step's loss (CE + aux of its
        own forward) scaled by 1/n, so the accumulated gradient is that of the mean over the local
        batch; FSDP2 keeps gradients local until the last micro-step's backward, the replicated ones
        are reduced once after it. Every micro-step runs its backward, also after a non-finite loss
        (all ranks alike; the step is then skipped), so no gradient is left half-accumulated."""
        n = self.micro_steps
        ces, auxes, stats = [], [], []
        for i, (x_bT, y_bT) in enumerate(zip(x_BT.chunk(n), y_BT.chunk(n))):
            last = i == n - 1
            set_gradient_sync(self.model, last)
            if last and self.grad_buckets is not None:
                self.grad_buckets.arm()
            ce, aux = self._forward(step, x_bT, y_bT)
            g_ce, g_aux = self._mean_over_ranks([ce, aux])
            self._check_loss(step, g_ce, g_aux)  # raises under `stop`
            ces.append(g_ce)
            auxes.append(g_aux)
            stats.append([layer.stats for _, layer in self.model.moe_layers()])
            ((ce + aux.to(ce.device)) / n).backward()
            if not last:
                finish_prefetch(self.model)  # the copies' gradient sums land before the next forward
        self._sync_gradients()
        g_ce, g_aux = float(np.mean(ces)), float(np.mean(auxes))
        return g_ce, g_aux, stats, not (math.isfinite(g_ce) and math.isfinite(g_aux))

    def _result(self, step, loss, aux, lr, grad_norm, skipped, stats_ML) -> StepResult:
        """The step's record: statistics of its micro-steps (M) summed (counts, drops, copies,
        flows) or averaged (imbalance, load spread, cross-node share) per layer (L); what the
        strategy did (per-rank loads, planner and schedule) from the last micro-step."""
        per_layer = list(zip(*stats_ML))

        def mean(f) -> list[float]:
            return [float(np.mean([f(s) for s in layer])) for layer in per_layer]

        return StepResult(
            step=step,
            loss=loss,
            aux_loss=aux,
            lr=lr,
            grad_norm=grad_norm,
            skipped=skipped,
            counts_LE=[np.sum([s.expert_counts.numpy() for s in layer], axis=0).tolist() for layer in per_layer],
            imbalance_L=mean(lambda s: s.load_imbalance),
            load_std_L=mean(lambda s: s.load_std),
            dropped=sum(s.dropped for layer in per_layer for s in layer),
            cross_node_share_L=mean(lambda s: s.cross_node_share),
            extra_copies_L=[sum(int(s.placement.materialized_EW().sum()) for s in layer) for layer in per_layer],
            redirected=sum(s.redirected for layer in per_layer for s in layer),
            remote_nodes_per_token_L=mean(lambda s: s.remote_nodes_per_token),
            flow_LWE=(
                np.stack([np.sum([s.flow.numpy() for s in layer], axis=0) for layer in per_layer])
                if self.trace is not None
                else None
            ),
            **placement_fields(stats_ML[-1]),
        )

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        losses = [self._ce(x_BT, y_BT) for x_BT, y_BT in self.val_batches]
        self.model.train()
        # Equal rows per rank and per batch: the mean of rank means is the global mean.
        return self._mean_over_ranks([torch.stack(losses).mean()])[0]
