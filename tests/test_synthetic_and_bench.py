"""Synthetic routing for benchmarks, and the benchmark's speedup / bound arithmetic."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from moeflow.bench.interleave import balanced_order, williams_rows
from moeflow.bench.strategies import StrategyBenchConfig, Variant, _add_speedups
from moeflow.commands.bench import _print_strategy_rows
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
            "dispatch": "a2a",
            "median_s": 1.0,
            "forward_a2a_s": 0.2,
            "forward_compute_s": 0.1,
        },
        {"routing": "z", "strategy": "shadow", "schedule": "sync", "dispatch": "a2a", "median_s": 0.5},
        {"routing": "z", "strategy": "ep", "schedule": "pairwise", "dispatch": "a2a", "median_s": 0.8},
    ]
    _add_speedups(rows)
    assert rows[1]["speedup_vs_ep"] == pytest.approx(2.0)
    # comm = 2 x 0.2, comp = 3 x 0.1: bound (0.4 + 0.3) / 0.4 = 1.75; achieved 1 / 0.8 = 1.25.
    assert rows[2]["pairwise_bound"] == pytest.approx(1.75)
    assert rows[2]["share_of_bound"] == pytest.approx(1.25 / 1.75)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_balanced_order_gives_every_variant_every_position_and_every_predecessor(n):
    items = [f"v{i}" for i in range(n)]
    rows = williams_rows(n)
    assert len(rows) == (n if n % 2 == 0 else 2 * n)
    rounds = [balanced_order(items, r) for r in range(len(rows))]
    assert balanced_order(items, len(rows)) == rounds[0]  # the cycle repeats
    for position in range(n):
        counts = Counter(rnd[position] for rnd in rounds)
        assert set(counts.values()) == {len(rows) // n} and len(counts) == n
    pairs = Counter((a, b) for rnd in rounds for a, b in zip(rnd, rnd[1:]))
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) <= 1  # each ordered pair alike
    assert balanced_order([], 5) == []


def test_bench_variants_parse_and_name_the_bad_one():
    assert Variant.parse("shadow:pairwise") == ("shadow", "pairwise", "a2a", None, False, ())
    fssdp = Variant.parse("fssdp/rematerialize=true/window=3:sync+prefetch")
    assert fssdp.options == (("rematerialize", "true"), ("window", "3")) and fssdp.prefetch
    assert str(fssdp) == "fssdp/rematerialize=true/window=3:sync+prefetch"
    with pytest.raises(ValueError, match="key=value"):
        Variant.parse("fssdp/rematerialize:sync")
    assert Variant.parse("prophet:sync+prefetch").prefetch and not Variant.parse("prophet:sync").prefetch
    assert str(Variant.parse("prophet:sync+prefetch:a2a:bfloat16")) == "prophet:sync+prefetch:a2a:bfloat16"
    with pytest.raises(ValueError, match=r"\+prefetch"):
        Variant.parse("prophet:sync+overlap")
    with pytest.raises(ValueError, match="--blocks >= 2"):
        StrategyBenchConfig(variants=(Variant.parse("prophet:sync+prefetch"),))
    with pytest.raises(ValueError, match="trace_replay"):
        StrategyBenchConfig(trace_replay=True)
    with pytest.raises(ValueError, match="warmup=-1"):
        StrategyBenchConfig(warmup=-1)
    with pytest.raises(ValueError, match="ep_size=0 must be positive"):
        StrategyBenchConfig(ep_size=0)
    assert str(Variant.parse("ep:sync:hierarchical")) == "ep:sync:hierarchical"
    assert Variant.parse("ep:sync:a2a:bfloat16").wire_dtype == "bfloat16"
    assert str(Variant.parse("ep:sync:a2a:bfloat16")) == "ep:sync:a2a:bfloat16"
    with pytest.raises(ValueError, match="--variants 'ep'"):
        Variant.parse("ep")


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
        "--variants",
        *("ep:sync", "shadow:sync", "ep:pairwise", "shadow:pairwise", "ep:sync:hierarchical", "ep:sync:a2a:bfloat16"),
        "--json",
    ]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["rows"]
    assert result["world_size"] == 2 and len(rows) == 2 * 6
    assert {(r["strategy"], r["schedule"], r["dispatch"], r["wire_dtype"]) for r in rows} == {
        ("ep", "sync", "a2a", None),
        ("shadow", "sync", "a2a", None),
        ("ep", "pairwise", "a2a", None),
        ("shadow", "pairwise", "a2a", None),
        ("ep", "sync", "hierarchical", None),
        ("ep", "sync", "a2a", "bfloat16"),
    }
    # Same rows each way: the hierarchical exchange counts them once, a bf16 wire in half the bytes.
    for routing in ("zipf-0", "zipf-1.5"):
        a2a, hier, bf16 = (
            r["dispatch_bytes_on_network"]
            for r in rows
            if r["routing"] == routing and (r["strategy"], r["schedule"]) == ("ep", "sync")
        )
        assert a2a == hier == 2 * bf16 > 0
    assert all(r["median_s"] > 0 and len(r["times_s"]) == 2 for r in rows)
    # The cost model's speedup of what ran over the owners alone sits next to the measurement (shadowing
    # takes copies only when they are predicted faster; EP is the owners alone).
    assert all(r["planner_predicted_speedup"] == pytest.approx(1.0) for r in rows if r["strategy"] == "ep")
    assert all(r["planner_predicted_speedup"] >= 1.0 for r in rows if r["strategy"] == "shadow")
    _print_strategy_rows(rows)
    printed = capsys.readouterr().out
    assert "ep:sync:hierarchical" not in printed and "hierarchical" in printed and "bfloat16" in printed
    assert all("pairwise_bound" in r for r in rows if r["schedule"] == "pairwise")
    skewed = [r for r in rows if r["routing"] == "zipf-1.5"]
    assert skewed[0]["load_imbalance"] > rows[0]["load_imbalance"]


@pytest.mark.multirank
def test_suite_blocks_prefetch_trace_replay_drift_and_ceiling_on_two_ranks(tmp_path, capsys):
    """`--suite`: every strategy and schedule on Zipf, the trace replayed step by step and a drifting
    load, two blocks with the prefetch, the force-balanced ceiling beside each (explicit flags kept)."""
    import json

    from moeflow import cli
    from moeflow.commands.bench import SUITE
    from moeflow.perf.costmodel import CostModel
    from moeflow.perf.topology import Topology

    cost_model = tmp_path / "cm.json"
    CostModel(Topology.homogeneous(2, 1e10), gemm_flops_per_s=1e8).save(cost_model)
    argv = ["bench", "--nproc", "2", "--tokens", "64", "--d-model", "16", "--d-hidden", "32", "--experts", "2"]
    argv += ["--suite", "--skews", "2", "--iterations", "3", "--cost-model", str(cost_model), "--json"]
    assert cli.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    per_case = len(SUITE["variants"]) + 1  # and the ceiling
    assert [r["routing"] for r in rows[::per_case]] == ["zipf-2", "trace-replay@245", "drift-4"]
    assert len(rows) == 3 * per_case
    for r in rows:
        assert r["median_s"] > 0 and r["load_std_mean"] >= 0 and len(r["times_s"]) == 3
        if r["strategy"] == "prophet":
            assert r["copies_mean"] > 0 and r["prefetch"], r  # fast network, slow GEMMs
            assert all(0.0 <= h <= 1.0 for h in r["prefetch_hidden_share"])
    assert [bool(r.get("ceiling")) for r in rows] == ([False] * (per_case - 1) + [True]) * 3
    ceilings = [r for r in rows if r.get("ceiling")]
    # Perfectly even routing: every rank computes the same rows.
    assert all(r["strategy"] == "ep" and r["load_std_mean"] == 0 and r["copies_mean"] == 0 for r in ceilings)
    # None where even routing measured no faster than EP (64 tokens: within the noise)
    assert all("share_of_ceiling" in r for r in rows if not r.get("ceiling"))
    shares = [r["share_of_ceiling"] for r in rows if r.get("share_of_ceiling") is not None]
    assert all(abs(x) < float("inf") for x in shares)
    auto = [r for r in rows if (r["strategy"], r["schedule"]) == ("auto", "auto")]
    assert all(sum(r["chosen_schedule"].values()) == 2 * 3 for r in auto)  # two layers, three iterations
    assert all(set(r["chosen_schedule"]) <= {"sync", "pairwise", "pipeline"} for r in auto)
