"""DDL-Roofline (FasterMoE §3.3).

x axis: ``R_CC = Lat_comp / Lat_comm`` (forward expert time of the slowest device over one
all-to-all); y axis: average achieved throughput per device
``P̄ = 3·f·Σ_w B_w / (N · Lat_e2e)`` with f the forward FLOPs per token (f = 4·d·h for a
2-layer FFN, so ``3·f = 12·α·d²``, FasterMoE's numerator). Curves: ideal (full overlap)
``P̄ = P·min(1, R_CC)``; semi-ideal (no overlap) ``P̄ = P·R_CC / (R_CC + 1)``. A synchronous
EP step costs ``3·Lat_comp + 4·Lat_comm`` and lands below the semi-ideal curve.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moeflow.core.expert_shape import ExpertShape
from moeflow.sim.simulator import Breakdown


@dataclass
class RooflinePoint:
    """One workload under one strategy/schedule."""

    label: str
    """Legend text (strategy/schedule or a measured configuration)."""
    r_cc: float
    """Lat_comp / Lat_comm."""
    throughput_flops_per_s: float
    """P̄ per device."""
    lat_comp_s: float | None = None
    """Forward expert time of the slowest device (FasterMoE Eq. 1)."""
    lat_comm_s: float | None = None
    """One all-to-all (FasterMoE Eq. 2)."""
    lat_e2e_s: float | None = None
    """Layer step (forward + backward)."""
    kind: str = "predicted"
    """``predicted`` (simulator) or ``measured``."""


def throughput(tokens: Any, lat_e2e_s: Any, world_size: int, shape: ExpertShape) -> np.ndarray:
    """FasterMoE §3.3: ``P̄ = 3·f·Σ_w B_w / (N·Lat_e2e)``."""
    f = shape.forward_flops_per_token
    return 3 * f * np.asarray(tokens, dtype=np.float64) / (world_size * np.asarray(lat_e2e_s, dtype=np.float64))


def points_from_simulation(results: Sequence[Breakdown], shape: ExpertShape, world_size: int) -> list[RooflinePoint]:
    """One point per (strategy, schedule): means over iterations and layers."""
    out = []
    for r in results:
        comp = float(r.layer_compute_fwd_IL.mean())
        comm = float(r.layer_a2a_IL.mean())
        e2e = float(r.layer_total_IL.mean())
        tokens = float(r.tokens_IL.mean())
        out.append(
            RooflinePoint(
                f"{r.strategy}/{r.schedule}",
                comp / comm if comm > 0 else float("inf"),
                float(throughput(tokens, e2e, world_size, shape)),
                comp,
                comm,
                e2e,
            )
        )
    return out


def curves(peak_flops_per_s: float, r_cc: np.ndarray) -> dict[str, np.ndarray]:
    """Ideal ``P·min(1, R)`` and semi-ideal ``P·R/(R+1)`` over an R_CC grid."""
    r = np.asarray(r_cc, dtype=np.float64)
    return {"ideal": peak_flops_per_s * np.minimum(1.0, r), "semi_ideal": peak_flops_per_s * r / (r + 1.0)}


def load_measured(path: str | Path) -> list[RooflinePoint]:
    """Measured points: JSON ``{"points": [{"label", "r_cc", "throughput_flops_per_s", ...}]}``
    (written by ``benchmarks/perf_model_accuracy.py``)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--measured file {str(path)!r} does not exist")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"--measured file {str(path)!r}: not JSON ({exc})") from None
    pts = data.get("points") if isinstance(data, dict) else None
    if not isinstance(pts, list):
        raise ValueError(f"--measured file {str(path)!r}: expected an object with a 'points' list")
    keys = set(RooflinePoint.__dataclass_fields__)
    return [RooflinePoint(**{**{k: v for k, v in q.items() if k in keys}, "kind": "measured"}) for q in pts]


def _styles(points: Sequence[RooflinePoint]) -> tuple[dict[str, Any], dict[str, str]]:
    """A distinct colour per strategy (tab10, then tab20) and a marker per schedule, in order of appearance."""
    import matplotlib

    strategies = list(dict.fromkeys(p.label.partition("/")[0] for p in points))
    schedules = list(dict.fromkeys(p.label.partition("/")[2] for p in points if p.kind == "predicted"))
    palette = matplotlib.colormaps["tab10" if len(strategies) <= 10 else "tab20"]
    markers = "osD^vP*X<>hp"
    colours = {s: palette(i % palette.N) for i, s in enumerate(strategies)}
    return colours, {s: markers[i % len(markers)] for i, s in enumerate(schedules)}


def write(
    points: Sequence[RooflinePoint], peak_flops_per_s: float, out_dir: str | Path, title: str = "DDL-Roofline"
) -> dict[str, str]:
    """Write ``roofline.json`` and ``roofline.png`` into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    finite = [p.r_cc for p in points if np.isfinite(p.r_cc) and p.r_cc > 0]
    # Around the points, with the knee at R_CC = 1 in view: the points do not crowd into one spot.
    lo = min([0.5, *finite]) / 2
    hi = max([2.0, *finite]) * 2
    grid = np.geomspace(lo, hi, 200)
    cv = curves(peak_flops_per_s, grid)
    fig, ax = plt.subplots(figsize=(9.5, 5.2), layout="constrained")
    ax.plot(grid, cv["ideal"] / 1e9, "k-", lw=1.2, label="ideal  P·min(1, R_CC)")
    ax.plot(grid, cv["semi_ideal"] / 1e9, "k--", lw=1.2, label="semi-ideal  P·R/(R+1)")
    curve_legend = ax.legend(loc="upper left", fontsize=8, title="bounds", title_fontsize=8)
    ax.add_artist(curve_legend)
    colour_of, marker_of = _styles(points)
    for p in points:
        strategy, _, schedule = p.label.partition("/")
        ax.scatter(
            [p.r_cc],
            [p.throughput_flops_per_s / 1e9],
            s=46 if p.kind == "predicted" else 70,
            color=colour_of[strategy],
            marker=marker_of[schedule] if p.kind == "predicted" else "x",
            edgecolors="black" if p.kind == "predicted" else None,
            linewidths=0.5,
            alpha=0.85,
        )
    # One legend entry per strategy (colour) and per schedule (marker), outside the axes.
    handles = [
        Line2D([], [], ls="", marker="o", color=c, markeredgecolor="black", label=s) for s, c in colour_of.items()
    ]
    handles += [
        Line2D([], [], ls="", marker=m, color="0.6", markeredgecolor="black", label=s) for s, m in marker_of.items()
    ]
    if any(p.kind == "measured" for p in points):
        handles.append(Line2D([], [], ls="", marker="x", color="black", label="measured"))
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        frameon=False,
        title="strategy (colour)\nschedule (shape)",
        title_fontsize=8,
    )
    ax.set_xscale("log")
    ax.set_xlabel("R_CC = Lat_comp / Lat_comm (forward expert time of the slowest device / one all-to-all)")
    ax.set_ylabel("P̄: achieved throughput per device (GFLOP/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    png = out / "roofline.png"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    js = out / "roofline.json"
    js.write_text(
        json.dumps(
            {
                "peak_flops_per_s": peak_flops_per_s,
                "points": [asdict(p) for p in points],
                "curves": {"r_cc": grid.tolist(), **{k: v.tolist() for k, v in cv.items()}},
            },
            indent=2,
        )
        + "\n"
    )
    return {"png": str(png), "json": str(js)}
