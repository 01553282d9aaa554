"""Profiler (one spawned 2-rank gloo run via `moeflow profile --nproc 2`) and the netns testbed."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # scripts/testbed.py

from moeflow.cli import main
from moeflow.perf.costmodel import CostModel
from moeflow.profiling.profiler import ProfileConfig


@pytest.mark.multirank
def test_profile_two_gloo_ranks(tmp_path, capsys):
    out = tmp_path / "profile.json"
    rc = main(
        [
            "profile",
            "--nproc",
            "2",
            "--out",
            str(out),
            "--sizes",
            "4096,16384,65536",
            "--gemm-sizes",
            "16,32,64",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--chunk-layer",
            "64,16,32",
            "--json",
        ]
    )
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    data = json.loads(out.read_text())
    assert printed["fits"] == data["fits"]
    assert data["world_size"] == 2 and data["backend"] == "gloo" and data["nodes"] == [[0, 1]]
    # every kind measurable on one node was measured and fitted; no inter-node pair exists
    expected = {
        "gemm",
        "elementwise",
        "a2a",
        "all_gather",
        "reduce_scatter",
        "all_reduce",
        "broadcast",
        "reduce",
        "p2p_intra",
        "chunk_forward",
        "chunk_backward",
    }
    assert set(data["fits"]) == expected
    assert data["measurements"]["chunk_forward"]["sizes"] == [1, 2, 4, 8]  # the pipeline degrees
    assert data["fits"]["chunk_forward"]["unit"] == data["fits"]["chunk_backward"]["unit"] == "chunk"
    assert len(data["pipeline_overlap"]) == 2 and all(0.0 <= eta <= 1.0 for eta in data["pipeline_overlap"])
    assert data["chunk_exchange_s"] > 0
    for kind, fit in data["fits"].items():
        m = data["measurements"][kind]
        assert len(m["sizes"]) == len(m["median_s"]) >= 3
        assert all(t > 0 or (kind == "chunk_backward" and t == 0) for t in m["median_s"])  # a difference
        assert fit["alpha_s"] >= 0 and fit["beta_s_per_unit"] >= 0 and fit["r2"] <= 1.0
        assert np.isfinite(m["noise_cv"])
    model = CostModel.load(out)  # a profile is a complete cost model
    assert model.pipeline_overlap == tuple(data["pipeline_overlap"])
    assert model.topology.num_devices == 2 and model.topology.node_of == [0, 0]
    assert float(model.a2a_time(np.full((2, 2), 32768.0))) == pytest.approx(
        data["fits"]["a2a"]["alpha_s"] + data["fits"]["a2a"]["beta_s_per_unit"] * 65536
    )


def test_profile_argument_errors(capsys):
    assert main(["profile", "--nproc", "2", "--ops", "a2a,allreduce"]) == 2
    assert "allreduce" in capsys.readouterr().err
    assert main(["profile", "--nproc", "2", "--sizes", "4k"]) == 2
    assert "--sizes='4k'" in capsys.readouterr().err
    assert main(["profile", "--repeats", "1", "--nproc", "2"]) == 2
    assert "repeats=1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="gemm_sizes"):
        ProfileConfig(gemm_sizes=(8,))
    assert main(["profile", "--nproc", "2", "--chunk-layer", "64,16"]) == 2
    assert "chunk_layer=[64, 16]" in capsys.readouterr().err
    assert main(["profile", "--nproc", "2", "--chunk-esp-size", "3"]) == 2
    assert "chunk_esp_size=3" in capsys.readouterr().err
    with pytest.raises(ValueError, match="chunk_degrees"):
        ProfileConfig(chunk_degrees=(2, 2))


def test_chunk_fit_and_layout():
    """`profiling.chunk_profile`: t(r) = a + b/r + c·r recovered exactly (c = cost of one more chunk),
    the realised overlap η from it; an ESP group must lie inside one node."""
    from moeflow.profiling.chunk_profile import check_chunk_layout, chunk_fit, overlap_share

    r = np.array([1, 2, 4, 8])
    fit = chunk_fit(r, 0.010 + 0.006 / r + 0.002 * r)
    assert fit.unit == "chunk" and fit.alpha_s == pytest.approx(0.010) and fit.beta_s_per_unit == pytest.approx(0.002)
    assert fit.r2 == pytest.approx(1.0)
    # the overlap alone (time falling with r) is no chunk cost: c stays >= 0
    assert chunk_fit(r, 0.01 + 0.006 / r).beta_s_per_unit == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="3 distinct degrees"):
        chunk_fit([1, 2], [0.1, 0.2])
    # η = b / H: exchange 0.010 s, the rest of the block 0.030 s, 40% of the exchange hidden
    exchange, rest, eta, c = 0.010, 0.030, 0.4, 0.002
    t = exchange + rest - eta * exchange * (1 - 1 / r) + c * (r - 1)
    assert overlap_share(r, t, exchange) == pytest.approx(eta)
    assert overlap_share(r, exchange + rest + c * (r - 1), exchange) == pytest.approx(0.0, abs=1e-6)  # none hidden
    assert overlap_share(r, t, 0.05) == 0.0  # the exchange is the whole block: nothing to hide it behind
    assert check_chunk_layout(4, [0, 0, 1, 1], 2) == 2 and check_chunk_layout(4, [0, 0, 1, 1], 1) == 4
    with pytest.raises(ValueError, match="chunk_esp_size=2: ranks 0..1 span nodes"):
        check_chunk_layout(4, [0, 1, 0, 1], 2)


needs_netns = pytest.mark.skipif(
    not (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")),
    reason="the testbed needs root and iproute2",
)


def _namespaces():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@needs_netns
def test_testbed_env_isolation_and_teardown(tmp_path):
    from testbed import Testbed, TestbedConfig

    script = (
        "import os, json, socket, sys; "
        "d = {k: os.environ[k] for k in ('RANK','WORLD_SIZE','LOCAL_RANK','LOCAL_WORLD_SIZE','GROUP_RANK',"
        "'MASTER_ADDR','MASTER_PORT','GLOO_SOCKET_IFNAME','MOEFLOW_CPU_THREADS')}; "
        "d['netns'] = os.readlink('/proc/self/ns/net'); "
        f"open('{tmp_path}/r' + d['RANK'] + '.json', 'w').write(json.dumps(d))"
    )
    cfg = TestbedConfig(nodes=2, ranks_per_node=2, bandwidth_mbit=100.0, master_port=29533)
    with Testbed(cfg) as tb:
        prefix = tb.prefix
        assert prefix in _namespaces()
        assert tb.run([sys.executable, "-c", script]) == 0
        # the node link answers: node 1 reaches node 0's address through the bridge
        ping = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                tb.node_ns[1],
                sys.executable,
                "-c",
                "import socket; s = socket.socket(); s.settimeout(2); r = s.connect_ex(('10.77.0.1', 9)); print(r)",
            ],
            capture_output=True,
            text=True,
        )
        assert ping.returncode == 0  # refused (nothing listens) or reached, but routed
        qdisc = subprocess.run(
            ["ip", "netns", "exec", tb.node_ns[0], "tc", "qdisc", "show", "dev", "eth0"],
            capture_output=True,
            text=True,
        ).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        assert tb.run([sys.executable, "-c", "import os, sys; sys.exit(3 if os.environ['RANK'] == '2' else 0)"]) == 3
        # The profiler on two emulated nodes measures the shadow copies through the tree.
        profile = tmp_path / "profile.json"
        ops, sizes = "gemm,copies,p2p_inter,p2p_intra", "65536,262144,1048576"
        cmd = [sys.executable, "-m", "moeflow.cli", "profile", "--ops", ops, "--sizes", sizes, "--gemm-sizes", "16,32"]
        cmd += ["--out", str(profile)]
        assert tb.run(cmd) == 0
    assert prefix not in _namespaces()  # torn down
    envs = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(4)]
    assert [e["GROUP_RANK"] for e in envs] == ["0", "0", "1", "1"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]
    assert all(e["WORLD_SIZE"] == "4" and e["MASTER_ADDR"] == "10.77.0.1" for e in envs)
    # 4 ranks share this host's cores, whatever the emulated node they sit on.
    threads = str(max(1, (os.cpu_count() or 1) // 4))
    assert [e["MOEFLOW_CPU_THREADS"] for e in envs] == [threads] * 4
    assert envs[0]["netns"] == envs[1]["netns"] != envs[2]["netns"] == envs[3]["netns"]
    data = json.loads(profile.read_text())
    assert data["backend"] == "gloo" and data["nodes"] == [[0, 1], [2, 3]] and "copies" in data["fits"]
    cm = CostModel.load(profile)
    # Calibrated: every owner copying n bytes at once (forward + back) costs the fit's β·n.
    n, everywhere = 1e6, np.ones((4, 4), dtype=bool)
    both = sum(cm.copies_time(n, everywhere, np.arange(4), d) for d in ("materialize", "reduce"))
    latency = 4 * float(cm.topology.path_latency_WW.max())  # two stages, two directions
    assert both == pytest.approx(cm.fits["copies"].beta_s_per_unit * n, abs=latency + 1e-9)


@needs_netns
def test_testbed_tears_down_when_build_fails():
    from testbed import Testbed, TestbedConfig

    before = _namespaces()
    # latency needs sch_netem; where the kernel lacks it the build fails and must leave nothing
    tb = Testbed(TestbedConfig(nodes=2, ranks_per_node=1, bandwidth_mbit=None, latency_ms=1.0))
    try:
        with tb:
            pass
    except RuntimeError as exc:
        assert "netem" in str(exc)
    assert tb.prefix not in _namespaces() and _namespaces() == before


def test_testbed_config_errors():
    from testbed import TestbedConfig

    with pytest.raises(ValueError, match="nodes=0"):
        TestbedConfig(nodes=0)
    with pytest.raises(ValueError, match="bandwidth_mbit=-5"):
        TestbedConfig(bandwidth_mbit=-5)


def test_cpu_threads_per_rank(monkeypatch):
    from moeflow.core.launch import cpu_threads_per_rank

    monkeypatch.delenv("MOEFLOW_CPU_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cpu_threads_per_rank() == max(1, (os.cpu_count() or 1) // 2)
    monkeypatch.setenv("MOEFLOW_CPU_THREADS", "3")
    assert cpu_threads_per_rank() == 3
    monkeypatch.setenv("MOEFLOW_CPU_THREADS", "0")
    with pytest.raises(ValueError, match="MOEFLOW_CPU_THREADS='0'"):
        cpu_threads_per_rank()
