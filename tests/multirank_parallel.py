"""The device mesh on 4 gloo ranks (run inside tests/test_parallel.py's one spawn): every layout is
the one-process model.

- Meta-device build: the weights a dp 2 × ep 2 layout materializes (FSDP2 shards, expert rows)
  gathered are exactly the one-process build's with the same seed.
- Training: 10 steps on dp 2 × ep 2 with `dense`/`experts` = `fsdp` and = `replicate`, for `ep`,
  `shadow` and `fssdp` (Hecate over the dp × ep mesh under `experts="fsdp"`; over each EP group, with
  replicas, under `replicate`), give the losses and weights of the one-process run (same seed and
  global batch); the planners did copy and re-shard, identically on the replicas.
- Activation checkpointing `selective` and `full`, and 4 micro-steps against 1, give the same
  gradients (and `full` records each forward once: planner history, balance choices).
- A checkpoint of dp 2 × ep 2 (FSDP2 both) resumes as ep 4, as dp 4 × ep 1, and (in the test
  body) on one process with the same next-step loss.

Tolerances (fp32): layouts compute the same global batch; only summation orders differ (the
all-to-all's order, FSDP2's reduce-scatter, the mean over ranks), so losses and norms are compared
within 1e-5 relative, weights after 10 AdamW steps within 1e-5 relative + 2e-5 absolute (Adam's
normalised early steps amplify rounding), one step's gradients within 1e-5 relative + 1e-7
absolute. A real divergence — a gradient summed over the wrong ranks, divided by the wrong count, a
missed reduction — moves the first loss or norm by far more (checked by breaking FSDP2's divide
factor fails the loss comparison).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import set_checkpoint_early_stop

from moeflow.training import checkpoint
from moeflow.training.config_files import load_config
from moeflow.training.data import load_corpus
from moeflow.training.trainer import Trainer

from .test_checkpoint import TINY

STEPS, SAVE_AT = 10, 3
LOSS_TOL = dict(rel=1e-5, abs=1e-5)
WEIGHT_TOL = dict(rtol=1e-5, atol=2e-5)
GRAD_TOL = dict(rtol=1e-5, atol=1e-7)
LAYOUTS = {
    "fsdp": ["parallel.dense=fsdp", "parallel.experts=fsdp"],
    "replicate": ["parallel.dense=replicate", "parallel.experts=replicate"],
}


def config(*extra: str):
    return load_config(None, [*TINY, "moe.num_experts=4", f"train.steps={STEPS}", "train.checkpoint_every=100", *extra])


def strategy(name: str, layout: str, tmp: Path) -> list[str]:
    """`--set`s of a strategy on dp 2 × ep 2: a fast network and slow GEMMs, so that copies pay.
    FSSDP under `experts="fsdp"` spans the dp × ep mesh: its cost model has 4 devices."""
    devices = 4 if name == "fssdp" and layout == "fsdp" else 2
    cost = [f"moe.cost_model={tmp / f'fast{devices}.json'}"]
    if name == "shadow":
        return ["moe.strategy=shadow", *cost]
    if name == "fssdp":
        return ["moe.strategy=fssdp", "moe.strategy_options.reshard_interval=3", *cost]
    return []


def gathered(trainer: Trainer, grads: bool = False) -> dict[str, torch.Tensor]:
    """Collective: every parameter (or its gradient) as one full tensor, keyed as in checkpoints
    (experts `.e<global id>`). FSDP2 shards are gathered; copies held by several ranks (replicated
    dense tensors, expert replicas) must be bit-identical: asserted."""
    model = trainer.model
    if grads:
        full = {}
        for name, p in model.named_parameters():
            g = p.grad
            full[name] = g.full_tensor() if isinstance(g, DTensor) else g
    else:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    rows = checkpoint.expert_rows(model)
    mine = []
    for name, tensor in full.items():
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        if name not in rows:
            mine.append((f"model.{name}", tensor.detach().clone()))
            continue
        local = (model.get_parameter(name).grad if grads else model.get_parameter(name)).detach()
        local = local.to_local() if isinstance(local, DTensor) else local
        mine += [(f"model.{name}.e{e}", local[i].clone()) for i, e in enumerate(rows[name].expert_ids)]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out: dict[str, torch.Tensor] = {}
    for key, t in (item for items in everyone for item in items):
        if key in out:
            assert torch.equal(out[key], t), f"{key}: copies differ across ranks"
        out[key] = t
    return out


def assert_states(got: dict, expected: dict, **tol) -> None:
    assert sorted(got) == sorted(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], **tol, msg=lambda m, key=key: f"{key}: {m}")


def train(trainer: Trainer, steps: int) -> list:
    return [trainer.train_step() for _ in range(steps)]


def check_training(rank: int, tmp: Path, corpus, ref: dict) -> None:
    for layout, sets in LAYOUTS.items():
        for name in ("ep", "shadow", "fssdp"):
            what = f"{name} on dp 2 × ep 2 ({layout})"
            trainer = Trainer(
                config("parallel.ep_size=2", *sets, *strategy(name, layout, tmp)), tmp / "x", corpus=corpus
            )
            if name == "ep":  # the meta-device build materializes exactly the one-process model
                assert_states(gathered(trainer), ref["init"], rtol=0, atol=0)
            results = train(trainer, STEPS)
            assert [r.loss for r in results] == pytest.approx(ref["losses"], **LOSS_TOL), what
            assert [r.grad_norm for r in results] == pytest.approx(ref["norms"], **LOSS_TOL), what
            assert_states(gathered(trainer), ref["end"], **WEIGHT_TOL)
            copies = sum(sum(r.extra_copies_L) for r in results)
            assert (copies > 0) == (name != "ep"), f"{what}: {copies} copies"
            layers = [layer for _, layer in trainer.model.moe_layers()]
            if name == "fssdp":  # re-sharded (owners moved off the plain layout), alike on the replicas
                owners = [layer.placement.owner_E.tolist() for layer in layers]
                everyone: list = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, owners)
                assert all(o == everyone[0] for o in everyone), f"{what}: replicas re-sharded differently"
            if name != "ep":  # planners of the replicas planned alike (on the mean of their flows)
                placed = [layer.stats.placement.holders_EW.tolist() for layer in layers]
                everyone = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, placed)
                assert all(h == everyone[0] for h in everyone), f"{what}: replicas planned differently"


def one_step_gradients(cfg, tmp: Path, corpus, records: list | None = None, kept: list | None = None):
    """The gradients and global norm of step 1 (before clipping and the optimizer); `records`
    collects a mark per MoE layer forward that recorded its stats and balance choices, `kept` the
    bytes autograd saved for backward outside checkpointed regions."""
    trainer = Trainer(cfg, tmp / "g", corpus=corpus)
    if records is not None:
        for _, layer in trainer.model.moe_layers():
            record = layer._record
            layer._record = lambda *args, record=record: (records.append(1), record(*args))
    x_BT, y_BT = trainer.sampler.batch(1)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if kept is not None:
            kept.append(t.numel() * t.element_size())
        return t

    # No early stop: a recomputation runs the whole block, up to its MoE layers' last records.
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), set_checkpoint_early_stop(False):
        if trainer.micro_steps == 1:
            trainer._whole_batch(1, x_BT, y_BT)
        else:
            trainer._micro_steps(1, x_BT, y_BT)
    norm = trainer_norm(trainer)
    return gathered(trainer, grads=True), norm, trainer


def trainer_norm(trainer: Trainer) -> float:
    from moeflow.training.optim import clip_gradients

    return clip_gradients(trainer.model, trainer.layout, 0.0)


def check_recompute_and_micro_steps(rank: int, tmp: Path, corpus) -> None:
    base = ["parallel.ep_size=2", *LAYOUTS["fsdp"], "train.global_batch_size=16"]
    fssdp = strategy("fssdp", "replicate", tmp)
    kept: dict[str, list] = {mode: [] for mode in ("none", "selective", "full")}
    ref, ref_norm, _ = one_step_gradients(config(*base), tmp, corpus, kept=kept["none"])
    for mode in ("selective", "full"):
        got, norm, _ = one_step_gradients(
            config(*base, f"train.activation_checkpointing={mode}"), tmp, corpus, kept=kept[mode]
        )
        assert norm == pytest.approx(ref_norm, rel=1e-6), mode
        assert_states(got, ref, **GRAD_TOL)
    kept_bytes = {mode: sum(sizes) for mode, sizes in kept.items()}
    assert kept_bytes["none"] > kept_bytes["selective"] > kept_bytes["full"], kept_bytes
    got, norm, trainer = one_step_gradients(config(*base, "train.micro_batch_size=1"), tmp, corpus)
    assert trainer.micro_steps == 4
    assert norm == pytest.approx(ref_norm, rel=1e-5)
    assert_states(got, ref, **GRAD_TOL)
    # Full recomputation of layers whose planner keeps a history: each forward recorded once.
    base = ["parallel.ep_size=2", *LAYOUTS["replicate"], "train.global_batch_size=16", *fssdp]
    ref, ref_norm, _ = one_step_gradients(config(*base), tmp, corpus)
    records: list = []
    full = config(*base, "train.activation_checkpointing=full", "train.micro_batch_size=2")
    got, norm, trainer = one_step_gradients(full, tmp, corpus, records)
    assert norm == pytest.approx(ref_norm, rel=1e-5)
    assert_states(got, ref, **GRAD_TOL)
    layers = [layer for _, layer in trainer.model.moe_layers()]
    assert len(records) == 2 * len(layers), "a recomputed forward recorded its stats and balance choices again"
    assert all(len(layer.planner.history) == 2 for layer in layers), "a recomputed forward reached the planner"


def check_resume(rank: int, tmp: Path, corpus) -> None:
    """dp 2 × ep 2 (FSDP2 both) → ep 4, dp 4 × ep 1: the same next-step loss."""
    saved = Trainer(config("parallel.ep_size=2", *LAYOUTS["fsdp"]), tmp / "dp2ep2", corpus=corpus)
    train(saved, SAVE_AT)
    path = saved.save()
    expected = train(saved, 2)
    for shape in (["parallel.ep_size=4", "parallel.dense=fsdp"], ["parallel.ep_size=1", *LAYOUTS["fsdp"]]):
        resumed = Trainer(config(*shape), tmp / "resumed", corpus=corpus)
        resumed.resume(path)
        assert resumed.step == SAVE_AT
        got = train(resumed, 2)
        assert [r.loss for r in got] == pytest.approx([r.loss for r in expected], **LOSS_TOL), shape
    if rank == 0:
        (tmp / "dp2ep2.json").write_text(json.dumps({"path": str(path), "losses": [r.loss for r in expected]}))


def four_ranks(rank: int, world: int, tmp: str, ref: dict) -> None:
    tmp = Path(tmp)
    corpus = load_corpus(config().data, min_tokens=33)
    check_training(rank, tmp, corpus, ref)
    check_recompute_and_micro_steps(rank, tmp, corpus)
    check_resume(rank, tmp, corpus)
