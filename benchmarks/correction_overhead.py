"""Time `strategy="auto"`'s online correction on the critical path per forward, against the model's
depth (`strategies/planners/auto_correction.py`, "Layers"; docs/benchmarks.md, "The correction's
fit, once a forward").

    .venv/bin/python benchmarks/correction_overhead.py --out results/correction_overhead.json

Each layer of a model observes its forward at its next count exchange (`OnlineCorrection.observe`,
the layers linked as `share_correction` links them); what those calls take, summed over the
model's layers, is what one forward waits for its corrections. Layers of L ∈ {2, 8, 32}, windows of
32 forwards (the default) full before timing, one schedule; random terms and times, seeded (the
fit's cost depends on the sizes, not the values). Median over `--forwards` forwards.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from moeflow.strategies.planners.auto import AutoOptions
from moeflow.strategies.planners.auto_correction import Observation, OnlineCorrection, Terms

sys.path.insert(0, str(Path(__file__).resolve().parent))
from testbed_run import write_result  # noqa: E402

DEPTHS = (2, 8, 32)


def forward_ms(layers: int, forwards: int, seed: int = 0) -> float:
    """Median ms per forward of `layers` linked corrections observing, once their windows are full."""
    options = AutoOptions()
    rng = np.random.default_rng(seed)
    linked = [
        OnlineCorrection(options.window, options.min_observations, half_life=options.half_life) for _ in range(layers)
    ]
    spent = []
    for step in range(options.window + forwards):
        start = time.perf_counter()
        for correction in linked:
            terms = Terms(*rng.uniform(0.01, 0.05, 3), False)
            forward, backward = rng.uniform(0.02, 0.04), rng.uniform(0.04, 0.08)
            correction.observe(Observation(terms, "sync", forward, 0.005, backward, 0.005, 0.01), linked)
        if step >= options.window:
            spent.append(time.perf_counter() - start)
    return 1e3 * float(np.median(spent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/correction_overhead.json")
    parser.add_argument("--forwards", type=int, default=20)
    args = parser.parse_args()
    result = {"ms_per_forward": {}}
    for depth in DEPTHS:
        result["ms_per_forward"][depth] = forward_ms(depth, args.forwards)
        print(f"{depth:3d} layers: {result['ms_per_forward'][depth]:8.2f} ms per forward")
    write_result(__file__, args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
