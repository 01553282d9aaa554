"""The FasterMoE and TA-MoE techniques inside `moeflow train`, by config name, on 2 gloo ranks.

Shadowing and the pairwise schedule do not change routing, so a 2-rank run with both must follow
plain EP's loss curve; the hierarchical gate and the TA-MoE loss change routing, so that run is
checked for what they promise (no cross-node traffic when the network forbids it)."""

from __future__ import annotations

import json

import pytest

from moeflow import cli
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology

from .test_train import TINY


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _train(tmp_path, name, cost_model, *sets):
    run = tmp_path / name
    argv = ["train", "--nproc", "2", "--steps", "6", "--out", str(run), "--cost-model", str(cost_model)]
    for item in [*TINY, "moe.num_experts=4", "train.checkpoint_every=100", "train.eval_every=100", *sets]:
        argv += ["--set", item]
    assert cli.main(argv) == 0
    return _metrics(run)


@pytest.mark.multirank
def test_shadow_and_pairwise_follow_ep_and_topology_aware_routing_stays_local(tmp_path):
    # Fast network, slow GEMMs: shadowing the busiest experts pays, so the planner does it.
    fast = tmp_path / "fast.json"
    CostModel(Topology([[0], [1]], [1e12, 1e12]), gemm_flops_per_s=1e6).save(fast)
    ep = _train(tmp_path, "ep", fast)
    both = _train(tmp_path, "both", fast, "moe.strategy=shadow", "moe.schedule=pairwise", "moe.group_size=1")
    assert [m["loss"] for m in both] == pytest.approx([m["loss"] for m in ep], rel=1e-5, abs=1e-5)
    assert sum(sum(m["extra_copies_per_layer"]) for m in both) > 0, "the planner never shadowed"
    assert all(sum(m["extra_copies_per_layer"]) == 0 for m in ep)

    # Two nodes of one rank: W_net / (M · W_local) = 0 (no intra-node link to spare), so the
    # hierarchical gate keeps every assignment on its own node; TA-MoE's loss trains alongside.
    local = _train(tmp_path, "local", fast, "moe.gate=hierarchical", "moe.balance=ta_moe", "moe.balance_weight=0.01")
    assert all(m["cross_node_share"] == 0.0 for m in local)
    assert all(m["cross_node_share"] > 0.0 for m in ep)
    assert sum(m["redirected"] for m in local) > 0
