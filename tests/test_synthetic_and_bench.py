"""Synthetic routing for benchmarks, and the benchmark's speedup / bound arithmetic."""

from __future__ import annotations

import pytest
import torch

from moeflow.bench.strategies import _add_speedups
from moeflow.routing.sampled import SampledGate, zipf_probabilities


def test_zipf_probabilities():
    p = zipf_probabilities(8, 0.0)
    torch.testing.assert_close(p, torch.full((8,), 1 / 8))
    p = zipf_probabilities(8, 1.2, seed=3)
    assert p.sum().item() == pytest.approx(1.0)
    ordered = torch.sort(p, descending=True).values
    torch.testing.assert_close(ordered[0] / ordered[1], torch.tensor(2.0**1.2))
    assert torch.equal(p, zipf_probabilities(8, 1.2, seed=3))  # same on every rank
    with pytest.raises(ValueError, match="skew=-1"):
        zipf_probabilities(8, -1)


def test_sampled_gate_follows_its_distribution_and_stays_a_real_gate():
    probs = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.7]])
    gate = SampledGate(8, 4, 1, probs, seed=0, rank=1)
    r = gate(torch.randn(4000, 8))
    share = torch.bincount(r.expert_A, minlength=4).float() / 4000
    assert abs(share[3].item() - 0.7) < 0.05
    r.weight_A.sum().backward()  # weights are the gate's own probabilities: differentiable
    assert gate.weight.grad is not None
    two = SampledGate.zipf(8, 4, 2, skew=1.0)(torch.randn(50, 8))
    assert all(len(set(pair)) == 2 for pair in two.expert_A.view(2, 50).t().tolist())
    with pytest.raises(ValueError, match="at least top_k=2"):
        SampledGate(8, 4, 2, torch.tensor([1.0, 0, 0, 0]))


def test_speedups_and_pairwise_bound():
    rows = [
        {
            "routing": "z",
            "strategy": "ep",
            "schedule": "sync",
            "median_s": 1.0,
            "forward_a2a_s": 0.2,
            "forward_compute_s": 0.1,
        },
        {"routing": "z", "strategy": "shadow", "schedule": "sync", "median_s": 0.5},
        {"routing": "z", "strategy": "ep", "schedule": "pairwise", "median_s": 0.8},
    ]
    _add_speedups(rows)
    assert rows[1]["speedup_vs_ep"] == pytest.approx(2.0)
    # comm = 2 x 0.2, comp = 3 x 0.1: bound (0.4 + 0.3) / 0.4 = 1.75; achieved 1 / 0.8 = 1.25.
    assert rows[2]["pairwise_bound"] == pytest.approx(1.75)
    assert rows[2]["share_of_bound"] == pytest.approx(1.25 / 1.75)


@pytest.mark.multirank
def test_strategy_bench_on_two_ranks(tmp_path, capsys):
    import json

    from moeflow import cli
    from moeflow.perf.costmodel import CostModel
    from moeflow.perf.topology import Topology

    cost_model = tmp_path / "cm.json"
    CostModel(Topology([[0], [1]], [1e9, 1e10]), gemm_flops_per_s=1e9).save(cost_model)
    argv = [
        "bench",
        "--nproc",
        "2",
        "--tokens",
        "64",
        "--d-model",
        "16",
        "--d-hidden",
        "32",
        "--experts",
        "2",
        "--skews",
        "0",
        "1.5",
        "--iterations",
        "2",
        "--cost-model",
        str(cost_model),
        "--json",
    ]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["rows"]
    assert result["world_size"] == 2 and len(rows) == 2 * 4
    assert {(r["strategy"], r["schedule"]) for r in rows} == {
        ("ep", "sync"),
        ("shadow", "sync"),
        ("ep", "pairwise"),
        ("shadow", "pairwise"),
    }
    assert all(r["median_s"] > 0 and len(r["times_s"]) == 2 for r in rows)
    assert all("pairwise_bound" in r for r in rows if r["schedule"] == "pairwise")
    skewed = [r for r in rows if r["routing"] == "zipf-1.5"]
    assert skewed[0]["load_imbalance"] > rows[0]["load_imbalance"]
