"""The FasterMoE and TA-MoE techniques inside `moeflow train`, by config name, on 2 gloo ranks.

Shadowing and the pairwise schedule do not change routing, so a 2-rank run with both must follow
plain EP's loss curve; the hierarchical gate and the TA-MoE loss change routing, so that run is
checked for what they promise (no cross-node traffic when the network forbids it). The 2-rank runs
train in the session's shared gloo spawn (`trained`); their resumes and samples go through the commands."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

from moeflow import cli
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology

from .multirank_train import runs, train_all
from .test_train import TINY


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _sets(cost_model, *sets):
    """`moeflow train --nproc 2 --steps 6 --cost-model COST --set ...` of each run, as overrides."""
    common = [*TINY, "moe.num_experts=4", "train.checkpoint_every=100", "train.eval_every=100"]
    return [*common, *sets, "train.steps=6", f"moe.cost_model={cost_model}"]


def _cost_models(tmp: Path) -> tuple:
    """Here, before the spawn: the cost models of the runs."""
    # Fast network, slow GEMMs: shadowing the busiest experts pays, so the planner does it.
    CostModel(Topology([[0], [1]], [1e12, 1e12]), gemm_flops_per_s=1e6).save(tmp / "fast.json")
    # Two nodes of one rank behind a network a million times slower than each device's own link.
    CostModel(Topology([[0], [1]], [1e6, 1e12]), gemm_flops_per_s=1e6).save(tmp / "slow.json")
    return ()


def _train_strategy_runs(rank, world, tmp):
    """Every 2-process run of this file; the resumes below go through `moeflow train` itself, one
    of them on 2 launched processes."""
    fast, slow = Path(tmp) / "fast.json", Path(tmp) / "slow.json"
    three = ["model.n_layers=3", "train.checkpoint_every=4"]
    hecate = [
        "moe.strategy=fssdp",
        "moe.prefetch=true",
        "moe.strategy_options.reshard_interval=2",
        "moe.strategy_options.rematerialize=true",
    ]
    configs = {
        "ep": _sets(fast),
        "both": _sets(fast, "moe.strategy=shadow", "moe.schedule=pairwise", "moe.schedule_options.group_size=1"),
        "prophet": _sets(fast, "moe.strategy=prophet", "moe.prefetch=true", "model.n_layers=3"),
        "ep3": _sets(fast, "model.n_layers=3"),
        "local": _sets(slow, "moe.gate=hierarchical", "moe.balance=ta_moe", "moe.balance_weight=0.01"),
        "ep3_saved": _sets(fast, *three),
        "fssdp": _sets(fast, *three, *hecate),
    }
    train_all(rank, world, runs(tmp, configs))


@pytest.fixture(scope="module")
def trained(shared_spawns):
    """The run folders, trained in the session's shared 2-rank spawn (tests/multirank_train.py)."""
    return shared_spawns.run(_train_strategy_runs, 2)


@pytest.mark.multirank
@pytest.mark.spawned(body=_train_strategy_runs, world=2, setup=_cost_models)
def test_shadow_and_pairwise_follow_ep_and_topology_aware_routing_stays_local(trained):
    ep, both = _metrics(trained / "ep"), _metrics(trained / "both")
    assert [m["step"] for m in ep] == list(range(1, 7))
    assert [m["loss"] for m in both] == pytest.approx([m["loss"] for m in ep], rel=1e-5, abs=1e-5)
    assert sum(sum(m["extra_copies_per_layer"]) for m in both) > 0, "the planner never shadowed"
    assert all(sum(m["extra_copies_per_layer"]) == 0 for m in ep)
    # Pro-Prophet planned a step ahead, with the block-wise prefetch: plain EP's curve again.
    prophet, ep3 = _metrics(trained / "prophet"), _metrics(trained / "ep3")
    assert [m["loss"] for m in prophet] == pytest.approx([m["loss"] for m in ep3], rel=1e-5, abs=1e-5)
    assert sum(sum(m["extra_copies_per_layer"][1:]) for m in prophet) > 0, "nothing to prefetch"
    assert all(len(m["device_load_std_per_layer"]) == 3 for m in prophet)

    # Two nodes of one rank behind a network a million times slower than each device's own link:
    # W_net / (M · W_local) = 1e-6 (M = 1: the device's link is its local transfer), so the
    # hierarchical gate keeps every assignment on its own node; TA-MoE's loss trains alongside.
    local = _metrics(trained / "local")
    assert all(m["cross_node_share"] == 0.0 for m in local)
    assert all(m["cross_node_share"] > 0.0 for m in ep)
    assert sum(m["redirected"] for m in local) > 0

    # The cost model describes the cluster of a run, not the model: the runs sample in one process
    # and resume on another process count, each with a one-line notice instead of an error.
    for name in ("both", "local"):
        with pytest.warns(UserWarning, match="describes 2 devices but this expert-parallel group has 1"):
            assert cli.main(["generate", "--run", str(trained / name), "--length", "8", "--json"]) == 0
    argv = ["train", "--nproc", "1", "--steps", "8", "--out", str(trained / "local"), "--resume"]
    with pytest.warns(UserWarning, match="describes 2 devices"):
        assert cli.main(argv) == 0
    resumed = _metrics(trained / "local")
    assert [m["step"] for m in resumed] == list(range(1, 9)) and resumed[-1]["cross_node_share"] == 0.0


@pytest.mark.multirank
@pytest.mark.spawned(body=_train_strategy_runs, world=2, setup=_cost_models)
def test_fssdp_follows_ep_across_resharding_and_resumes_on_another_process_count(trained, tmp_path):
    ep, fssdp = _metrics(trained / "ep3_saved"), _metrics(trained / "fssdp")
    assert [m["step"] for m in fssdp] == list(range(1, 7))
    assert [m["loss"] for m in fssdp] == pytest.approx([m["loss"] for m in ep], rel=1e-5, abs=1e-5)
    assert sum(sum(m["extra_copies_per_layer"]) for m in fssdp) > 0, "nothing was materialized"
    # The checkpoint of step 4 was written after two re-shardings (steps 2 and 4): resumed on 2
    # launched processes (`moeflow train --nproc 2 --resume`) and on 1, steps 5-6 repeat the
    # uninterrupted run's.
    for nproc in (2, 1):
        run = tmp_path / f"resume{nproc}"
        shutil.copytree(trained / "fssdp", run)
        shutil.rmtree(run / "checkpoints" / "step_00000006")
        argv = ["train", "--nproc", str(nproc), "--steps", "6", "--out", str(run), "--resume"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # 1 process: the 2-device cost model is set aside, with a notice
            assert cli.main(argv) == 0
        resumed = _metrics(run)
        assert [m["step"] for m in resumed] == list(range(1, 7))
        assert [m["loss"] for m in resumed[4:]] == pytest.approx([m["loss"] for m in fssdp[4:]], rel=1e-5, abs=1e-5)
