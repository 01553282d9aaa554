"""`moeflow tune` against FSMoE's published degree tool (``tools/optim.py``, github.com/xpan413/FSMoE)
on a grid of layers: forward and backward pipeline degrees, case by case, and every difference
attributed to a rule of the tool that moeflow does not apply and priced with FSMoE's model.

    .venv/bin/python benchmarks/fsmoe_tool_agreement.py --out docs/results/2026-11-26-fsmoe-tool-agreement.json

The tool's answers are data, tests/data/fsmoe_tool_degrees.json (made by scripts/fsmoe_tool_grid.py:
where they come from, the grid, the constant sets). moeflow's are what `moeflow tune` computes with
the same inputs (``--alpha-ms``/``--beta-ms`` of the set, the tool's example factor, ESP, layers
and ``--others-ms``): `grad_partition.partition_gradients`, then `pipeline_degree.plan_degrees`.
For the set measured on this machine, also ``--cost-model`` its profile (moeflow's measured
per-chunk cost and overlap share η, which the tool has no terms for): reported, not attributed.

A differing degree is priced at both degrees with the same inputs (FSMoE Eq. 1 and the §4.2 case
formulas, `pipeline_degree.priced_time`; the backward at moeflow's t_gar of that layer) and
attributed to one of ``RULES``; ``None`` where no rule explains it. Where moeflow's own solver,
given the t_gar the tool solved that layer with (stored with its answers), gives the tool's degree,
the difference is in the inputs (``gradient_partition``), and each side's generalized layer is priced
with the gradient placement it chose.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "fsmoe_tool_degrees.json"
SHORT_A2A_MS = 1.0
RULES = {
    "short_all_to_all": "the tool's forward degree is 1 when one unchunked all-to-all takes < 1 ms",
    "backward_follows_forward": "the tool's backward degree of the layer that hides no gradient (the model's "
    "last) is 1 whenever its forward degree is 1",
    "cheaper_degree": "the tool prices a snapped degree only inside the case region of the SLSQP optimum "
    "it neighbours (one start per sub-problem) and misses a cheaper degree that moeflow prices by the case "
    "holding there",
    "gradient_partition": "the tool solves the layer with another t_gar (moeflow's solver gives the tool's "
    "degree at the tool's t_gar): it leaves the all-reduce of α_ar/β_ar elements in the dense part beyond "
    "its overlappable time, where moeflow conserves elements and keeps the dense part within it",
}


def load(path: Path = DATA) -> dict:
    return json.loads(path.read_text())


def workload_of(data: dict, row: list):
    from moeflow.perf.pipeline_inputs import PipelineWorkload

    e = data["example"]
    b, s, m, h, n = row[:5]
    return PipelineWorkload(b, s, m, h, n, e["factor"], e["esp"], e["layers"], e["others_ms"])


def compare_case(data: dict, row: list, fits) -> dict:
    """moeflow tune's degrees on one case, its differences from the tool's with their rule and
    priced times (ms): of the pass, and for ``gradient_partition`` of the generalized layer."""
    from moeflow.perf.grad_partition import dense_overlappable_ms, partition_gradients
    from moeflow.perf.pipeline_degree import find_degree, pass_model, plan_degrees, priced_time

    w = workload_of(data, row)
    tool_forward, tool_backward, tool_gar = row[5], row[6], row[7]
    partition = partition_gradients(w, fits)
    plan = plan_degrees(w, fits, partition.moe_gar_ms)
    forward_model, backward_model = pass_model(w, fits, False), pass_model(w, fits, True)
    unchunked_a2a_ms = fits.alpha("a2a") + fits.beta("a2a") * w.elements("a2a")
    diffs = []

    def priced(model, r: int, gar: float) -> float:
        return float(priced_time(model, r, gar))

    if plan.forward_degree != tool_forward:
        ours, theirs = plan.forward_degree, tool_forward
        rule = "short_all_to_all" if theirs == 1 and unchunked_a2a_ms < SHORT_A2A_MS else None
        t_ours, t_theirs = priced(forward_model, ours, 0.0), priced(forward_model, theirs, 0.0)
        if rule is None and t_ours < t_theirs:
            rule = "cheaper_degree"
        diffs.append({"pass": "forward", "moeflow": ours, "tool": theirs, "t_gar_ms": 0.0, "tool_t_gar_ms": 0.0,
                      "moeflow_ms": t_ours, "tool_ms": t_theirs, "rule": rule})  # fmt: skip
    for i, (ours, theirs) in enumerate(zip(plan.backward_degrees, tool_backward, strict=True)):
        if ours == theirs:
            continue
        gar, their_gar = partition.moe_gar_ms[i], tool_gar[i]
        t_ours, t_theirs = priced(backward_model, ours, gar), priced(backward_model, theirs, gar)
        rule = None
        if i == w.layers - 1 and gar == 0.0 and tool_forward == 1 and theirs == 1:
            rule = "backward_follows_forward"
        elif find_degree(backward_model, their_gar).degree == theirs and w.layers == 2 and i == 0:
            # the inputs differ; price the generalized layer whose gradient it hides (layer 1's, the
            # only one that any layer hides when there are two): MoE pipeline, plus the dense
            # part's all-reduce beyond its overlappable time, plus what is left exposed of it
            olp = dense_overlappable_ms(w, fits)
            g = w.grad_elements
            their_moe = fits.ar_fit_elements(their_gar) if their_gar > 0 else 0.0
            t_theirs = priced(backward_model, theirs, their_gar) + max(0.0, float(fits.ar_time_ms(g - their_moe)) - olp)
            exposed = partition.exposed_elements - g  # all but the model's first layer's gradient
            overflow = max(0.0, float(fits.ar_time_ms(partition.dense_elements[i])) - olp)
            t_ours = priced(backward_model, ours, gar) + overflow + float(fits.ar_time_ms(exposed))
            rule = "gradient_partition" if t_ours <= t_theirs else None
        elif t_ours < t_theirs:
            rule = "cheaper_degree"
        diffs.append({"pass": f"backward {i}", "moeflow": ours, "tool": theirs, "t_gar_ms": gar,
                      "tool_t_gar_ms": their_gar, "moeflow_ms": t_ours, "tool_ms": t_theirs, "rule": rule})  # fmt: skip
    return {
        "case": row[:5],
        "tool": [tool_forward, tool_backward],
        "moeflow": [plan.forward_degree, plan.backward_degrees],
        "moe_gar_ms": list(partition.moe_gar_ms),
        "tool_t_gar_ms": list(tool_gar),
        "unchunked_a2a_ms": unchunked_a2a_ms,
        "differences": diffs,
    }


def degrees_with_cost_model(data: dict, row: list, cost_model) -> list:
    """`moeflow tune --cost-model`: the profile with its measured per-chunk cost and η."""
    from moeflow.perf.pipeline_inputs import PipelineFits

    return tune_degrees(data, row, PipelineFits.from_cost_model(cost_model, workload_of(data, row)))


def summarize(rows: list[dict]) -> dict:
    entries = [d for r in rows for d in r["differences"]]
    by_rule = {}
    for rule in [*RULES, None]:
        picked = [d for d in entries if d["rule"] == rule]
        if not picked:
            continue
        ratios = [d["tool_ms"] / d["moeflow_ms"] for d in picked]
        by_rule[str(rule)] = {
            "cases": sum(any(d["rule"] == rule for d in r["differences"]) for r in rows),
            "degrees": len(picked),
            "passes": sorted({d["pass"] for d in picked}),
            "tool_over_moeflow_time": {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)},
            "tool_minus_moeflow_ms": {
                "min": min(d["tool_ms"] - d["moeflow_ms"] for d in picked),
                "max": max(d["tool_ms"] - d["moeflow_ms"] for d in picked),
            },
        }
    return {
        "cases": len(rows),
        "agree": sum(not r["differences"] for r in rows),
        "agree_forward": sum(r["tool"][0] == r["moeflow"][0] for r in rows),
        "agree_backward": sum(r["tool"][1] == r["moeflow"][1] for r in rows),
        "by_rule": by_rule,
        "unexplained": [r["case"] for r in rows if any(d["rule"] is None for d in r["differences"])],
    }


def tune_degrees(data: dict, row: list, fits) -> list:
    """`moeflow tune`'s forward and backward degrees of one case, nothing else."""
    from moeflow.perf.grad_partition import partition_gradients
    from moeflow.perf.pipeline_degree import plan_degrees

    w = workload_of(data, row)
    plan = plan_degrees(w, fits, partition_gradients(w, fits).moe_gar_ms)
    return [plan.forward_degree, plan.backward_degrees]


def count_agreement(data: dict, name: str) -> dict:
    """Cases agreeing (both passes, forward, backward) without attribution: runs on any moeflow
    with ``partition_gradients`` and ``plan_degrees``, e.g. a tree from before this comparison."""
    from moeflow.perf.pipeline_inputs import PipelineFits

    consts = data["sets"][name]
    fits = PipelineFits(tuple(consts["alpha_ms"]), tuple(consts["beta_ms"]))
    pairs = [(tune_degrees(data, row, fits), [row[5], row[6]]) for row in consts["cases"]]
    return {
        "cases": len(pairs),
        "agree": sum(a == b for a, b in pairs),
        "agree_forward": sum(a[0] == b[0] for a, b in pairs),
        "agree_backward": sum(a[1] == b[1] for a, b in pairs),
    }


def compare_set(data: dict, name: str) -> dict:
    from moeflow.perf.pipeline_inputs import PipelineFits

    consts = data["sets"][name]
    fits = PipelineFits(tuple(consts["alpha_ms"]), tuple(consts["beta_ms"]))
    rows = [compare_case(data, row, fits) for row in consts["cases"]]
    return {"summary": summarize(rows), "cases": rows}


def _rounded(value, digits: int = 4):
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: _rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v, digits) for v in value]
    return value


def dumps(result: dict) -> str:
    """The result as JSON: only the differing cases, one per line, times to 0.1 µs."""
    lines = {}
    for name, block in result["sets"].items():
        differing = [_rounded(row) for row in block.pop("cases") if row["differences"]]
        lines[name] = ",\n    ".join(json.dumps(row, separators=(",", ":")) for row in differing)
        block["differing_cases"] = f"@{name}@"
    text = json.dumps(result, indent=1, ensure_ascii=False)
    for name, body in lines.items():
        text = text.replace(f'"@{name}@"', f"[\n    {body}\n   ]")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument(
        "--profile", type=Path, default=ROOT / "docs/results/2026-11-26-fsmoe-tool-agreement.profile.json"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--counts-only", action="store_true", help="print the agreement counts, no attribution")
    args = parser.parse_args(argv)
    if args.counts_only:
        for name in (data := load(args.data))["sets"]:
            print(name, count_agreement(data, name))
        return 0
    from moeflow.perf.costmodel import CostModel

    data = load(args.data)
    result = {
        "command": "python benchmarks/fsmoe_tool_agreement.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "tool": data["source"],
        "rules": RULES,
        "sets": {},
    }
    for name in data["sets"]:
        result["sets"][name] = compare_set(data, name)
        s = result["sets"][name]["summary"]
        print(
            f"{name:<10} {s['agree']:>3}/{s['cases']} agree (forward {s['agree_forward']}, backward "
            f"{s['agree_backward']}); by rule: "
            + ", ".join(
                f"{k} {v['cases']} cases, tool/moeflow time {v['tool_over_moeflow_time']['min']:.3f}–"
                f"{v['tool_over_moeflow_time']['max']:.3f}"
                for k, v in s["by_rule"].items()
            )
        )
    cm = CostModel.load(args.profile)
    rows = data["sets"]["machine"]["cases"]
    with_cm = [degrees_with_cost_model(data, row, cm) for row in rows]
    result["machine_with_cost_model"] = {
        "cost_model": str(args.profile.relative_to(ROOT) if args.profile.is_relative_to(ROOT) else args.profile),
        "agree": sum([row[5], row[6]] == got for row, got in zip(rows, with_cm, strict=True)),
        "cases": len(rows),
        "degrees": {"forward": sorted({g[0] for g in with_cm}), "backward": sorted({d for g in with_cm for d in g[1]})},
    }
    m = result["machine_with_cost_model"]
    print(f"machine, --cost-model (chunk cost, eta): {m['agree']}/{m['cases']} agree; degrees {m['degrees']}")
    if args.out:
        args.out.write_text(dumps(result) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
