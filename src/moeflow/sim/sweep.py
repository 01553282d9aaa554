"""One trace priced on several clusters (`moeflow simulate --sweep`): per cluster, every strategy ×
schedule of `simulate`, its speedup over plain EP and its share of the force-balanced ceiling;
one JSON and one plot (speedup over EP per strategy per cluster, a panel per schedule, the
ceiling — plain EP with perfectly even routing — marked on every cluster).

A cluster is what `--cluster` takes: a preset, a preset at another size (`NAME@N`: its link
classes, `topology_presets.resolve_preset`) or a profile JSON; the trace is folded or unfolded onto
each (`Trace.rescale`), its experts to a multiple of the cluster's devices when they are not one.

    moeflow simulate --trace smartmoe --sweep johnny,johnny@64,hecate_a,trevor --out results/sweep.json
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from moeflow.sim.simulator import Breakdown


def sweep_experts(num_experts: int, world: int) -> int:
    """The experts a trace of `num_experts` is priced with on `world` devices: as recorded when they
    are a multiple of the devices, else the least common multiple (reached by unfolding)."""
    return num_experts if num_experts % world == 0 else math.lcm(num_experts, world)


def sweep(clusters: Sequence[str], run: Callable[[str], tuple[dict, list[Breakdown]]]) -> dict[str, Any]:
    """`run(cluster) -> (header, results)` for every cluster → the sweep's JSON document."""
    out: dict[str, Any] = {"clusters": {}}
    for cluster in clusters:
        header, results = run(cluster)
        out["clusters"][cluster] = {**header, "results": [r.summary() for r in results]}
    return out


def plot_sweep(document: dict[str, Any], path: str | Path, title: str = "") -> Path:
    """Grouped bars: speedup over plain EP (same schedule) per strategy, clusters along x, one
    panel per schedule; a black bar-wide tick for the ceiling (EP on even routing)."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    clusters = list(document["clusters"])
    rows = [r for c in clusters for r in document["clusters"][c]["results"]]
    schedules = list(dict.fromkeys(r["schedule"] for r in rows))
    strategies = [s for s in dict.fromkeys(r["strategy"] for r in rows) if s != "ep"]
    width = 0.8 / max(len(strategies), 1)
    colors = plt.get_cmap("tab10").colors
    fig, axes = plt.subplots(
        len(schedules),
        1,
        figsize=(max(7.0, 1.0 + 1.3 * len(clusters)), 2.4 * len(schedules) + 1.0),
        squeeze=False,
        layout="constrained",
    )
    for ax, schedule in zip(axes[:, 0], schedules):
        top = 1.0
        for i, cluster in enumerate(clusters):
            by = {r["strategy"]: r for r in document["clusters"][cluster]["results"] if r["schedule"] == schedule}
            for j, strategy in enumerate(strategies):
                speedup = by.get(strategy, {}).get("speedup_over_ep")
                if speedup is None:
                    continue
                x = i - 0.4 + (j + 0.5) * width
                ax.bar(x, speedup, width, color=colors[j % 10], label=strategy if i == 0 else None)
                top = max(top, speedup)
            ep = by.get("ep") or next(iter(by.values()), {})
            if ep.get("ceiling_total_s"):
                ceiling = ep["total_s"] / ep["ceiling_total_s"]
                ax.plot(
                    [i - 0.42, i + 0.42],
                    [ceiling, ceiling],
                    color="k",
                    lw=2,
                    label="ceiling: EP, even routing" if i == 0 else None,
                )
                top = max(top, ceiling)
        ax.axhline(1.0, color="0.5", lw=0.8, ls="--")
        ax.set_xticks(range(len(clusters)))
        ax.set_xticklabels(
            [f"{c}\n{document['clusters'][c]['world_size']}×{document['clusters'][c]['num_experts']}" for c in clusters]
        )
        ax.set_ylim(0, top * 1.12)
        ax.set_ylabel(f"speedup over EP\n(schedule {schedule})")
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(
        handles,
        labels,
        loc="outside upper center",
        ncol=min(len(labels), 8),
        fontsize=9,
        frameon=False,
        title=title or None,
        title_fontsize=11,
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
