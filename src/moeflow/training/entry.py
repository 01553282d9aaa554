"""Entry points of `moeflow train`: one pre-flight validation, then the ranks.

    moeflow train --config configs/tiny.toml --nproc 2 --out runs/default
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m moeflow.cli train --config configs/small.toml --out /shared/runs/small
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch.distributed as dist

from moeflow.core.launch import (
    init_distributed,
    launch_local,
    ranks_not_timed_out,
    resolve_world_size,
    restart_count,
    timed_out_collective,
)
from moeflow.layer import ClusterMismatchWarning
from moeflow.training import checkpoint
from moeflow.training.config import RunConfig
from moeflow.training.config_files import config_from_dict, config_to_dict
from moeflow.training.cost_model_setup import check_cost_model, provide_cost_model
from moeflow.training.data import Corpus, load_corpus, read_text, training_part
from moeflow.training.interrupts import StopRequest, launcher_signals
from moeflow.training.loop import run
from moeflow.training.run_dir import check_fresh
from moeflow.training.tensorboard_log import check_tensorboard
from moeflow.training.tokenizer import load_tokenizer, prepare_tokenizer


def preflight(
    cfg: RunConfig, out: Path, resume: bool, world: int, in_process: bool, overwrite: bool = False
) -> Corpus | None:
    """Everything that can be checked before processes start, each input read once: the process
    count against the mesh (`[parallel]`), the experts and the batch, the cost model (a preset or a
    profile JSON, and the cluster it describes against the run's: `cost_model_setup.check_cost_model`),
    the run folder (a fresh run never replaces an earlier one unless `overwrite`), the checkpoint to
    resume from, the data (loaded and split here, so that an empty folder or binary files fail now;
    kept when training runs in this process, so the trainer reuses it). Names and options of the
    layer's components were validated when the config was built (`MoEConfig`)."""
    default_layout = cfg.parallel.ep_size is None and cfg.parallel.esp_size == 1
    if default_layout and cfg.moe.num_experts % world:  # other layouts: validate_world_size says it
        raise ValueError(
            f"--nproc {world}: moe.num_experts={cfg.moe.num_experts} experts cannot be split "
            f"evenly over {world} processes (use a divisor of {cfg.moe.num_experts})"
        )
    cfg.validate_world_size(world)
    check_tensorboard(cfg)
    note = check_cost_model(cfg, world, out, resume)
    if note and int(os.environ.get("RANK", "0")) == 0:
        print(note, flush=True)
    if resume and checkpoint.latest_checkpoint(out / "checkpoints") is None:
        raise ValueError(f"--resume: no complete checkpoint in {str(out / 'checkpoints')!r}")
    if not resume and not overwrite:
        check_fresh(out)
    # Bad data fails here, before any spawn; a BPE (data.tokenizer = "bpe:N") is trained here, once.
    text, _, _ = read_text(cfg.data)
    tokenizer, said = prepare_tokenizer(cfg.data.tokenizer, out, training_part(text, cfg.data), resume)
    if said and int(os.environ.get("RANK", "0")) == 0:
        print(said, flush=True)
    if cfg.model.vocab_size not in (256, tokenizer.vocab_size):  # 256: the default, following the tokenizer
        raise ValueError(
            f"model.vocab_size={cfg.model.vocab_size} but data.tokenizer={cfg.data.tokenizer!r} has "
            f"{tokenizer.vocab_size} tokens (leave model.vocab_size out: it follows the tokenizer)"
        )
    cfg.model.vocab_size = tokenizer.vocab_size
    corpus = load_corpus(cfg.data, cfg.model.seq_len + 1, tokenizer)
    return corpus if in_process else None


def worker(
    cfg_dict: dict,
    out_dir: str,
    resume: bool,
    corpus: Corpus | None = None,
    launched_at: int = 0,
    in_process: bool = False,
) -> dict:
    """Entry point of every rank (elastic launcher, torchrun, or in-process for one process).

    Returns the run summary, or {"error": message} for bad input / a non-finite loss: such errors
    are reached by all ranks together (they follow from shared values), so no rank is left waiting.
    A restarted group (torch's elastic agent, `train.max_restarts`) resumes from the newest complete
    checkpoint by itself (`launched_at`: the step the command started from, for its summary).
    SIGINT/SIGTERM stop it after the current step, with a checkpoint (`training.interrupts`;
    `in_process`: this is the command's own process). A
    collective that timed out (a stalled or dead peer) raises with a message that names it, this
    rank and the ranks that did not answer, so that the agent restarts the group or ends the run.
    """
    cfg = config_from_dict(cfg_dict)
    restart = restart_count()
    quiet_notices()
    if restart and checkpoint.latest_checkpoint(Path(out_dir) / "checkpoints") is not None:
        resume = True
    rank0 = int(os.environ.get("RANK", "0")) == 0
    stop = StopRequest(in_process, say=rank0).install()
    try:
        device = init_distributed(
            cfg.train.device,
            cfg.train.deterministic,
            cfg.train.collective_timeout_s,
            needs_group=cfg.parallel.dense == "fsdp",
        )
        provide_cost_model(cfg, Path(out_dir), device, say=rank0)
        if corpus is None:  # a worker process: its own copy of the text, in the run's tokens
            tokenizer = load_tokenizer(cfg.data.tokenizer, out_dir)
            corpus = load_corpus(cfg.data, cfg.model.seq_len + 1, tokenizer)
        summary = run(cfg, out_dir, resume=resume, device=device, corpus=corpus, restart=restart, stop=stop)
        if restart:  # the summary describes the command, not only its last attempt
            summary["first_step"] = launched_at
        return summary
    except (ValueError, TypeError, FileNotFoundError, FloatingPointError) as exc:
        return {"error": str(exc)}
    except RuntimeError as exc:
        timeout = _timeout_message(exc, cfg.train.collective_timeout_s)
        if timeout is None:
            what = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            print(f"moeflow: rank {os.environ.get('RANK', '0')}: {what}", file=sys.stderr, flush=True)
            raise
        print(f"moeflow: {timeout}", file=sys.stderr, flush=True)
        # A new message for the launcher's one-line error (torch's record() keeps the last one).
        raise RuntimeError(timeout) from exc
    finally:
        stop.uninstall()
        if dist.is_initialized():
            dist.destroy_process_group()


def _one_line(message, category, filename, lineno, line=None) -> str:
    return f"{category.__name__}: {message}\n"


def quiet_notices() -> None:
    """Notices in one line each (not attributed to torch's module.py), and the cluster-mismatch
    notice from rank 0 only: every rank would say the same."""
    warnings.formatwarning = _one_line
    if int(os.environ.get("RANK", "0")) != 0:
        warnings.filterwarnings("ignore", category=ClusterMismatchWarning)


def _timeout_message(exc: RuntimeError, timeout_s: float) -> str | None:
    """Which operation timed out on which rank, and which ranks did not time out with it (stalled or
    dead): `rank 0: all_reduce (called at ...) timed out after train.collective_timeout_s=5 s; rank 1
    did not answer (stalled or dead) (gloo's message)`. None when `exc` is not a timeout."""
    text = str(exc).strip()
    if "timed out" not in text.lower() and "timeout" not in text.lower():
        return None
    rank = os.environ.get("RANK", "0")
    op = timed_out_collective(exc) or "a collective"
    # The other waiting ranks time out within about one step of this one.
    missing = ranks_not_timed_out(grace_s=min(timeout_s / 2, 10.0))
    if missing:
        names = ", ".join(map(str, missing))
        who = f"rank {names} did not answer (stalled or dead)" if len(missing) == 1 else f"ranks {names} did not answer"
    elif missing == []:
        who = "every rank timed out in it (a lost link, or ranks in different collectives)"
    else:
        who = "the other ranks could not be asked"
    first = text.splitlines()[0]
    return f"rank {rank}: {op} timed out after train.collective_timeout_s={timeout_s:g} s; {who} ({first})"


def _step_of(path: Path | None) -> int:
    return int(path.name.removeprefix("step_")) if path is not None else 0


def launch(
    cfg: RunConfig, out_dir: str | Path, resume: bool, nproc: int | None, overwrite: bool = False
) -> dict | None:
    """Validate everything that can be checked before starting processes, then train: in this
    process (one process, or one rank of an outer torchrun) or on `nproc` local processes.
    `overwrite`: a fresh run may replace an earlier run in `out_dir` (else that is an error).

    Returns rank 0's summary ({"error": ...} when training failed), None on other torchrun ranks.
    """
    out = Path(out_dir)
    world, under_torchrun = resolve_world_size(nproc)
    # One process runs here, unless it is to be restarted: then under the elastic agent like any --nproc.
    in_process = under_torchrun or (world == 1 and not cfg.train.max_restarts)
    corpus = preflight(cfg, out, resume, world, in_process, overwrite)
    if in_process:
        if under_torchrun and cfg.train.max_restarts and os.environ["RANK"] == "0":
            print(
                f"note: train.max_restarts={cfg.train.max_restarts} applies to --nproc runs; under torchrun "
                f"pass --max-restarts to torchrun (the restarted group resumes by itself either way)",
                flush=True,
            )
        summary = worker(config_to_dict(cfg), str(out), resume, corpus, in_process=True)
        return summary if not under_torchrun or int(os.environ["RANK"]) == 0 else None

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        with launcher_signals():  # SIGINT/SIGTERM reach the ranks, which finish their step and checkpoint
            return launch_local(
                worker,
                world,
                config_to_dict(cfg),
                str(out),
                resume,
                None,
                _step_of(checkpoint.latest_checkpoint(out / "checkpoints")) if resume else 0,
                name="moeflow-train",
                max_restarts=cfg.train.max_restarts,
                ranks_handle_interrupts=True,
            )[0]
    except ChildFailedError as exc:
        # The failing process printed its traceback above; name it in one line.
        rank, failure = exc.get_first_failure()
        restarts = f" after {cfg.train.max_restarts} restart(s)" if cfg.train.max_restarts else ""
        message = failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message)
        what = message.strip().splitlines()[0] if message.strip() and message != "<N/A>" else ""
        what = what.removeprefix("RuntimeError: ")
        detail = f": {what}" if what else "; see its error above"
        return {"error": f"training process {rank} failed (exit code {failure.exitcode}){restarts}{detail}"}
