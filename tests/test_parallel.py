"""The `[parallel]` device mesh (docs/parallel.md): the session's shared 4-rank gloo spawn runs every
multi-rank check of tests/multirank_parallel.py (meta-device build = one process; dp 2 × ep 2 under FSDP2 and
replicated, for ep, shadow and fssdp, = one process over 10 steps; activation checkpointing and
micro-steps give the same gradients; a dp 2 × ep 2 checkpoint resumes as ep 4 and dp 4 × ep 1);
here, its resume on one process, and the one-line errors of layouts that cannot work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeflow import cli
from moeflow.core.parallel import ParallelLayout
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.training import checkpoint
from moeflow.training.config import ParallelConfig
from moeflow.training.config_files import load_config
from moeflow.training.data import load_corpus
from moeflow.training.trainer import Trainer

from .multirank_parallel import LOSS_TOL, SAVE_AT, STEPS, config, four_ranks, train


def reference(tmp: Path) -> dict:
    """The one-process run: its initial weights, losses, norms and final weights (checkpoint keys)."""
    trainer = Trainer(config(), tmp / "one", corpus=load_corpus(config().data, min_tokens=33))
    init = {k: v.detach().clone() for k, v in checkpoint.model_state(trainer.model).items()}
    results = train(trainer, STEPS)
    end = {k: v.detach().clone() for k, v in checkpoint.model_state(trainer.model).items()}
    return dict(init=init, losses=[r.loss for r in results], norms=[r.grad_norm for r in results], end=end)


def setup(tmp: Path) -> tuple[dict]:
    """Here, before the shared 4-rank spawn: the cost models the strategies read, and the reference."""
    for devices in (2, 4):
        CostModel(Topology([[d] for d in range(devices)], [1e12, 1e12]), gemm_flops_per_s=1e6).save(
            tmp / f"fast{devices}.json"
        )
    return (reference(tmp),)


@pytest.mark.multirank
@pytest.mark.spawned(body=four_ranks, world=4, setup=setup)
def test_every_layout_is_the_one_process_model(tmp_path, shared_spawns):
    ran = shared_spawns.run(four_ranks, 4)  # four_ranks(rank, 4, its folder, reference), in the session's spawn
    # The dp 2 × ep 2 checkpoint (FSDP2 shards, expert rows by global id) on one process.
    saved = json.loads((ran / "dp2ep2.json").read_text())
    one = Trainer(config(), tmp_path / "one_resumed")
    one.resume(Path(saved["path"]))
    assert one.step == SAVE_AT
    assert [r.loss for r in train(one, 2)] == pytest.approx(saved["losses"], **LOSS_TOL)


def test_layouts_that_cannot_work_are_one_line_errors(tmp_path, capsys):
    def layout_error(match: str, **kw) -> None:
        with pytest.raises(ValueError, match=match):
            ParallelLayout(**{"world_size": 4, "rank": 0, **kw})

    layout_error(r"ep_size=3 · esp_size=1 does not divide world_size=4", ep_size=3)
    layout_error(r"experts='fsdp' with dp_size=1 \(world_size=4 / ep_size=4 / esp_size=1\)", experts="fsdp")
    layout_error(r"esp_size=4 is larger than a node of 2 ranks", esp_size=4, ep_size=1, node_size=2)
    layout_error(r"dense='sharded' must be one of replicate, fsdp", dense="sharded")
    with pytest.raises(ValueError, match="parallel.experts must be one of replicate, fsdp; got 'zero3'"):
        ParallelConfig(experts="zero3")
    with pytest.raises(ValueError, match="parallel.ep_size must be an integer >= 1, got 0"):
        ParallelConfig(ep_size=0)
    with pytest.raises(ValueError, match="config key 'moe.esp_size' is now parallel.esp_size"):
        load_config(None, ["moe.esp_size=2"])
    with pytest.raises(ValueError, match="train.micro_batch_size must be an integer >= 1, got 0"):
        load_config(None, ["train.micro_batch_size=0"])
    with pytest.raises(ValueError, match="train.activation_checkpointing must be one of none, selective, full"):
        load_config(None, ["train.activation_checkpointing=some"])
    with pytest.raises(ValueError, match="moe.prefetch=true with parallel.experts='fsdp'"):
        load_config(None, ["moe.prefetch=true", "parallel.experts=fsdp"])
    with pytest.raises(ValueError, match="train.grad_sync='ddp' buckets replicated dense gradients"):
        load_config(None, ["parallel.dense=fsdp", "train.grad_sync=ddp"])
    cfg = load_config(None, ["moe.num_experts=4", "parallel.ep_size=2", "train.global_batch_size=8"])
    cfg.validate_world_size(4)
    with pytest.raises(ValueError, match=r"parallel.ep_size=2 · parallel.esp_size=1 = 2 does not divide the 3"):
        cfg.validate_world_size(3)
    fsdp = load_config(None, ["moe.num_experts=4", "parallel.experts=fsdp", "train.micro_batch_size=3"])
    with pytest.raises(ValueError, match="parallel.experts='fsdp' with 4 processes as ep 4 × esp 1: no data-parallel"):
        fsdp.validate_world_size(4)
    micro = load_config(None, ["moe.num_experts=4", "parallel.ep_size=1", "train.micro_batch_size=3"])
    with pytest.raises(ValueError, match="train.micro_batch_size=3 does not divide the 8 sequences per process"):
        micro.validate_world_size(2)
    esp = load_config(None, ["moe.num_experts=4", "parallel.esp_size=4", "parallel.ep_size=1"])
    with pytest.raises(ValueError, match="parallel.esp_size=4 is larger than a node of 2 processes"):
        esp.validate_world_size(4, node_size=2)
    hecate = load_config(
        None, ["moe.num_experts=2", "moe.strategy=fssdp", "parallel.experts=fsdp", "parallel.ep_size=2"]
    )
    with pytest.raises(ValueError, match=r"4 owner ranks .*one owner per expert over dp 2 × ep 2"):
        hecate.validate_world_size(4)
    with pytest.raises(ValueError, match=r"2 expert-parallel ranks \(4 processes as dp 2 × ep 2 × esp 1\) cannot"):
        load_config(None, ["moe.num_experts=3", "parallel.ep_size=2", "moe.top_k=1"]).validate_world_size(4)
    # The command refuses before any process starts, in one line naming the values.
    argv = ["train", "--nproc", "4", "--set", "parallel.experts=fsdp", "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "parallel.experts='fsdp' with 4 processes as ep 4 × esp 1" in err and "\n" not in err
    assert torch.get_default_dtype() == torch.float32


def test_measured_cost_model_narrowed_to_the_planning_group():
    """The start-up cost model measures every rank; the MoE layers plan over one expert-parallel
    group (or, for FSSDP with experts="fsdp", the dp × ep mesh): the profile is narrowed to it."""
    from moeflow.training.config_files import config_from_dict
    from moeflow.training.cost_model_setup import expert_group_profile, planning_group_size

    fits = {
        "p2p_intra": {"alpha_s": 1e-5, "beta_s_per_unit": 1e-10, "r2": 0.99},
        "p2p_inter": {"alpha_s": 1e-5, "beta_s_per_unit": 1e-9, "r2": 0.99},
    }
    profile = {"name": "p", "world_size": 8, "nodes": [[0, 1, 2, 3], [4, 5, 6, 7]], "fits": fits}
    two_nodes = expert_group_profile(profile, ep_size=4, esp_size=2)  # ranks 0, 2, 4, 6
    assert two_nodes["world_size"] == 4 and two_nodes["nodes"] == [[0, 1], [2, 3]]
    assert Topology.from_dict(two_nodes["topology"]).num_nodes == 2
    one_node = expert_group_profile(profile, ep_size=2, esp_size=1)  # ranks 0, 1
    assert one_node["nodes"] == [[0, 1]] and Topology.from_dict(one_node["topology"]).num_devices == 2

    cfg = config_from_dict({"parallel": {"ep_size": 2}, "moe": {"strategy": "shadow"}})
    assert planning_group_size(cfg, 4) == 2
    cfg = config_from_dict({"parallel": {"ep_size": 2, "experts": "fsdp"}, "moe": {"strategy": "fssdp"}})
    assert planning_group_size(cfg, 4) == 4
