"""`strategy="auto"`'s online correction on hand-built layers: it recovers known factors (the copies
sent now and sent ahead apart, forward and backward), keeps the factor of a term nothing exercised,
forecasts each schedule's layers from that schedule's own fit, and reports its error out of sample."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from moeflow.core.layer_times import LayerTimes
from moeflow.strategies.planners.auto_correction import (
    Correction,
    Observation,
    OnlineCorrection,
    Terms,
    fit_correction,
)

TRUE = Correction(comp=2.0, comm=0.5, copy=3.0, ahead=0.2, fixed=1e-3, copy_back=4.0, fixed_back=2e-3)


def _terms(n: int, seed: int = 0) -> list[Terms]:
    rng = np.random.default_rng(seed)
    return [Terms(*rng.uniform(1e-3, 1e-2, 3), bool(i % 2)) for i in range(n)]


def _measured(t: Terms, c: Correction = TRUE, schedule=None, rest: float = 1.0) -> Observation:
    """What a machine whose factors are `c` measures (the non-copy part scaled by `rest`); the
    prefetched copies' waits, out and back, count as the layer's wherever they fell (in the block
    before: `LayerTimes.borrow`)."""
    copies = (c.ahead if t.prefetched else c.copy) * t.copies / 2
    copies_back = (c.ahead if t.prefetched else c.copy_back) * t.copies / 2
    forward = (c.forward(t) - copies) * rest + copies
    backward = (c.backward(t) - copies_back) * rest + copies_back
    return Observation(t, schedule, forward, copies, backward, copies_back)


def test_recovers_the_factors_with_and_without_the_copies_timed():
    """Exactly, without the prior (`prior_weight=0`)."""
    timed = [_measured(t) for t in _terms(20)]
    assert fit_correction(timed, prior_weight=0.0) == pytest.approx(TRUE, rel=1e-6)
    # Not timed apart: one joint fit, the copies now / ahead / back as columns of their own.
    untimed = [o._replace(measured_copies=math.nan, measured_copies_backward=math.nan) for o in timed]
    assert fit_correction(untimed, prior_weight=0.0) == pytest.approx(TRUE, rel=1e-6)
    # Forwards alone (no backward timed): the forward's factors; the backward's stay as they were.
    forwards = [o._replace(measured_backward=math.nan, measured_copies_backward=math.nan) for o in timed]
    expected = TRUE._replace(copy_back=math.nan, fixed_back=0.0)
    assert fit_correction(forwards, prior_weight=0.0) == pytest.approx(expected, nan_ok=True)
    # A term no layer exercised (EP alone ran: no copies) keeps the factor it had.
    no_copies = [_measured(t._replace(copies=0.0)) for t in _terms(20)]
    kept = fit_correction(no_copies, Correction(copy=7.0, ahead=0.5, copy_back=6.0), prior_weight=0.0)
    assert kept == pytest.approx(TRUE._replace(copy=7.0, ahead=0.5, copy_back=6.0), rel=1e-6)


def test_what_the_window_cannot_tell_from_the_fixed_cost_stays_at_the_profile():
    """One balanced placement forward after forward: its compute barely changes, so compute and the
    fixed cost are one column apart from noise. Without the prior the fit put the compute at 0 and
    everything in the fixed cost (on the testbed: EP's imbalance then cost nothing and the arbiter
    ran shadowing's copies); with it the compute stays at the profile's 1. Data that vary still
    move the factors: 20 layers of widely varying terms give the true ones within 10%."""
    rng = np.random.default_rng(4)
    machine = Correction(fixed=0.03, fixed_back=0.05)
    observations = []
    for _ in range(16):  # measured as the profile predicts, ±10% of noise
        t = Terms(0.28 * rng.uniform(0.99, 1.01), 0.0, 0.0, False)
        o = _measured(t, machine)
        observations.append(o._replace(measured=o.measured * rng.uniform(0.9, 1.1)))
    assert fit_correction(observations, prior_weight=0.0).comp < 0.5  # noise decides
    assert fit_correction(observations).comp == pytest.approx(1.0, abs=0.05)
    # The layer times its expert computes too: their factor is then measured, not held (a machine
    # computing at 0.7× the profile's time).
    timed = [o._replace(measured_compute=0.7 * o.predicted.compute / 3) for o in observations]
    assert fit_correction(timed).comp == pytest.approx(0.7)
    fitted = fit_correction([_measured(t) for t in _terms(20)])
    assert (fitted.comp, fitted.comm) == pytest.approx((TRUE.comp, TRUE.comm), rel=0.1)


def test_dear_copy_gradients_are_priced_from_the_backward():
    """Copies whose gradient sums cost 4× their model while their forward copies cost 1×: a forward-only
    correction prices them at 1× both ways; with the backward timed their price is the measured one."""
    machine = TRUE._replace(comp=1.0, comm=1.0, copy=1.0, copy_back=4.0)
    observations = [_measured(t._replace(prefetched=False), machine) for t in _terms(12, seed=3)]
    t = Terms(1e-2, 1e-2, 1e-2, False)
    whole = fit_correction(observations)
    assert whole.copies_price(t) == pytest.approx(2.5e-2) and whole.price(t) == pytest.approx(4.5e-2)
    forward_only = fit_correction([o._replace(measured_backward=math.nan) for o in observations])
    assert forward_only.copies_price(t) == pytest.approx(1e-2)


def test_each_schedule_is_forecast_from_its_own_layers():
    """Pipelined layers spend 0.8× the sync ones' time outside their copies at the same terms: the
    pooled fit misses both; each schedule's own fit forecasts its layers exactly (out of sample)."""
    correction = OnlineCorrection(window=32, min_observations=4, prior_weight=0.0)
    for i, t in enumerate(_terms(24, seed=1)):
        schedule = ("sync", "pipeline")[i % 2]
        correction.observe(_measured(t, schedule=schedule, rest=0.8 if schedule == "pipeline" else 1.0))
    assert correction.model_error() < 0.05  # the first forecasts used the pooled fit
    last = list(correction.forecasts)[-8:]
    assert [f / m for f, m in last] == pytest.approx([1.0] * 8, rel=1e-6)
    pooled = [o.forecast(correction.pooled) for o in list(correction.observations)[-8:]]
    assert max(abs(f / m - 1.0) for f, m in pooled) > 0.05


def test_the_error_is_out_of_sample():
    """A machine that turns twice as slow: the layer after the change is forecast with the old factors."""
    correction = OnlineCorrection(window=8, min_observations=4, prior_weight=0.0)
    terms = _terms(7, seed=2)
    for t in terms[:6]:
        correction.observe(_measured(t))
    assert len(correction.forecasts) == 2 and correction.model_error() is None  # fewer than 4 forecasts
    slower = TRUE._replace(**{k: 2 * v for k, v in TRUE._asdict().items()})
    t = terms[6]._replace(prefetched=False)
    correction.observe(_measured(t, slower))
    correction.observe(_measured(t, slower))
    (first, measured), (second, _) = list(correction.forecasts)[-2:]
    assert measured == pytest.approx(2.0 * TRUE.time(t))
    # The next one with factors that saw it (moved less than the machine: one slow layer in eight may be a
    # stall, and the level is the median of the window's: "Level").
    assert first == pytest.approx(measured / 2.0, rel=1e-6) and second > 1.05 * first
    assert correction.model_error() == pytest.approx((0.5 + abs(second / measured - 1.0)) / 4, rel=1e-6)


def test_layers_share_the_machine_and_keep_their_fixed_costs():
    """Layer 0 only ever ran a placement with nothing to exchange (its exchange factor unseen); layer 1
    ran EP and copies in turn. Linked (`share_correction`), layer 0 prices exchanges with the factor
    layer 1's layers measured (0.5 here), and each keeps its own fixed costs."""
    machine = TRUE._replace(comm=0.5)
    first, second = (OnlineCorrection(window=32, min_observations=4, prior_weight=0.0) for _ in range(2))
    for i, t in enumerate(_terms(12, seed=5)):
        layer0 = _measured(t._replace(exchange=0.0), machine._replace(fixed=0.01, fixed_back=0.02))
        layer1 = _measured(t if i % 2 else t._replace(copies=0.0), machine)
        first.observe(layer0, [first, second])
        second.observe(layer1, [first, second])
    assert first.pooled.comm == pytest.approx(0.5, rel=1e-6) and second.pooled.comm == pytest.approx(0.5, rel=1e-6)
    assert (first.pooled.fixed, first.pooled.fixed_back) == pytest.approx((0.01, 0.02), rel=1e-6)
    assert (second.pooled.fixed, second.pooled.fixed_back) == pytest.approx((TRUE.fixed, TRUE.fixed_back), rel=1e-6)
    alone = OnlineCorrection(window=32, min_observations=4, prior_weight=0.0)
    for o in first.observations:
        alone.observe(o)
    assert alone.pooled.comm == 1.0  # never exercised: kept


def test_linked_layers_fit_once_a_forward(monkeypatch):
    """Three linked layers: the last one to observe fits for all, once a forward (one schedule ran:
    the per-schedule fit is that one), and each layer's correction is its own part of that fit."""
    import moeflow.strategies.planners.auto_correction as module

    fits = []
    real = module.fit_corrections
    monkeypatch.setattr(module, "fit_corrections", lambda *a, **k: fits.append(1) or real(*a, **k))
    layers = [OnlineCorrection(window=32, min_observations=4, prior_weight=0.0) for _ in range(3)]
    fixed = (0.01, 0.02, 0.03)
    for t in _terms(10, seed=2):
        for layer, cost in zip(layers, fixed):
            layer.observe(_measured(t, TRUE._replace(fixed=cost)), layers)
    assert len(fits) == 7 + 1  # from the 4th forward on, one a forward; the schedule's own once, first
    for layer, cost in zip(layers, fixed):
        assert layer.pooled.fixed == pytest.approx(cost, rel=1e-6) and layer.pooled.comm == pytest.approx(TRUE.comm)
        assert layer.by_schedule[None] == layer.pooled
    # A layer's own observation leaves its factors to the last layer's fit.
    before = layers[0].pooled
    layers[0].observe(_measured(_terms(1, seed=9)[0], TRUE._replace(comm=3.0)), layers)
    assert layers[0].pooled == before


def test_waits_for_prefetched_copies_count_as_their_layers():
    """The block-wise prefetch waits on layer 2's copies inside layer 1 (before its combine, and their
    gradients in its backward): the waits move from layer 1's times to layer 2's and its copies'."""
    first, second = LayerTimes(), LayerTimes()
    first.lend(0.03, backward=False)  # layer 1's forward waited 30 ms on layer 2's copies ...
    second.borrow(0.03, backward=False)
    first.record_forward(0.25, training=True)
    second.record_copies(0.01, training=True)  # ... and layer 2's on the rest of them
    second.record_forward(0.2, training=True)
    assert (first.forward_s, second.forward_s, second.copies_s) == pytest.approx((0.22, 0.23, 0.04))
    # Backward: layer 2's span ends first; layer 1's then waits (sleeps 30 ms, 20 of them on the gradient
    # sums of layer 2's copies): real autograd through both spans' marks.
    x = torch.ones(1, requires_grad=True)
    entry, close_first = first.time_backward(x, training=True)
    inside_first = entry * 2

    def wait_on_second(grad):
        time.sleep(0.03)
        first.lend(0.02, backward=True)
        second.borrow(0.02, backward=True)

    inside_first.register_hook(wait_on_second)
    entry, close_second = second.time_backward(close_first(inside_first), training=True)
    started = time.perf_counter()
    close_second(entry * 3).backward()
    whole_s = time.perf_counter() - started
    assert second.copies_backward_s == pytest.approx(0.02) and second.backward_s >= 0.02
    assert 0.01 <= first.backward_s <= whole_s - 0.02  # its 30 ms less the 20 lent
    # Evaluation: nothing to learn from, and nothing carried over.
    first.lend(0.01, backward=False)
    first.record_forward(0.3, training=False)
    assert first.forward_s == 0.0
    first.record_forward(0.3, training=True)
    assert first.forward_s == pytest.approx(0.3)


def test_copies_sent_ahead_cost_the_models_exposed_share_until_measured():
    """Sent ahead, the whole transfers are the term and `ahead` the share measured exposed; until a
    prefetched layer was measured, the share the model expects (Eq. 8: `unhidden`)."""
    t = Terms(0.0, 0.0, 0.1, True, 0.02)
    assert Correction().copies_price(t) == pytest.approx(0.02)
    assert Correction(ahead=0.3).copies_price(t) == pytest.approx(0.03)
    measured = [Observation(t, None, 0.02, 0.01, 0.03, 0.02)]  # waited 30 ms of the 100 ms sent ahead
    assert fit_correction(measured, prior_weight=0.0).ahead == pytest.approx(0.3)


def test_recent_layers_weigh_more():
    """A machine that turns 30% slower after 20 layers: weighing every layer of the window alike, the
    forecasts of its 5th to 8th layers still miss by over 15%; with a half-life of 4 forwards,
    by under 7%."""
    terms = _terms(28, seed=7)
    misses = {}
    for half_life in (None, 4.0):
        correction = OnlineCorrection(window=32, min_observations=4, prior_weight=0.0, half_life=half_life)
        for i, t in enumerate(terms):
            slower = 1.3 if i >= 20 else 1.0
            correction.observe(_measured(t, TRUE._replace(**{k: slower * v for k, v in TRUE._asdict().items()})))
        forecast, measured = np.asarray(list(correction.forecasts)[-4:]).T
        misses[half_life] = float(np.mean(np.abs(forecast / measured - 1.0)))
    assert misses[None] > 0.15 and misses[4.0] < 0.07, misses


def test_the_level_is_the_median_of_the_layers_own_times():
    """One placement forward after forward (its terms within 1%), one forward in five a stall (twice its
    time): the least-squares factors chase the mean and forecast the others 20% high; the level (the
    median of measured over fitted: "Level") brings them within 2%. It scales every placement of the
    layer alike: the prices' ratios, which decide, stay."""
    rng = np.random.default_rng(8)
    base = Terms(3e-2, 1e-2, 1e-2, False)
    terms = [base._replace(compute=base.compute * rng.uniform(0.99, 1.01)) for _ in range(20)]
    observations = []
    for i, t in enumerate(terms):
        o = _measured(t)
        stall = 2.0 if i % 5 == 0 else 1.0
        observations.append(o._replace(measured=stall * o.measured, measured_backward=stall * o.measured_backward))
    fitted = fit_correction(observations, prior_weight=0.0)
    regular = [o for i, o in enumerate(observations) if i % 5]
    level = np.array([f / m for f, m in (o.forecast(fitted) for o in regular)])
    mean = np.array([f / m for f, m in (o.forecast(fitted._replace(scale=1.0)) for o in regular)])
    assert np.all(mean > 1.15) and np.all(np.abs(level - 1.0) < 0.02)
    a, b = Terms(3e-2, 1e-2, 0.0, False), Terms(2e-2, 0.0, 2e-2, False)
    unscaled = fitted._replace(scale=1.0)
    assert fitted.scale < 0.9
    assert fitted.price(a) / fitted.price(b) == pytest.approx(unscaled.price(a) / unscaled.price(b))
