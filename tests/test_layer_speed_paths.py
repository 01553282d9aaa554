"""The layer's fast paths equal the plain formulas they replace, values and gradients: per-group
bias (vs `x + b[row_expert]`), widened GEMMs for bf16 (vs fp32 matmuls rounded to bf16), and the
gather/sum token rows and combine (vs `index_select` / `index_add`), the one-process dispatch plan
and count exchange (vs the general ones)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moeflow import MoELayer
from moeflow.core import dispatch, experts
from moeflow.core.dispatch import exchange_counts
from moeflow.core.placement import dispatch_counts
from moeflow.routing.routing import token_choices

COUNTS = [3, 0, 6, 1, 0]  # empty groups in the middle and at the end


def _row_expert(counts):
    return torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))


def _grads(out, inputs, seed=3):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_bias_equals_gathered_bias(dtype):
    torch.manual_seed(0)
    n = sum(COUNTS)
    x = torch.randn(n, 16, dtype=dtype, requires_grad=True)
    w = torch.randn(len(COUNTS), 16, 32, dtype=dtype, requires_grad=True)
    b = torch.randn(len(COUNTS), 32, dtype=dtype, requires_grad=True)
    out = experts.grouped_mm(x, w, COUNTS, b)
    ref = experts.grouped_mm(x, w, COUNTS) + b[_row_expert(COUNTS)]
    assert torch.equal(out, ref)  # the same roundings: GEMM result, then + bias
    # bf16: the bias gradient is one fp32-accumulated sum per group where `index_put` rounded
    # after every row (so it differs by bf16 roundings, towards the exact sum).
    tol = {} if dtype == torch.float32 else {"rtol": 0.02, "atol": 0.02}
    for got, want in zip(_grads(out, (x, w, b)), _grads(ref, (x, w, b)), strict=True):
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("onehot_max_local", [64, 0])  # one GEMM / one sum per group
def test_group_bias_backward_is_a_segment_sum(onehot_max_local, monkeypatch):
    monkeypatch.setattr(experts._GroupBias, "onehot_max_local", onehot_max_local)
    torch.manual_seed(1)
    x = torch.randn(sum(COUNTS), 8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(len(COUNTS), 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, c: experts._GroupBias.apply(a, c, COUNTS), (x, b))
    (grad_b,) = torch.autograd.grad(experts._GroupBias.apply(x, b, COUNTS).sum(), b)
    assert grad_b[1].eq(0).all() and grad_b[4].eq(0).all()  # experts without rows


def test_widened_per_expert_mm_equals_fp32_matmuls_rounded_to_bf16(monkeypatch):
    monkeypatch.setattr(experts._PerExpertMM, "min_wide_rows", 1)  # widen every group here
    torch.manual_seed(2)
    x = torch.randn(sum(COUNTS), 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(len(COUNTS), 16, 32, dtype=torch.bfloat16, requires_grad=True)
    out = experts._PerExpertMM.apply(x, w, COUNTS, torch.float32)
    assert out.dtype == torch.bfloat16
    ref = torch.cat([x[:3].float() @ w[0].float(), x[3:9].float() @ w[2].float(), x[9:].float() @ w[3].float()])
    assert torch.equal(out, ref.bfloat16())
    g = torch.randn(out.shape, dtype=torch.bfloat16)
    gx, gw = torch.autograd.grad(out, (x, w), g)
    rx, rw = torch.autograd.grad(ref, (x, w), g.float())  # fp32 grads, rounded once at the end
    assert torch.equal(gx, rx.bfloat16())
    assert torch.equal(gw, rw.bfloat16())
    assert not gw[1].any() and not gw[4].any()  # experts without rows


def test_small_groups_stay_narrow():
    torch.manual_seed(8)
    counts = [experts._PerExpertMM.min_wide_rows, experts._PerExpertMM.min_wide_rows - 1]
    x = torch.randn(sum(counts), 16, dtype=torch.bfloat16)
    w = torch.randn(2, 16, 32, dtype=torch.bfloat16)
    out = experts._PerExpertMM.apply(x, w, counts, torch.float32)
    assert torch.equal(out[: counts[0]], (x[: counts[0]].float() @ w[0].float()).bfloat16())
    assert torch.equal(out[counts[0] :], x[counts[0] :] @ w[1])


def test_gemm_dtype_is_chosen_per_machine(monkeypatch):
    x16, x32 = torch.zeros(2, 2, dtype=torch.bfloat16), torch.zeros(2, 2)
    monkeypatch.setattr(experts, "_cpu_has_amx_bf16", lambda: True)
    assert experts._gemm_dtype(x16) == torch.bfloat16 and experts._gemm_dtype(x32) == torch.float32
    monkeypatch.setattr(experts, "_cpu_has_amx_bf16", lambda: False)
    assert experts._gemm_dtype(x16) == torch.float32 and experts._gemm_dtype(x32) == torch.float32


@pytest.mark.parametrize("expert", ["ffn", "swiglu"])
def test_bf16_layer_with_widened_gemms_matches_native_bf16_kernels(expert, monkeypatch):
    monkeypatch.setattr(experts._PerExpertMM, "min_wide_rows", 1)
    torch.manual_seed(3)
    layer = MoELayer(16, 32, 4, top_k=2, expert=expert).to(torch.bfloat16)
    x = torch.randn(24, 16, dtype=torch.bfloat16, requires_grad=True)
    outs = {}
    for amx in (True, False):
        monkeypatch.setattr(experts, "_cpu_has_amx_bf16", lambda amx=amx: amx)
        layer.zero_grad(set_to_none=True)
        y = layer(x)
        (gx,) = torch.autograd.grad(y.float().square().sum(), (x,))
        outs[amx] = (y, gx)
    for native, widened in zip(outs[True], outs[False], strict=True):
        torch.testing.assert_close(widened.float(), native.float(), rtol=0.02, atol=0.02)


def test_widened_gemms_under_autocast(monkeypatch):
    monkeypatch.setattr(experts._PerExpertMM, "min_wide_rows", 1)
    torch.manual_seed(6)
    layer = MoELayer(16, 32, 4, top_k=2, expert="ffn")
    x = torch.randn(24, 16)
    outs = {}
    for amx in (True, False):
        monkeypatch.setattr(experts, "_cpu_has_amx_bf16", lambda amx=amx: amx)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        y.float().square().sum().backward()
        outs[amx] = (y, layer.experts.w1.grad.clone())
        layer.zero_grad(set_to_none=True)
    for native, widened in zip(outs[True], outs[False], strict=True):
        torch.testing.assert_close(widened.float(), native.float(), rtol=0.02, atol=0.02)


def test_choices_per_token():
    t = torch.arange(5)
    assert dispatch.choices_per_token(t.repeat(3), 5) == 3
    assert dispatch.choices_per_token(t, 5) == 1
    assert dispatch.choices_per_token(t.repeat(2)[1:], 5) == 0  # a dropped row
    assert dispatch.choices_per_token(t.flip(0).repeat(2), 5) == 0  # expert-choice-like order
    assert dispatch.choices_per_token(torch.zeros(0, dtype=torch.long), 0) == 0


def test_scatter_counts_equal_bincount():
    """The count an accelerator takes (`scatter_counts`, no read-back of the largest id) and
    `count_per_expert` equal `bincount` with `minlength`: random ids, every id equal, none."""
    gen = torch.Generator().manual_seed(4)
    for ids, size in (
        (torch.randint(0, 8, (1000,), generator=gen), 8),
        (torch.randint(0, 3, (7,), generator=gen), 16),  # the high ids never chosen
        (torch.full((5,), 2), 3),
        (torch.zeros(0, dtype=torch.int64), 4),
    ):
        want = torch.bincount(ids, minlength=size)
        for got in (dispatch.scatter_counts(ids, size), dispatch.count_per_expert(ids, size)):
            assert got.dtype == torch.int64
            assert torch.equal(got, want)


def test_routing_counts_once_and_knows_its_choice_major_rows():
    """`token_choices` says its rows are choice-major (`choice_major_k`, what the check would
    find); `expert_counts` is the bincount, computed once; capacity drops keep or forget the claim."""
    torch.manual_seed(0)
    for tokens, k in ((5, 2), (1, 3), (0, 2)):
        expert_TK = torch.randint(0, 4, (tokens, k))
        routing = token_choices(expert_TK, torch.rand(tokens, k), torch.rand(tokens, 4), torch.rand(tokens, 4))
        assert routing.choice_major_k == dispatch.choices_per_token(routing.token_A, tokens)
        counts_E = routing.expert_counts(4)
        assert torch.equal(counts_E, torch.bincount(routing.expert_A, minlength=4))
        assert routing.expert_counts(4) is counts_E
    expert_TK = torch.tensor([[0, 1], [0, 1], [0, 1], [0, 1]])
    routing = token_choices(expert_TK, torch.rand(4, 2), torch.rand(4, 4), torch.rand(4, 4))
    roomy, dropped = routing.within_capacity(2.0, 4, 2)  # 4 per expert: nothing dropped
    assert dropped == 0 and roomy.choice_major_k == 2 and roomy._counts_E is None
    tight, dropped = routing.within_capacity(0.5, 4, 2)  # 1 per expert
    assert dropped == 6 and tight.choice_major_k is None  # unknown: checked where used
    assert tight._choices_per_token(4) == dispatch.choices_per_token(tight.token_A, 4) == 0
    assert torch.equal(tight.expert_counts(4), torch.tensor([1, 1, 0, 0]))


def test_group_offsets_are_the_running_sums():
    offs_J = experts.group_offsets(COUNTS, torch.device("cpu"))
    assert offs_J.dtype == torch.int32
    assert offs_J.tolist() == torch.tensor(COUNTS).cumsum(0).tolist()
    assert experts.group_offsets([], torch.device("cpu")).numel() == 0


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_token_rows_and_combine_equal_index_select_and_index_add(k, dtype):
    torch.manual_seed(4 + k)
    num_tokens, d, num_experts = 7, 5, 4
    expert_TK = torch.stack([torch.randperm(num_experts)[:k] for _ in range(num_tokens)])
    probs = torch.softmax(torch.randn(num_tokens, num_experts), -1)
    routing = token_choices(expert_TK, probs.gather(1, expert_TK).requires_grad_(), probs, probs.log())
    order = torch.sort(routing.expert_A, stable=True).indices
    x = torch.randn(num_tokens, d, dtype=dtype, requires_grad=True)
    y = torch.randn(num_tokens * k, d, dtype=dtype, requires_grad=True)

    rows = routing.rows(x, order)
    ref_rows = x.index_select(0, routing.token_A[order])
    assert torch.equal(rows, ref_rows)
    (gx,), (rgx,) = _grads(rows, (x,)), _grads(ref_rows, (x,))
    torch.testing.assert_close(gx, rgx)

    out = routing.combine(y, order, num_tokens)
    weighted = y * routing.weight_A[order, None].to(dtype)
    ref = torch.zeros(num_tokens, d, dtype=dtype).index_add(0, routing.token_A[order], weighted)
    if k <= 2:  # one addition per token: bit-identical
        assert torch.equal(out, ref)
    torch.testing.assert_close(out, ref)
    for got, want in zip(_grads(out, (y, routing.weight_A)), _grads(ref, (y, routing.weight_A)), strict=True):
        torch.testing.assert_close(got, want)


def test_dropped_rows_take_the_scatter_path_and_still_match():
    torch.manual_seed(5)
    layer = MoELayer(8, 16, 4, top_k=2, capacity_factor=0.5)
    ref = MoELayer(8, 16, 4, top_k=2, capacity_factor=0.5)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(12, 8, requires_grad=True)
    y = layer(x)
    assert layer.stats.dropped > 0
    w = layer.experts
    # Dense reference: each kept (token, expert) row through its expert, weighted, summed.
    routing = layer.gate(x)
    kept, _ = routing.within_capacity(0.5, 4, 2)
    dense = torch.zeros_like(x)
    for t, e, wt in zip(kept.token_A.tolist(), kept.expert_A.tolist(), kept.weight_A, strict=True):
        out_D = F.gelu(x[t] @ w.w1[e] + w.b1[e]) @ w.w2[e] + w.b2[e]
        dense = dense.index_add(0, torch.tensor([t]), (wt * out_D)[None])
    torch.testing.assert_close(y, dense)
    torch.testing.assert_close(*[torch.autograd.grad(v.square().sum(), x)[0] for v in (y, dense)])


def test_one_process_dispatch_plan_is_dispatch_counts():
    """The one-process plan the layer builds is `dispatch_counts`' own: same values, dtype and shape."""
    layer = MoELayer(8, 16, 6, top_k=2)
    flow_WE = np.array([[3, 0, 7, 1, 0, 5]], dtype=np.int64)
    plan_SEW = layer._dispatch_plan(flow_WE, layer.placement)
    expected = dispatch_counts(flow_WE, layer.placement, layer.node_of)
    assert plan_SEW.dtype == expected.dtype and plan_SEW.shape == expected.shape
    np.testing.assert_array_equal(plan_SEW, expected)
    assert not np.shares_memory(plan_SEW, flow_WE)


def test_exchange_counts_one_process_copies():
    """One process: the count row comes back as a `[1, E]` int64 copy (flow and choices), not a view
    of the routing's counts; with two rows (capacity) each has its own matrix."""
    counts_E = torch.tensor([2, 0, 5], dtype=torch.int64)
    flow_WE, choices_WE = exchange_counts([counts_E], None)
    assert flow_WE is choices_WE and flow_WE.dtype == np.int64 and flow_WE.shape == (1, 3)
    np.testing.assert_array_equal(flow_WE, [[2, 0, 5]])
    counts_E[0] = 9
    assert flow_WE[0, 0] == 2
    flow_WE, choices_WE = exchange_counts([counts_E.to(torch.int32), torch.tensor([1, 1, 1])], None)
    np.testing.assert_array_equal(flow_WE, [[9, 0, 5]])
    np.testing.assert_array_equal(choices_WE, [[1, 1, 1]])


def test_stable_topk_by_key_keeps_subnormals_and_every_nan_apart():
    """The accelerator top-k's key (`stable_topk_by_key`, run here on the CPU) is the stable sort's
    prefix also where scores are subnormal (kept, not flushed to zero: `x + 0 = x`), NaNs carry
    other signs and payloads (all one NaN, above +∞) and −0 ties +0."""
    from moeflow.routing.routing import stable_topk_by_key

    gen = torch.Generator().manual_seed(1)
    special = torch.tensor([1e-45, -1e-45, 1e-40, -1e-40, 0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 3.0])
    pick = torch.randint(0, len(special), (300, 40), generator=gen)
    scores = torch.where(torch.rand(300, 40, generator=gen) < 0.6, special[pick], torch.randn(300, 40, generator=gen))
    payload_nans = torch.tensor([0x7FC00001, 0xFFC00123 - 2**32, 0x7F800001], dtype=torch.int32).view(torch.float32)
    scores[:, :3] = payload_nans
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        typed = scores.to(dtype)
        for k in (1, 2, 5, 40):
            want = torch.sort(typed, dim=-1, descending=True, stable=True).indices[:, :k]
            assert torch.equal(stable_topk_by_key(typed, k), want), (dtype, k)


def test_run_expert_major_one_source_runs_the_rows_as_they_came():
    """One source: the rows reach the experts as they came, with that source's counts (a list of
    ints, as the general path's `sum(0)` gives), and come back in the same order."""
    seen = []

    def experts(x_RD, counts_J):
        seen.append(counts_J)
        return x_RD * 2

    x_RD = torch.arange(12.0).reshape(6, 2)
    out = dispatch.run_expert_major(experts, x_RD, np.array([[2, 0, 4]], dtype=np.int64))
    assert seen == [[2, 0, 4]] and all(type(n) is int for n in seen[0])
    assert torch.equal(out, x_RD * 2)
    two_sources = dispatch.run_expert_major(experts, x_RD, np.array([[1, 0, 2], [1, 0, 2]], dtype=np.int64))
    assert seen[-1] == [2, 0, 4] and torch.equal(two_sources, x_RD * 2)


def test_remote_nodes_per_token_counts_the_pairs_without_unique():
    """`dispatch.remote_nodes_per_token` (a mask of (token, node) pairs on the device) equals the
    count of distinct remote (token, node) pairs over the tokens, on random rows, node ids that are
    not 0..N-1 runs, every row local, and one token."""
    gen = torch.Generator().manual_seed(4)
    for trial in range(40):
        tokens, k = int(torch.randint(1, 50, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen))
        node_W = torch.randint(0, 7, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen)
        if trial % 10 == 0:
            node_W = torch.zeros_like(node_W)  # one node: nothing is remote
        token_A = torch.arange(tokens).repeat(k)[torch.randperm(tokens * k, generator=gen)]
        dest_A = torch.randint(0, node_W.numel(), (tokens * k,), generator=gen)
        me = int(torch.randint(0, node_W.numel(), (1,), generator=gen))
        node_A = node_W[dest_A]
        remote = node_A != node_W[me]
        pairs = {(int(t), int(n)) for t, n in zip(token_A[remote], node_A[remote])}
        got = dispatch.remote_nodes_per_token(token_A, node_A, int(node_W[me]), tokens, int(node_W.max()) + 1)
        assert got.dim() == 0 and float(got) == len(pairs) / tokens
