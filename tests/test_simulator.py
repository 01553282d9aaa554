"""Simulator, traces, roofline and the simulate/roofline CLI (in-process)."""

import json

import numpy as np
import pytest

from moeflow.cli import main
from moeflow.perf import simulator as sim
from moeflow.perf.costmodel import CostModel
from moeflow.perf.roofline import curves, points_from_simulation, throughput
from moeflow.perf.topology import Topology
from moeflow.perf.traces import Trace, load_trace, synthetic_trace


def small_model(inter=1e9, intra=1e10, flops=1e12):
    return CostModel(Topology.from_spec([[0, 1], [2, 3]], [inter, intra]), flops)


def test_synthetic_traces():
    t = synthetic_trace("uniform", 4, 2, 4, 8, tokens_per_rank=100, top_k=2)
    assert t.flow.shape == (4, 2, 4, 8) and np.all(t.flow.sum(-1) == 200)  # k·T per rank
    z = synthetic_trace("zipf", 20, 1, 4, 16, 1000, skew=1.5)
    u = synthetic_trace("uniform", 20, 1, 4, 16, 1000)
    assert z.load_imbalance().mean() > 2 * u.load_imbalance().mean()
    d = synthetic_trace("drift", 40, 1, 4, 8, 1000, hot_experts=1, hot_share=0.6, drift_period=10)
    hot = d.flow.sum(2)[:, 0].argmax(-1)
    assert list(hot[::10]) == [0, 1, 2, 3]  # the hot expert moves every drift_period iterations
    with pytest.raises(ValueError, match="kind='pareto'"):
        synthetic_trace("pareto", 1, 1, 2, 2, 10)
    with pytest.raises(ValueError, match="top_k=3"):
        synthetic_trace("uniform", 1, 1, 2, 2, 10, top_k=3)


def test_trace_files_roundtrip_and_smartmoe_format(tmp_path):
    t = synthetic_trace("zipf", 3, 2, 2, 4, 50, seed=3)
    t.meta.update(d_model=32, d_hidden=64)
    t.save(tmp_path / "r.npz")
    back = load_trace(tmp_path / "r.npz")
    assert np.array_equal(back.flow, t.flow) and back.meta["d_model"] == 32
    counts = np.random.default_rng(0).integers(0, 100, (5, 3, 2, 4, 6)).astype(np.uint16)
    np.savez(tmp_path / "s.npz", counts=counts, iterations=np.arange(5) * 10, meta=json.dumps({"source": "x"}))
    s = load_trace(tmp_path / "s.npz")
    assert np.array_equal(s.flow, counts.sum(axis=3)) and s.meta["top_k"] == 2  # micro-batches summed
    assert list(s.steps_I) == [0, 10, 20, 30, 40]
    np.savez(tmp_path / "bad.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="neither 'flow' nor 'counts'"):
        load_trace(tmp_path / "bad.npz")
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.npz")


def test_sync_ep_by_hand():
    # W=4, E=4 (one expert per rank), d=8, h=16: one (iteration, layer).
    flow = np.array([[10, 0, 0, 30], [0, 10, 0, 0], [0, 0, 10, 0], [0, 0, 0, 10]])
    m = small_model()
    (r,) = sim.simulate(Trace(flow[None, None], [0]), m, sim.ModelConfig(8, 16), ("ep",), ("sync",))
    B = flow.sum(0)  # expert e lives on rank e
    comp = 4 * B.max() * 8 * 16 / 1e12
    # dispatch: 30 tokens of 8 fp32 from 0 to 3 cross the network (960 bytes at 1 GB/s)
    a2a = 30 * 8 * 4 / 1e9
    counts = np.full((4, 4), 8.0)  # the count exchange: E int64 per pair, uniform
    np.fill_diagonal(counts, 0)
    t_counts = float(m.a2a_time(counts))
    assert r.total_I[0] == pytest.approx(3 * comp + 4 * a2a + t_counts)
    assert r.compute_I[0] == pytest.approx(3 * comp) and r.a2a_I[0] == pytest.approx(4 * a2a)
    assert r.exposed_comm_I[0] == pytest.approx(4 * a2a + t_counts) and r.overlapped_comm_I[0] == 0


def test_fast_path_equals_planner_path(monkeypatch):
    trace = synthetic_trace("zipf", 6, 2, 4, 8, 300, seed=1)
    m = small_model()
    model = sim.ModelConfig(32, 64)
    fast = sim.simulate(trace, m, model, ("ep",), ("sync", "pairwise"))
    monkeypatch.setitem(sim.STRATEGIES, "ep_planner", sim.Strategy("ep_planner", "ep", None))
    slow = sim.simulate(trace, m, model, ("ep_planner",), ("sync", "pairwise"))
    for a, b in zip(fast, slow):
        assert np.allclose(a.total_I, b.total_I) and np.allclose(a.a2a_I, b.a2a_I)
        assert b.replicated_IL.max() == 0


def test_pairwise_schedule_respects_the_bound():
    # FasterMoE §4.2: overlap can at best turn comm + comp into max(comm, comp).
    m = CostModel(Topology.homogeneous(8, 2e9), 2e11)
    for d, h in ((64, 128), (256, 1024), (512, 4096)):
        t = synthetic_trace("uniform", 3, 1, 8, 16, 2048, seed=d)
        s, p = sim.simulate(t, m, sim.ModelConfig(d, h), ("ep",), ("sync", "pairwise"))
        bound = sim.speedup_bound(s.a2a_I, s.compute_I)
        speedup = s.total_I / p.total_I
        # (not necessarily > 1: per-step stragglers can make fine-grained steps slower)
        assert np.all(speedup <= bound * (1 + 1e-9))
        assert np.allclose(p.exposed_comm_I + p.overlapped_comm_I, p.a2a_I + p.other_comm_I)
    # comm ≈ comp: fine-grained steps get most of the way to the 2x bound
    t = synthetic_trace("uniform", 2, 1, 8, 16, 4096, seed=0)
    s, p = sim.simulate(t, m, sim.ModelConfig(256, 128), ("ep",), ("sync", "pairwise"))
    bound = float(sim.speedup_bound(s.a2a_I, s.compute_I).mean())
    assert 1.5 < bound <= 2.0 and float((s.total_I / p.total_I).mean()) > 1 + 0.6 * (bound - 1)


def test_validation_errors():
    m = small_model()
    t = synthetic_trace("uniform", 1, 1, 4, 8, 10)
    with pytest.raises(ValueError, match="strategy='magic'"):
        sim.simulate(t, m, sim.ModelConfig(8, 8), ("magic",))
    with pytest.raises(ValueError, match="schedule='async'"):
        sim.simulate(t, m, sim.ModelConfig(8, 8), schedules=("async",))
    with pytest.raises(ValueError, match="world_size=2"):
        sim.simulate(synthetic_trace("uniform", 1, 1, 2, 2, 10), m, sim.ModelConfig(8, 8))
    with pytest.raises(ValueError, match="pairwise_group_size=3"):
        sim.simulate(t, m, sim.ModelConfig(8, 8), pairwise_group_size=3)
    with pytest.raises(ValueError, match="d_model=0"):
        sim.ModelConfig(0, 8)


def test_roofline_formulas():
    r = np.array([0.5, 1.0, 4.0])
    c = curves(10.0, r)
    assert np.allclose(c["ideal"], [5, 10, 10]) and np.allclose(c["semi_ideal"], [10 / 3, 5, 8])
    model = sim.ModelConfig(16, 64)
    assert float(throughput(1000, 2.0, 4, model)) == pytest.approx(12 * 16 * 64 * 1000 / (4 * 2.0))
    m = small_model()
    res = sim.simulate(synthetic_trace("uniform", 2, 1, 4, 4, 500), m, model, ("ep",), ("sync",))
    (pt,) = points_from_simulation(res, model, 4)
    # sync EP lies under the semi-ideal curve (it cannot overlap anything)
    assert pt.throughput_flops_per_s <= curves(m.gemm_flops_per_s, pt.r_cc)["semi_ideal"] * (1 + 1e-9)


def test_cli_simulate_and_roofline(capsys, tmp_path):
    rc = main(
        [
            "simulate",
            "--cluster",
            "prophet_lpwnv",
            "--trace",
            "zipf",
            "--iterations",
            "5",
            "--d-model",
            "64",
            "--json",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 8 and {r["schedule"] for r in out["results"]} == {"sync", "pairwise"}
    assert all(r["total_s"] > 0 for r in out["results"])
    rc = main(
        [
            "roofline",
            "--cluster",
            "prophet_lpwnv",
            "--trace",
            "uniform",
            "--iterations",
            "3",
            "--out",
            str(tmp_path / "rl"),
            "--json",
        ]
    )
    assert rc == 0 and (tmp_path / "rl" / "roofline.png").stat().st_size > 0
    data = json.loads((tmp_path / "rl" / "roofline.json").read_text())
    assert {p["label"] for p in data["points"]} == {
        f"{s}/{sch}" for s in sim.STRATEGIES for sch in ("sync", "pairwise")
    }
    capsys.readouterr()
    assert main(["simulate", "--strategy", "magic", "--iterations", "1"]) == 2
    assert "--strategy='magic'" in capsys.readouterr().err
    assert main(["simulate", "--cluster", "mars"]) == 2
    assert "--cluster='mars'" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(tmp_path / "none.npz")]) == 2
    assert "none.npz" in capsys.readouterr().err
    assert (
        main(
            [
                "roofline",
                "--iterations",
                "1",
                "--measured",
                str(tmp_path / "m.json"),
                "--out",
                str(tmp_path / "r2"),
            ]
        )
        == 2
    )
    assert "m.json" in capsys.readouterr().err
