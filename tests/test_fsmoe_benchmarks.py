"""benchmarks/fsmoe_simulated.py on its tiny grid: the JSON's structure and the invariants that can
fail (the optimiser never priced above a fixed degree; in the middle generalized layer, FSMoE's
gradient partition never above Tutel-Improved's dense overlap, nor that above the all-reduce after
the backward, and every gradient element placed once; cases named and counted)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    sim = _load("fsmoe_simulated")
    out = tmp_path_factory.mktemp("fsmoe") / "sim.json"
    assert sim.main(["--tiny", "--out", str(out)]) == 0
    return sim, json.loads(out.read_text())


def test_structure_and_case_names(simulated):
    sim, result = simulated
    assert result["fixed_degrees"] == [1, 2, 4, 8]
    assert set(result["presets"]) == {"fsmoe_a", "fsmoe_b"}
    for preset, p in result["presets"].items():
        assert p["esp"] == sim.ESP[preset]
        names = [r["case"] for r in p["rows"]]
        assert len(names) == len(set(names)) == p["summary"]["cases"] == 2
        assert all(n.startswith("B1-") and n.endswith("-simple") for n in names)
        s = p["summary"]
        assert s["published_speedup_over_tutel"] == sim.PUBLISHED[preset]
        assert sum(s["optimiser_cases"].values()) == 2
        assert sum(s["optimiser_degrees"].values()) == 2
        assert set(s["speedup_over_fixed"]) == {"1", "2", "4", "8"}


def test_optimiser_never_priced_above_a_fixed_degree(simulated):
    _, result = simulated
    for p in result["presets"].values():
        for r in p["rows"]:
            opt = r["optimiser"]
            assert opt["forward_degree"] in (1, 2, 4, 8) and opt["backward_degree"] in (1, 2, 4, 8)
            assert opt["forward_case"] in (1, 2, 3, 4) and opt["backward_case"] in (1, 2, 3, 4)
            for d, t in r["fixed_ms"].items():
                assert opt["ms"] <= t * (1 + 1e-9), (r["case"], d)
            assert r["best_fixed_ms"] == min(r["fixed_ms"].values())
            assert r["fixed_ms"][str(r["best_fixed_degree"])] == r["best_fixed_ms"]
        s = p["summary"]
        assert s["speedup_over_best_fixed"]["mean"] >= 1 - 1e-9
        for d in s["speedup_over_fixed"].values():
            assert d["min"] >= 1 - 1e-9 and d["min"] <= d["geomean"] <= d["max"]


def test_middle_layer_with_its_gradient(simulated):
    _, result = simulated
    for p in result["presets"].values():
        for r in p["rows"]:
            g, opt = r["gradient"], r["gradient"]["optimiser"]
            assert g["all_reduce_ms"] > 0 and g["dense_ms"] > 0  # S > 1: the attention's MP collectives
            for d in ("1", "2", "4", "8"):
                assert g["tutel_ms"][d] == pytest.approx(r["fixed_ms"][d] + 2 * g["dense_ms"] + g["all_reduce_ms"])
                assert g["tutel_improved_ms"][d] < g["tutel_ms"][d], (r["case"], d)
            assert g["best_tutel_ms"] == min(g["tutel_ms"].values())
            assert g["best_tutel_improved_ms"] == min(g["tutel_improved_ms"].values())
            assert opt["ms"] <= g["best_tutel_improved_ms"] * (1 + 1e-9), r["case"]
            # the same step 1 fills the dense part on both sides; every element placed once
            assert opt["dense_elements"] == g["tutel_improved_dense_elements"] > 0
            assert opt["dense_elements"] + opt["moe_elements"] + opt["exposed_elements"] == g["grad_elements"]
            assert opt["moe_elements"] > 0 and opt["t_gar_ms"] > 0
            assert opt["backward_degree"] in (1, 2, 4, 8) and opt["backward_case"] in (1, 2, 3, 4)
        w = p["summary"]["with_gradient"]
        assert w["speedup_over_best_tutel_improved"]["min"] >= 1 - 1e-9
        assert w["speedup_over_best_tutel"]["min"] >= w["speedup_over_best_tutel_improved"]["min"]
        assert w["tutel_improved_over_tutel"]["min"] > 1
        assert 0 < w["hidden_share"]["min"] <= w["hidden_share"]["mean"] <= w["hidden_share"]["max"] <= 1
        assert w["moe_hides_cases"] == 2


def test_testbed_r2():
    tb = _load("fsmoe_testbed")
    assert tb.r2([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == pytest.approx(1.0)
    assert tb.r2([2.0, 2.0, 2.0], [1.0, 2.0, 3.0]) == pytest.approx(0.0)
    assert tb.r2([1.0], [1.0]) is None


def test_simulate_degree_sweep(capsys):
    from moeflow import cli

    argv = ["simulate", "--cluster", "fsmoe_b", "--trace", "zipf", "--iterations", "3", "--layers", "2"]
    argv += ["--strategy", "ep", "--schedule", "sync", "--degrees", "1,2,4,8,auto", "--json"]
    assert cli.main(argv) == 0
    rows = {r["schedule"]: r["total_s"] for r in json.loads(capsys.readouterr().out)["results"]}
    assert list(rows) == ["sync", "pipe/r=1", "pipe/r=2", "pipe/r=4", "pipe/r=8", "pipe/auto"]
    assert rows["pipe/r=1"] == pytest.approx(rows["sync"])  # degree 1 is sync's price
    assert all(rows["pipe/auto"] <= t * (1 + 1e-9) for k, t in rows.items() if k.startswith("pipe/r="))
    with pytest.raises(SystemExit, match="--degrees: '0'"):
        cli.main([*argv[:-3], "--degrees", "0"])
