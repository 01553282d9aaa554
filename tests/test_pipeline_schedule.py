"""`schedule="pipeline"`: chunk boundaries and per-chunk counts, options, prediction (pure), and the
equivalence with `sync` on 2 and 4 gloo ranks (tests/multirank_pipeline.py)."""

from __future__ import annotations

import numpy as np
import pytest

from moeflow.core.expert_shape import ExpertShape
from moeflow.perf.alpha_beta import AlphaBeta
from moeflow.perf.costmodel import CostModel
from moeflow.perf.pipeline_degree import candidate_degrees, find_degree, priced_time
from moeflow.perf.topology import Topology
from moeflow.strategies import DISPATCHERS, SCHEDULES
from moeflow.strategies.schedules.base import StepLoad
from moeflow.strategies.schedules.pipeline import PipelineOptions, PipelineSchedule, chunk_bounds, chunk_counts
from moeflow.strategies.schedules.pipeline_pricing import pass_models, scalar_model

from .multirank_pipeline import check_pipeline_equals_sync

SHAPE = ExpertShape(16, 32)


def test_chunk_bounds_cover_every_row_any_degree():
    for rows in (0, 1, 3, 7, 16):
        for r in (1, 2, 3, 4, 9):
            b = chunk_bounds(rows, r)
            assert b[0] == 0 and b[-1] == rows and len(b) == r + 1 and np.all(np.diff(b) >= 0)
    np.testing.assert_array_equal(chunk_bounds([7, 0], 3), [[0, 2, 4, 7], [0, 0, 0, 0]])


def test_chunk_counts_split_each_source_piece_in_expert_order():
    counts_SJ = np.array([[3, 2], [0, 0], [1, 4]])
    per_chunk = chunk_counts(counts_SJ, 2)  # piece 0: rows 0..2 | 2..5; piece 2: 0..2 | 2..5
    np.testing.assert_array_equal(per_chunk[0], [[2, 0], [0, 0], [1, 1]])
    np.testing.assert_array_equal(per_chunk[1], [[1, 2], [0, 0], [0, 3]])
    for r in (1, 3, 5, 11):
        c = chunk_counts(counts_SJ, r)
        np.testing.assert_array_equal(c.sum(0), counts_SJ)
        np.testing.assert_array_equal(c.sum(2).T, np.diff(chunk_bounds(counts_SJ.sum(1), r), axis=1))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(degree=0), "degree=0"),
        (dict(degree=-2), "degree=-2"),
        (dict(forward_degree=0), "forward_degree=0"),
        (dict(backward_degree="fast"), "backward_degree='fast'"),
        (dict(snap="odd"), "snap='odd'"),
    ],
)
def test_options_errors_name_argument_and_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipelineOptions(**kwargs)


def test_options_parsed_and_unknown_names_refused():
    o = PipelineOptions(degree="4", backward_degree="auto", snap="divisors")
    assert (o.forward, o.backward) == (4, "auto")
    with pytest.raises(ValueError, match="chunks"):
        SCHEDULES.build("pipeline", _ctx(), {"chunks": 2})
    with pytest.raises(ValueError, match="cost model"):
        PipelineSchedule(PipelineOptions(degree="auto"))


def _ctx(cm=None):
    from moeflow.core.registry import LayerContext

    return LayerContext(num_experts=8, top_k=2, expert=SHAPE, cost_model=cm)


def _step():
    rng = np.random.default_rng(0)
    send = rng.integers(0, 200, size=(3, 4, 4)).astype(float)
    computed = rng.integers(0, 300, size=(3, 4, 8)).astype(float)
    return StepLoad(send, computed, SHAPE, [0, 0, 1, 1])


def test_predict_is_pipeline_degree_priced_time():
    cm = CostModel(Topology.homogeneous(4, 1e7), gemm_flops_per_s=1e9)
    step, a2a = _step(), DISPATCHERS.build("a2a", _ctx(cm))
    fwd, bwd = pass_models(step, cm, a2a)
    for r_f, r_b in ((1, 1), (2, 4), (8, 3)):
        got = PipelineSchedule(PipelineOptions(forward_degree=r_f, backward_degree=r_b)).predict(step, cm, a2a)
        want = (priced_time(fwd, float(r_f), 0.0) + priced_time(bwd, float(r_b), 0.0)) / 1e3
        np.testing.assert_allclose(got.total_s, want)
    # Degree 1: the synchronous block's dispatch + experts + combine, forward and backward.
    sync = SCHEDULES.build("sync", _ctx()).predict(step, cm, a2a)
    one = PipelineSchedule(PipelineOptions(degree=1)).predict(step, cm, a2a)
    np.testing.assert_allclose(one.total_s, sync.total_s, rtol=1e-9)
    # auto: the cheapest candidate of each pass.
    auto = PipelineSchedule(PipelineOptions(degree="auto"), cm, SHAPE).predict(step, cm, a2a)
    best = sum(np.min([priced_time(m, float(r), 0.0) for r in candidate_degrees("powers")], axis=0) for m in (fwd, bwd))
    np.testing.assert_allclose(auto.total_s, best / 1e3)


def test_measured_chunk_cost_is_priced_per_chunk_and_moves_auto_to_fewer_chunks():
    """`moeflow profile`'s chunk_* fits add to the experts' α of their pass (profiling.chunk_profile):
    each chunk pays it, so degree 1 costs sync + one chunk per pass, and a chunk cost of the size
    the CPU testbed measured (milliseconds) turns auto's choice from many chunks to few."""
    base = CostModel(Topology.homogeneous(4, 1e7), gemm_flops_per_s=1e9)
    step, a2a = _step(), DISPATCHERS.build("a2a", _ctx(base))
    chunk = {"chunk_forward": AlphaBeta(0.0, 2e-3, "chunk"), "chunk_backward": AlphaBeta(0.0, 5e-3, "chunk")}
    cm = CostModel(base.topology, gemm_flops_per_s=1e9, fits=chunk)
    (f0, b0), (f1, b1) = pass_models(step, base, a2a), pass_models(step, cm, a2a)
    np.testing.assert_allclose(f1.alpha_ms[3], f0.alpha_ms[3] + 2.0)
    np.testing.assert_allclose(b1.alpha_ms[3], b0.alpha_ms[3] + 5.0)
    np.testing.assert_allclose(np.stack(f1.volume_ms), np.stack(f0.volume_ms))
    np.testing.assert_allclose(np.stack(b1.alpha_ms[:3]), np.stack(b0.alpha_ms[:3]))
    sync = SCHEDULES.build("sync", _ctx()).predict(step, cm, a2a)
    one = PipelineSchedule(PipelineOptions(degree=1)).predict(step, cm, a2a)
    np.testing.assert_allclose(one.total_s, sync.total_s + 7e-3, rtol=1e-9)
    cands = candidate_degrees("powers")
    free = [find_degree(scalar_model(m), 0.0, cands).degree for m in (f0, b0)]
    costly = [find_degree(scalar_model(m), 0.0, cands).degree for m in (f1, b1)]
    assert costly[0] < free[0] and costly[1] < free[1], (free, costly)


def test_overlap_share_prices_between_fsmoe_and_serial_and_moves_auto_to_one_chunk():
    """η (CostModel.pipeline_overlap) per pass: 1 is FSMoE's case formula, 0 every chunk's stages
    one after another (then one chunk is cheapest), in between the mix; the CostModel keeps it."""
    base = CostModel(Topology.homogeneous(4, 1e7), gemm_flops_per_s=1e9)
    step, a2a = _step(), DISPATCHERS.build("a2a", _ctx(base))
    r = np.array([1.0, 2.0, 4.0, 8.0])
    f1 = scalar_model(pass_models(step, base, a2a)[0])
    assert f1.overlap == 1.0
    serial = r * f1.chunk_times(r)[[0, 0, 1, 2, 3]].sum(0)  # dispatch, combine, ag, rs, experts per chunk
    for eta in (0.0, 0.3):
        cm = CostModel(base.topology, gemm_flops_per_s=1e9, pipeline_overlap=(eta, 1.0))
        fwd, bwd = (scalar_model(m) for m in pass_models(step, cm, a2a))
        assert (fwd.overlap, bwd.overlap) == (eta, 1.0)
        np.testing.assert_allclose(priced_time(fwd, r, 0.0), eta * priced_time(f1, r, 0.0) + (1 - eta) * serial)
    assert find_degree(f1, 0.0, (1, 2, 4, 8)).degree > 1  # FSMoE's model: chunking pays here
    none = CostModel(base.topology, gemm_flops_per_s=1e9, pipeline_overlap=(0.0, 0.0))
    assert [find_degree(scalar_model(m), 0.0, (1, 2, 4, 8)).degree for m in pass_models(step, none, a2a)] == [1, 1]
    assert CostModel.from_dict(none.to_dict()).pipeline_overlap == (0.0, 0.0)
    with pytest.raises(ValueError, match="pipeline_overlap="):
        CostModel(base.topology, gemm_flops_per_s=1e9, pipeline_overlap=(1.5, 1.0))


def test_refuses_other_dispatchers():
    with pytest.raises(ValueError, match="dispatch='hierarchical'"):
        PipelineSchedule().check_dispatcher(DISPATCHERS.build("hierarchical", _ctx()))


@pytest.mark.spawned(body=check_pipeline_equals_sync)
@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_equals_sync_multirank(world, shared_spawns):
    shared_spawns.run(check_pipeline_equals_sync, world)
