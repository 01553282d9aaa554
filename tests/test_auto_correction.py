"""`strategy="auto"`'s online correction on hand-built forwards: it recovers known factors (the copies
sent now and sent ahead apart), keeps the factor of a term nothing exercised, forecasts each
schedule's forwards from that schedule's own fit, and reports its error out of sample."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moeflow.strategies.planners.auto_correction import (
    Correction,
    Forward,
    Observation,
    OnlineCorrection,
    fit_correction,
)

TRUE = Correction(comp=2.0, comm=0.5, copy=3.0, ahead=0.2, fixed=1e-3)


def _forwards(n: int, seed: int = 0) -> list[Forward]:
    rng = np.random.default_rng(seed)
    return [Forward(*rng.uniform(1e-3, 1e-2, 3), bool(i % 2)) for i in range(n)]


def test_recovers_the_factors_with_and_without_the_copies_timed():
    forwards = _forwards(20)
    timed = [
        Observation(f, None, TRUE.time(*f), (TRUE.ahead if f.prefetched else TRUE.copy) * f.copies) for f in forwards
    ]
    assert fit_correction(timed) == pytest.approx(TRUE, rel=1e-6)
    untimed = [o._replace(measured_copies=math.nan) for o in timed]  # one joint fit, copies now / ahead apart
    assert fit_correction(untimed) == pytest.approx(TRUE, rel=1e-6)
    # A term no forward exercised (EP alone ran: no copies) keeps the factor it had.
    no_copies = [Observation(f._replace(copies=0.0), None, TRUE.time(*f._replace(copies=0.0)), 0.0) for f in forwards]
    kept = fit_correction(no_copies, Correction(copy=7.0, ahead=0.5))
    assert kept == pytest.approx(TRUE._replace(copy=7.0, ahead=0.5), rel=1e-6)


def test_each_schedule_is_forecast_from_its_own_forwards():
    """Pipelined forwards spend 0.8× the sync ones' time outside their copies at the same terms: the
    pooled fit misses both; each schedule's own fit forecasts its forwards exactly (out of sample)."""
    correction = OnlineCorrection(window=32, min_observations=4)
    for i, f in enumerate(_forwards(24, seed=1)):
        schedule = ("sync", "pipeline")[i % 2]
        copies = (TRUE.ahead if f.prefetched else TRUE.copy) * f.copies
        measured = (TRUE.time(*f) - copies) * (0.8 if schedule == "pipeline" else 1.0) + copies
        correction.observe(f, measured, copies, schedule)
    assert correction.model_error() < 0.05  # the first forecasts used the pooled fit
    last = list(correction.forecasts)[-8:]
    assert [f / m for f, m in last] == pytest.approx([1.0] * 8, rel=1e-6)
    pooled = [correction.pooled.time(*o.predicted) / o.measured for o in list(correction.observations)[-8:]]
    assert max(abs(r - 1.0) for r in pooled) > 0.05


def test_the_error_is_out_of_sample():
    """A machine that turns twice as slow: the forward after the change is forecast with the old factors."""
    correction = OnlineCorrection(window=8, min_observations=4)
    forwards = _forwards(7, seed=2)
    for f in forwards[:6]:
        correction.observe(f, TRUE.time(*f), TRUE.copy * f.copies if not f.prefetched else TRUE.ahead * f.copies)
    assert len(correction.forecasts) == 2 and correction.model_error() is None  # fewer than 4 forecasts
    f = forwards[6]._replace(prefetched=False)
    correction.observe(f, 2.0 * TRUE.time(*f), 2.0 * TRUE.copy * f.copies)
    correction.observe(f, 2.0 * TRUE.time(*f), 2.0 * TRUE.copy * f.copies)
    (first, measured), (second, _) = list(correction.forecasts)[-2:]
    assert first == pytest.approx(measured / 2.0, rel=1e-6) and second != pytest.approx(first, rel=0.1)
    assert correction.model_error() == pytest.approx((0.5 + abs(second / measured - 1.0)) / 4, rel=1e-6)
