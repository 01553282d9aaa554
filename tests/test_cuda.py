"""On a CUDA device (skipped where there is none, as in CI): the layer computes on the GPU what it
computes on the CPU, forward and backward; the timer `strategy="auto"` learns from measures the GPU's
work (kernels run asynchronously: a host clock around a launch reads the launch, not the work); and a
short training run on the GPU checkpoints and resumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from moeflow import MoELayer
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.strategies import timing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _no_tf32():
    """Full fp32 matrix products, so that the GPU's numbers can be held to the CPU's."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_compute_timer_reads_the_kernels_not_their_launch():
    forward = timing._Forward(cuda=True)
    a_DD = torch.randn(4096, 4096, device="cuda") / 64

    def compute(x_RD, counts_SJ):
        for _ in range(20):
            x_RD = torch.tanh(x_RD @ a_DD)
        return x_RD

    x_RD = torch.randn(4096, 4096, device="cuda")
    compute(x_RD, None)  # warm-up: cuBLAS handles, allocator
    torch.cuda.synchronize()
    started = time.perf_counter()
    forward.timed("compute", compute, x_RD, None)
    launched_s = time.perf_counter() - started
    torch.cuda.synchronize()
    wall_s = time.perf_counter() - started
    compute_s = forward.seconds("compute")  # reads the events
    assert compute_s > 0.5 * wall_s, (compute_s, wall_s, launched_s)
    assert compute_s <= wall_s * 1.05, (compute_s, wall_s)


@pytest.mark.parametrize("expert", ["ffn", "swiglu"])
def test_layer_on_cuda_equals_cpu(expert):
    torch.manual_seed(0)
    cpu = MoELayer(64, 128, 4, top_k=2, expert=expert)
    gpu = MoELayer(64, 128, 4, top_k=2, expert=expert)
    gpu.load_state_dict(cpu.state_dict())
    gpu.cuda()
    x = torch.randn(4, 50, 64)
    g = torch.randn(4, 50, 64)
    outs = []
    for layer, device in ((cpu, "cpu"), (gpu, "cuda")):
        x_in = x.to(device).detach().clone().requires_grad_()
        y = layer(x_in)
        (y * g.to(device)).sum().backward()
        outs.append((y.cpu(), x_in.grad.cpu(), {n: p.grad.cpu() for n, p in layer.named_parameters()}))
    (y_cpu, gx_cpu, grads_cpu), (y_gpu, gx_gpu, grads_gpu) = outs
    torch.testing.assert_close(y_gpu, y_cpu, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gx_gpu, gx_cpu, rtol=1e-4, atol=1e-5)
    for name, grad in grads_cpu.items():
        torch.testing.assert_close(grads_gpu[name], grad, rtol=1e-4, atol=1e-5, msg=name)


SYNC_WARNING = "called a synchronizing CUDA operation"
"""What `torch.cuda.set_sync_debug_mode(1)` warns at every call that waits for the device."""

LAYERS_ON_ONE_GPU = {
    "mixtral": {"expert": "swiglu"},
    "mixtral_ffn": {"expert": "ffn"},  # the per-group bias
    "deepseek_v3": {
        "expert": "swiglu",
        "gate": "sigmoid",
        "gate_options": {"n_group": 4, "topk_group": 2, "normalize": True, "scaling_factor": 2.5},
        "num_shared_experts": 1,
    },
    "deepseek_v3_aux_free": {  # the selection bias, and the choices kept for the balance update
        "expert": "swiglu",
        "gate": "sigmoid",
        "balance": "aux_free",
        "gate_options": {"n_group": 4, "topk_group": 2, "normalize": True, "scaling_factor": 2.5},
        "num_shared_experts": 1,
    },
}


def _synchronising_calls(step) -> list[str]:
    """The messages of the synchronising calls `step()` makes (the device idle before it)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [str(w.message) for w in caught if SYNC_WARNING in str(w.message)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # bf16: torch._grouped_mm
@pytest.mark.parametrize("block", sorted(LAYERS_ON_ONE_GPU))
def test_one_process_step_synchronises_once(block, dtype):
    """A one-process forward+backward waits for the GPU once: the per-expert counts the planner
    and the dispatch plan read on the host (`dispatch.exchange_counts`); nothing else does."""
    torch.manual_seed(0)
    layer = MoELayer(64, 128, 16, top_k=2, **LAYERS_ON_ONE_GPU[block]).to("cuda", dtype)
    x = torch.randn(512, 64, device="cuda", dtype=dtype, requires_grad=True)

    def step():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        (layer(x).float().square().mean() + layer.aux_loss).backward()

    for _ in range(2):  # warm-up: kernels loaded, allocators filled
        step()
    calls = _synchronising_calls(step)
    assert len(calls) <= 1, calls


def test_capacity_dropping_synchronises_for_its_gather_alone():
    """Capacity drops assignments by a mask: the rows kept are a size the host learns once (the
    gather), and the count dropped is read from the shapes, not from a second wait."""
    torch.manual_seed(0)
    layer = MoELayer(64, 128, 16, top_k=2, capacity_factor=0.5).cuda()
    x = torch.randn(512, 64, device="cuda", requires_grad=True)

    def step():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        (layer(x).square().mean() + layer.aux_loss).backward()

    for _ in range(2):
        step()
    calls = _synchronising_calls(step)
    assert len(calls) <= 2, calls
    assert layer.stats.dropped > 0


def test_auto_learns_from_the_timed_gpu_forwards():
    torch.manual_seed(0)
    cm = CostModel(Topology.homogeneous(1, 1e11), gemm_flops_per_s=1e13)
    layer = MoELayer(256, 1024, 4, top_k=2, strategy="auto", cost_model=cm).cuda()
    for _ in range(timing.AGREE_EVERY + 1):  # the first AGREE_EVERY forwards' times agreed at the next
        x = torch.randn(2048, 256, device="cuda", requires_grad=True)
        layer(x).square().sum().backward()
    factor = layer.planner.factors["compute"].value
    assert factor is not None and factor > 0 and layer.planner.model_error() is not None


def test_train_on_cuda_checkpoints_and_resumes(tmp_path: Path):
    config = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
    base = [sys.executable, "-m", "moeflow.cli", "train", "--config", str(config), "--out", str(tmp_path), "--json"]
    common = ["--set", "train.device=cuda", "--set", "train.checkpoint_every=4", "--set", "train.eval_every=4"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    first = subprocess.run(base + common + ["--steps", "4"], capture_output=True, text=True, env=env, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = subprocess.run(
        base + common + ["--steps", "8", "--resume"], capture_output=True, text=True, env=env, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert (summary["first_step"], summary["last_step"]) == (4, 8), summary
