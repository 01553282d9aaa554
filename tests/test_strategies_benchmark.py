"""benchmarks/strategies.py's summaries on hand-built rows: the best single strategy per workload and
the interval of `auto`'s distance to it; benchmarks/pool_suites.py's pooling of several runs;
benchmarks/planner_overhead.py on an even load; benchmarks/planner_scale.py's replicas."""

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


def test_on_an_even_load_auto_chooses_ep_and_the_overhead_is_reported():
    """`benchmarks/planner_overhead.py --load even --hidden-share 0`: plain EP wins every call; the
    CPU time of both modes (searches inline, on the planning thread) is reported."""
    overhead = _load("planner_overhead")
    planners = overhead.measure("prophet_lpwnv", calls=10, gap_s=0.0, load="even", hidden_share=0.0)["planners"]
    assert set(planners["auto"]["chosen"]) == {"ep"} and set(planners["auto"]["cpu_ms"]) == {"inline", "thread"}


def test_planner_scale_plans_on_the_mean_of_replicas_flows(tmp_path):
    """`benchmarks/planner_scale.py --replicas 2`: each call's flow is the mean of two consecutive
    iterations in whole tokens (as a layer with replicas plans on); the JSON says so."""
    import json

    scale = _load("planner_scale")
    flows = scale.loads("zipf", 16, 32, 4, 1)
    out = tmp_path / "scale.json"
    argv = ["--sizes", "16x32", "--loads", "zipf1.2", "--planners", "shadow", "--calls", "2", "--warmup", "1"]
    assert scale.main([*argv, "--replicas", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["replicas"] == 2 and result["sizes"]["16x32"]["loads"]["zipf1.2"]["planners"]["shadow"]
    mean = flows[:2].mean(axis=0)
    assert not np.array_equal(mean, np.rint(mean))  # the replicas' mean is fractional, then rounded
    with pytest.raises(SystemExit):
        scale.main([*argv, "--replicas", "0", "--out", str(out)])
