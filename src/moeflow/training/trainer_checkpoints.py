"""One rank's checkpoints and resume: `TrainerCheckpoints`, a base class of
`moeflow.training.trainer.Trainer`, kept apart from the training step because it is everything a
run must carry across a restart beyond the weights and optimizer (`training.checkpoint` writes
those): the step, the sampler's and LR schedule's state, each rank's random streams, the skipped
steps, and the planners' state — Pro-Prophet's, EPLB's and FSSDP's windows of past flows and the
placements they planned ahead, `auto`'s calibration, Hecate's re-sharded owners (Hecate §4.3) — so
that a resumed run places experts as the uninterrupted one would. A resume may run on another
number of ranks or another `esp_size`; the model-defining config sections must match.

It reads from the trainer: `cfg`, `out`, `rank`, `world_size`, `distributed`, `device`, `model`,
`optimizer`, `scheduler`, `sampler`, `trace`, and sets `step` and `skipped_steps` on resume.

Shape suffixes: E experts, W ranks (a planner's flows are `[W, E]`).
"""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moeflow.core.resharding import reshard_experts
from moeflow.model_step import fssdp_layers
from moeflow.strategies.planners.base import FunctionPlanner
from moeflow.training import checkpoint
from moeflow.training.config_files import config_to_dict
from moeflow.training.run_dir import TRACE_FILE

# Model-defining config sections: a checkpoint only resumes into a run with the same values; the
# `[parallel]` layout may change (checkpoints hold full experts by global id, `training.expert_keys`;
# `moe.esp_size` is where checkpoints of earlier releases kept the ESP size).
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


def seed_rank(seed: int, rank: int, step: int) -> None:
    """Per-rank streams for anything random during training (noisy gates): distinct per rank, and a
    pure function of (seed, rank, step) so a resume onto a different world size is reproducible."""
    mixed = int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])
    torch.manual_seed(mixed)
    np.random.seed(mixed)
    random.seed(mixed)


class TrainerCheckpoints:
    """`save` and `resume` of `Trainer` (module docstring)."""

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
        flows and the placement each planned ahead, `auto`'s calibration, what the prefetch measured;
        and what each layer's schedule measured (`Schedule.state`: `schedule="auto"`'s factors, its
        trial rounds done). Restored, the next steps are placed and scheduled as the uninterrupted run
        would have done. (A planner wrapping a plain function keeps nothing. Planners see the flows of
        their EP group — averaged over its data-parallel replicas —, the same on every rank; schedules
        learn from times the ranks agree.)"""
        state = {
            f"layer{i}": pickle.dumps(layer.planner)
            for i, layer in self.model.moe_layers()
            if not isinstance(layer.planner, FunctionPlanner)
        }
        # Hecate's re-sharded owners: the restored planners planned ahead on them.
        state["fssdp_owners"] = pickle.dumps([layer.placement.owner_E for layer in fssdp_layers(self.model)])
        state["schedules"] = pickle.dumps({i: layer.schedule.state() for i, layer in self.model.moe_layers()})
        state["group_size"] = pickle.dumps(self._planner_group_size())
        return state

    def _planner_group_size(self) -> int:
        """The size of the group the planners plan for (their flows are `[W, E]`)."""
        return self.model.moe_layers()[0][1].placement.world_size

    def _load_planner_state(self, state: dict[str, bytes], saved_world_size: int) -> None:
        saved = pickle.loads(state["group_size"]) if "group_size" in state else saved_world_size
        if saved != self._planner_group_size():
            return  # flows and placements of another group size: the planners start afresh
        schedules = pickle.loads(state["schedules"]) if "schedules" in state else {}
        for i, layer in self.model.moe_layers():
            if f"layer{i}" in state:
                # In place: hooks (the block-wise prefetch) hold the planner itself.
                layer.planner.__dict__.update(pickle.loads(state[f"layer{i}"]).__dict__)
            if schedules.get(i) is not None:
                layer.schedule.load_state(schedules[i])
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
            seed_rank(self.cfg.train.seed, self.rank, self.step)
        if self.trace is not None:
            self.trace.load_until(self.out / TRACE_FILE, self.step)
