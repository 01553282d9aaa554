"""What the `auto` arbiters recorded, for the strategy benchmark's rows: the corrected model's error
and every forecast against its measurement (`strategy="auto"`), each candidate schedule's timings
(`schedule="auto"`), and the layers' spread — the noise floor those errors are read against.

Shape suffixes: I timed iterations, L MoE layers.
"""

from __future__ import annotations

import numpy as np


def forget_forecasts(layers) -> None:
    """The timed iterations begin: `auto`'s model error is reported over their layers (and the last
    warm-up one, whose times the first timed forward brings); its forecasts of the warm-up, made
    while `schedule="auto"` still tried its candidates, are dropped."""
    for layer in layers:
        if hasattr(layer.planner, "correction"):
            layer.planner.correction.forecasts.clear()


def arbiter_fields(layers) -> dict:
    """The arbiters' fields of a row (none for a run without them)."""
    out: dict = {}
    errors = [layer.planner.model_error() for layer in layers if hasattr(layer.planner, "model_error")]
    if errors and None not in errors:  # `auto`: its corrected model's error on the layers it timed
        out["auto_model_error"] = float(np.mean(errors))
        # Per layer, each forward + backward's (corrected forecast, measured) seconds, in order, and
        # the correction's window: (compute, exchange, copies, prefetched, unhidden, schedule, measured forward,
        # its copies, measured backward, its copies, the forward's measured computes).
        corrections = [layer.planner.correction for layer in layers]
        out["auto_forecasts"] = [[list(map(float, f)) for f in c.forecasts] for c in corrections]
        out["auto_observations"] = [
            [[*map(float, o.predicted), o.schedule, *map(float, o[2:])] for o in c.observations] for c in corrections
        ]
        # Per layer, the last arbitration: each candidate's corrected price, and the factors.
        decisions = [layer.planner.last for layer in layers]
        out["auto_last_prices"] = [{n: float(p) for n, p in d.prices_s.items()} for d in decisions]
        out["auto_factors"] = [d.correction._asdict() for d in decisions]
    arbiters = [layer.schedule for layer in layers if hasattr(layer.schedule, "timings")]
    if arbiters:  # `schedule="auto"`: per layer, each candidate's (measured, predicted) medians and factor
        out["schedule_timings"] = [
            {n: [*t.medians(), t.factor] for n, t in a.timings.items() if t.measured_s} for a in arbiters
        ]
    return out


def layer_spread(layer_IL) -> float:
    """The layers' times' (forward + backward) mean relative distance from their layer's median: the
    error of a predictor that knew each layer's typical time exactly (the noise floor of a per-layer
    model error)."""
    layer_IL = np.asarray(layer_IL, dtype=np.float64)
    return float(np.mean(np.abs(layer_IL - np.median(layer_IL, axis=0)) / layer_IL))
