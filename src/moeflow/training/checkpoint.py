"""Sharded, atomic, resharding-friendly checkpoints with torch.distributed.checkpoint (DCP).

    save_checkpoint(run / "checkpoints", step, model, optimizer, extra, keep=2)
    path = latest_checkpoint(run / "checkpoints")         # None when there is no complete one
    extra = load_checkpoint(path, model, optimizer, extra_template)

State. The model's and the optimizer's state come from
`torch.distributed.checkpoint.state_dict.get_state_dict` (parameter names as keys, FSDP2 shards as
DTensors; for a run that has not stepped yet it creates AdamW's state the way torch does) and go
back through `set_state_dict`, after DCP has loaded into them in place.

Keys. Dense tensors keep their parameter name (`model.blocks.0.attn.qkv.weight`): replicated, every
rank offers the same key and DCP writes it once; FSDP2-sharded (`parallel.dense="fsdp"`), each rank
offers its shard of the DTensor and DCP writes the pieces — either way one full tensor, which loads
into any other layout. Expert tensors are split per expert and keyed by the GLOBAL expert id
(`model.blocks.0.ffn.experts.w1.e3`), so each rank saves and loads exactly the experts it holds (its
FSDP2 shard's rows under `parallel.experts="fsdp"`) — a checkpoint written by 4 processes as dp 2 ×
ep 2 loads into ep 4, dp 4 × ep 1, 2 processes or 1, and vice versa. Expert tensors always have the
FULL hidden size: under expert sharding (ESP) each member saves and loads its hidden slice as a
chunk of it (`training.expert_keys`), so any `esp_size` resumes any other. AdamW state follows its
parameter (`optim.<param name>.exp_avg[.e3]`, `optim.<param name>.step`).

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
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from moeflow.training.expert_keys import expert_rows, split

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _flat(state: dict[str, Any], prefix: str, rows: dict, optim: dict | None = None) -> dict[str, Any]:
    """DCP entries of a model state dict (or an optimizer's per-parameter `state`): expert tensors
    split by global id, everything else as is. Views: loading into them writes into `state`."""
    out: dict[str, Any] = {}
    if optim is None:
        for name, tensor in state.items():
            out.update(split(f"{prefix}.{name}", tensor, rows.get(name)))
        return out
    for name, entries in optim.items():
        for key, value in entries.items():
            key_prefix = f"{prefix}.{name}.{key}"
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                out.update(split(key_prefix, value, rows.get(name)))
            else:
                out[key_prefix] = value  # AdamW's `step`: identical on every rank
    return out


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's DCP entries (`get_model_state_dict`, experts by global id)."""
    return _flat(get_model_state_dict(model), "model", expert_rows(model))


def _states(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None, dict]:
    """(model state dict, optimizer state dict or None, their DCP entries)."""
    rows = expert_rows(model)
    if optimizer is None:
        msd, osd = get_model_state_dict(model), None
    else:
        msd, osd = get_state_dict(model, optimizer)
    flat = _flat(msd, "model", rows)
    if osd is not None:
        flat.update(_flat({}, "optim", rows, osd["state"]))
    return msd, osd, flat


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
    state = {**_states(model, optimizer)[2], **extra}
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
    msd, osd, state = _states(model, optimizer)
    _check_shapes(path, state)
    keys = saved_keys(path)
    extra = {k: v for k, v in extra.items() if any(s == k or s.startswith(k + ".") for s in keys)}
    state.update(extra)
    _dcp(dcp.load, state, path)
    if osd is None:
        set_model_state_dict(model, msd)
    else:
        # Non-tensor entries come back by value, not in place.
        for name, entries in osd["state"].items():
            for key, value in entries.items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    entries[key] = state[f"optim.{name}.{key}"]
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
    return {k: state[k] for k in extra}
