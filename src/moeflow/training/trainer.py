"""The trainer: MoE-GPT with expert parallelism over all ranks, AdamW, warmup + cosine LR.

Launch through the CLI (it starts the processes with torch's elastic launcher):

    moeflow train --config configs/tiny.toml --nproc 2 --out runs/default
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        -m moeflow.cli train --config configs/small.toml --out /shared/runs/small

Every rank is a data-parallel rank for the dense parameters (it trains on its own rows of the
global batch) and owns num_experts / world_size experts of every MoE layer. Per step:
forward → loss = CE + Σ aux → backward → all_reduce_gradients → clip (global norm over dense +
sharded expert gradients) → AdamW → LR schedule step. Rank 0 writes metrics.jsonl, the routing
trace and plots; every rank writes its shard of each checkpoint.

Shape suffixes: B batch rows on this rank, T sequence, V vocabulary, L MoE layers, W ranks, E experts.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moeflow.core.launch import init_distributed, launch_local, resolve_world_size
from moeflow.core.parallel import ParallelLayout, all_reduce_gradients, dense_parameters, expert_parameters
from moeflow.perf.traces import Trace, load_trace
from moeflow.training import checkpoint
from moeflow.training.config import RunConfig, config_from_dict, config_to_dict, write_config
from moeflow.training.data import BatchSampler, load_corpus, validation_batches
from moeflow.training.model import MoEGPT, check_moe_config, parallelize

METRICS_FILE = "metrics.jsonl"
TRACE_FILE = "routing.npz"
# Model-defining config sections: a checkpoint only resumes into a run with the same values.
SHAPE_SECTIONS = ("model", "moe")


def lr_factor(completed_steps: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """LR multiplier for the update after `completed_steps` updates: linear warmup, cosine decay."""
    step = completed_steps + 1
    if step <= warmup_steps:
        return step / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _is_no_decay(name: str, param: torch.Tensor) -> bool:
    # Biases (also the per-expert b1/b2, which are 2-D [E_local, H]) and LayerNorm gains are not decayed.
    leaf = name.rsplit(".", 1)[-1]
    return param.dim() < 2 or leaf in ("bias", "b1", "b2")


def build_optimizer(model: torch.nn.Module, cfg) -> torch.optim.AdamW:
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not _is_no_decay(n, p)], "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in named if _is_no_decay(n, p)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def clip_gradients(model: torch.nn.Module, layout: ParallelLayout, max_norm: float) -> float:
    """Clip to the global gradient norm and return it (before clipping).

    Dense gradients are identical on every rank after all_reduce_gradients; expert gradients are
    sharded, so their squared norms are summed over the EP group (each expert counted once).
    """
    dense = [p.grad for _, p in dense_parameters(model) if p.grad is not None]
    experts = [p.grad for _, p in expert_parameters(model) if p.grad is not None]
    device = next(model.parameters()).device
    dense_sq = torch.nn.utils.get_total_norm(dense).float() ** 2 if dense else torch.zeros((), device=device)
    expert_sq = torch.nn.utils.get_total_norm(experts).float() ** 2 if experts else torch.zeros((), device=device)
    if layout.ep_size > 1:
        dist.all_reduce(expert_sq, group=layout.ep_group)
    total = (dense_sq + expert_sq).sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_([p for p in model.parameters() if p.grad is not None], max_norm, total)
    return float(total)


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


class RoutingTrace:
    """Per-step, per-MoE-layer flow matrices [W, E] (docs/traces.md), written as one .npz file."""

    def __init__(self, meta: dict[str, Any]) -> None:
        self.meta = meta
        self.steps: list[int] = []
        self.flows: list[np.ndarray] = []

    @classmethod
    def for_model(cls, model: MoEGPT, world_size: int, tokens_per_rank: int) -> RoutingTrace:
        layers = model.moe_layers()
        first = layers[0][1]
        return cls(
            {
                "num_experts": first.num_experts,
                "top_k": first.top_k,
                "world_size": world_size,
                "d_model": first.d_model,
                "d_hidden": first.experts.d_hidden,
                "tokens_per_rank": tokens_per_rank,
                "layers": [i for i, _ in layers],
            }
        )

    def append(self, step: int, flow_LWE: np.ndarray) -> None:
        self.steps.append(step)
        self.flows.append(flow_LWE.astype(np.int32))

    def write(self, path: Path) -> None:
        """Atomically replace `path` with the trace so far (`moeflow.perf.traces` format)."""
        L, W, E = len(self.meta["layers"]), self.meta["world_size"], self.meta["num_experts"]
        flow = np.stack(self.flows) if self.flows else np.zeros((0, L, W, E), np.int32)
        Trace(flow, np.asarray(self.steps, np.int64), dict(self.meta)).save(path)

    def load_until(self, path: Path, last_step: int) -> None:
        """On resume: keep the recorded steps up to the checkpoint's. A trace recorded with other
        dimensions (a different world size) is kept aside as routing.until_step<N>.npz."""
        if not path.exists():
            return
        flow, steps, meta = read_routing_trace(path)
        if meta != self.meta:
            os.replace(path, path.with_name(f"{path.stem}.until_step{last_step}{path.suffix}"))
            return
        keep = steps <= last_step
        self.steps = steps[keep].tolist()
        self.flows = list(flow[keep])


def read_routing_trace(path: str | Path) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """(flow int32 [S, L, W, E], steps int64 [S], meta) of a routing.npz written by training."""
    trace = load_trace(path)
    return trace.flow_ILWE.astype(np.int32), trace.steps_I, trace.meta


@dataclass
class StepResult:
    """What one optimizer step did (losses are global means over all ranks)."""

    step: int
    loss: float
    aux_loss: float
    lr: float
    grad_norm: float
    skipped: bool
    counts_LE: list[list[int]]
    imbalance_L: list[float]
    dropped: int
    flow_LWE: np.ndarray | None = None
    cross_node_share_L: list[float] | None = None
    """Per layer: global share of assignments dispatched across nodes (0 without a topology)."""
    extra_copies_L: list[int] | None = None
    """Per layer: expert copies materialized beyond their owners (shadowing)."""
    redirected: int = 0
    """Assignments the hierarchical gate moved to a local expert, on this rank."""


class Trainer:
    """One rank's training state. Build on every rank (after init_process_group), then `run()`."""

    def __init__(self, cfg: RunConfig, out_dir: str | Path, device: torch.device | None = None) -> None:
        self.cfg = cfg
        self.out = Path(out_dir)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        cfg.validate_world_size(self.world_size)
        self.device = device or torch.device("cpu")

        # warn_only: an op without a deterministic kernel warns instead of stopping the run.
        torch.use_deterministic_algorithms(cfg.train.deterministic, warn_only=True)
        torch.manual_seed(cfg.train.seed)  # identical full model on every rank before sharding
        model = MoEGPT(cfg.model, cfg.moe)
        self.layout = ParallelLayout(ep_size=self.world_size)
        self.model = parallelize(model, self.layout).to(self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        min_ratio = cfg.optim.min_lr / cfg.optim.lr
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda done: lr_factor(done, cfg.optim.warmup_steps, cfg.train.steps, min_ratio)
        )

        corpus = load_corpus(cfg.data, min_tokens=cfg.model.seq_len + 1)
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
        # Flows are global (identical on every rank): rank 0 alone records them.
        self.trace = (
            RoutingTrace.for_model(self.model, self.world_size, self.sampler.local_batch_size * cfg.model.seq_len)
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

    # ---- one step ---------------------------------------------------------------------------
    def train_step(self) -> StepResult:
        step = self.step + 1
        self.model.train()
        x_BT, y_BT = self.sampler.batch(step)
        lr = self.optimizer.param_groups[0]["lr"]
        ce = self._ce(x_BT, y_BT)
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
            loss.backward()
            all_reduce_gradients(self.model, self.layout)
            grad_norm = clip_gradients(self.model, self.layout, self.cfg.optim.grad_clip)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
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
            dropped=sum(s.dropped for s in stats),
            cross_node_share_L=[s.cross_node_share for s in stats],
            extra_copies_L=[int(s.placement.materialized_EW().sum()) for s in stats],
            redirected=sum(s.redirected for s in stats),
            flow_LWE=np.stack([s.flow.numpy() for s in stats]) if self.trace is not None else None,
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
            # One key per rank: a resume onto more ranks finds no stream for the new ones.
            f"rng.rank{self.rank}": _rng_state(),
        }

    def save(self) -> Path:
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
        """Load a checkpoint (possibly written by a different number of ranks) and continue from it."""
        # Compare the model-defining config first: "moe.num_experts=8, this run has 4" is a clearer
        # message than the tensor-level mismatch the full load would report.
        saved = json.loads(checkpoint.load_extra(path, {"train": self._extra_state()["train"]})["train"]["config"])
        ours = {s: config_to_dict(self.cfg)[s] for s in SHAPE_SECTIONS}
        for section in SHAPE_SECTIONS:
            for key in sorted(set(saved[section]) | set(ours[section])):
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
        if f"rng.rank{self.rank}" in extra:
            _set_rng_state(extra[f"rng.rank{self.rank}"])
        else:  # different world size: this rank had no stream in the checkpoint
            _seed_rank(self.cfg.train.seed, self.rank, self.step)
        if self.trace is not None:
            self.trace.load_until(self.out / TRACE_FILE, self.step)


def metric_record(result: StepResult, tokens_per_s: float, val_loss: float | None) -> dict[str, Any]:
    rec = {
        "step": result.step,
        "loss": result.loss,
        "aux_loss": result.aux_loss,
        "total_loss": result.loss + result.aux_loss,
        "lr": result.lr,
        "grad_norm": result.grad_norm,
        "tokens_per_s": tokens_per_s,
        "load_imbalance": float(np.mean(result.imbalance_L)),
        "load_imbalance_per_layer": result.imbalance_L,
        "expert_counts": result.counts_LE,
        "dropped": result.dropped,
        "cross_node_share": float(np.mean(result.cross_node_share_L or [0.0])),
        "extra_copies_per_layer": result.extra_copies_L,
        "redirected": result.redirected,
    }
    if result.skipped:
        rec["skipped"] = True
    if val_loss is not None:
        rec["val_loss"] = val_loss
    # json has no NaN/Infinity: non-finite values of skipped steps are written as null.
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records after `last_step` (written by a run that died after its last checkpoint)."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    kept = []
    for ln in lines:
        try:
            if json.loads(ln)["step"] <= last_step:
                kept.append(ln)
        except (json.JSONDecodeError, KeyError):
            break  # a torn last line from a killed writer
    path.write_text("".join(k + "\n" for k in kept))


def clear_run(out: Path) -> None:
    """A fresh (not resumed) run replaces the files of an earlier run in the same folder."""
    old = [out / METRICS_FILE, out / TRACE_FILE, out / "checkpoints"]
    if any(p.exists() for p in old):
        print(
            f"note: starting a fresh run in {out} (replacing the previous run there; --resume continues it instead)",
            flush=True,
        )
    for p in old:
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)


def run(cfg: RunConfig, out_dir: str | Path, resume: bool = False, device: torch.device | None = None) -> dict:
    """Train (or continue) a run on this rank; returns a summary (meaningful on rank 0)."""
    from tqdm import tqdm

    out = Path(out_dir)
    trainer = Trainer(cfg, out, device)
    rank0 = trainer.rank == 0
    metrics_path = out / METRICS_FILE
    if resume:
        path = checkpoint.latest_checkpoint(trainer.ckpt_dir)
        if path is None:
            raise ValueError(f"--resume: no complete checkpoint in {str(trainer.ckpt_dir)!r}")
        trainer.resume(path)
    if rank0:
        if resume:
            truncate_metrics(metrics_path, trainer.step)
        else:
            clear_run(out)
        out.mkdir(parents=True, exist_ok=True)
        write_config(cfg, out / "config.toml")
    first_step = trainer.step
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
    # mininterval: fewer redraws, since CI logs keep every one of them.
    bar = tqdm(total=cfg.train.steps, initial=first_step, disable=not rank0, unit="step", mininterval=0.5)
    # Throughput counts the training steps only, not evaluation and checkpoint time.
    step_time, steps_timed = 0.0, 0
    train_time = 0.0  # cumulative step time of this launch, for loss-vs-wall-time comparisons
    summary: dict[str, Any] = {"first_step": first_step, "out": str(out), "corpus": trainer.corpus_source}
    with metrics_path.open("a") if rank0 else contextlib.nullcontext() as metrics:
        while trainer.step < cfg.train.steps:
            started = time.perf_counter()
            result = trainer.train_step()
            elapsed = time.perf_counter() - started
            step_time += elapsed
            train_time += elapsed
            steps_timed += 1
            step = result.step
            if trainer.trace is not None and rank0:
                trainer.trace.append(step, result.flow_LWE)
            last = step == cfg.train.steps
            val_loss = None
            if cfg.train.eval_every and (step % cfg.train.eval_every == 0 or last):
                val_loss = trainer.evaluate()
            if step % cfg.train.log_every == 0 or last or val_loss is not None:
                tok_s = tokens_per_step * steps_timed / max(step_time, 1e-9)
                step_time, steps_timed = 0.0, 0
                rec = metric_record(result, tok_s, val_loss)
                rec["train_time_s"] = train_time
                if rank0:
                    metrics.write(json.dumps(rec) + "\n")
                    metrics.flush()
                    bar.set_postfix_str(
                        f"loss={result.loss:.3f} tok/s={tok_s:,.0f} imb={rec['load_imbalance']:.2f}", refresh=False
                    )
                summary.setdefault("first_loss", result.loss)
                summary.update(last_loss=result.loss, val_loss=val_loss or summary.get("val_loss"))
            bar.update(1)
            if (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0) or last:
                trainer.save()
    bar.close()
    summary["last_step"] = trainer.step
    if rank0 and trainer.step > first_step:
        from moeflow.training.plots import write_plots

        summary["plots"] = [str(p) for p in write_plots(metrics_path, out)]
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    """The lines printed at the end of `moeflow train`: what happened and where the results are."""
    out = Path(summary["out"])
    lines = [f"trained steps {summary['first_step']} -> {summary['last_step']} on {summary['corpus']}"]
    if "first_loss" in summary:
        val = summary.get("val_loss")
        lines.append(
            f"loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}"
            + (f" (validation {val:.3f})" if val is not None else "")
        )
    lines.append(f"results in {out}/:")
    lines.append(f"  config.toml, {METRICS_FILE}" + (f", {TRACE_FILE}" if (out / TRACE_FILE).exists() else ""))
    lines += [f"  {Path(p).name}" for p in summary.get("plots", [])]
    newest = checkpoint.latest_checkpoint(out / "checkpoints")
    if newest is not None:
        lines.append(f"  checkpoints/{newest.name}  (moeflow train --out {out} --resume; moeflow generate --run {out})")
    return "\n".join(lines)


def worker(cfg_dict: dict, out_dir: str, resume: bool) -> dict:
    """Entry point of every rank (elastic launcher, torchrun, or in-process for one process).

    Returns the run summary, or {"error": message} for bad input / a non-finite loss: such errors
    are reached by all ranks together (they follow from shared values), so no rank is left waiting.
    """
    cfg = config_from_dict(cfg_dict)
    try:
        device = init_distributed(cfg.train.device, cfg.train.deterministic)
        return run(cfg, out_dir, resume=resume, device=device)
    except (ValueError, TypeError, FileNotFoundError, FloatingPointError) as exc:
        return {"error": str(exc)}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(cfg: RunConfig, out_dir: str | Path, resume: bool, nproc: int | None) -> dict | None:
    """Validate everything that can be checked before starting processes, then train: in this
    process (one process, or one rank of an outer torchrun) or on `nproc` local processes.

    Returns rank 0's summary ({"error": ...} when training failed), None on other torchrun ranks.
    """
    out = Path(out_dir)
    world, under_torchrun = resolve_world_size(nproc)
    if cfg.moe.num_experts % world:
        raise ValueError(
            f"--nproc {world}: moe.num_experts={cfg.moe.num_experts} experts cannot be split "
            f"evenly over {world} processes (use a divisor of {cfg.moe.num_experts})"
        )
    cfg.validate_world_size(world)
    check_moe_config(cfg.moe)
    load_corpus(cfg.data, min_tokens=cfg.model.seq_len + 1)  # bad --data fails here, before any spawn
    if resume and checkpoint.latest_checkpoint(out / "checkpoints") is None:
        raise ValueError(f"--resume: no complete checkpoint in {str(out / 'checkpoints')!r}")
    if under_torchrun or world == 1:
        summary = worker(config_to_dict(cfg), str(out), resume)
        return summary if not under_torchrun or int(os.environ["RANK"]) == 0 else None

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        return launch_local(worker, world, config_to_dict(cfg), str(out), resume, name="moeflow-train")[0]
    except ChildFailedError as exc:
        # The failing process printed its traceback above; name it in one line.
        rank, failure = exc.get_first_failure()
        return {"error": f"training process {rank} failed (exit code {failure.exitcode}); see its traceback above"}
