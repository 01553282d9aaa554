"""FSMoE pipeline degree (§4, Algorithm 1) and gradient partitioning (§5): formulas by hand, the
four regimes of Fig. 4, the published tool's constants, snapping, and `moeflow tune`."""

import json

import numpy as np
import pytest

from moeflow.cli import main
from moeflow.perf.costmodel import CostModel
from moeflow.perf.grad_partition import partition_gradients, step1
from moeflow.perf.pipeline_degree import (
    PassModel,
    best_candidate_time_ms,
    candidate_degrees,
    case_at,
    case_times,
    find_degree,
    overlappable_ms,
    pass_model,
    plan_degrees,
    predicate_margins,
    priced_time,
)
from moeflow.perf.pipeline_inputs import PipelineFits, PipelineWorkload

# The published tool's constants (order a2a, ag, gemm, rs, ar) and its example model.
ALPHA = [0.23515350484, 0.0549, 0.59194353200, 0.0688, 0.34099276392]
BETA = [1.8543323833e-06, 6.72388e-07, 5.6847387697e-11, 6.70433e-07, 3.4950701465e-06]
PUBLISHED = PipelineWorkload(4, 1024, 4096, 14336, 3, 2.4, 8, 2, 1.3)
FITS = PipelineFits(tuple(ALPHA), tuple(BETA))
SIZES = "--batch 4 --seq 1024 --d-model 4096 --d-hidden 14336 --gemms 3 --factor 2.4 --esp 8 --layers 2 --others-ms 1.3"
CLI = SIZES.split() + ["--alpha-ms", *map(str, ALPHA), "--beta-ms", *map(str, BETA)]


def model(a2a, ag, rs, exp):
    """(α, n·β) per op, in ms."""
    return PassModel(*zip(a2a, ag, rs, exp))


def test_case_formulas_and_predicates_by_hand():
    # r = 2: t_a2a = 1 + 8/2 = 5, t_ag = t_rs = 0.5 + 4/2 = 2.5, t_exp = 1 + 10/2 = 6; t_gar = 3.
    m = model((1, 8), (0.5, 4), (0.5, 4), (1, 10))
    np.testing.assert_allclose(m.chunk_times(2), [5, 2.5, 2.5, 6])
    # Case 1: 2r·t_a2a + t_gar = 20 + 3; Case 2: 2·5 + 2.5 + 2.5 + 2·6 = 27;
    # Case 3: 2·2·5 + 5 = 25; Case 4: 2·5 + 2·2.5 + 2·2.5 = 20.
    np.testing.assert_allclose(case_times(m, 2, 3.0), [23, 27, 25, 20])
    # Q1: 5 > 2.5; Q2: 12 > 2·1·5; Q3: 12 > 1·5; Q4: 3 > 5 no; Q5: 3 > 12 − 10 + 5 no;
    # Q6: 3 > 5 + 5 − 10 yes; Q7: 3 > 5 + 12 − 10 no.
    np.testing.assert_allclose(predicate_margins(m, 2, 3.0), [2.5, 2, 7, -2, -4, 3, -4])
    assert case_at(m, 2, 3.0) == 2 and priced_time(m, 2, 3.0) == 27
    # a large all-reduce: Q5 holds, Case 1 (inter-node) prices the degree
    assert case_at(m, 2, 30.0) == 1 and priced_time(m, 2, 30.0) == pytest.approx(50)
    # the §5.2 overlappable time in Case 2 is the Q5 threshold: r·t_exp + t_ag + t_rs − 2(r−1)·t_a2a = 7
    assert case_at(m, 2, 0.0) == 2 and overlappable_ms(m, 2) == pytest.approx(7)


def test_priced_time_is_the_largest_case_when_allgather_equals_reducescatter():
    rng = np.random.default_rng(0)
    r = np.arange(1, 33, dtype=float)
    for _ in range(50):
        a2a, ag, exp = rng.uniform(0.01, 1, 2), rng.uniform(0.01, 1, 2) * [1, 50], rng.uniform(0.01, 1, 2) * [1, 80]
        m = model(a2a * [1, 40], ag, ag, exp)
        gar = float(rng.uniform(0, 60))
        np.testing.assert_allclose(priced_time(m, r, gar), case_times(m, r, gar).max(0), rtol=1e-12)


@pytest.mark.parametrize(
    "coefficients, t_gar, case, degree",
    [
        # experts dominate (Fig. 4b): Case 2 = 0.2 + 8/r + 0.1 + 0.1r + 100, r* = √80 → 8
        (((0.1, 2), (0.05, 2), (0.05, 2), (0.1, 100)), 0.0, 2, 8),
        # all-to-all dominates (Fig. 4c): Case 3 = 0.2r + 100 + 0.1 + 2/r, best integer 4
        (((0.1, 50), (0.05, 1), (0.05, 1), (0.1, 1)), 0.0, 3, 4),
        # all-gather / reduce-scatter dominate (Fig. 4d): Case 4 = 0.2 + 4/r + 0.1r + 100, r* = √40 → 8
        (((0.1, 2), (0.05, 50), (0.05, 50), (0.1, 1)), 0.0, 4, 8),
        # the gradient all-reduce dominates (Fig. 4a): Case 1 = 0.2r + 20 + 100, r = 1
        (((0.1, 10), (0.05, 5), (0.05, 5), (0.1, 5)), 100.0, 1, 1),
    ],
)
def test_each_regime_selects_its_case(coefficients, t_gar, case, degree):
    choice = find_degree(model(*coefficients), t_gar)
    assert (choice.case, choice.degree) == (case, degree)
    assert np.isfinite(choice.case_minima_ms[case - 1])
    # the snapped choice is the best candidate
    assert choice.time_ms == pytest.approx(min(t for _, t in choice.candidate_times_ms))


def test_slsqp_optimum_matches_a_fine_grid():
    m = pass_model(PUBLISHED, FITS, backward=False)
    choice = find_degree(m, 0.0, candidate_degrees("divisors", 4096))
    grid = np.linspace(1, 4096, 400_001)
    t = priced_time(m, grid, 0.0)
    # Case 4: 2·α_a2a + 2·n_a2a·β_a2a/r + r(α_ag + α_rs) + const, minimised at r = √(2·n_a2a·β_a2a/(α_ag + α_rs))
    r_star = np.sqrt(2 * PUBLISHED.elements("a2a") * BETA[0] / (ALPHA[1] + ALPHA[3]))
    assert choice.case == 4 and choice.continuous_degree == pytest.approx(r_star, rel=1e-3)
    assert grid[np.argmin(t)] == pytest.approx(r_star, rel=1e-3)
    assert min(choice.case_minima_ms[3], t.min()) == pytest.approx(t.min(), rel=1e-6)


def test_published_constants_give_the_published_degrees():
    partition = partition_gradients(PUBLISHED, FITS)
    plan = plan_degrees(PUBLISHED, FITS, partition.moe_gar_ms)
    assert plan.forward_degree == 8 and plan.backward_degrees == [8, 8]
    assert plan.forward.case == 4 and [b.case for b in plan.backward] == [4, 4]
    # Eq. 3: the last layer's backward runs first and has no gradient to hide; layer 0 gets layer 1's
    # attention gradient less what the dense part hides (others + the attention's all-gather and
    # reduce-scatter of B·L·M elements, S = 8 > 1)
    n = 4 * 1024 * 4096
    olp_dense = 1.3 + ALPHA[1] + BETA[1] * n + ALPHA[3] + BETA[3] * n
    assert partition.olp_dense_ms == pytest.approx(olp_dense)
    hidden = int((olp_dense - ALPHA[4]) / BETA[4])
    assert partition.dense_elements == (hidden, 0)
    assert partition.moe_gar_ms == (pytest.approx(FITS.ar_time_ms(PUBLISHED.grad_elements - hidden)), 0.0)
    # the model's first layer's gradient is produced last: all-reduced after the backward
    assert partition.exposed_elements == PUBLISHED.grad_elements
    # §4.1 read literally (α_exp = N·α_gemm) makes the backward prefer degree 4 with these constants
    literal = plan_degrees(PUBLISHED, FITS, partition.moe_gar_ms, expert_alpha="per_gemm")
    assert literal.backward_degrees == [4, 4]


def test_tune_json_gives_the_published_degrees(capsys):
    assert main(["tune", *CLI, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["forward_degree"] == 8 and out["backward_degrees"] == [8, 8]
    grads = out["gradient_partition"]
    assert sum(grads["layer_bytes"]) == grads["total_bytes"] == 2 * 4 * PUBLISHED.grad_elements
    assert set(out["forward"]["candidate_times_ms"]) == {"1", "2", "4", "8"}
    assert main(["tune", *CLI]) == 0
    table = capsys.readouterr().out
    assert "forward" in table and "backward" in table and "r=8" in table


def test_snapping_powers_and_divisors():
    assert candidate_degrees("powers") == (1, 2, 4, 8)
    assert candidate_degrees("divisors", 24) == (1, 2, 3, 4, 6, 8, 12, 24)
    # the continuous optimum (≈12.3) lies beyond 8: powers stop at 8, divisors of B·L = 4096 go to 16,
    # divisors of 24 to 12
    assert plan_degrees(PUBLISHED, FITS, snap="powers").forward_degree == 8
    assert plan_degrees(PUBLISHED, FITS, snap="divisors").forward_degree == 16
    assert plan_degrees(PUBLISHED, FITS, snap="divisors", chunk_dim=24).forward_degree == 12
    with pytest.raises(ValueError, match="snap='primes'"):
        candidate_degrees("primes")


def test_fast_pricing_equals_algorithm_1():
    m = pass_model(PUBLISHED, FITS, backward=True)
    for cands in ((1, 2, 4, 8), candidate_degrees("divisors", 24)):
        for t_gar in (0.0, 29.7, 40.0, 120.0):
            assert best_candidate_time_ms(m, t_gar, cands) == pytest.approx(find_degree(m, t_gar, cands).time_ms)


def test_gradient_partition_is_exact_prefix_feasible_and_deterministic():
    # gradients far larger than the overlappable time: step 2 has work
    big = PipelineWorkload(4, 1024, 4096, 14336, 3, 2.4, 8, 4, 1.3, dense_grad_elements=20_000_000)
    first = partition_gradients(big, FITS)
    assert first == partition_gradients(big, FITS)
    assert sum(first.layer_elements) == first.total_elements == 4 * 20_000_000
    assert sum(first.layer_bytes) == 4 * first.total_elements
    assert sum(first.moe_extra_elements) > 0 and min(first.moe_extra_elements) >= 0
    # prefix constraint, backward order (last layer first): nothing is reduced before it exists; a
    # layer's gradient exists once its backward ends, so the first layer in backward reduces nothing
    produced = 0
    reduced = 0
    for k in range(big.layers)[::-1]:
        reduced += first.dense_elements[k] + first.moe_first_elements[k] + first.moe_extra_elements[k]
        assert reduced <= produced
        produced += big.grad_elements
    assert first.moe_gar_ms[-1] == 0.0 and first.exposed_elements >= big.grad_elements
    # better than leaving step 1's remainder exposed after the backward
    m = pass_model(big, FITS, backward=True)
    nothing_added = sum(
        best_candidate_time_ms(m, FITS.ar_time_ms(f), (1, 2, 4, 8)) for f in first.moe_first_elements
    ) + FITS.ar_time_ms(sum(first.moe_extra_elements) + first.exposed_elements)
    assert first.objective_ms < nothing_added


def test_step1_by_hand():
    # t_ar(n) = 1 + n ms: dense parts hide 2 ms → 1 element, MoE parts 5 ms → 4 elements.
    fits = PipelineFits((0, 0, 0, 0, 1.0), (0, 0, 0, 0, 1.0))
    dense, moe, caps, leftover = step1([10, 10, 10], 2.0, 5.0, fits)
    # k=0: nothing produced yet. k=1: layer 0's 10 arrive; dense takes 1, MoE 4 (5 left).
    # k=2: layer 1's 10 arrive (15); dense takes 1, MoE 4 (10 left); layer 2's 10 come after: 20.
    # Step 2 may take nothing by MoE layer 0, 5 by MoE layer 1 (the older elements), 10 in all.
    assert (dense, moe, caps, leftover) == ([0, 1, 1], [0, 4, 4], [0, 5, 10], 20)


def test_fits_from_cost_model():
    cm = CostModel.from_preset("fsmoe_a")  # FSMoE Fig. 5 constants, stored in seconds per byte / FLOP
    fits = PipelineFits.from_cost_model(cm, PUBLISHED)
    assert fits.alpha_ms == pytest.approx((0.287, 0.337, 0.0426, 0.395, 0.511))
    # per float32 element: back to Fig. 5's numbers; per multiply-add: 2 FLOPs
    assert fits.beta_ms == pytest.approx((2.21e-7, 2.32e-6, 2 * 2.29e-11, 2.34e-7, 4.95e-6))
    bare = CostModel.from_preset("fsmoe_a", with_published_fits=False)
    derived = PipelineFits.from_cost_model(bare, PUBLISHED)
    nbytes = 4 * PUBLISHED.elements("ag")
    expected = 1e3 * bare.op_time("all_gather", nbytes)
    assert derived.alpha("ag") + derived.beta("ag") * PUBLISHED.elements("ag") == pytest.approx(expected)
    assert derived.alpha("gemm") == 0 and derived.beta("gemm") == pytest.approx(2e3 / bare.gemm_flops_per_s)


@pytest.mark.parametrize(
    "change, flag",
    [
        (["--batch", "0"], "--batch=0"),
        (["--esp", "3"], "--esp=3"),
        (["--factor", "-1"], "--factor=-1"),
        (["--alpha-ms", "1", "2", "3"], "--alpha-ms"),
        (["--beta-ms", "1", "2"], "--beta-ms"),
        (["--cost-model", "fsmoe_a"], "--cost-model"),
    ],
)
def test_bad_input_names_the_flag(capsys, change, flag):
    args = list(CLI)
    if change[0] in args and change[0] not in ("--alpha-ms", "--beta-ms"):
        i = args.index(change[0])
        args[i : i + 2] = change
    elif change[0] in ("--alpha-ms", "--beta-ms"):
        i = args.index(change[0])
        j = i + 6
        args[i:j] = change
    else:
        args += change  # both --cost-model and α/β
    assert main(["tune", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moeflow tune: error:") and flag in err and err.count("\n") == 1


def test_neither_cost_model_nor_alpha_is_refused(capsys):
    assert main(["tune", *SIZES.split()]) == 2
    assert "--cost-model" in capsys.readouterr().err
    with pytest.raises(ValueError, match="esp=3 must divide d_hidden"):
        PipelineWorkload(4, 1024, 4096, 14336, 3, 2.4, 3, 2, 1.3)


def test_scalar_terms_are_the_vectorised_predicates_and_cases_with_their_slopes():
    # what SLSQP evaluates (plain floats, exact derivatives) is predicate_margins and case_times
    from moeflow.perf.pipeline_degree import _scalar_case_terms

    rng = np.random.default_rng(1)
    for _ in range(20):
        m = PassModel(tuple(rng.uniform(0.01, 1, 4)), tuple(rng.uniform(0.1, 50, 4)))
        gar, r, h = float(rng.uniform(0, 30)), float(rng.uniform(1, 16)), 1e-6
        values, slopes = _scalar_case_terms(m, gar, r)
        expected = np.concatenate([predicate_margins(m, r, gar), case_times(m, r, gar)])
        np.testing.assert_allclose(values, expected, rtol=1e-12, atol=1e-12)
        ahead, behind = (np.array(_scalar_case_terms(m, gar, x)[0]) for x in (r + h, r - h))
        np.testing.assert_allclose(slopes, (ahead - behind) / (2 * h), rtol=1e-5, atol=1e-6)
