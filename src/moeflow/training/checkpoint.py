"""Sharded, atomic, resharding-friendly checkpoints with torch.distributed.checkpoint (DCP).

    save_checkpoint(run / "checkpoints", step, model, optimizer, extra, keep=2)
    path = latest_checkpoint(run / "checkpoints")         # None when there is no complete one
    extra = load_checkpoint(path, model, optimizer, extra_template)

Keys. Dense tensors keep their parameter name (`model.blocks.0.attn.qkv.weight`); every rank
offers the same key and DCP writes it once. Expert tensors are split per expert and keyed by the
GLOBAL expert id (`model.blocks.0.ffn.experts.w1.e3`), so each rank saves and loads exactly the
experts it owns — a checkpoint written by 4 processes loads into 2 (or 1) and vice versa. Expert
tensors always have the FULL hidden size: under expert sharding (ESP) each member saves and loads its
hidden slice as a chunk of it (`training.expert_keys`), so any `esp_size` resumes any other. AdamW
state follows its parameter (`optim.<param name>.exp_avg[.e3]`): expert optimizer state lives,
and is saved, only on the owner (its slice on each ESP member).

Atomicity. A checkpoint is written into `step_N.tmp/`; after every rank has finished (dcp.save
returns once the coordinator has written the metadata), rank 0 writes the `COMPLETE` marker and
renames the folder to `step_N/`. Only folders with the marker are ever loaded, so a run killed
mid-save falls back to the previous checkpoint. With several machines the folder must be on a
shared filesystem (rank 0 renames what all ranks wrote).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from moeflow.training.expert_keys import expert_rows, split

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    rows = expert_rows(model)
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        state.update(split(f"model.{name}", param.data, rows.get(name)))
    for name, buf in model.named_buffers():
        state[f"model.{name}"] = buf
    return state


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazily built state so that DCP has tensors to load into.

    Same approach as torch.distributed.checkpoint.state_dict: one step with zero gradients and
    lr = 0 (AdamW's update and its decoupled decay are then exactly zero), state then overwritten.
    """
    if all(p in optimizer.state for g in optimizer.param_groups for p in g["params"]):
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    rows = expert_rows(model)
    state: dict[str, Any] = {}
    for name, param in model.named_parameters():
        for key, value in optimizer.state.get(param, {}).items():
            prefix = f"optim.{name}.{key}"
            if isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 0:
                state.update(split(prefix, value, rows.get(name)))
            else:
                state[prefix] = value  # AdamW's scalar `step`: identical on every rank
    return state


def damage(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be trusted (None: intact): no marker, an unreadable
    marker, or a file missing or of another size than the marker recorded when the save completed
    (a disk that filled up, a copy cut short)."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except FileNotFoundError:
        return f"no {MARKER} marker (the save did not finish)"
    except (OSError, json.JSONDecodeError) as exc:
        return f"unreadable {MARKER} marker ({exc})"
    for name, size in marker.get("files", {}).items():
        f = path / name
        if not f.is_file():
            return f"file {name!r} is missing"
        if f.stat().st_size != size:
            return f"file {name!r} has {f.stat().st_size} bytes, the save wrote {size}"
    return None


def complete_checkpoints(ckpt_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint that has its completion marker, oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = []
    for child in ckpt_dir.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / MARKER).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(ckpt_dir: str | Path, say: bool = False) -> Path | None:
    """The newest intact checkpoint; a damaged newer one is passed over (`say`: with a note)."""
    for _, path in reversed(complete_checkpoints(ckpt_dir)):
        why = damage(path)
        if why is None:
            return path
        if say:
            print(f"note: checkpoint {str(path)!r} is damaged ({why}); using an older one", flush=True)
    return None


def _dcp(fn, state: dict[str, Any], path: Path) -> None:
    """dcp.save / dcp.load, collective when torch.distributed is initialized, else single-process."""
    with warnings.catch_warnings():
        # Single-process use is intended (one-process runs, `moeflow generate`): not worth a warning.
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        fn(state, checkpoint_id=path, no_dist=not _distributed())


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    ckpt_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    keep: int,
) -> Path:
    """Collective: every rank calls it. `extra` holds non-parameter state (step, sampler, RNG...)."""
    ckpt_dir = Path(ckpt_dir)
    final = ckpt_dir / f"step_{step:08d}"
    tmp = ckpt_dir / f"step_{step:08d}.tmp"
    rank = dist.get_rank() if _distributed() else 0
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that was killed
        tmp.mkdir(parents=True)
    _barrier()
    state = {**model_state(model), **optimizer_state(model, optimizer), **extra}
    _dcp(dcp.save, state, tmp)
    if rank == 0:
        marker = tmp / MARKER
        files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
        with marker.open("w") as fh:
            json.dump({"step": step, "files": files}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(ckpt_dir)
        for _, old in complete_checkpoints(ckpt_dir)[:-keep]:  # only now that the new one is complete
            shutil.rmtree(old, ignore_errors=True)
        for child in ckpt_dir.glob("step_*.tmp"):
            shutil.rmtree(child, ignore_errors=True)
    _barrier()
    return final


def _shape_error(path: Path, state: dict[str, Any]) -> str | None:
    """This rank's first mismatch between the checkpoint and `state`, or None."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        meta = saved.get(key)
        if meta is None or not hasattr(meta, "size"):
            return f"checkpoint {str(path)!r} has no tensor {key!r}: it is from a different model shape"
        if tuple(meta.size) != tuple(value.shape):
            return (
                f"checkpoint {str(path)!r} tensor {key!r} has shape {tuple(meta.size)}, "
                f"this model needs {tuple(value.shape)}"
            )
    return None


def _check_shapes(path: Path, state: dict[str, Any]) -> None:
    """Collective: every tensor each rank needs exists with its shape, and no model tensor of the
    checkpoint is left unowned (more experts, more layers). All ranks raise the same error."""
    error = _shape_error(path, state)
    mine = sorted(k for k in state if k.startswith("model."))
    if _distributed():
        # Errors and owned keys are agreed on by all ranks, so none is left waiting in dcp.load.
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (error, mine))
        errors = [e for e, _ in gathered if e is not None]
        error = errors[0] if errors else None
        owned = set().union(*(set(keys) for _, keys in gathered))
    else:
        owned = set(mine)
    if error is None:
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        extra = sorted(k for k in saved if k.startswith("model.") and k not in owned)
        if extra:
            error = (
                f"checkpoint {str(path)!r} has tensor {extra[0]!r} that this model lacks: "
                f"it is from a different model shape"
            )
    if error is not None:
        raise ValueError(error)


def saved_keys(path: str | Path) -> set[str]:
    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def load_extra(path: str | Path, extra: dict[str, Any]) -> dict[str, Any]:
    """Load only the non-parameter state (cheap; used to compare configs before the real load)."""
    path = Path(path)
    keys = saved_keys(path)
    extra = {k: v for k, v in extra.items() if any(s == k or s.startswith(k + ".") for s in keys)}
    _dcp(dcp.load, extra, path)
    return extra


def load_checkpoint(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict[str, Any]
) -> dict[str, Any]:
    """Load in place into `model` (and `optimizer`); returns `extra` filled from the checkpoint.

    `extra` is a template of the non-parameter state (same keys as saved; values are replaced).
    Keys of `extra` missing from the checkpoint are dropped from the template before loading.
    """
    path = Path(path)
    why = damage(path)
    if why is not None:
        raise ValueError(f"checkpoint {str(path)!r} cannot be loaded: {why}")
    state = model_state(model)
    if optimizer is not None:
        init_optimizer_state(optimizer)
        state.update(optimizer_state(model, optimizer))
    _check_shapes(path, state)
    keys = saved_keys(path)
    extra = {k: v for k, v in extra.items() if any(s == k or s.startswith(k + ".") for s in keys)}
    state.update(extra)
    _dcp(dcp.load, state, path)
    if optimizer is not None:
        # Non-tensor optimizer entries (none for AdamW today) come back by value, not in place.
        for name, param in model.named_parameters():
            for key in list(optimizer.state.get(param, {})):
                value = state.get(f"optim.{name}.{key}")
                if value is not None and not isinstance(optimizer.state[param][key], torch.Tensor):
                    optimizer.state[param][key] = value
    return {k: state[k] for k in extra}
