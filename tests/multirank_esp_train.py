"""Expert sharding (ESP, FSMoE §3) in training, under real gloo collectives (run inside
tests/test_esp_train.py's spawns): `parallel.esp_size` > 1 follows plain EP's losses, gradient norms and
weights; its checkpoints resume bit for bit under the same layout and load exactly under another
(esp 2 ↔ esp 1, 4 ranks esp 2 × ep 2 → 2 ranks esp 2 × ep 1).

`full_state` reassembles every expert tensor by global id at its full hidden size from all ranks,
so states of different layouts compare key by key (the checkpoint's keys)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moeflow.core.expert_sharding import hidden_axis
from moeflow.core.experts import GroupedExperts
from moeflow.training.config_files import load_config
from moeflow.training.data import load_corpus
from moeflow.training.trainer import Trainer

from .test_checkpoint import TINY

STEPS, SAVE_AT = 6, 3
D_HIDDEN = 64
# Layouts compute the same global batch; only summation orders differ. Measured after 6 AdamW steps
# (gradient norms ~2, so clipping acts every step): losses within 3e-7, gradient norms within 1e-7
# relative, Adam moments within 2e-8, weights within 9e-6 (Adam's normalised steps amplify the
# first steps' rounding); a real divergence (a norm summed wrongly) is orders of magnitude larger.
LOSS_TOL = dict(rel=1e-5, abs=1e-5)
WEIGHT_TOL = dict(rtol=1e-5, atol=5e-5)


def config(esp_size: int, *extra: str):
    return load_config(
        None,
        [
            *TINY,
            "moe.num_experts=4",
            f"moe.d_hidden={D_HIDDEN}",
            f"parallel.esp_size={esp_size}",
            f"train.steps={STEPS}",
            "train.checkpoint_every=100",
            *extra,
        ],
    )


def full_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Collective: every parameter and AdamW moment, keyed as in checkpoints (experts `.e<id>`,
    full hidden size). Copies held by several ranks (dense tensors, b2 on ESP members, expert-DP
    replicas) must be bit-identical: asserted."""
    mine: list[tuple[str, int | None, int, torch.Tensor]] = []
    opt = trainer.optimizer.state
    experts = {
        f"{m}.{n}": (module, n)
        for m, module in trainer.model.named_modules()
        if isinstance(module, GroupedExperts)
        for n, _ in module.named_parameters(recurse=False)
    }
    for name, p in trainer.model.named_parameters():
        tensors = {f"model.{name}": p.detach()}
        tensors.update({f"optim.{name}.{k}": v for k, v in opt.get(p, {}).items() if k != "step"})
        if name not in experts:
            mine += [(key, None, 0, t.clone()) for key, t in tensors.items()]
            continue
        module, pname = experts[name]
        axis = hidden_axis(module, pname)
        offset = module.hidden_offset if axis is not None else 0
        for key, t in tensors.items():
            for row, e in enumerate(module.expert_ids):
                mine.append((f"{key}.e{e}", None if axis is None else axis - 1, offset, t[row].clone()))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    full: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    whole: dict[str, torch.Tensor] = {}
    for key, axis, offset, t in (item for rank_items in gathered for item in rank_items):
        if axis is None:
            if key in whole:
                assert torch.equal(whole[key], t), f"{key}: copies differ across ranks"
            whole[key] = t
            continue
        shape = list(t.shape)
        shape[axis] = D_HIDDEN
        target = full.setdefault(key, torch.full(shape, float("nan")))
        piece = target.narrow(axis, offset, t.shape[axis])
        if not piece.isnan().all():
            assert torch.equal(piece, t), f"{key}: replicas of a hidden slice differ"
        else:
            filled[key] = filled.get(key, 0) + t.shape[axis]
        piece.copy_(t)
    assert all(n == D_HIDDEN for n in filled.values()), filled
    assert not set(full) & set(whole)
    return {**whole, **full}


def assert_states(got: dict, expected: dict, **tol) -> None:
    assert sorted(got) == sorted(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], **tol, msg=lambda m, key=key: f"{key}: {m}")


def train(trainer: Trainer, steps: int) -> tuple[list[float], list[float]]:
    results = [trainer.train_step() for _ in range(steps)]
    return [r.loss for r in results], [r.grad_norm for r in results]


def run_and_save(cfg, out: Path, corpus) -> dict:
    """STEPS steps, a checkpoint after SAVE_AT; losses, norms, states at the checkpoint and the end."""
    trainer = Trainer(cfg, out, corpus=corpus)
    losses, norms = train(trainer, SAVE_AT)
    at_save, path = full_state(trainer), trainer.save()
    more_losses, more_norms = train(trainer, STEPS - SAVE_AT)
    return dict(
        losses=losses + more_losses, norms=norms + more_norms, at_save=at_save, end=full_state(trainer), path=path
    )


def resume(cfg, out: Path, path: Path, corpus, at_save: dict) -> tuple[Trainer, list[float]]:
    """Resume from `path`; the loaded state must be exactly the saved one (a copy, no arithmetic)."""
    trainer = Trainer(cfg, out, corpus=corpus)
    trainer.resume(path)
    assert trainer.step == SAVE_AT
    assert_states(full_state(trainer), at_save, rtol=0, atol=0)
    losses, _ = train(trainer, STEPS - SAVE_AT)
    return trainer, losses


def assert_follows(run: dict, ref: dict) -> None:
    assert run["losses"] == pytest.approx(ref["losses"], **LOSS_TOL)
    assert run["norms"] == pytest.approx(ref["norms"], **LOSS_TOL)  # the true global norm, clipped alike
    assert_states(run["end"], ref["end"], **WEIGHT_TOL)


def four_ranks(rank: int, world: int, tmp: str) -> None:
    """esp 2 × ep 2 and esp 4 × ep 1 follow esp 1 × ep 4; esp 2 × ep 2's checkpoint is left for the
    2-rank spawn (with its state at the checkpoint and its losses)."""
    tmp_path = Path(tmp)
    corpus = load_corpus(config(1).data, min_tokens=33)
    ref = run_and_save(config(1), tmp_path / "ep4", corpus)
    esp = run_and_save(config(2), tmp_path / "esp2_ep2", corpus)
    assert_follows(esp, ref)
    assert_follows(run_and_save(config(4), tmp_path / "esp4", corpus), ref)
    if rank == 0:
        torch.save(esp["at_save"], tmp_path / "esp2_ep2_state.pt")
        (tmp_path / "esp2_ep2.json").write_text(json.dumps({"losses": esp["losses"], "path": str(esp["path"])}))


def two_ranks(rank: int, world: int, tmp: str) -> None:
    tmp_path = Path(tmp)
    corpus = load_corpus(config(1).data, min_tokens=33)
    ref = run_and_save(config(1), tmp_path / "ep2", corpus)  # esp 1 × ep 2
    esp = run_and_save(config(2), tmp_path / "esp2", corpus)  # esp 2 × ep 1
    assert_follows(esp, ref)

    # Same layout: bit for bit (weights, Adam moments, losses).
    again, losses = resume(config(2), tmp_path / "again", esp["path"], corpus, esp["at_save"])
    assert losses == esp["losses"][SAVE_AT:]
    assert_states(full_state(again), esp["end"], rtol=0, atol=0)
    # esp 2 → esp 1 and esp 1 → esp 2: loaded exactly, then the other layout's arithmetic.
    _, losses = resume(config(1), tmp_path / "down", esp["path"], corpus, esp["at_save"])
    assert losses == pytest.approx(esp["losses"][SAVE_AT:], **LOSS_TOL)
    _, losses = resume(config(2), tmp_path / "up", ref["path"], corpus, ref["at_save"])
    assert losses == pytest.approx(ref["losses"][SAVE_AT:], **LOSS_TOL)
    # 4 ranks (esp 2 × ep 2) → 2 ranks (esp 2 × ep 1).
    four = json.loads((tmp_path / "esp2_ep2.json").read_text())
    at_save = torch.load(tmp_path / "esp2_ep2_state.pt")
    _, losses = resume(config(2), tmp_path / "from4", Path(four["path"]), corpus, at_save)
    assert losses == pytest.approx(four["losses"][SAVE_AT:], **LOSS_TOL)

    # Dense buckets overlapped with the backward compose with ESP (expert gradients untouched).
    ddp = Trainer(config(2, "train.grad_sync=ddp", "train.grad_bucket_mb=0.01"), tmp_path / "ddp", corpus=corpus)
    assert len(ddp.grad_buckets.buckets) > 1
    losses, norms = train(ddp, SAVE_AT)
    assert losses == pytest.approx(esp["losses"][:SAVE_AT], **LOSS_TOL)
    assert norms == pytest.approx(esp["norms"][:SAVE_AT], **LOSS_TOL)
    assert_states(full_state(ddp), esp["at_save"], **WEIGHT_TOL)
