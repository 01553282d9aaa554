"""The online correction of `strategy="auto"`'s cost model: what each forward was predicted to take
against what it measured, fitted into factors on the model's terms.

A planner's cost model misprices a machine systematically (on the 2 × 1 testbed the shadow planner
needed a 5% margin for it). The layer times its own forward on every rank, and within it the wait
for its copies (the sparse all-gather, or the prefetched copies' arrival), and sends both with the
next count exchange (two more rows of the all-gather it runs anyway, no extra synchronisation), so
every rank sees every rank's times and corrects identically. Each time is paired with what was
predicted for that forward — compute `fec`, exchanges `a2a/2` (two of the four) and copies `trans`
(the copies out) — and the window of the last `window` forwards is fitted as

    measured ≈ comp·compute + comm·exchanges + (copy or ahead)·copies + fixed

(`fixed`: the layer's own cost, gate and sort). The copies' factors are their measured time over
their predicted one, apart from the rest: `copy` for copies sent on the critical path, `ahead` for
copies the block-wise prefetch sent during the block before (the layer takes them from it when the
placement that runs is the one sent ahead). Both have their own factor, and their own timer, because
they run on other collectives than the exchanges: a fit that lumped the copies with the exchanges
learnt, from a placement whose copies cost 3× the model, that EP's exchanges cost 3× too — and kept
choosing the copies; a joint fit with separate factors could not tell them apart either when one
placement ran forward after forward (its terms move together); and on the 2 × 1 testbed the
prefetched copies measured 5–15% of their predicted time while copies sent on the critical path
measured about their price, so one factor for both underpriced the latter several times over. The
rest of the forward, without its copies, is fitted by non-negative least squares
(`scipy.optimize.nnls`). A term that no forward of the window exercised (no copies since EP alone
ran) keeps its last factor. Until `min_observations` forwards are in, every factor is 1.

Per schedule. Which schedule ran a forward changes its time (on the testbed a pipelined forward
measured 20% under a sync one's at the same terms), so besides the fit over every forward (the
prices: with `schedule="auto"` a placement's block is priced by the schedule arbiter's own
corrected prices, and only the copies' factors are used) each schedule has the fit over its own
forwards, from which that schedule's forwards are forecast.

Error. `model_error()` is out of sample: each forward's forecast, made with the factors as they were
before it was measured, against what it then measured.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
from scipy.optimize import nnls


class Correction(NamedTuple):
    """The factors: measured ≈ comp·compute + comm·exchange + (ahead if prefetched else copy)·copies +
    fixed (seconds)."""

    comp: float = 1.0
    comm: float = 1.0
    copy: float = 1.0
    ahead: float = 1.0
    fixed: float = 0.0

    def time(self, compute: float, exchange: float, copies: float, prefetched: bool) -> float:
        copy = self.ahead if prefetched else self.copy
        return self.comp * compute + self.comm * exchange + copy * copies + self.fixed


class Forward(NamedTuple):
    """What was predicted for one forward, uncorrected (seconds)."""

    compute: float
    """Its share of the expert compute (one of three)."""
    exchange: float
    """Its share of the exchanges (half)."""
    copies: float
    """Its share of the copies (the copies out: half; as far as the prefetch hides them, if prefetched)."""
    prefetched: bool
    """Its copies were sent ahead by the block-wise prefetch."""


class Observation(NamedTuple):
    predicted: Forward
    schedule: str | None
    """The schedule that ran it."""
    measured: float
    """The slowest rank's forward."""
    measured_copies: float
    """Of it, the wait for the copies (NaN: not timed)."""


def fit_correction(observations: Iterable[Observation], previous: Correction | None = None) -> Correction:
    """The factors over `observations` (module docstring); a term that is zero in every one keeps
    its `previous` factor. Without the copies' times (some NaN), one least-squares fit over every
    term, the copies sent ahead and on the critical path as two."""
    obs = list(observations)
    terms = np.array([o.predicted[:3] for o in obs], dtype=np.float64)
    prefetched = np.array([o.predicted.prefetched for o in obs], dtype=bool)
    measured = np.array([o.measured for o in obs], dtype=np.float64)
    copies_measured = np.array([o.measured_copies for o in obs], dtype=np.float64)
    factors = (previous or Correction())._asdict()
    copies_now, copies_ahead = np.where(prefetched, 0.0, terms[:, 2]), np.where(prefetched, terms[:, 2], 0.0)
    if np.all(np.isfinite(copies_measured)):
        for name, predicted in (("copy", copies_now), ("ahead", copies_ahead)):
            if np.any(predicted > 0.0):
                factors[name] = copies_measured[predicted > 0.0].sum() / predicted.sum()
        names, X = ("comp", "comm"), terms[:, :2]
        y = np.maximum(measured - copies_measured, 0.0)
    else:
        names, y = ("comp", "comm", "copy", "ahead"), measured
        X = np.column_stack([terms[:, :2], copies_now, copies_ahead])
    seen = np.flatnonzero(np.any(X != 0.0, axis=0))
    coef, _ = nnls(np.column_stack([X[:, seen], np.ones(len(obs))]), y)
    factors.update({names[i]: c for i, c in zip(seen, coef[:-1])})
    factors["fixed"] = coef[-1]
    return Correction(**{k: float(v) for k, v in factors.items()})


class OnlineCorrection:
    """The window of observed forwards, the fits over it (pooled, per schedule) and the forecasts'
    error (module docstring)."""

    def __init__(self, window: int, min_observations: int) -> None:
        self.min_observations = min_observations
        self.observations: deque[Observation] = deque(maxlen=window)
        self.pooled = Correction()
        """Over every forward of the window: what candidates are priced with."""
        self.by_schedule: dict[str | None, Correction] = {}
        """Over each schedule's own forwards: what its forwards are forecast with."""
        self.forecasts: deque[tuple[float, float]] = deque(maxlen=window)
        """(forecast, measured) of each forward, the forecast made before it was measured."""

    def observe(
        self, predicted: Forward, measured: float, measured_copies: float = math.nan, schedule: str | None = None
    ) -> None:
        if len(self.observations) >= self.min_observations:
            self.forecasts.append((self.by_schedule.get(schedule, self.pooled).time(*predicted), measured))
        self.observations.append(Observation(predicted, schedule, measured, measured_copies))
        if len(self.observations) < self.min_observations:
            return
        self.pooled = fit_correction(self.observations, self.pooled)
        own = [o for o in self.observations if o.schedule == schedule]
        if len(own) >= self.min_observations:
            self.by_schedule[schedule] = fit_correction(own, self.by_schedule.get(schedule, self.pooled))

    def model_error(self) -> float | None:
        """Mean relative error of the forecasts over the window (None: fewer than `min_observations`)."""
        if len(self.forecasts) < self.min_observations:
            return None
        forecast, measured = np.asarray(self.forecasts).T
        return float(np.mean(np.abs(forecast - measured) / measured))
