"""A newcomer's first hour (issue 41): strategies without a cost model file, what the strategy did,
`moeflow advise`, interrupts and run folders, errors that say what to do, readable plots, tokenizers.

One spawned run (2 gloo ranks, in a subprocess so that it can be interrupted) carries the checks that
need processes; the rest runs in this process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from moeflow import cli
from moeflow.sim.advise import advise, even_trace
from moeflow.sim.simulator import SimulatedLayer
from moeflow.sim.traces import synthetic_trace
from moeflow.training.config_files import ConfigErrors, load_config
from moeflow.training.cost_model_setup import MEASURED_FILE, check_cost_model, cost_model_users
from moeflow.training.interrupts import SAME_SIGNAL_S, StopRequest
from moeflow.training.metrics import StepResult, metric_record
from moeflow.training.plots import write_plots
from moeflow.training.strategy_report import StrategyTally, bar_fields, format_strategy
from moeflow.training.tokenizer import TextStream, load_tokenizer, parse_tokenizer, prepare_tokenizer

from .test_train import TINY, sets

ROOT = Path(__file__).resolve().parents[1]


# ---- errors -------------------------------------------------------------------------------------
def test_config_problems_are_reported_together_with_did_you_mean(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[moe]\nnum_expert = 4\ntop_k = 9\n[train]\nstepz = 3\nprecision = "fp16"\n')
    with pytest.raises(ConfigErrors) as info:
        load_config(bad, ["moe.strategy=shadw", "train.log_evry=2"])
    text = str(info.value)
    assert text.startswith("6 problems in the configuration:")
    for part in (
        "'moe.num_expert' (did you mean 'moe.num_experts'?)",
        "'train.stepz' (did you mean 'train.steps'?)",
        "'train.log_evry' (did you mean 'train.log_every'?)",
        "moe.top_k=9 exceeds moe.num_experts=4",
        "train.precision",
        "moe.strategy='shadw': unknown (did you mean 'shadow'?)",
    ):
        assert part in text, part


def test_file_errors_name_the_file(tmp_path, capsys):
    junk = tmp_path / "junk.npz"
    junk.write_bytes(os.urandom(64))
    assert cli.main(["simulate", "--trace", str(junk)]) == 2
    assert f"trace {str(junk)!r}: not a routing trace" in capsys.readouterr().err
    assert cli.main(["simulate", "--cluster", str(junk)]) == 2
    assert f"cost model file {str(junk)!r}" in capsys.readouterr().err


# ---- the cost model -----------------------------------------------------------------------------
def test_a_cost_model_of_another_cluster_is_an_error_before_processes_start(tmp_path):
    cfg = load_config(None, ["moe.strategy=shadow", "moe.gate=hierarchical"])
    assert cost_model_users(cfg) == ["moe.strategy='shadow'", "moe.gate='hierarchical'"]
    assert cost_model_users(load_config(None, ["moe.schedule=pipeline", "moe.schedule_options.degree=auto"]))
    assert cost_model_users(load_config(None, [])) == []
    cfg.moe.cost_model = "johnny"  # 16 devices
    with pytest.raises(ValueError, match="'johnny' describes 16 devices but this run has 2 expert-parallel ranks"):
        check_cost_model(cfg, 2, tmp_path, resume=False)
    assert "note:" in check_cost_model(cfg, 2, tmp_path, resume=True)  # resuming on another size: a notice
    # Measured at start-up for another layout: measured again, not refused.
    measured = load_config(None, ["moe.strategy=shadow", f"moe.cost_model={ROOT / 'configs' / 'tiny.toml'}"])
    measured.moe.cost_model = str(tmp_path / MEASURED_FILE)
    (tmp_path / MEASURED_FILE).write_text(json.dumps(_cost_model_dict("johnny")))
    assert check_cost_model(measured, 2, tmp_path, resume=True) is None and measured.moe.cost_model is None


def _cost_model_dict(preset: str) -> dict:
    from moeflow.perf.costmodel import CostModel

    return CostModel.from_preset(preset).to_dict()


def test_start_up_profile_is_measured_once_and_cached(tmp_path, monkeypatch):
    from moeflow.perf.costmodel import CostModel
    from moeflow.profiling.startup import startup_profile

    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(tmp_path))
    profile, report = startup_profile(torch.device("cpu"))
    assert report.startswith("cost model: measured this machine in") and "GEMM" in report
    cached = list((tmp_path / "cost-models").glob("*-1ranks-1nodes.json"))
    assert len(cached) == 1 and f"cached in {cached[0]}" in report
    again, report = startup_profile(torch.device("cpu"))
    assert report.startswith(f"cost model: {cached[0]}") and again["measured_at"] == profile["measured_at"]
    assert CostModel.from_dict(again).topology.num_devices == 1


# ---- what the strategy did ----------------------------------------------------------------------
def test_records_bar_and_summary_show_the_placement(tmp_path):
    result = StepResult(
        step=1,
        loss=2.0,
        aux_loss=0.0,
        lr=1e-3,
        grad_norm=1.0,
        skipped=False,
        counts_LE=[[6, 2], [4, 4]],
        imbalance_L=[1.5, 1.0],
        dropped=0,
        extra_copies_L=[1, 0],
        rank_loads_LW=[[4, 4], [5, 3]],
        owner_loads_LW=[[6, 2], [5, 3]],
        strategy_L=["shadow", "ep"],
        schedule_L=["sync", "sync"],
    )
    rec = metric_record(result, 100.0, None)
    assert rec["rank_load_imbalance_owners"] == pytest.approx((1.5 + 1.25) / 2)
    assert rec["rank_load_imbalance"] == pytest.approx((1.0 + 1.25) / 2)
    assert rec["copies"] == 1 and rec["strategy_per_layer"] == ["shadow", "ep"]
    assert "imb=1.25 ranks=1.38→1.12 copies=1 auto→" in bar_fields(rec, "auto")
    assert bar_fields({**rec, "loss": None}, "ep").startswith("loss=nan ")  # a skipped step
    tally = StrategyTally("auto", "sync")
    tally.add(rec)
    summary = tally.summary()
    assert summary["strategy_chosen"] == {"shadow": 0.5, "ep": 0.5} and "schedule_chosen" not in summary
    line = format_strategy(summary)[0]
    assert line.startswith("strategy auto (chose shadow 50%, ep 50% of layer-steps), schedule sync: 1.0 expert")
    assert "1.38 with owners only -> 1.12 after placement" in line
    with (tmp_path / "metrics.jsonl").open("w") as fh:
        for step in range(1, 6):  # resumed on 3 ranks after step 2
            loads = rec["rank_loads"] if step <= 2 else [[3, 3, 2], [2, 3, 3]]
            fh.write(json.dumps({**rec, "step": step, "rank_loads": loads}) + "\n")
    names = {p.name for p in write_plots(tmp_path / "metrics.jsonl", tmp_path)}
    assert {"loss.png", "expert_load.png", "rank_load.png", "throughput.png"} <= names


# ---- advise --------------------------------------------------------------------------------------
def test_advise_ranks_strategies_against_ep_and_the_ceiling(capsys):
    from moeflow.core.expert_shape import ExpertShape
    from moeflow.perf.costmodel import CostModel

    cost_model = CostModel.from_preset("johnny")
    trace = synthetic_trace("zipf", 4, 1, 16, 32, 1024, skew=1.4, seed=1)
    assert (even_trace(trace).flow.sum(-1) == trace.flow.sum(-1)).all()
    assert np.ptp(even_trace(trace).flow, axis=-1).max() <= 1
    layer = SimulatedLayer(ExpertShape(256, 1024))
    advice = advise(trace, cost_model, layer, ["ep", "shadow"], ["sync", "pairwise"])
    steps = [c.step_s for c in advice.candidates]
    assert steps == sorted(steps) and len(steps) == 4
    ep = next(c for c in advice.candidates if (c.strategy, c.schedule) == ("ep", "sync"))
    assert ep.speedup_vs_ep == 1.0 and ep.share_of_ceiling == 0.0 and ep.step_s == advice.ep_s
    assert advice.ceiling_s < advice.ep_s  # skewed routing costs time that perfect balance would save
    # The command: the same ranking, and the winner's flags are a valid `moeflow train` command line.
    argv = ["advise", "--cluster", "johnny", "--set", "moe.num_experts=32", "--iterations", "2"]
    assert cli.main([*argv, "--strategy", "ep,shadow", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    best = out["candidates"][0]
    assert out["winner_command"].endswith(
        f"--cost-model johnny --set moe.strategy={best['strategy']} --set moe.schedule={best['schedule']}"
    )
    words = out["winner_command"].split()[2:]
    args = cli.build_parser().parse_args(["train", *words])
    assert load_config(None, args.overrides).moe.strategy == best["strategy"] and args.nproc == 16
    assert cli.main([*argv, "--strategy", "ep,shadw"]) == 2
    assert "did you mean 'shadow'" in capsys.readouterr().err


# ---- interrupts -----------------------------------------------------------------------------------
def test_a_stop_request_counts_a_doubled_signal_once_and_a_later_one_stops_at_once():
    stop = StopRequest(in_process=True, say=False)
    stop._handle(signal.SIGINT, None)
    stop._handle(signal.SIGTERM, None)  # the launcher's copy of the same request
    assert stop.requested and stop.agreed(False, torch.device("cpu"))
    stop.first_at -= SAME_SIGNAL_S  # a second Ctrl-C, later
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGINT, None)


def test_a_fresh_run_never_replaces_an_earlier_one(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "checkpoints" / "step_00000002" / "COMPLETE").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    assert cli.main(["train", *sets(TINY), "--out", str(run)]) == 2
    assert "holds a run" in capsys.readouterr().err and (run / "metrics.jsonl").exists()


# ---- tokenizers ------------------------------------------------------------------------------------
def test_bpe_is_trained_on_the_corpus_saved_and_streams_back(tmp_path):
    text = b"".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n".encode() for i in range(400))
    tokenizer, said = prepare_tokenizer("bpe:300", tmp_path, text, resume=False)
    assert tokenizer.vocab_size == 300 and "BPE of 300 tokens" in said
    assert load_tokenizer("bpe:300", tmp_path).vocab_size == 300
    ids = tokenizer.encode("héllo wörld\n".encode())
    stream = TextStream(tokenizer)
    shown = "".join(stream.push(t) for t in ids) + stream.finish()
    assert shown == "héllo wörld\n"
    assert len(tokenizer.encode(text)) < len(text) / 2  # it learned the corpus
    with pytest.raises(ValueError, match="bpe:N"):
        parse_tokenizer("bpe:12")
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_tokenizer(str(tmp_path / "missing.json"), tmp_path)


# ---- the spawned run ---------------------------------------------------------------------------------
@pytest.mark.multirank
def test_strategy_without_cost_model_file_interrupted_resumable_with_its_bpe(tmp_path):
    """2 gloo ranks: shadow with no cost model (measured at start-up, cached, in the run folder), a BPE
    trained for the run, SIGINT to the whole process group (a terminal's Ctrl-C): every rank finishes
    its step, a checkpoint is written, the --resume command printed, exit 130; generate reads the BPE."""
    text = tmp_path / "text.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(3000)))
    run = tmp_path / "run"
    extra = ["moe.strategy=shadow", "data.tokenizer=bpe:300", "train.checkpoint_every=1000", "train.eval_every=0"]
    tensorboard = importlib_available("tensorboard")
    extra += ["train.tensorboard=true"] if tensorboard else []
    cmd = [sys.executable, "-m", "moeflow.cli", "train", "--nproc", "2", "--steps", "2000", "--out", str(run)]
    cmd += sets([*TINY, *extra]) + ["--data", str(text)]
    env = {**os.environ, "MOEFLOW_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # until a few steps were logged
        lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").exists() else []
        if len(lines) >= 3:
            break
        time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=240)
    out = out.decode()
    assert proc.returncode == 130, out[-3000:]
    assert f"continue with  moeflow train --out {run} --resume --nproc 2" in out
    assert "cost model: measured this machine" in out and "used by moe.strategy='shadow'" in out
    assert "tokenizer: a BPE of 300 tokens" in out
    checkpoints = list((run / "checkpoints").glob("step_*"))
    assert len(checkpoints) == 1 and int(checkpoints[0].name[5:]) < 2000
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == int(checkpoints[0].name[5:])
    assert all("rank_load_imbalance" in r and "copies" in r for r in records)
    assert "strategy shadow, schedule sync:" in out and "ranks=" in out
    assert (run / MEASURED_FILE).is_file() and list((tmp_path / "cache" / "cost-models").glob("*2ranks*"))
    assert (run / "rank_load.png").is_file() and (run / "tokenizer.json").is_file()
    assert not tensorboard or list((run / "tensorboard").glob("events.*"))
    assert load_config(run / "config.toml").model.vocab_size == 300
    assert cli.main(["generate", "--run", str(run), "--length", "5", "--json", "--prompt", "def "]) == 0


def importlib_available(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
