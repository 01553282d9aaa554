"""Single-process MoELayer: dense equivalence, capacity order, experts, hooks, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeflow import MoEHook, MoELayer
from moeflow.core.experts import GroupedExperts, grouped_mm


@pytest.mark.parametrize("expert", ["ffn", "swiglu"])
def test_one_expert_top1_equals_dense_ffn(expert):
    torch.manual_seed(0)
    layer = MoELayer(8, 16, 1, top_k=1, expert=expert)
    x = torch.randn(3, 5, 8, requires_grad=True)
    y = layer(x)
    w = layer.experts
    x2 = x.detach().clone().requires_grad_()
    if expert == "ffn":
        ref = F.gelu(x2 @ w.w1[0] + w.b1[0]) @ w.w2[0] + w.b2[0]
    else:
        ref = (F.silu(x2 @ w.w13[0][:, 0]) * (x2 @ w.w13[0][:, 1])) @ w.w2[0]  # w13 [D, 2, H]: gate, up
    torch.testing.assert_close(y, ref)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_capacity_keeps_first_choices_then_earlier_tokens():
    # E=2, k=2, T=2, c=0.5 -> C = ceil(0.5*2*2/2) = 1 per expert. Both tokens prefer expert 0.
    layer = MoELayer(2, 4, 2, top_k=2, capacity_factor=0.5)
    with torch.no_grad():
        layer.gate.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    x = torch.tensor([[1.0, 0.5], [2.0, -0.5]])
    y = layer(x)
    # choice-major order: (t0,e0) (t1,e0) (t0,e1) (t1,e1); expert 0 keeps t0, expert 1 keeps t0.
    assert layer.stats.dropped == 2
    assert layer.stats.flow.tolist() == [[1, 1]]
    torch.testing.assert_close(y[1], torch.zeros(2))
    dropless = MoELayer(2, 4, 2, top_k=2)
    dropless.load_state_dict(layer.state_dict())
    torch.testing.assert_close(y[0], dropless(x)[0])  # token 0 kept both choices
    # Capacity large enough drops nothing and equals dropless.
    layer.capacity_factor = 2.0
    torch.testing.assert_close(layer(x), dropless(x))
    assert layer.stats.dropped == 0


def test_grouped_mm_matches_per_expert_matmul_with_empty_groups():
    torch.manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(10, 16, dtype=dtype, requires_grad=True)
        w = torch.randn(4, 16, 32, dtype=dtype, requires_grad=True)
        counts = [3, 0, 7, 0]
        out = grouped_mm(x, w, counts)
        ref = torch.cat([x[:3] @ w[0], x[3:] @ w[2]])
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
        out.sum().backward()  # stride-0 gradient must be accepted
        assert w.grad[1].abs().sum() == 0 and w.grad[0].abs().sum() > 0


def test_bf16_and_autocast():
    torch.manual_seed(2)
    layer = MoELayer(16, 32, 4, top_k=2)
    x = torch.randn(6, 16)
    ref = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=0.05, atol=0.05)
    layer_bf16 = MoELayer(16, 32, 4, top_k=2).to(torch.bfloat16)
    out = layer_bf16(x.bfloat16())
    assert out.dtype == torch.bfloat16 and out.shape == (6, 16)


def test_stats_and_aux_loss_single_process():
    torch.manual_seed(3)
    layer = MoELayer(8, 16, 4, top_k=2, z_loss_weight=0.1)
    layer(torch.randn(2, 3, 8))
    s = layer.stats
    assert s.flow.shape == (1, 4) and int(s.expert_counts.sum()) == 12
    assert s.device_loads.tolist() == [12] and s.dropped == 0
    assert s.bytes_sent.tolist() == [0]  # nothing leaves a single process
    assert s.load_imbalance >= 1.0
    assert layer.aux_loss.dim() == 0 and layer.aux_loss.requires_grad


def test_zero_tokens():
    layer = MoELayer(8, 16, 4, top_k=2)
    x = torch.zeros(0, 8, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, 8)
    (y.sum() + layer.aux_loss).backward()


class _Recorder(MoEHook):
    def __init__(self):
        self.seen = []

    def _record(self, name, t):
        self.seen.append((name, tuple(t.shape)))

    def before_moe_start(self, layer, x):
        self._record("before_moe_start", x)

    def before_dispatch(self, layer, x):
        self._record("before_dispatch", x)
        return x.to(torch.bfloat16)  # compress on the wire ...

    def after_dispatch(self, layer, x):
        self._record("after_dispatch", x)
        return x.float()  # ... and decompress

    def before_combine(self, layer, y):
        self._record("before_combine", y)

    def after_combine(self, layer, y):
        self._record("after_combine", y)
        return 2 * y

    def before_moe_end(self, layer, y):
        self._record("before_moe_end", y)


def test_six_hooks_run_in_order_and_can_replace_tensors():
    torch.manual_seed(4)
    plain = MoELayer(8, 16, 4, top_k=2)
    hooked = MoELayer(8, 16, 4, top_k=2, hooks=[rec := _Recorder()])
    hooked.load_state_dict(plain.state_dict())
    x = torch.randn(5, 8)
    y = hooked(x)
    assert [n for n, _ in rec.seen] == [
        "before_moe_start",
        "before_dispatch",
        "after_dispatch",
        "before_combine",
        "after_combine",
        "before_moe_end",
    ]
    assert rec.seen[1][1] == (10, 8)
    torch.testing.assert_close(y, 2 * plain(x), rtol=0.02, atol=0.02)
    with pytest.raises(TypeError, match="hooks entry"):
        MoELayer(8, 16, 4, hooks=[object()])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(gate="bogus"), ValueError, r"gate='bogus'.*topk"),
        (dict(expert="mlp"), ValueError, r"expert='mlp'.*swiglu"),
        (dict(strategy="fast"), ValueError, r"strategy='fast'"),
        (dict(schedule="async"), ValueError, r"schedule='async'"),
        (dict(top_k=5), ValueError, r"top_k=5 must be in \[1, num_experts=4\]"),
        (dict(top_k=0), ValueError, r"top_k=0"),
        (dict(num_experts=0), ValueError, r"num_experts=0"),
        (dict(d_model=-1), ValueError, r"d_model=-1"),
        (dict(d_hidden=2.5), TypeError, r"d_hidden=2.5"),
        (dict(capacity_factor=0), ValueError, r"capacity_factor=0"),
        (dict(capacity_factor=-1.5), ValueError, r"capacity_factor=-1.5"),
        (dict(balance="shard"), ValueError, r"balance='shard'"),
        (dict(balance_weight=-1.0), ValueError, r"balance_weight=-1.0"),
    ],
)
def test_bad_construction_names_argument_and_value(kwargs, error, match):
    args = dict(d_model=8, d_hidden=16, num_experts=4, top_k=2) | kwargs
    with pytest.raises(error, match=match):
        MoELayer(**args)


def test_bad_input_and_check_finite():
    layer = MoELayer(8, 16, 4, top_k=2, check_finite=True)
    with pytest.raises(ValueError, match=r"shape \(3, 7\).*d_model=8"):
        layer(torch.randn(3, 7))
    with pytest.raises(TypeError, match="dtype=torch.int64"):
        layer(torch.ones(3, 8, dtype=torch.long))
    bad = torch.randn(3, 8)
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        layer(bad)
    with torch.no_grad():
        layer.gate.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match="routing scores"):
        layer(torch.randn(3, 8))


def test_experts_module_sharding_and_errors():
    e = GroupedExperts(6, 4, 8)
    full_w1 = e.w1.detach().clone()
    e.shard_([2, 3])
    assert e.expert_ids == [2, 3] and e.num_local == 2 and e.row_of(3) == 1
    torch.testing.assert_close(e.w1.detach(), full_w1[2:4])
    with pytest.raises(ValueError, match="expert='moe'"):
        GroupedExperts(2, 4, 8, kind="moe")


def test_per_expert_mm_fallback_gradients_match_plain_matmuls():
    from moeflow.core.experts import _PerExpertMM

    torch.manual_seed(7)
    x = torch.randn(9, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 16, 8, dtype=torch.float64, requires_grad=True)
    counts = [2, 0, 7, 0]
    assert torch.autograd.gradcheck(lambda a, b: _PerExpertMM.apply(a, b, counts), (x, w))
    out = _PerExpertMM.apply(x, w, counts)
    torch.testing.assert_close(out, torch.cat([x[:2] @ w[0], x[2:] @ w[2]]))
