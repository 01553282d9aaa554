"""The online correction of `strategy="auto"`'s cost model: what each layer's forward and backward
were predicted to take against what they measured, fitted into factors on the model's terms.

A planner's cost model misprices a machine systematically (on the 2 × 1 testbed the shadow planner
needed a 5% margin for it). The layer times its own forward and backward on every rank, and within
them its copies' share — in the forward the wait for its copies (the sparse all-gather, or the
prefetched copies' arrival), in the backward their gradient sums back to the owners — and its
forward's expert computes, and sends the five times with the next count exchange (five more rows
of the all-gather it runs anyway, no extra synchronisation), so every rank sees every rank's
times and corrects identically (`core.layer_times`). Each pair is matched with what was predicted
for that layer (`Terms`: the slowest device's expert compute, the exchanges, the copies), split as
the pass splits it — the forward one compute of three, two exchanges of four, the copies out; the
backward two computes, the other two exchanges, the copies' gradients back — and the window of the
last `window` layers is fitted as

    forward  ≈ comp·compute/3   + comm·exchange/2 + (copy      or ahead)·copies/2 + fixed
    backward ≈ comp·2·compute/3 + comm·exchange/2 + (copy_back or ahead)·copies/2 + fixed_back

(`fixed`, `fixed_back`: the layer's own cost each way, gate and sort). The backward used to be
assumed, not measured — 2× the forward's compute and the copies' gradients at the copies' own
factor — and on the 2 × 1 testbed the iterations disagreed: at Zipf 2, EPLB's 1.5 copies per
layer measured 13% faster than shadowing's 3 (0.596 against 0.684 s an iteration) where the
forward-fitted prices put them within 1%. The copies' factors are their measured time over their
predicted one, apart from the rest: `copy` / `copy_back` for copies sent on the critical path, out
and back, `ahead` for copies the block-wise prefetch sent during the block before (the layer takes
them from it when the placement that runs is the one sent ahead; their gradients go back
overlapped with the backward of the layer before). Both directions of those are waited on partly
in the block before — the prefetch waits for the first part of the copies before that block's
combine, and for the gradient sums inside its backward — and the waits count as this layer's
(`core.layer_times`: `lend`, `borrow`), so `ahead` is the waits out and back, wherever they fell,
over the whole transfers sent ahead: the share the prefetch left exposed, measured (until a
prefetched layer is measured, the share the model expects: `Terms.unhidden`, Pro-Prophet Eq. 8).
Counted only at this layer's own start, on the 2 × 1 testbed at Zipf 2 the waits read 0.2 of the
model's exposed share, a prefetched placement looked nearly free, and the block before paid for it
unseen (0.34 s alone, 0.47 s while the next layer's copies were prefetched); counted where they
belong, 3–6× it. The model's exposed share itself is a poor base there: Eq. 8 scales the compute
windows by the measured hidden share, and windows longer than the transfers leave nothing
exposed (run o of docs/benchmarks.md: 0–2 ms of about 84 ms sent ahead, where 25 ms were waited),
so the factor is over the whole transfers. The copies have their own factors, and their own
timers, because they run on other collectives than the exchanges: a fit that lumped the copies
with the exchanges learnt, from a placement whose copies cost 3× the model, that EP's exchanges
cost 3× too — and kept choosing the copies; a joint fit with separate factors could not tell them
apart either when one placement ran forward after forward (its terms move together); and copies
sent ahead cost what the prefetch fails to hide, copies sent now their whole transfer, so one
factor cannot serve both. The rest of the forwards and backwards, without their copies, is one
non-negative least-squares fit (`scipy.optimize.nnls`, two rows per layer sharing `comp` and
`comm`). A term that no layer of the window exercised (no copies since EP alone ran) keeps its last
factor; a backward never timed (a layer only evaluated) leaves the backward's factors as assumed.
Until `min_observations` layers are in, every factor is 1.

Prior. A placement that runs forward after forward barely changes its terms (a balanced one
computes the same rows every time): its compute column is then the fixed cost's column plus noise,
and the least-squares fit may put either at 0. On the 2 × 1 testbed it put the compute at 0 and
everything in the fixed cost (Zipf 2, shadowing in every forward) — EP's imbalance then cost
nothing and the arbiter priced copies against exchanges alone. So the compute and exchange factors
(the compute's when its time is not measured) are pulled towards 1, the profiled model, by one
more row of the fit each, worth `PRIOR_WEIGHT` layers at that term's typical size: what the window
cannot tell apart from the fixed costs stays at the profile, what it can (terms that moved: EP and
copies in turn) follows the data, within a few per cent. (The copies' factors, timed apart, need none.)

Computes. The layer also times its expert computes (every call of the schedule's `compute`), so the
compute factor is their measured time over their predicted one, as the copies' are, and the backward's
computes are priced at twice the forward's; the fit is then over the exchanges and the fixed costs.

Layers. The layers of one model run on one machine: linked (`planners.auto.share_correction`), the
factors are fitted over every layer's window, each layer with its own fixed costs (a first layer
times more of the pass than the others) and its own level. One fit serves them all: the model's last
layer makes it when it has observed, and every layer takes its correction from it. (Each layer used
to fit over every window at its own observation: L fits of L windows a forward, 353 ms of the
critical path per forward at 32 layers, 8.8 ms at 8, 0.9 ms at 2; one fit: 15, 2.0 and 0.7–1.0 ms,
`benchmarks/correction_overhead.py`. The other layers now price with factors one observation of
their own older; replaying the recorded suites r–ab, the forecasts' error is unchanged to the
fourth decimal.) A layer that only ever ran a placement with nothing to exchange (shadowing every
expert on 2 ranks) then prices the exchanges of the others with what the other layers measured,
not with the factor it started with: on the 2 × 1 testbed at Zipf 2 it kept 1.0 where the other
layer had measured 0.6.

Per schedule. Which schedule ran a layer changes its time (on the testbed a pipelined forward
measured 20% under a sync one's at the same terms), so besides the fit over every layer each
schedule has the fit over its own layers: that schedule's layers are forecast from it, and while
it runs placements are priced with it (`planners.auto`; the fit over every layer until it has
`min_observations` layers).

Recency. A machine's speed moves: on the 2 × 1 testbed the first iterations of each workload ran
slower, and with every layer of the window alike the forecasts of the timed iterations kept coming
out high (run t of docs/benchmarks.md, the drifting load: 10–30% on average per layer). So an
observation weighs half after `half_life` forwards of its layer (`AutoOptions.half_life`, 4;
exponential forgetting, as recursive least squares does), the window still bounding what is kept.
Replaying the recorded suites r, s, t through the correction: out-of-sample error 12.3, 8.9, 10.2%
with all alike, 11.7, 8.5, 8.8% with a half-life of 4 (2 to 8: within 0.3 of that; a hard window of
8 forwards: 12.3, 8.9, 9.0% — the stationary workloads lost to noise what the drifting one gained);
on run u, not used to choose, 11.7 → 11.2% (`benchmarks/replay_correction.py`); runs v and w, made
with it, recorded 11.5 and 9.6%, their layers weighed alike replay to 11.5 and 11.6%.

Level. The factors are the machine's, shared by every layer and placement, and each layer adds only
its fixed costs; what is particular to the placement a layer runs beyond that stays in its
forecasts. On the 2 × 1 testbed the computes of a layer on copies sent ahead measured 0.70–0.75 of
the profile against 0.82–0.88 in the layer before, and the least-squares fit chases the mean of
times the machine's stalls skew upwards (one forward in a few dozen measures twice its neighbours,
and weighs for several forwards after): that layer's forecasts came out 12–23% high on average in
9 of the 28 rows of runs v and w, and forecasting each layer by the median of its last 8 times
with the same placement would have erred 1.4–4.1 points less than the model on runs r–w. So each
fit also returns `scale`, the median over the layer's own observations of the window (weighed for
recency) of measured over fitted, and the forecasts are the fit's times `scale`: the median
because the error is judged in absolute terms, which the median minimises, and is deaf to the
stalls. One factor on the whole layer prices every placement alike: it changes no choice (the
shared factors decide), only the level of the layer's forecasts and prices. Replaying the
recorded suites r–w (`benchmarks/replay_correction.py`; exact, since no choice changes): 11.7,
8.5, 8.8, 11.2, 11.5, 9.6% → 9.0, 7.2, 7.8, 10.1, 9.5, 8.2%. Tried before it and not kept, each
moving the replays' error by under 0.7 points: fixed costs allowed below 0 (`lsq_linear`), a
robust refit with Huber weights, the compute factor as the median of its ratios, or per layer.

Error. `model_error()` is out of sample: each layer's forecast (forward + backward), made with the
factors as they were before it was measured, against what it then measured.

Shape suffixes: N observations (layers of the window), 3 terms (compute, exchange, copies).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np
from scipy.optimize import nnls

PRIOR_WEIGHT = 1.0
"""The pull of the `PRIORS` factors towards 1, in rows of the fit (module docstring, "Prior")."""
PRIORS = ("comp", "comm")
"""The factors a window may not tell apart from the fixed costs (terms that barely change)."""


class Terms(NamedTuple):
    """What was predicted for one forward + backward of a layer, uncorrected (seconds)."""

    compute: float
    """3 expert computes of the slowest device: one in the forward, two in the backward."""
    exchange: float
    """The 4 token exchanges: half in each direction of the pass."""
    copies: float
    """The copies out (forward) and their gradients back (backward), half each, whole transfers
    (sent now or ahead)."""
    prefetched: bool
    """The copies were sent ahead by the block-wise prefetch."""
    unhidden: float = 0.0
    """Sent ahead: the part of `copies` the model expects the prefetch to leave exposed (Pro-Prophet
    Eq. 8, windows scaled by the measured hidden share) — their price until `ahead` is measured."""

    def halves(self) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) shares of (compute, exchange, copies)."""
        return np.array([self.compute / 3, self.exchange / 2, self.copies / 2]), np.array(
            [2 * self.compute / 3, self.exchange / 2, self.copies / 2]
        )


class Correction(NamedTuple):
    """The factors: forward ≈ comp·compute/3 + comm·exchange/2 + (ahead if prefetched else copy)·copies/2
    + fixed; backward ≈ comp·2·compute/3 + comm·exchange/2 + (ahead if prefetched else copy_back)·copies/2
    + fixed_back; the layer's time `scale`·(forward + backward) (seconds; `copy_back` NaN until copies'
    backwards were measured: as `copy`; `ahead` NaN until copies sent ahead were measured: the model's
    `unhidden` share)."""

    comp: float = 1.0
    comm: float = 1.0
    copy: float = 1.0
    ahead: float = math.nan
    fixed: float = 0.0
    copy_back: float = math.nan
    fixed_back: float = 0.0
    scale: float = 1.0
    """The layer's level: the median of measured over fitted (module docstring, "Level")."""

    def _copies(self, t: Terms, backward: bool) -> float:
        """One direction's copies (seconds)."""
        if t.prefetched:
            return (t.unhidden if math.isnan(self.ahead) else self.ahead * t.copies) / 2
        return (self.copy_back if backward and math.isfinite(self.copy_back) else self.copy) * t.copies / 2

    def forward(self, t: Terms) -> float:
        copies = self._copies(t, False)
        return self.comp * t.compute / 3 + self.comm * t.exchange / 2 + copies + self.fixed

    def backward(self, t: Terms) -> float:
        copies = self._copies(t, True)
        return self.comp * 2 * t.compute / 3 + self.comm * t.exchange / 2 + copies + self.fixed_back

    def time(self, t: Terms) -> float:
        """Forward + backward, at the layer's level."""
        return self.scale * (self.forward(t) + self.backward(t))

    def price(self, t: Terms) -> float:
        """`time` without the layer's fixed costs (the same whatever the placement)."""
        return self.time(t) - self.scale * (self.fixed + self.fixed_back)

    def copies_price(self, t: Terms) -> float:
        """The copies' share of `price`."""
        return self.scale * (self._copies(t, False) + self._copies(t, True))


class Observation(NamedTuple):
    """One layer's forward and backward measured (the slowest rank's), against what was predicted."""

    predicted: Terms
    schedule: str | None
    """The schedule that ran it."""
    measured: float
    """The slowest rank's forward."""
    measured_copies: float
    """Of it, the wait for the copies (NaN: not timed)."""
    measured_backward: float = math.nan
    """The slowest rank's backward (NaN: not timed)."""
    measured_copies_backward: float = math.nan
    """Of it, the copies' gradient sums (NaN: not timed)."""
    measured_compute: float = math.nan
    """The slowest rank's expert computes in the forward (NaN: not timed)."""

    def forecast(self, c: Correction) -> tuple[float, float]:
        """(forecast, measured): forward + backward when the backward was timed, else the forward."""
        if math.isfinite(self.measured_backward):
            return c.time(self.predicted), self.measured + self.measured_backward
        return c.scale * c.forward(self.predicted), self.measured


def fit_correction(
    observations: Iterable[Observation],
    previous: Correction | None = None,
    prior_weight: float = PRIOR_WEIGHT,
    layer_N: Sequence[int] | None = None,
    weight_N: Sequence[float] | None = None,
) -> Correction:
    """Layer 0's correction of `fit_corrections` (one layer: the window's)."""
    return fit_corrections(observations, previous, prior_weight, layer_N, weight_N)[0]


def fit_corrections(
    observations: Iterable[Observation],
    previous: Correction | None = None,
    prior_weight: float = PRIOR_WEIGHT,
    layer_N: Sequence[int] | None = None,
    weight_N: Sequence[float] | None = None,
) -> dict[int, Correction]:
    """The factors over `observations` (module docstring); a term that is zero in every one keeps
    its `previous` factor. The copies' factors are their timed waits over their predicted times;
    the rest is one non-negative least-squares fit over the forwards and the timed backwards (two
    rows per observation, sharing `comp` and `comm`, each direction its own fixed cost). Copies not
    timed (NaN) become columns of that fit: sent ahead and on the critical path apart. `layer_N`:
    the layer each observation comes from (default all one), each with its own fixed costs and
    level; the factors are the machine's. Returns each layer's correction (module docstring,
    "Layers", "Level").
    `weight_N`: each observation's weight (default all 1; module docstring, "Recency")."""
    obs = list(observations)
    factors = (previous or Correction())._asdict()
    forward_N3, backward_N3 = (np.array(h, dtype=np.float64) for h in zip(*(o.predicted.halves() for o in obs)))
    prefetched = np.array([o.predicted.prefetched for o in obs], dtype=bool)
    measured_N4 = np.array([o[2:6] for o in obs], dtype=np.float64)  # forward, its copies, backward, its copies
    compute_N = np.array([o.measured_compute for o in obs], dtype=np.float64)
    # Weighted: each observation's predicted and measured times scaled by its weight (and so are the
    # fixed costs' columns below): the factors' ratios become weighted sums, the fit's rows weighted.
    w_N = np.ones(len(obs)) if weight_N is None else np.asarray(weight_N, dtype=np.float64)
    forward_N3, backward_N3 = forward_N3 * w_N[:, None], backward_N3 * w_N[:, None]
    measured_N4, compute_N = measured_N4 * w_N[:, None], compute_N * w_N
    copies_now = np.where(prefetched, 0.0, forward_N3[:, 2])
    copies_ahead = np.where(prefetched, forward_N3[:, 2], 0.0)
    back = np.isfinite(measured_N4[:, 2])
    y_forward, y_backward = measured_N4[:, 0].copy(), measured_N4[back, 2].copy()
    columns: dict[str, tuple[np.ndarray, np.ndarray]] = {"comm": (forward_N3[:, 1], backward_N3[back, 1])}
    if np.all(np.isfinite(compute_N)):  # the computes timed: their factor apart (the backward's twice)
        if np.any(forward_N3[:, 0] > 0.0):
            factors["comp"] = compute_N[forward_N3[:, 0] > 0.0].sum() / forward_N3[:, 0].sum()
        y_forward -= factors["comp"] * forward_N3[:, 0]
        y_backward -= factors["comp"] * backward_N3[back, 0]
    else:
        columns["comp"] = (forward_N3[:, 0], backward_N3[back, 0])
    back_copies_timed = np.all(np.isfinite(measured_N4[back, 3]))
    if np.all(np.isfinite(measured_N4[:, 1])):  # the copies' waits timed: their factors apart
        if np.any(copies_now > 0.0):
            factors["copy"] = measured_N4[copies_now > 0.0, 1].sum() / copies_now.sum()
        if np.any(copies_ahead > 0.0):  # sent ahead: out and back, wherever their waits fell
            waited, sent = measured_N4[prefetched, 1].sum(), copies_ahead.sum()
            if back_copies_timed:  # their gradients' waits too
                waited, sent = waited + measured_N4[back & prefetched, 3].sum(), sent + copies_ahead[back].sum()
            factors["ahead"] = waited / sent
        y_forward -= measured_N4[:, 1]
        if not back_copies_timed:  # the prefetched copies' gradients (Agg), not timed: as priced
            priced = Correction(**factors)
            y_backward -= w_N[back] * [
                priced._copies(o.predicted, True) if o.predicted.prefetched else 0.0
                for o in obs
                if math.isfinite(o.measured_backward)
            ]
    else:
        columns["copy"] = (copies_now, np.zeros(back.sum()))
        columns["ahead"] = (copies_ahead, copies_ahead[back])
    if back_copies_timed:
        if np.any(copies_now[back] > 0.0):
            factors["copy_back"] = measured_N4[back & (copies_now > 0.0), 3].sum() / copies_now[back].sum()
        y_backward -= measured_N4[back, 3]
    else:
        columns["copy_back"] = (np.zeros(len(obs)), copies_now[back])
    layer_N = np.zeros(len(obs), dtype=np.int64) if layer_N is None else np.asarray(layer_N)
    for layer in np.unique(layer_N):  # each layer its own fixed costs (layer 0's are returned)
        mine = (layer_N == layer) * w_N
        suffix = "" if layer == 0 else f"@{layer}"
        columns["fixed" + suffix] = (mine, np.zeros(back.sum()))
        if back[layer_N == layer].any():
            columns["fixed_back" + suffix] = (np.zeros(len(obs)), mine[back])
    names = [n for n, (f, b) in columns.items() if n.startswith("fixed") or np.any(f != 0.0) or np.any(b != 0.0)]
    X = np.array([np.concatenate(columns[n]) for n in names]).T
    y = np.maximum(np.concatenate([y_forward, y_backward]), 0.0)
    # The prior: compute and exchange factors 1 (the profiled model), each worth `prior_weight` rows
    # at its typical term (where not 0). What the window cannot tell from the fixed costs stays at it.
    prior = np.diag([prior_weight * _typical(X[:, j]) if n in PRIORS else 0.0 for j, n in enumerate(names)])
    keep = np.any(prior != 0.0, axis=1)
    coef, _ = nnls(np.vstack([X, prior[keep]]), np.concatenate([y, prior[keep].sum(axis=1)]))  # at 1
    fitted = dict(zip(names, coef))
    factors.update((n, c) for n, c in fitted.items() if n in factors)
    out = {}
    for layer in np.unique(layer_N).tolist():  # each layer's fixed costs, then its level ("Level")
        suffix = "" if layer == 0 else f"@{layer}"
        own = {k: fitted[k + suffix] for k in ("fixed", "fixed_back") if k + suffix in fitted}
        mine = Correction(**{k: float(v) for k, v in (factors | own).items()})._replace(scale=1.0)
        out[layer] = mine._replace(scale=_level(obs, layer_N == layer, w_N, mine, factors["scale"]))
    return out


def _level(obs: list[Observation], own_N: np.ndarray, w_N: np.ndarray, fitted: Correction, otherwise: float) -> float:
    """The median over a layer's own observations (`own_N`, weighed `w_N`) of measured over
    `fitted` (module docstring, "Level"); `otherwise` when none was forecast."""
    own = np.flatnonzero(own_N)
    forecast_N, measured_N = np.array([obs[i].forecast(fitted) for i in own]).reshape(-1, 2).T
    valid = forecast_N > 0.0
    if not valid.any():
        return otherwise
    ratio = measured_N[valid] / forecast_N[valid]
    return float(np.quantile(ratio, 0.5, weights=w_N[own][valid], method="inverted_cdf"))


def _typical(column: np.ndarray) -> float:
    """Root mean square of a column's non-zero entries."""
    used = column[column != 0.0]
    return float(np.sqrt(np.mean(used**2))) if used.size else 0.0


class OnlineCorrection:
    """The window of observed layers, the fits over it (pooled, per schedule) and the forecasts'
    error (module docstring)."""

    half_life: float | None = None  # also what a correction checkpointed before "Recency" resumes with

    def __init__(
        self, window: int, min_observations: int, prior_weight: float = PRIOR_WEIGHT, half_life: float | None = None
    ) -> None:
        self.min_observations = min_observations
        self.prior_weight = prior_weight
        self.half_life = half_life
        """Forwards after which an observation weighs half (None: all alike; "Recency")."""
        self.observations: deque[Observation] = deque(maxlen=window)
        self.pooled = Correction()
        """Over every layer of the window: what candidates are priced with."""
        self.by_schedule: dict[str | None, Correction] = {}
        """Over each schedule's own layers: what its layers are forecast with."""
        self.forecasts: deque[tuple[float, float]] = deque(maxlen=window)
        """(forecast, measured) of each forward + backward, the forecast made before it was measured."""

    def observe(self, observation: Observation, peers: Sequence[OnlineCorrection] = ()) -> None:
        """One more layer measured. Alone, the fits over its window; linked with the model's other
        layers (`peers`, in the model's order, this one among them: `share_correction`), the last of
        them fits once over every layer's window, each layer with its own fixed costs and level
        ("Layers")."""
        schedule = observation.schedule
        if len(self.observations) >= self.min_observations:
            self.forecasts.append(observation.forecast(self.by_schedule.get(schedule, self.pooled)))
        self.observations.append(observation)
        layers = list(peers) if any(c is self for c in peers) else [self, *peers]
        if layers[-1] is not self or len(self.observations) < self.min_observations:
            return
        rows = [(o, n, len(c.observations) - 1 - i) for n, c in enumerate(layers) for i, o in enumerate(c.observations)]
        before, pooled = self.pooled, self._fit(rows, self.pooled)
        for n, fitted in pooled.items():
            layers[n].pooled = fitted
        if sum(o.schedule == schedule for o in self.observations) >= self.min_observations:
            own = [row for row in rows if row[0].schedule == schedule]
            previous = self.by_schedule.get(schedule, self.pooled)
            # One schedule ran every layer of the windows, and both fits start from the same factors:
            # the same fit (a second one would only cost the layer's critical path its time again).
            same = len(own) == len(rows) and np.array_equal(previous, before, equal_nan=True)
            for n, fitted in (pooled if same else self._fit(own, previous)).items():
                layers[n].by_schedule[schedule] = fitted

    def _fit(self, rows: list[tuple[Observation, int, int]], previous: Correction) -> dict[int, Correction]:
        """`rows`: (observation, its layer, its age: the layer's forwards since); each layer's fit."""
        obs, layers, ages = zip(*rows)
        weights = None if self.half_life is None else 0.5 ** (np.asarray(ages) / self.half_life)
        return fit_corrections(obs, previous, self.prior_weight, layers, weights)

    def model_error(self) -> float | None:
        """Mean relative error of the forecasts over the window (None: fewer than `min_observations`)."""
        if len(self.forecasts) < self.min_observations:
            return None
        forecast, measured = np.asarray(self.forecasts).T
        return float(np.mean(np.abs(forecast - measured) / measured))
