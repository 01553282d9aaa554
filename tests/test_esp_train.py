"""Expert sharding (ESP, FSMoE §3) in `moeflow train`: one gloo spawn per world size (4, then 2)
runs every check of tests/multirank_esp_train.py — esp 2 × ep 2, esp 4 and esp 2 × ep 1 follow
plain EP; checkpoints resume bit for bit under the same layout and reshard esp 2 ↔ esp 1 and from
4 ranks to 2 (and, here, to one process). Bad `parallel.esp_size` values are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeflow import cli
from moeflow.training import checkpoint
from moeflow.training.config import ParallelConfig
from moeflow.training.config_files import load_config
from moeflow.training.model import MoEGPT

from .multirank import run_ranks
from .multirank_esp_train import config, four_ranks, two_ranks


@pytest.mark.multirank
def test_esp_training_follows_ep_and_its_checkpoints_reshard(tmp_path):
    run_ranks(four_ranks, 4, str(tmp_path))
    run_ranks(two_ranks, 2, str(tmp_path))
    # One process (what `moeflow generate` does): the 4-rank hidden slices load as full experts.
    cfg = config(1)
    model = MoEGPT(cfg.model, cfg.moe)
    path = Path(json.loads((tmp_path / "esp2_ep2.json").read_text())["path"])
    checkpoint.load_checkpoint(path, model, None, {})
    saved = torch.load(tmp_path / "esp2_ep2_state.pt")
    loaded = checkpoint.model_state(model)
    assert sorted(loaded) == sorted(k for k in saved if k.startswith("model."))
    for key, value in loaded.items():
        torch.testing.assert_close(value, saved[key], rtol=0, atol=0, msg=key)


def test_bad_esp_size_is_refused_by_name(tmp_path, capsys):
    with pytest.raises(ValueError, match="parallel.esp_size must be an integer >= 1, got 0"):
        ParallelConfig(esp_size=0)
    with pytest.raises(ValueError, match="parallel.esp_size=3 must divide moe.d_hidden=64"):
        load_config(None, ["parallel.esp_size=3", "moe.d_hidden=64"])
    with pytest.raises(ValueError, match="parallel.esp_size=2 supports moe.strategy='ep' only, got .*'fssdp'"):
        load_config(None, ["parallel.esp_size=2", "moe.strategy=fssdp"])
    with pytest.raises(ValueError, match="config key 'moe.esp_size' is now parallel.esp_size"):
        load_config(None, ["moe.esp_size=2"])
    cfg = load_config(None, ["parallel.esp_size=2", "moe.num_experts=2", "train.global_batch_size=24"])
    cfg.validate_world_size(4)  # esp 2 × ep 2
    cfg.validate_world_size(4, node_size=2)
    with pytest.raises(ValueError, match="parallel.esp_size=2 is larger than a node of 1 processes"):
        cfg.validate_world_size(4, node_size=1)
    with pytest.raises(ValueError, match="parallel.esp_size=2 must divide the processes per node, 3"):
        cfg.validate_world_size(6, node_size=3)
    with pytest.raises(ValueError, match="parallel.esp_size=2 must divide the number of processes, 3"):
        cfg.validate_world_size(3)
    with pytest.raises(ValueError, match=r"4 expert-parallel ranks \(8 processes as dp 1 × ep 4 × esp 2\)"):
        cfg.validate_world_size(8)
    # The command refuses before any process starts, in one line naming the key.
    assert cli.main(["train", "--nproc", "3", "--set", "parallel.esp_size=2", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "parallel.esp_size=2 must divide the number of processes, 3" in err and "\n" not in err
