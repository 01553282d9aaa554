"""Checkpoints: exact resume, atomicity, last-K, shape mismatches, a SIGKILLed run, resharding
between 1 and 2 processes (experts are keyed by global id)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moeflow import cli
from moeflow.sim.traces import load_trace
from moeflow.training import checkpoint
from moeflow.training.config import ModelConfig, MoEConfig
from moeflow.training.config_files import load_config
from moeflow.training.model import MoEGPT
from moeflow.training.trainer import Trainer

TINY = [
    "model.n_layers=2",
    "model.d_model=32",
    "model.n_heads=2",
    "model.seq_len=32",
    "model.d_ff=64",
    "moe.d_hidden=64",
    "moe.balance_weight=0",
    "data.max_bytes=300000",
    "train.global_batch_size=8",
    "train.eval_every=0",
    "optim.warmup_steps=5",
    "train.steps=20",
]
# For the multi-process runs: a little larger so a step takes long enough to be killed mid-run.
SPAWN = [
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=4",
    "model.seq_len=64",
    "model.d_ff=128",
    "moe.d_hidden=128",
    "moe.balance_weight=0",
    "data.max_bytes=300000",
    "train.global_batch_size=16",
    "train.eval_every=10",
    "train.eval_batches=2",
    "train.checkpoint_every=10",
    "train.keep_checkpoints=4",
    "optim.warmup_steps=5",
    "train.steps=40",
    "train.record_routing=true",
]
# 1 and 2 processes compute the same global batch; only the summation order differs (measured
# differences are below 1e-6 over 40 steps), so this tolerance still catches any real divergence.
CROSS_WORLD_TOL = 1e-4


def sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def losses(run: Path) -> dict[int, float]:
    """Step → loss of the records written so far: a run being written may end in a torn line (the
    text after the last newline), which is left out, as `training.plots` leaves it out."""
    complete = (run / "metrics.jsonl").read_text().split("\n")[:-1]
    return {r["step"]: r["loss"] for r in map(json.loads, complete)}


def test_resume_after_step_10_reproduces_steps_11_to_20(tmp_path):
    cfg = load_config(None, TINY)
    straight = Trainer(cfg, tmp_path / "a")
    expected = [straight.train_step().loss for _ in range(20)]

    first = Trainer(cfg, tmp_path / "b")
    assert [first.train_step().loss for _ in range(10)] == expected[:10]
    first.save()
    resumed = Trainer(cfg, tmp_path / "b")
    resumed.resume(checkpoint.latest_checkpoint(tmp_path / "b" / "checkpoints"))
    assert resumed.step == 10
    assert [resumed.train_step().loss for _ in range(10)] == expected[10:]  # bit-identical
    for p, q in zip(straight.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_the_schedules_measurements_are_resumed(tmp_path):
    # `schedule="auto"`'s factors and trial rounds travel with the planners' state; a resume that
    # dropped them would run two trial rounds per layer again.
    cfg = load_config(None, [*TINY, "moe.schedule=auto", "moe.cost_model=johnny"])
    first = Trainer(cfg, tmp_path)
    first.train_step()
    for k, (_, layer) in enumerate(first.model.moe_layers()):
        layer.schedule.calls = 9 + k  # as after measured forwards (one process measures none)
        layer.schedule.factors["sync"].value = 1.5 + k
    first.save()
    resumed = Trainer(cfg, tmp_path)
    resumed.resume(checkpoint.latest_checkpoint(tmp_path / "checkpoints"))
    states = [layer.schedule.state() for _, layer in resumed.model.moe_layers()]
    assert len(states) == 2 and states == [layer.schedule.state() for _, layer in first.model.moe_layers()]
    assert [s["calls"] for s in states] == [9, 10] and [s["factors"]["sync"] for s in states] == [1.5, 2.5]


def test_checkpoint_holds_every_expert_by_global_id_and_the_optimizer(tmp_path):
    trainer = Trainer(load_config(None, TINY), tmp_path)
    trainer.train_step()
    path = trainer.save()
    keys = checkpoint.saved_keys(path)
    for e in range(4):
        assert f"model.blocks.1.ffn.experts.w1.e{e}" in keys
        assert f"optim.blocks.1.ffn.experts.w1.exp_avg.e{e}" in keys
    assert "model.blocks.0.attn.qkv.weight" in keys and "optim.blocks.0.attn.qkv.weight.exp_avg_sq" in keys
    assert "train.step" in keys and "rng.rank0.torch" in keys


def save_model_checkpoint(ckpt_dir: Path, step: int, model: MoEGPT, keep: int = 10) -> Path:
    optimizer = torch.optim.AdamW(model.parameters())
    return checkpoint.save_checkpoint(ckpt_dir, step, model, optimizer, {"train": {"step": step}}, keep=keep)


def test_atomic_markers_and_keep_last_k(tmp_path):
    model = MoEGPT(ModelConfig(n_layers=1, d_model=16, n_heads=2, seq_len=8), MoEConfig(d_hidden=16))
    for step in (1, 2, 3):
        save_model_checkpoint(tmp_path, step, model, keep=2)
    assert [s for s, _ in checkpoint.complete_checkpoints(tmp_path)] == [2, 3]
    # A save killed midway leaves step_N.tmp; a folder without the marker is not a checkpoint.
    (tmp_path / "step_00000009.tmp").mkdir()
    shutil.copytree(tmp_path / "step_00000003", tmp_path / "step_00000007")
    (tmp_path / "step_00000007" / checkpoint.MARKER).unlink()
    assert checkpoint.latest_checkpoint(tmp_path).name == "step_00000003"
    with pytest.raises(ValueError, match="did not finish"):
        checkpoint.load_checkpoint(tmp_path / "step_00000007", model, None, {})
    assert checkpoint.latest_checkpoint(tmp_path / "nothing") is None


def test_a_truncated_newest_checkpoint_is_passed_over_with_a_note(tmp_path, capsys):
    model = MoEGPT(ModelConfig(n_layers=1, d_model=16, n_heads=2, seq_len=8), MoEConfig(d_hidden=16))
    for step in (1, 2):
        save_model_checkpoint(tmp_path, step, model, keep=2)
    shard = max((tmp_path / "step_00000002").glob("*.distcp"), key=lambda f: f.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:-10])  # the disk filled up while copying it
    assert checkpoint.latest_checkpoint(tmp_path, say=True).name == "step_00000001"
    assert "step_00000002" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"has \d+ bytes, the save wrote"):
        checkpoint.load_checkpoint(tmp_path / "step_00000002", model, None, {})


def test_loading_into_a_different_model_shape_names_the_tensor(tmp_path):
    torch.manual_seed(0)
    model = MoEGPT(ModelConfig(n_layers=1, d_model=16, n_heads=2, seq_len=8), MoEConfig(d_hidden=16))
    path = save_model_checkpoint(tmp_path, 1, model)
    wider = MoEGPT(ModelConfig(n_layers=1, d_model=32, n_heads=2, seq_len=8), MoEConfig(d_hidden=16))
    with pytest.raises(ValueError, match=r"'model\.tok_emb\.weight' has shape \(256, 16\)"):
        checkpoint.load_checkpoint(path, wider, None, {})
    fewer = MoEGPT(ModelConfig(n_layers=1, d_model=16, n_heads=2, seq_len=8), MoEConfig(num_experts=2, d_hidden=16))
    with pytest.raises(ValueError, match="gate"):
        checkpoint.load_checkpoint(path, fewer, None, {})
    deeper = MoEGPT(ModelConfig(n_layers=2, d_model=16, n_heads=2, seq_len=8), MoEConfig(d_hidden=16))
    with pytest.raises(ValueError, match=r"no tensor 'model\.blocks\.1\."):
        checkpoint.load_checkpoint(path, deeper, None, {})
    same = MoEGPT(ModelConfig(n_layers=1, d_model=16, n_heads=2, seq_len=8), MoEConfig(d_hidden=16))
    checkpoint.load_checkpoint(path, same, None, {})
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), same.parameters()))


def test_resume_with_a_different_config_is_a_one_line_error(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli.main(["train", *sets(TINY), "--steps", "2", "--out", str(run)]) == 0
    capsys.readouterr()
    rc = cli.main(["train", *sets(TINY), "--steps", "4", "--out", str(run), "--resume", "--set", "moe.top_k=1"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "moe.top_k=2, this run has 1" in err and "\n" not in err


def wait_then_kill(proc: subprocess.Popen, run: Path, timeout_s: float = 300) -> None:
    """SIGKILL the launcher and its workers once a checkpoint exists and steps beyond it were logged."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        newest = checkpoint.latest_checkpoint(run / "checkpoints")
        done = losses(run) if (run / "metrics.jsonl").exists() else {}
        if newest is not None and done and max(done) > int(newest.name.split("_")[1]) + 1:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole process group this test started
            break
        time.sleep(0.005)
    assert proc.wait(timeout=60) == -signal.SIGKILL, "the run ended before it could be killed"


@pytest.mark.multirank
def test_killed_run_resumes_exactly_and_reshards_between_1_and_2_processes(tmp_path):
    # Reference: one process, uninterrupted (its checkpoints at 10/20/30/40 seed the 1 -> 2 case).
    ref = tmp_path / "ref"
    assert cli.main(["train", *sets(SPAWN), "--out", str(ref)]) == 0
    expected = losses(ref)

    # 2 processes, SIGKILLed mid-run, then resumed with --resume.
    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "moeflow.cli", "train", *sets(SPAWN), "--nproc", "2", "--out", str(run)]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_then_kill(proc, run)
    before_kill = losses(run)
    resumed_from = int(checkpoint.latest_checkpoint(run / "checkpoints").name.split("_")[1])
    assert resumed_from < max(before_kill) < 40
    assert cli.main(["train", "--out", str(run), "--resume", "--nproc", "2"]) == 0
    after = losses(run)
    assert sorted(after) == list(range(1, 41))  # steps logged after the checkpoint were replaced once
    redone = range(resumed_from + 1, max(before_kill) + 1)
    assert all(after[s] == before_kill[s] for s in redone)  # same world size: bit-identical replay
    # The routing trace was cut back to the checkpoint and continued: every step once, 2 source ranks.
    trace = load_trace(run / "routing.npz")
    flow, steps, meta = trace.flow_ILWE, trace.steps_I, trace.meta
    assert steps.tolist() == list(range(1, 41)) and flow.shape == (40, 2, 2, 4) and meta["world_size"] == 2
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert flow.sum(axis=2).tolist() == [r["expert_counts"] for r in records]
    # 2-process expert parallelism == 1 process (same seed, same global batch).
    for s in range(1, 41):
        assert after[s] == pytest.approx(expected[s], abs=CROSS_WORLD_TOL), s

    # 2 -> 1 process: the 2-process checkpoint of step 20 continued by a single process.
    two_to_one = tmp_path / "two_to_one"
    (two_to_one / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "config.toml", two_to_one / "config.toml")
    shutil.copytree(run / "checkpoints" / "step_00000020", two_to_one / "checkpoints" / "step_00000020")
    assert cli.main(["train", "--out", str(two_to_one), "--resume"]) == 0
    got = losses(two_to_one)
    assert sorted(got) == list(range(21, 41))
    for s in got:
        assert got[s] == pytest.approx(expected[s], abs=CROSS_WORLD_TOL), s

    # 1 -> 2 processes: the reference's step-10 checkpoint continued by two processes.
    one_to_two = tmp_path / "one_to_two"
    (one_to_two / "checkpoints").mkdir(parents=True)
    shutil.copy(ref / "config.toml", one_to_two / "config.toml")
    shutil.copytree(ref / "checkpoints" / "step_00000010", one_to_two / "checkpoints" / "step_00000010")
    assert cli.main(["train", "--out", str(one_to_two), "--resume", "--nproc", "2"]) == 0
    got = losses(one_to_two)
    assert sorted(got) == list(range(11, 41))
    for s in got:
        assert got[s] == pytest.approx(expected[s], abs=CROSS_WORLD_TOL), s
