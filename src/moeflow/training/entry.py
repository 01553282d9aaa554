"""Entry points of `moeflow train`: one pre-flight validation, then the ranks.

    moeflow train --config configs/tiny.toml --nproc 2 --out runs/default
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m moeflow.cli train --config configs/small.toml --out /shared/runs/small
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist

from moeflow.core.launch import init_distributed, launch_local, resolve_world_size, restart_count
from moeflow.perf.costmodel import CostModel
from moeflow.training import checkpoint
from moeflow.training.config import RunConfig, config_from_dict, config_to_dict
from moeflow.training.data import Corpus, corpus_files, load_corpus
from moeflow.training.loop import run


def preflight(cfg: RunConfig, out: Path, resume: bool, world: int, in_process: bool) -> Corpus | None:
    """Everything that can be checked before processes start, each input read once: the process
    count against the experts and the batch, the cost model (a preset or a profile JSON), the data
    (loaded here when training runs in this process, so the trainer reuses it; only listed when
    worker processes will each load their own), the checkpoint to resume from. Names and options
    of the layer's components were validated when the config was built (`MoEConfig`)."""
    if cfg.moe.num_experts % world:
        raise ValueError(
            f"--nproc {world}: moe.num_experts={cfg.moe.num_experts} experts cannot be split "
            f"evenly over {world} processes (use a divisor of {cfg.moe.num_experts})"
        )
    cfg.validate_world_size(world)
    if cfg.moe.cost_model:
        CostModel.resolve(cfg.moe.cost_model)
    if resume and checkpoint.latest_checkpoint(out / "checkpoints") is None:
        raise ValueError(f"--resume: no complete checkpoint in {str(out / 'checkpoints')!r}")
    if in_process:
        return load_corpus(cfg.data, min_tokens=cfg.model.seq_len + 1)
    corpus_files(cfg.data)  # a bad --data fails here, before any spawn
    return None


def worker(cfg_dict: dict, out_dir: str, resume: bool, corpus: Corpus | None = None) -> dict:
    """Entry point of every rank (elastic launcher, torchrun, or in-process for one process).

    Returns the run summary, or {"error": message} for bad input / a non-finite loss: such errors
    are reached by all ranks together (they follow from shared values), so no rank is left waiting.
    A restarted group (torch's elastic agent, `train.max_restarts`) resumes from the newest complete
    checkpoint by itself. A collective that timed out (a stalled or dead peer) raises, after one line
    that names it and this rank, so that the agent restarts the group or ends the run.
    """
    cfg = config_from_dict(cfg_dict)
    restart = restart_count()
    if restart and checkpoint.latest_checkpoint(Path(out_dir) / "checkpoints") is not None:
        resume = True
    try:
        device = init_distributed(cfg.train.device, cfg.train.deterministic, cfg.train.collective_timeout_s)
        return run(cfg, out_dir, resume=resume, device=device, corpus=corpus, restart=restart)
    except (ValueError, TypeError, FileNotFoundError, FloatingPointError) as exc:
        return {"error": str(exc)}
    except RuntimeError as exc:
        rank = os.environ.get("RANK", "0")
        what = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            what = (
                f"a collective timed out after train.collective_timeout_s={cfg.train.collective_timeout_s:g} s: {what}"
            )
        print(f"moeflow: rank {rank}: {what}", file=sys.stderr, flush=True)
        raise
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
    in_process = under_torchrun or world == 1
    corpus = preflight(cfg, out, resume, world, in_process)
    if in_process:
        summary = worker(config_to_dict(cfg), str(out), resume, corpus)
        return summary if not under_torchrun or int(os.environ["RANK"]) == 0 else None

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        return launch_local(
            worker,
            world,
            config_to_dict(cfg),
            str(out),
            resume,
            name="moeflow-train",
            max_restarts=cfg.train.max_restarts,
        )[0]
    except ChildFailedError as exc:
        # The failing process printed its traceback above; name it in one line.
        rank, failure = exc.get_first_failure()
        restarts = f" after {cfg.train.max_restarts} restart(s)" if cfg.train.max_restarts else ""
        message = failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message)
        what = message.strip().splitlines()[0] if message.strip() and message != "<N/A>" else ""
        if "timed out" in what.lower():
            what += f" (train.collective_timeout_s={cfg.train.collective_timeout_s:g})"
        detail = f": {what}" if what else "; see its error above"
        return {"error": f"training process {rank} failed (exit code {failure.exitcode}){restarts}{detail}"}
