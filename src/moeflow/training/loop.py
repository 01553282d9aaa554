"""The training loop of one rank: steps, evaluation, metrics, checkpoints, plots (`moeflow train`)."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

import torch

from moeflow.core.heap import HeapTrim
from moeflow.training import checkpoint
from moeflow.training.config import RunConfig
from moeflow.training.config_files import write_config
from moeflow.training.data import Corpus
from moeflow.training.interrupts import StopRequest
from moeflow.training.metrics import metric_record
from moeflow.training.run_dir import METRICS_FILE, Truncated, clear_run, recovery_totals, truncate_metrics
from moeflow.training.strategy_report import StrategyTally, bar_fields
from moeflow.training.tensorboard_log import open_tensorboard
from moeflow.training.trainer import Trainer


def _open_run(trainer: Trainer, cfg: RunConfig, out: Path, resume: bool, restart: int) -> Truncated:
    """Resume from the newest complete checkpoint, or start fresh; rank 0 prepares the folder.
    Returns what the records past the checkpoint said (rank 0): the steps now recomputed, and when
    the run that wrote them was last heard of (also for a restart that found no checkpoint yet)."""
    truncated = Truncated(0, None)
    if resume:
        path = checkpoint.latest_checkpoint(trainer.ckpt_dir, say=trainer.rank == 0)
        if path is None:
            raise ValueError(f"--resume: no complete checkpoint in {str(trainer.ckpt_dir)!r}")
        trainer.resume(path)
    if trainer.rank == 0:
        if resume or restart:
            truncated = truncate_metrics(out / METRICS_FILE, trainer.step)
        if not resume:
            clear_run(out)
        out.mkdir(parents=True, exist_ok=True)
        write_config(cfg, out / "config.toml")
    return truncated


def run(
    cfg: RunConfig,
    out_dir: str | Path,
    resume: bool = False,
    device: torch.device | None = None,
    corpus: Corpus | None = None,
    restart: int = 0,
    stop: StopRequest | None = None,
) -> dict:
    """Train (or continue) a run on this rank; returns a summary (meaningful on rank 0). `restart`:
    the elastic agent's attempt (`core.launch.restart_count`); its first record says so. `stop`: the
    rank's stop request (`training.interrupts`): when any rank got SIGINT/SIGTERM, every rank
    finishes its step, a checkpoint of it is written and the summary says `interrupted`."""
    from tqdm import tqdm

    out = Path(out_dir)
    trainer = Trainer(cfg, out, device, corpus)
    rank0 = trainer.rank == 0
    truncated = _open_run(trainer, cfg, out, resume, restart)
    pending: dict[str, Any] = {}  # on the first record written
    if restart:
        # Recovery: from the failed group's last record (just before it died) to training again.
        since = truncated.last_written_s
        recovery = None if since is None else round(time.time() - since, 3)
        pending = {"restart": restart, "steps_lost": truncated.steps_lost, "recovery_s": recovery}
    first_step = trainer.step
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
    # mininterval: fewer redraws, since CI logs keep every one of them.
    bar = tqdm(total=cfg.train.steps, initial=first_step, disable=not rank0, unit="step", mininterval=0.5)
    # Throughput counts the training steps only, not evaluation and checkpoint time.
    step_time, steps_timed = 0.0, 0
    train_time = 0.0  # cumulative step time of this launch, for loss-vs-wall-time comparisons
    heap = HeapTrim()  # CPU runs: freed heap memory back to the system now and then (core.heap)
    summary: dict[str, Any] = {"first_step": first_step, "out": str(out), "corpus": trainer.corpus_source}
    tally = StrategyTally(cfg.moe.strategy, cfg.moe.schedule)
    board = open_tensorboard(cfg, out) if rank0 else None
    with (out / METRICS_FILE).open("a") if rank0 else contextlib.nullcontext() as metrics:
        while trainer.step < cfg.train.steps:
            started = time.perf_counter()
            result = trainer.train_step()
            elapsed = time.perf_counter() - started
            step_time, train_time, steps_timed = step_time + elapsed, train_time + elapsed, steps_timed + 1
            heap.maybe_trim()
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
                rec = {**metric_record(result, tok_s, val_loss), "train_time_s": train_time, **pending}
                rec["unix_time_s"] = round(time.time(), 3)
                if trainer.skipped_steps:  # so far in the run, also those between logged steps
                    rec["skipped_steps"] = trainer.skipped_steps
                pending = {}
                if rank0:
                    metrics.write(json.dumps(rec) + "\n")
                    metrics.flush()
                    tally.add(rec)
                    bar.set_postfix_str(bar_fields(rec, cfg.moe.strategy), refresh=False)
                    if board is not None:
                        board.add(rec)
                summary.setdefault("first_loss", result.loss)
                summary.update(last_loss=result.loss, val_loss=val_loss or summary.get("val_loss"))
            bar.update(1)
            saved = (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0) or last
            if saved:
                trainer.save()
            if stop is not None and not last and stop.agreed(trainer.distributed, trainer.device):
                if not saved:
                    trainer.save()
                summary["interrupted"] = True
                break
    bar.close()
    if board is not None:
        board.close()
    summary["last_step"] = trainer.step
    summary["strategy"] = tally.summary()
    summary["skipped_steps"] = trainer.skipped_steps
    summary.update(trainer.grad_sync_summary())
    if rank0:
        summary.update(recovery_totals(out / METRICS_FILE))
    if rank0 and trainer.step > first_step:
        from moeflow.training.plots import write_plots

        summary["plots"] = [str(p) for p in write_plots(out / METRICS_FILE, out)]
    return summary
