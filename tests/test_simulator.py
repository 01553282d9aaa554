"""Simulator, traces, roofline and the simulate/roofline CLI (in-process)."""

import json

import numpy as np
import pytest

from moeflow.cli import main
from moeflow.core.expert_shape import ExpertShape
from moeflow.core.registry import Component
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.routing.hierarchical import cross_node_ratios
from moeflow.sim import simulator as sim
from moeflow.sim.roofline import curves, points_from_simulation, throughput
from moeflow.sim.traces import Trace, load_trace, synthetic_trace
from moeflow.strategies import PLANNERS, SCHEDULES
from moeflow.strategies.planners.ep import plan_ep


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


def _layer(d: int, h: int, **kw) -> sim.SimulatedLayer:
    return sim.SimulatedLayer(ExpertShape(d, h), **kw)


def test_sync_ep_by_hand():
    # W=4, E=4 (one expert per rank), d=8, h=16: one (iteration, layer).
    flow = np.array([[10, 0, 0, 30], [0, 10, 0, 0], [0, 0, 10, 0], [0, 0, 0, 10]])
    m = small_model()
    (r,) = sim.simulate(Trace(flow[None, None], [0]), m, _layer(8, 16), ("ep",), ("sync",))
    B = flow.sum(0)  # expert e lives on rank e
    comp = 4 * B.max() * 8 * 16 / 1e12
    # dispatch: 30 tokens of 8 fp32 from 0 to 3 cross the network (960 bytes at 1 GB/s)
    a2a = 30 * 8 * 4 / 1e9
    # The count exchange is the runtime's all-gather of E int64 counts from every rank: on the ring
    # each rank forwards (W−1)/W of the W·E·8-byte buffer, here across the 1 GB/s link.
    t_counts = m.count_exchange_time(4)
    assert t_counts == pytest.approx(m.collective_time("all_gather", 4 * 4 * 8)) and t_counts >= 3 / 4 * 128 / 1e9
    assert r.total_I[0] == pytest.approx(3 * comp + 4 * a2a + t_counts)
    assert r.compute_I[0] == pytest.approx(3 * comp) and r.a2a_I[0] == pytest.approx(4 * a2a)
    assert r.exposed_comm_I[0] == pytest.approx(4 * a2a + t_counts) and r.overlapped_comm_I[0] == 0


def test_fast_path_equals_planner_path(monkeypatch):
    trace = synthetic_trace("zipf", 6, 2, 4, 8, 300, seed=1)
    m = small_model()
    layer = _layer(32, 64)
    fast = sim.simulate(trace, m, layer, ("ep",), ("sync", "pairwise"))
    # The same owners-only planner, but not `plan_ep` itself: the per-(iteration, layer) path.
    monkeypatch.setitem(
        PLANNERS._components,
        "ep_planner",
        Component("ep_planner", lambda ctx, o: lambda f, p, c=None: plan_ep(f, p, c)),
    )
    slow = sim.simulate(trace, m, layer, ("ep_planner",), ("sync", "pairwise"))
    for a, b in zip(fast, slow):
        assert np.allclose(a.total_I, b.total_I) and np.allclose(a.a2a_I, b.a2a_I)
        assert b.replicated_IL.max() == 0


def test_pairwise_schedule_respects_the_bound():
    # FasterMoE §4.2: overlap can at best turn comm + comp into max(comm, comp).
    m = CostModel(Topology.homogeneous(8, 2e9), 2e11)
    for d, h in ((64, 128), (256, 1024), (512, 4096)):
        t = synthetic_trace("uniform", 3, 1, 8, 16, 2048, seed=d)
        s, p = sim.simulate(t, m, _layer(d, h), ("ep",), ("sync", "pairwise"))
        bound = sim.speedup_bound(s.a2a_I, s.compute_I)
        speedup = s.total_I / p.total_I
        assert np.all(speedup <= bound * (1 + 1e-9))
        assert np.allclose(p.exposed_comm_I + p.overlapped_comm_I, p.a2a_I + p.other_comm_I)
    # comm ≈ comp: fine-grained steps get most of the way to the 2x bound
    t = synthetic_trace("uniform", 2, 1, 8, 16, 4096, seed=0)
    s, p = sim.simulate(t, m, _layer(256, 128), ("ep",), ("sync", "pairwise"))
    bound = float(sim.speedup_bound(s.a2a_I, s.compute_I).mean())
    assert 1.5 < bound <= 2.0 and float((s.total_I / p.total_I).mean()) > 1 + 0.6 * (bound - 1)


def test_pairwise_prediction_ranks_compute_independently_and_uses_the_node_as_group():
    """FasterMoE's workers compute their steps independently: under a balanced load the pairwise
    schedule is never predicted slower than sync (a lockstep sum of per-step maxima would be), and
    the default group is the node, as the runtime's (`default_group_size`)."""
    m = CostModel(Topology.from_spec([[0, 1], [2, 3]], [1e9, 1e10]), 1e11)
    for d, h in ((64, 64), (128, 512), (256, 2048)):
        t = synthetic_trace("uniform", 3, 2, 4, 8, 4096, seed=d)
        s, p = sim.simulate(t, m, _layer(d, h), ("ep",), ("sync", "pairwise"))
        assert np.all(p.total_I <= s.total_I * (1 + 1e-9)), (d, h)
    t = synthetic_trace("zipf", 3, 1, 4, 8, 2048, seed=1)
    (default,) = sim.simulate(t, m, _layer(64, 256), ("ep",), ("pairwise",))
    (node,) = sim.simulate(t, m, _layer(64, 256, options={"schedule": {"group_size": 2}}), ("ep",), ("pairwise",))
    (single,) = sim.simulate(t, m, _layer(64, 256, options={"schedule": {"group_size": 1}}), ("ep",), ("pairwise",))
    assert np.allclose(default.total_I, node.total_I) and not np.allclose(default.total_I, single.total_I)


def test_validation_errors_and_traces_of_another_size_are_rescaled():
    m = small_model()
    t = synthetic_trace("uniform", 1, 1, 4, 8, 10)
    with pytest.raises(ValueError, match="strategy='magic'"):
        sim.simulate(t, m, _layer(8, 8), ("magic",))
    with pytest.raises(ValueError, match="schedule='async'"):
        sim.simulate(t, m, _layer(8, 8), schedules=("async",))
    with pytest.raises(ValueError, match="group_size=3 must divide"):
        sim.simulate(t, m, _layer(8, 8, options={"schedule": {"group_size": 3}}), schedules=("pairwise",))
    with pytest.raises(ValueError, match="d_model=0"):
        ExpertShape(0, 8)
    with pytest.raises(ValueError, match="options: unknown axis 'planner'"):
        _layer(8, 8, options={"planner": {}})
    with pytest.raises(ValueError, match="balance='nope'"):
        _layer(8, 8, balance="nope")
    # A 2-rank trace on the 4-device cluster: unfolded, every rank's row split in two.
    two = synthetic_trace("uniform", 2, 1, 2, 8, 100)
    (r,) = sim.simulate(two, m, _layer(8, 8))
    (direct,) = sim.simulate(two.rescale(4), m, _layer(8, 8))
    assert np.allclose(r.total_I, direct.total_I)


def test_trace_rescale_folds_and_unfolds_ranks_and_experts():
    t = synthetic_trace("zipf", 3, 2, 4, 8, 100, seed=2)
    folded = t.rescale(2, 4)
    assert folded.flow.shape == (3, 2, 2, 4) and folded.meta["tokens_per_rank"] == 200
    assert np.array_equal(folded.flow, t.flow.reshape(3, 2, 2, 2, 4, 2).sum((3, 5)))  # contiguous blocks summed
    assert folded.meta["rescaled_from"] == [4, 8]
    unfolded = t.rescale(8)
    assert unfolded.flow.shape == (3, 2, 8, 8) and unfolded.meta["tokens_per_rank"] == 50
    assert np.array_equal(unfolded.flow.reshape(3, 2, 4, 2, 8).sum(3), t.flow)  # nothing lost
    assert np.abs(unfolded.flow[:, :, 0::2] - unfolded.flow[:, :, 1::2]).max() <= 1  # split evenly
    more = t.rescale(4, 16)
    assert np.array_equal(more.flow.reshape(3, 2, 4, 8, 2).sum(-1), t.flow)
    with pytest.raises(ValueError, match="world_size=3"):
        t.rescale(3)


def test_routing_effects_come_from_the_gate_and_balance_registries():
    """`--balance ta_moe` / `--gate hierarchical` change the replayed flow; other names leave it."""
    m = CostModel(Topology.from_spec([[0, 1], [2, 3]], [1e8, 1e10]), 1e11)
    t = synthetic_trace("uniform", 2, 1, 4, 8, 1000, seed=3)
    node = np.array(m.topology.node_of)
    owner = np.arange(8) // 2

    def crossing(flow):
        return flow[..., node[:, None] != node[owner][None, :]].sum() / flow.sum()

    plain = sim.routed_flow(t, m, _layer(32, 64))
    assert np.array_equal(plain, t.flow)
    ta = sim.routed_flow(t, m, _layer(32, 64, balance="ta_moe"))
    hier = sim.routed_flow(t, m, _layer(32, 64, gate="hierarchical"))
    for flow in (ta, hier):
        assert np.array_equal(flow.sum(-1), t.flow.sum(-1))  # every rank still routes all its choices
        assert crossing(flow) < 0.5 * crossing(t.flow)
    ratio = cross_node_ratios(m.topology)[0]  # 1e8 / (2 · 1e10)
    assert crossing(hier) <= ratio + 1e-9
    (ep_ta,) = sim.simulate(t, m, _layer(32, 64, balance="ta_moe"), ("ep",), ("sync",))
    (ep,) = sim.simulate(t, m, _layer(32, 64), ("ep",), ("sync",))
    assert ep_ta.a2a_I.mean() < ep.a2a_I.mean()


def test_expert_choice_and_soft_replay_a_uniform_flow_and_switch_needs_a_top1_trace():
    m = CostModel(Topology.from_spec([[0, 1], [2, 3]], [1e8, 1e10]), 1e11)
    t = synthetic_trace("zipf", 2, 1, 4, 8, 1000, seed=3, skew=1.2)  # S = 1000 tokens per rank, k = 2
    ec = sim.routed_flow(t, m, _layer(32, 64, gate="expert_choice"))
    assert (ec == 250).all()  # C = ceil(1 · 2 · 1000 / 8)
    soft = sim.routed_flow(t, m, _layer(32, 64, gate="soft", options={"gate": {"slots_per_expert": 3}}))
    assert (soft == 3).all()
    with pytest.raises(ValueError, match="switch.*top_k=2"):
        sim.routed_flow(t, m, _layer(32, 64, gate="switch"))


def test_roofline_formulas():
    r = np.array([0.5, 1.0, 4.0])
    c = curves(10.0, r)
    assert np.allclose(c["ideal"], [5, 10, 10]) and np.allclose(c["semi_ideal"], [10 / 3, 5, 8])
    shape = ExpertShape(16, 64)
    assert float(throughput(1000, 2.0, 4, shape)) == pytest.approx(12 * 16 * 64 * 1000 / (4 * 2.0))
    m = small_model()
    res = sim.simulate(synthetic_trace("uniform", 2, 1, 4, 4, 500), m, sim.SimulatedLayer(shape), ("ep",), ("sync",))
    (pt,) = points_from_simulation(res, shape, 4)
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
    # Every registered schedule runs with the plain all-to-all dispatcher, so all are simulated by default.
    assert out["world_size"] == 8 and {r["schedule"] for r in out["results"]} == set(SCHEDULES.names())
    assert all(r["total_s"] > 0 for r in out["results"])
    # The default schedules are those that run with the dispatcher: pairwise needs the plain a2a.
    argv = ["simulate", "--cluster", "prophet_lpwnv", "--trace", "zipf", "--iterations", "3", "--json"]
    assert main([*argv, "--dispatch", "hierarchical", "--strategy", "ep"]) == 0
    hier = json.loads(capsys.readouterr().out)["results"]
    # auto arbitrates among the schedules that run with the dispatcher (here: sync alone).
    assert [r["schedule"] for r in hier] == ["sync", "auto"]
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
    assert {p["label"] for p in data["points"]} == {f"{s}/{sch}" for s in PLANNERS.names() for sch in SCHEDULES.names()}
    capsys.readouterr()
    # The real trace that ships with the package, folded from 16 ranks onto 8 devices.
    argv = ["simulate", "--cluster", "prophet_lpwnv", "--trace", "smartmoe", "--strategy", "ep", "--schedule", "sync"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["world_size"], out["num_experts"], out["layers"]) == (8, 32, 4) and out["expert"] == "ffn"
    assert main(["simulate", "--strategy", "magic", "--iterations", "1"]) == 2
    assert "--strategy='magic'" in capsys.readouterr().err
    assert main(["simulate", "--strategy", "ta_moe", "--iterations", "1"]) == 2
    assert "is a balance term, not a strategy: use --balance ta_moe" in capsys.readouterr().err
    assert main(["simulate", "--option", "schedule.group_size", "--iterations", "1"]) == 2
    assert "expected AXIS.KEY=VALUE" in capsys.readouterr().err
    assert main(["simulate", "--cluster", "mars"]) == 2
    assert "--cluster='mars'" in capsys.readouterr().err
    assert main(["simulate", "--nonmoe-ms", "-1", "--iterations", "1"]) == 2
    assert "--nonmoe-ms=-1.0" in capsys.readouterr().err
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


def test_share_of_the_force_balanced_ceiling_sweep_and_progress(capsys, tmp_path):
    """Every row carries plain EP's time and the ceiling's (EP with the same tokens routed evenly,
    same schedule); a sweep prices one trace on several clusters into one JSON and one plot."""
    trace = synthetic_trace("zipf", 3, 2, 4, 8, 400, skew=1.4, seed=2)
    even = trace.balanced()
    assert np.array_equal(even.flow.sum(-1), trace.flow.sum(-1)) and np.ptp(even.flow, axis=-1).max() <= 1
    results = sim.simulate(trace, small_model(inter=1e8), _layer(64, 256), ("ep", "shadow"), ("sync", "pairwise"))
    (ceiling,) = sim.simulate(even, small_model(inter=1e8), _layer(64, 256), ("ep",), ("sync",), ceiling=False)
    for r in results:
        ep = next(x for x in results if (x.strategy, x.schedule) == ("ep", r.schedule))
        assert r.ep_total_s == pytest.approx(ep.total_I.mean())
        gap = r.ep_total_s - r.ceiling_total_s
        assert r.share_of_ceiling == pytest.approx((r.ep_total_s - r.total_I.mean()) / gap)
        assert r.summary()["speedup_over_ep"] == pytest.approx(r.ep_total_s / r.total_I.mean())
    assert results[0].ceiling_total_s == pytest.approx(ceiling.total_I.mean()) and results[0].share_of_ceiling == 0
    argv = ["simulate", "--trace", "smartmoe", "--trace-iterations", "0:2", "--strategy", "ep,shadow"]
    assert main([*argv, "--schedule", "sync", "--progress", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["iterations"] == 2 and "share_of_ceiling" in out["results"][1] and "simulate johnny" in captured.err
    path = tmp_path / "sweep.json"
    assert main([*argv, "--sweep", "prophet_lpwnv,johnny@32,fsmoe_b", "--out", str(path)]) == 0
    sweep = json.loads(path.read_text())
    sizes = {c: (v["world_size"], v["num_experts"]) for c, v in sweep["clusters"].items()}
    assert sizes == {"prophet_lpwnv": (8, 32), "johnny@32": (32, 32), "fsmoe_b": (32, 32)}
    assert all(r["speedup_over_ep"] > 0 for v in sweep["clusters"].values() for r in v["results"])
    assert path.with_suffix(".png").stat().st_size > 0
    assert main([*argv, "--trace-iterations", "5"]) == 2
    assert "--trace-iterations='5': expected START:STOP" in capsys.readouterr().err
    assert main([*argv, "--sweep", "johnny@12"]) == 2
    assert "--sweep='johnny@12'" in capsys.readouterr().err


def test_cli_simulate_copy_chunks_prices_the_trees_pipelined(capsys):
    """`--copy-chunks N` prices the copy trees in Hecate §4.1's chunk pipeline: on hecate_b (nodes of
    8: relays forward inside them) EPLB's copies cost less in 4 pieces than whole, for the same
    replicas; a bad value is a one-line error."""
    argv = ["simulate", "--cluster", "hecate_b", "--trace", "zipf", "--skew", "1.2", "--iterations", "3"]
    argv += ["--experts", "32", "--strategy", "eplb", "--schedule", "sync", "--json"]
    rows = {}
    for chunks in (1, 4):
        assert main([*argv, "--copy-chunks", str(chunks)]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["copy_chunks"] == chunks
        (rows[chunks],) = out["results"]
    assert rows[4]["replicated_experts_per_layer"] == rows[1]["replicated_experts_per_layer"] > 0
    assert rows[4]["other_comm_s"] < rows[1]["other_comm_s"]
    assert rows[4]["compute_s"] == rows[1]["compute_s"] and rows[4]["a2a_s"] == rows[1]["a2a_s"]
    assert main([*argv, "--copy-chunks", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "moeflow simulate: error: --copy-chunks must be an integer >= 1, got 0"
