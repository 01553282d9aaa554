"""On a CUDA device (skipped where there is none, as in CI): the layer computes on the GPU what it
computes on the CPU, forward and backward; the timers `strategy="auto"` learns from measure the GPU's
work (kernels run asynchronously: a host clock around a launch reads the launch, not the work); and a
short training run on the GPU checkpoints and resumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moeflow import MoELayer
from moeflow.core.layer_times import LayerTimes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _no_tf32():
    """Full fp32 matrix products, so that the GPU's numbers can be held to the CPU's."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_compute_timer_reads_the_kernels_not_their_launch():
    times = LayerTimes()
    a_DD = torch.randn(4096, 4096, device="cuda") / 64

    def compute(x_RD, counts_SJ):
        for _ in range(20):
            x_RD = torch.tanh(x_RD @ a_DD)
        return x_RD

    x_RD = torch.randn(4096, 4096, device="cuda")
    compute(x_RD, None)  # warm-up: cuBLAS handles, allocator
    torch.cuda.synchronize()
    times.computes_from_here()
    started = time.perf_counter()
    times.timed_compute(compute, x_RD, None)
    launched_s = time.perf_counter() - started
    torch.cuda.synchronize()
    wall_s = time.perf_counter() - started
    times.take_rows(1, "cuda")  # reads the events
    assert times.compute_s > 0.5 * wall_s, (times.compute_s, wall_s, launched_s)
    assert times.compute_s <= wall_s * 1.05, (times.compute_s, wall_s)


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


def test_layer_times_its_step_on_cuda():
    torch.manual_seed(0)
    layer = MoELayer(256, 1024, 4, top_k=2).cuda()
    for _ in range(2):
        x = torch.randn(2048, 256, device="cuda", requires_grad=True)
        layer(x).square().sum().backward()
    torch.cuda.synchronize()
    layer.times.take_rows(4, "cuda")
    times = layer.times
    assert times.forward_s > 0 and times.compute_s > 0
    assert times.compute_s <= times.forward_s * 1.05  # the computes are inside the forward


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
