"""benchmarks/strategies.py's summaries on hand-built rows: the best single strategy per workload and
the interval of `auto`'s distance to it; benchmarks/pool_suites.py's pooling of several runs;
benchmarks/planner_overhead.py on an even load."""

from __future__ import annotations

import numpy as np
import pytest

from .test_fsmoe_benchmarks import _load


def _rows(times: dict[str, list[float]]) -> list[dict]:
    out = []
    for label, t in times.items():
        strategy, schedule = label.split(":")
        prefetch = strategy.endswith("+prefetch")
        out.append({"routing": "w", "strategy": strategy.removesuffix("+prefetch"), "schedule": schedule,
                    "prefetch": prefetch, "times_s": t, "median_s": float(np.median(t))})  # fmt: skip
    return out


def _label(r: dict) -> str:
    return r["strategy"] + ("+prefetch" if r["prefetch"] else "") + ":" + r["schedule"]


def test_auto_vs_best_interval_resamples_the_iterations_together():
    bench = _load("strategies")
    rng = np.random.default_rng(0)
    noise = rng.uniform(0.8, 1.2, 10)  # one machine-wide factor per interleaved iteration
    times = {"ep:sync": list(1.0 * noise), "shadow:sync": list(0.5 * noise), "auto+prefetch:auto": list(0.55 * noise)}
    rows = _rows(times)
    speedups = {"w": {_label(r): times["ep:sync"][0] / r["times_s"][0] for r in rows}}
    summary = bench.summarize(speedups, list(times))
    assert summary["per_workload"]["w"]["best_single"] == "shadow:sync"
    assert summary["per_workload"]["w"]["auto+prefetch:auto_vs_best"] == pytest.approx(0.5 / 0.55)
    # Paired: the shared noise cancels, the interval is the ratio itself.
    assert bench.auto_vs_best_interval(rows, _label, summary)["w"] == pytest.approx([0.5 / 0.55] * 2)
    # Unpaired noise widens it around the point estimate.
    times["auto+prefetch:auto"] = list(0.55 * rng.uniform(0.8, 1.2, 10))
    low, high = bench.auto_vs_best_interval(_rows(times), _label, summary)["w"]
    point = np.median(times["shadow:sync"]) / np.median(times["auto+prefetch:auto"])
    assert low < point < high and high - low > 0.05


def test_the_arbiters_fields_and_the_layers_spread():
    from types import SimpleNamespace

    from moeflow.bench.arbiters import arbiter_fields, forget_forecasts, layer_spread
    from moeflow.strategies.planners.auto import AutoDecision
    from moeflow.strategies.planners.auto_correction import Observation, OnlineCorrection, Terms

    correction = OnlineCorrection(window=8, min_observations=2)
    for i in range(4):
        t = Terms(0.03 * (i + 1), 0.004, 0.0, False)
        correction.observe(Observation(t, "sync", 0.012 * (i + 1), 0.0, 0.024 * (i + 1), 0.0, 0.01 * (i + 1)))
    last = AutoDecision({"ep": 1.0, "shadow": 0.9}, "shadow", correction.pooled, [1.0, 0.9])
    planner = SimpleNamespace(correction=correction, model_error=correction.model_error, last=last)
    layers = [SimpleNamespace(planner=planner, schedule=object())] * 2
    fields = arbiter_fields(layers)
    recorded = {"auto_model_error", "auto_forecasts", "auto_observations", "auto_last_prices", "auto_factors"}
    assert set(fields) == recorded
    assert fields["auto_last_prices"][0] == {"ep": 1.0, "shadow": 0.9} and fields["auto_factors"][0]["comp"] > 0
    assert len(fields["auto_forecasts"][0]) == 2
    assert fields["auto_observations"][0][0][4:] == [0.0, "sync", 0.012, 0.0, 0.024, 0.0, 0.01]
    forget_forecasts(layers)
    assert arbiter_fields(layers) == {}  # no forecasts since the timed iterations began
    assert arbiter_fields([SimpleNamespace(planner=object(), schedule=object())]) == {}
    # Two layers, the second always twice the first: no spread; one forward 50% off its median: 1/6 of it.
    assert layer_spread([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]]) == 0.0
    assert layer_spread([[1.0, 2.0], [1.0, 2.0], [2.0, 2.0]]) == pytest.approx((1.0 / 2.0) / 6)


def test_the_replay_reproduces_the_recorded_error():
    """`benchmarks/replay_correction.py` fed a row's recorded observations with the settings the run
    had gives the error the run recorded; other settings another."""
    from types import SimpleNamespace

    from moeflow.bench.arbiters import arbiter_fields
    from moeflow.strategies.planners.auto import AutoDecision, AutoOptions
    from moeflow.strategies.planners.auto_correction import Observation, OnlineCorrection, Terms

    replay = _load("replay_correction")
    options = AutoOptions()
    rng = np.random.default_rng(3)
    corrections = [
        OnlineCorrection(options.window, options.min_observations, half_life=options.half_life) for _ in range(2)
    ]
    for i in range(14):
        slower = 1.0 if i < 8 else 1.3  # the machine changes speed: recency matters
        for layer, correction in enumerate(corrections):
            t = Terms(*rng.uniform(0.01, 0.05, 3), bool(layer))
            forward, backward = (slower * rng.uniform(0.8, 1.2) * v for v in (0.02, 0.04))
            correction.observe(
                Observation(t, "sync", forward, 0.2 * forward, backward, 0.1 * backward, 0.5 * forward), corrections
            )
    planners = [
        SimpleNamespace(
            correction=c, model_error=c.model_error, last=AutoDecision({"ep": 1.0}, "ep", c.pooled, [1.0, 1.0])
        )
        for c in corrections
    ]
    row = arbiter_fields([SimpleNamespace(planner=p, schedule=object()) for p in planners])
    recorded = float(np.mean([c.model_error() for c in corrections]))
    assert replay.replay_row(row, options.window, options.half_life, timed=10) == pytest.approx(recorded)
    assert replay.replay_row(row, options.window, None, timed=10) != pytest.approx(recorded)


def test_pooled_runs_choose_the_best_single_on_the_pooled_speedups():
    """`benchmarks/pool_suites.py`: speedups pooled as geometric means over runs (the trace's workload
    by its prefix), the best single chosen on them, and the same-work ratios at Zipf 0."""
    pool = _load("pool_suites")

    def run(prophet: float, fssdp: float, trace_at: int, zipf0: list[float]) -> dict:
        labels = ("ep:sync", "prophet+prefetch:sync", "fssdp+prefetch:sync", "auto+prefetch:auto")
        row = dict(zip(labels, (1.0, prophet, fssdp, 1.5)))
        speedups = {"zipf-0": dict(zip(labels, (1.0, *zipf0))), f"trace-replay@{trace_at}": row}
        rows = [  # Zipf 0: each sync variant ran plain EP's placement, no copies
            {"routing": "zipf-0", "schedule": "sync", "copies_mean": 0.0, "speedup_vs_ep": s}
            for s in (1.0, zipf0[0], zipf0[1])
        ] + [{"routing": "zipf-0", "schedule": "auto", "copies_mean": 0.0, "speedup_vs_ep": 2.0}]
        summary = {"per_workload": {w: {"auto+prefetch:auto_vs_best": 1.0} for w in speedups}}
        return {"speedup_over_ep": speedups, "summary": summary, "rows": rows}

    # One run each favours another single; pooled, they tie at sqrt(1.6 * 1.4) and auto is above both.
    out = pool.pool([run(1.6, 1.4, 225, [0.96, 1.0, 1.0]), run(1.4, 1.6, 205, [1.0, 0.9, 1.0])])
    assert out["workloads"] == ["zipf-0", "trace-replay"]
    pooled = out["pooled_speedup_over_ep"]["trace-replay"]
    assert pooled["prophet+prefetch:sync"] == pytest.approx(np.sqrt(1.6 * 1.4))
    assert out["summary"]["per_workload"]["trace-replay"]["auto+prefetch:auto_vs_best"] == pytest.approx(
        1.5 / np.sqrt(1.6 * 1.4)
    )
    # Same work: each sync variant over the best of the others (the schedule=auto row is not one).
    assert out["same_work"]["ratios_per_run"] == [pytest.approx([1.0, 0.96, 1.0]), pytest.approx([1.0, 1.0, 0.9])]
    assert out["same_work"]["share_below_margin"] == pytest.approx(2 / 6)


def test_on_an_even_load_auto_prices_ep_alone_most_calls():
    """`benchmarks/planner_overhead.py --load even --hidden-share 0`: plain EP wins every call, and
    `auto` rests the planners that propose its placement (EP alone priced most calls), where
    `auto_all` prices all of them every call; the CPU time of both modes is reported."""
    overhead = _load("planner_overhead")
    planners = overhead.measure("prophet_lpwnv", calls=10, gap_s=0.0, load="even", hidden_share=0.0)["planners"]
    for name in ("auto", "auto_all"):
        assert set(planners[name]["chosen"]) == {"ep"} and set(planners[name]["cpu_ms"]) == {"inline", "thread"}
    assert planners["auto_all"]["candidates_priced_mean"] == 5  # EP and the four planners' one placement
    assert planners["auto"]["candidates_priced_mean"] < 2
