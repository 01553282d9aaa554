"""Training end to end on CPU: loss goes down, run folder contents, metrics, traces, numerics, CLI.

Multi-process runs go through `moeflow train --nproc 2` (torch's elastic launcher, gloo); each costs
several seconds, so one spawned run checks many things.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from moeflow import cli
from moeflow.sim.traces import TraceRecorder, load_trace
from moeflow.training.config_files import load_config
from moeflow.training.optim import clip_gradients, lr_factor
from moeflow.training.trainer import Trainer


def read_routing_trace(path):
    trace = load_trace(path)
    return trace.flow_ILWE.astype(np.int32), trace.steps_I, trace.meta


# A model small enough for a few seconds of CPU; balance weight 0 makes 1- and 2-process runs
# mathematically identical (the balance loss is per rank), so their losses can be compared.
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
    "train.eval_every=10",
    "train.eval_batches=2",
    "train.checkpoint_every=10",
    "train.keep_checkpoints=3",
    "optim.warmup_steps=5",
]
FIELDS = {"step", "loss", "lr", "tokens_per_s", "aux_loss", "load_imbalance", "expert_counts", "grad_norm"}


def sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def read_records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_single_process_run_learns_and_writes_everything(tmp_path, capsys):
    run = tmp_path / "run"
    rc = cli.main(
        [
            "train",
            *sets(TINY),
            "--set",
            "moe.balance_weight=0.01",
            "--steps",
            "30",
            "--out",
            str(run),
            "--record-routing",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert f"results in {run}" in printed and "loss.png" in printed

    records = read_records(run)
    assert [r["step"] for r in records] == list(range(1, 31))
    assert all(set(r) >= FIELDS for r in records)
    first, last = records[0]["loss"], np.mean([r["loss"] for r in records[-5:]])
    assert first > 5.0 and last < first - 1.0, (first, last)
    assert [r["step"] for r in records if "val_loss" in r] == [10, 20, 30]
    assert all(r["aux_loss"] > 0 and r["load_imbalance"] >= 1.0 for r in records)
    assert all(len(r["expert_counts"]) == 2 and len(r["expert_counts"][0]) == 4 for r in records)

    for name in ("config.toml", "loss.png", "expert_load.png", "throughput.png", "routing.npz"):
        assert (run / name).stat().st_size > 0, name
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_00000010",
        "step_00000020",
        "step_00000030",
    ]
    assert load_config(run / "config.toml").moe.balance_weight == 0.01

    flow, steps, meta = read_routing_trace(run / "routing.npz")
    assert flow.dtype == np.int32 and steps.dtype == np.int64
    assert flow.shape == (30, 2, 1, 4) and steps.tolist() == list(range(1, 31))
    assert meta == {
        "num_experts": 4,
        "top_k": 2,
        "world_size": 1,
        "d_model": 32,
        "d_hidden": 64,
        "expert": "ffn",
        "tokens_per_rank": 8 * 32,
        "layers": [0, 1],
    }
    # Dropless: every token's k assignments are in the flow; the trace agrees with the metrics.
    assert (flow.sum(axis=(2, 3)) == meta["tokens_per_rank"] * meta["top_k"]).all()
    assert flow[:, :, 0, :].tolist() == [r["expert_counts"] for r in records]

    # The trained model samples text through `moeflow generate`.
    rc = cli.main(["generate", "--run", str(run), "--prompt", "def ", "--length", "40", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step"] == 30 and out["text"].startswith("def ") and len(out["text"].encode()) >= 40


def test_make_run_shortened(tmp_path, capsys):
    """`make run` = the tiny config on 2 processes; shortened to 5 steps."""
    run = tmp_path / "default"
    rc = cli.main(["train", "--config", "configs/tiny.toml", "--nproc", "2", "--steps", "5", "--out", str(run)])
    assert rc == 0
    assert f"results in {run}" in capsys.readouterr().out
    records = read_records(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[-1]["loss"] < records[0]["loss"]
    assert "val_loss" in records[-1]
    assert (run / "checkpoints" / "step_00000005" / "COMPLETE").is_file()
    assert {"loss.png", "expert_load.png", "throughput.png", "config.toml"} <= {p.name for p in run.iterdir()}


def test_lr_schedule_warmup_then_cosine():
    f = [lr_factor(done, warmup_steps=4, total_steps=20, min_ratio=0.1) for done in range(20)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(f[3:], f[4:]))  # non-increasing after warmup
    assert f[-1] == pytest.approx(0.1)
    assert f[11] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 8 / 16)))


def tiny_config(*extra: str):
    return load_config(None, [*TINY, *extra])


def test_nonfinite_loss_stops_naming_the_step_or_is_skipped(tmp_path):
    trainer = Trainer(tiny_config(), tmp_path)
    trainer.train_step()
    with torch.no_grad():
        trainer.model.head.weight[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="step 2"):
        trainer.train_step()

    trainer = Trainer(tiny_config("train.on_nonfinite=skip"), tmp_path)
    with torch.no_grad():
        trainer.model.head.weight[0, 0] = float("inf")
    before = [p.detach().clone() for p in trainer.model.parameters()]
    result = trainer.train_step()
    assert result.skipped and not math.isfinite(result.loss) and trainer.step == 1
    after = list(trainer.model.parameters())
    assert all(torch.equal(a, b) or torch.isnan(a).any() for a, b in zip(before, after))
    assert all(torch.equal(a, b) for a, b in zip(before[1:], after[1:]))


def test_clip_gradients_matches_torch_on_one_process(tmp_path):
    trainer = Trainer(tiny_config(), tmp_path)
    x, y = trainer.sampler.batch(1)
    loss = trainer._ce(x, y) + trainer.model.aux_loss()
    loss.backward()
    grads = [p.grad.clone() for p in trainer.model.parameters()]
    norm = clip_gradients(trainer.model, trainer.layout, max_norm=0.5)
    expected = torch.nn.utils.get_total_norm(grads)
    assert norm == pytest.approx(expected.item(), rel=1e-5)
    clipped = torch.nn.utils.get_total_norm([p.grad for p in trainer.model.parameters()])
    assert clipped.item() == pytest.approx(0.5, rel=1e-4)


def test_routing_trace_resume_keeps_steps_up_to_the_checkpoint(tmp_path):
    meta = {
        "num_experts": 2,
        "top_k": 1,
        "world_size": 1,
        "d_model": 4,
        "d_hidden": 8,
        "tokens_per_rank": 3,
        "layers": [0],
    }
    trace = TraceRecorder(dict(meta))
    for step in (1, 2, 3):
        trace.append(step, np.array([[[step, 3 - step]]]))
    trace.write(tmp_path / "routing.npz")
    again = TraceRecorder(dict(meta))
    again.load_until(tmp_path / "routing.npz", 2)
    assert again.steps == [1, 2] and again.flows[1].tolist() == [[[2, 1]]]
    other = TraceRecorder({**meta, "world_size": 2})
    other.load_until(tmp_path / "routing.npz", 2)  # other dimensions: old trace kept aside
    assert other.steps == [] and (tmp_path / "routing.until_step2.npz").exists()


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--set", "moe.nonsense=1"], "moe.nonsense"),
        (["--set", "train.steps=ten"], "train.steps"),
        (["--set", "moe.gate=nonsense"], "gate='nonsense'"),
        (["--set", "moe.copy_chunks=0"], "moe.copy_chunks must be an integer >= 1, got 0"),
        (["--nproc", "3"], "--nproc 3"),
        (["--nproc", "8"], "--nproc 8"),
        (["--nproc", "0"], "--nproc"),
        (["--data", "/definitely/not/here"], "/definitely/not/here"),
        (["--resume"], "no complete checkpoint"),
        (["--config", "missing.toml"], "missing.toml"),
    ],
)
def test_cli_errors_are_one_line_naming_the_culprit(tmp_path, capsys, argv, named):
    rc = cli.main(["train", *sets(TINY), "--out", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert named in err and err.startswith("moeflow train: error:") and "\n" not in err


def test_cli_error_for_empty_data_folder(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    rc = cli.main(["train", *sets(TINY), "--out", str(tmp_path / "run"), "--data", str(tmp_path / "empty")])
    assert rc == 2 and "contains no text" in capsys.readouterr().err


def test_user_data_trains(tmp_path):
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    rc = cli.main(
        ["train", *sets(TINY), "--steps", "20", "--out", str(tmp_path / "run"), "--data", str(tmp_path / "text.txt")]
    )
    assert rc == 0
    records = read_records(tmp_path / "run")
    assert records[-1]["loss"] < records[0]["loss"] - 1.0  # a repetitive text is learnt fast


def test_trace_file_is_what_the_simulator_reads(tmp_path):
    """docs/traces.md is a contract with `moeflow simulate`: its reader must accept our file."""
    traces = pytest.importorskip("moeflow.sim.traces")
    trace = TraceRecorder(
        {
            "num_experts": 4,
            "top_k": 2,
            "world_size": 2,
            "d_model": 8,
            "d_hidden": 16,
            "tokens_per_rank": 5,
            "layers": [0, 1],
        }
    )
    flows = np.random.default_rng(0).integers(0, 5, size=(3, 2, 2, 4))
    for step, flow in zip((4, 5, 6), flows):
        trace.append(step, flow)
    trace.write(tmp_path / "routing.npz")
    loaded = traces.load_trace(tmp_path / "routing.npz")
    assert np.array_equal(loaded.flow, flows) and loaded.steps_I.tolist() == [4, 5, 6]
    assert loaded.meta["top_k"] == 2 and loaded.meta["tokens_per_rank"] == 5
