"""Fault tolerance of `moeflow train` with injected faults (`moeflow.training.faults`, gloo, CPU):
a worker killed mid-run is restarted by torch's elastic agent and the run ends where an uninterrupted
one does, weights and all (with shadowing and the aux-free bias; with FSSDP right after it
re-sharded; with Pro-Prophet's plan made before the kill); a stalled worker ends the run with the
timed-out collective and the stalled rank named instead of hanging; a non-finite step on one rank
is skipped by all and counted; a truncated newest checkpoint is passed over; non-finite weights are
never saved."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from moeflow import cli
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.training import checkpoint, faults
from moeflow.training.trainer import Trainer

from .multirank_train import runs, summary, train_all
from .test_train import TINY, tiny_config


def _train(run, *extra, nproc=2, steps=8, env=None, monkeypatch=None):
    argv = ["train", "--nproc", str(nproc), "--steps", str(steps), "--out", str(run), "--json", *extra]
    for item in [*TINY, "moe.num_experts=4", "train.checkpoint_every=2", "train.eval_every=100"]:
        argv += ["--set", item]
    if env is not None:
        monkeypatch.setenv(faults.ENV, env)
    try:
        return cli.main(argv)
    finally:
        if monkeypatch is not None:
            monkeypatch.delenv(faults.ENV, raising=False)


def _summary(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(run):
    """The final checkpoint as one dict of tensors (DCP's own converter)."""
    out = run.parent / f"{run.name}.pt"
    dcp_to_torch_save(checkpoint.latest_checkpoint(run / "checkpoints"), out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if k.startswith(("model.", "optim.")) and isinstance(v, torch.Tensor)}


def _fast_cost_model(tmp: Path) -> tuple:
    """A cluster whose GEMMs are so slow that copying experts always pays: planners place copies."""
    CostModel(Topology([[0], [1]], [1e12, 1e12]), gemm_flops_per_s=1e6).save(tmp / "fast.json")
    return ()


def _train_unlaunched_runs(rank, world, tmp):
    """`_train`'s runs that need no launcher: the uninterrupted run (shadowing, aux-free bias) that the
    healed runs must reproduce, and the run whose rank 1 has a non-finite loss in step 3."""
    common = [*TINY, "moe.num_experts=4", "train.checkpoint_every=2", "train.eval_every=100"]
    cost = f"moe.cost_model={Path(tmp) / 'fast.json'}"
    configs = {
        "clean": ["moe.balance=aux_free", "moe.strategy=shadow", *common, "train.steps=8", cost],
        "nan": ["train.on_nonfinite=skip", *common, "train.steps=5"],
    }
    train_all(rank, world, runs(tmp, configs, env={"nan": {faults.ENV: "nan@3:1"}}))


SPAWNED = pytest.mark.spawned(body=_train_unlaunched_runs, world=2, setup=_fast_cost_model)


@pytest.fixture(scope="module")
def spawned(shared_spawns):
    """The folder of `_train_unlaunched_runs`'s runs, in the session's shared 2-rank spawn."""
    return shared_spawns.run(_train_unlaunched_runs, 2)


@pytest.fixture(scope="module")
def fast(spawned):
    return ["--cost-model", str(spawned / "fast.json"), "--set", "moe.balance=aux_free"]


@pytest.fixture(scope="module")
def clean(spawned):
    return spawned / "clean"


def test_fault_specs_parse_and_name_the_bad_one():
    assert faults.parse("kill@5:1, nan@3, stop@2:1+12") == [
        ("kill", 5, 1, None),
        ("nan", 3, None, None),
        ("stop", 2, 1, 12.0),
    ]
    for bad in ("boom@2", "kill@2+3"):
        with pytest.raises(ValueError, match=re.escape(f"MOEFLOW_FAULT={bad!r}")):
            faults.parse(bad)


@pytest.mark.multirank
@SPAWNED
def test_killed_worker_is_restarted_and_the_run_ends_as_if_uninterrupted(clean, fast, tmp_path, monkeypatch, capsys):
    capsys.readouterr()
    shadow = [*fast, "--set", "moe.strategy=shadow"]
    # Rank 1 dies in step 5 (the checkpoint of step 4 is complete): one restart.
    run = tmp_path / "healed"
    rc = _train(run, *shadow, "--max-restarts", "1", env="kill@5:1", monkeypatch=monkeypatch)
    assert rc == 0
    summary = _summary(capsys)
    assert summary["restarts"] == 1 and (summary["first_step"], summary["last_step"]) == (0, 8)
    want_metrics, healed = _metrics(clean), _metrics(run)
    assert [m["step"] for m in healed] == list(range(1, 9))  # no step twice, none missing
    assert healed[4]["restart"] == 1 and healed[4]["steps_lost"] == summary["steps_lost"] >= 0
    assert [m["loss"] for m in healed] == pytest.approx([m["loss"] for m in want_metrics], rel=1e-6, abs=1e-6)
    assert [m["extra_copies_per_layer"] for m in healed] == [m["extra_copies_per_layer"] for m in want_metrics]
    want, got = _weights(clean), _weights(run)
    assert want.keys() == got.keys() and any("bias_E" in k for k in want)  # the aux-free bias is saved
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-6, msg=key)
    # Without restarts the same fault ends the run with a one-line error naming the process.
    assert _train(tmp_path / "dead", *shadow, env="kill@3:1", monkeypatch=monkeypatch) == 1
    assert "training process" in capsys.readouterr().err


@pytest.mark.multirank
@SPAWNED
def test_fssdp_killed_right_after_resharding_heals_to_the_same_weights(clean, fast, tmp_path, monkeypatch, capsys):
    # Steps 2 and 4 moved shards and their AdamW state: the restarted group loads the experts by
    # global id into the plain layout, same numbers.
    hecate = ["--set", "moe.strategy=fssdp", "--set", "moe.strategy_options.reshard_interval=2"]
    run = tmp_path / "fssdp"
    assert _train(run, *fast, *hecate, "--max-restarts", "1", env="kill@5:0", monkeypatch=monkeypatch) == 0
    assert _summary(capsys)["restarts"] == 1
    want, got = _weights(clean), _weights(run)
    for key, value in want.items():  # another strategy: another summation order, which AdamW's
        # normalisation amplifies on near-zero gradients (seen: 3.5e-6 on a bias after 8 steps)
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.multirank
@SPAWNED
def test_prophet_plan_made_before_the_kill_is_used_after_the_restart(clean, fast, tmp_path, monkeypatch, capsys):
    # Pro-Prophet runs step j on the placement planned from steps < j: a planner rebuilt empty would
    # run the first step after the restart (5) without copies; the checkpoint carries its window and
    # plan. (Checked by hand against an uninterrupted Pro-Prophet run: the same copies at every step.)
    run = tmp_path / "prophet"
    rc = _train(
        run, *fast, "--set", "moe.strategy=prophet", "--max-restarts", "1", env="kill@5:1", monkeypatch=monkeypatch
    )
    assert rc == 0
    assert _summary(capsys)["restarts"] == 1
    copies = [m["extra_copies_per_layer"] for m in _metrics(run)]
    # A planner's first call has no plan (no copies); the planner copied before the kill, and the
    # plan made in step 4 for step 5 survives the restart.
    assert copies[0] == [0, 0] and any(c != [0, 0] for c in copies[1:4]) and copies[4] != [0, 0], copies
    want, got = _weights(clean), _weights(run)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.multirank
def test_stalled_worker_ends_the_run_with_the_timeout_named(tmp_path, monkeypatch, capfd):
    # Rank 1 stops after its forward of step 3 and wakes 15 s later (a process that stays stopped is
    # SIGKILLed by torch's launcher 30 s after the run failed: the same ending, slower).
    run = tmp_path / "stalled"
    rc = _train(run, "--set", "train.collective_timeout_s=5", steps=6, env="stop@3:1+15", monkeypatch=monkeypatch)
    err = capfd.readouterr().err
    assert rc == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("moeflow train: error: training process 0 failed"), err[-3000:]
    assert "rank 0: all_reduce (called at training/trainer.py" in last, last
    assert "timed out after train.collective_timeout_s=5 s; rank 1 did not answer (stalled or dead)" in last, last


@pytest.mark.multirank
@SPAWNED
def test_nonfinite_loss_on_one_rank_is_skipped_by_all_and_counted(spawned):
    run = spawned / "nan"
    assert summary(run)["skipped_steps"] == 1
    records = _metrics(run)
    assert [m.get("skipped", False) for m in records] == [False, False, True, False, False]
    assert [m.get("skipped_steps", 0) for m in records] == [0, 0, 1, 1, 1]
    assert records[2]["loss"] is None and all(m["loss"] is not None for i, m in enumerate(records) if i != 2)
    assert all(v.isfinite().all() for v in _weights(run).values())


def test_truncated_newest_checkpoint_resume_falls_back_and_says_so(tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(run, nproc=1, steps=4) == 0
    newest = run / "checkpoints" / "step_00000004"
    shard = max(newest.glob("*.distcp"), key=lambda f: f.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # the disk filled up
    capsys.readouterr()
    assert _train(run, "--resume", nproc=1, steps=6) == 0
    out = capsys.readouterr().out
    assert f"checkpoint {str(newest)!r} is damaged (file {shard.name!r} has" in out
    assert json.loads(out.strip().splitlines()[-1])["first_step"] == 2
    assert [m["step"] for m in _metrics(run)] == list(range(1, 7))


def test_nonfinite_weights_are_never_saved(tmp_path):
    trainer = Trainer(tiny_config(), tmp_path)
    trainer.train_step()
    trainer.save()
    trainer.train_step()
    with torch.no_grad():
        trainer.model.head.weight[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"not saving the checkpoint of step 2: 'head.weight' on rank 0"):
        trainer.save()
    assert checkpoint.latest_checkpoint(trainer.ckpt_dir).name == "step_00000001"
