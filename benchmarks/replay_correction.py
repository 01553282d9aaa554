"""Replay the layers a strategy suite recorded through `strategy="auto"`'s online correction, with
other settings than the run had, and report the out-of-sample error each would have had
(docs/benchmarks.md, "recent layers weigh more" and "The layer's level";
`strategies/planners/auto_correction.py`, "Recency" and "Level"). The code replayed is the installed
correction's: replaying a suite recorded by older code shows what today's would have forecast.

    .venv/bin/python benchmarks/replay_correction.py results/strategies-testbed-2x1t.json \
        --half-life none 4 --window 32 8 --out results/replay-correction.json

Each `auto` row of the suite's testbed part keeps, per layer, every observation its correction saw
(`auto_observations`: the uncorrected terms, the schedule that ran, the measured times), in order.
The replay feeds them to fresh `OnlineCorrection`s, one per layer, linked as the model's are, layer
0 then layer 1 each iteration, and scores the forecasts of the last `--timed` observations per layer
(the run's timed iterations): the mean relative error of forecast against measured, per row, then
over the rows (the suite's `auto_model_mape`). The correction's decisions are not replayed: the
placements are those the run chose with its own settings (a change that moves no choice, as the
level, replays exactly). With the run's settings it reproduces the recorded error; a row keeps only
the window's last observations per layer, so a run with more timed iterations than that starts
nearly cold (run y: 7.6% replayed for 7.5% recorded).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import deque
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moeflow.strategies.planners.auto import AutoOptions  # noqa: E402
from moeflow.strategies.planners.auto_correction import Observation, OnlineCorrection, Terms  # noqa: E402
from testbed_run import write_result  # noqa: E402


def observations(row: dict) -> list[list[Observation]]:
    """Per layer, the recorded observations of an `auto` row (`bench.arbiters.arbiter_fields`)."""
    return [
        [Observation(Terms(o[0], o[1], o[2], bool(o[3]), o[4]), o[5], *o[6:]) for o in layer]
        for layer in row["auto_observations"]
    ]


def replay_row(row: dict, window: int, half_life: float | None, timed: int) -> float:
    """The row's error had its correction had `window` and `half_life` (module docstring)."""
    layers = observations(row)
    options = AutoOptions()
    corrections = [OnlineCorrection(window, options.min_observations, half_life=half_life) for _ in layers]
    for correction in corrections:  # every forecast kept, whatever the window: the same ones scored
        correction.forecasts = deque()
    count = min(map(len, layers))
    for step in range(count):
        for correction, seen in zip(corrections, layers):
            correction.observe(seen[len(seen) - count + step], corrections)
    errors = []
    for correction in corrections:
        forecast, measured = np.asarray(list(correction.forecasts)[-timed:]).T
        errors.append(float(np.mean(np.abs(forecast - measured) / measured)))
    return float(np.mean(errors))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suites", nargs="+", help="JSON written by benchmarks/strategies.py (its testbed part)")
    parser.add_argument("--window", type=int, nargs="+", default=[32])
    parser.add_argument("--half-life", nargs="+", default=["none", "4"], help="forwards; 'none': all alike")
    parser.add_argument("--timed", type=int, default=10, help="timed iterations of the suites")
    parser.add_argument("--out", default="results/replay-correction.json")
    args = parser.parse_args()
    half_lives = [None if h == "none" else float(h) for h in args.half_life]
    result: dict = {"suites": {}}
    for suite in args.suites:
        testbed = json.loads(Path(suite).read_text())["testbed"]
        rows = [r for r in testbed["rows"] if "auto_observations" in r]
        runs = {}
        for window, half_life in itertools.product(args.window, half_lives):
            per_row = [replay_row(r, window, half_life, args.timed) for r in rows]
            runs[f"window={window} half_life={half_life}"] = {"mape": float(np.mean(per_row)), "per_row": per_row}
            print(f"{suite} window={window} half_life={half_life}: MAPE {np.mean(per_row):.3f}", flush=True)
        result["suites"][suite] = {"recorded_mape": testbed["auto_model_mape"], "replayed": runs}
    write_result(__file__, args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
