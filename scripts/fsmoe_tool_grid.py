"""Run FSMoE's published degree tool (``tools/optim.py`` of github.com/xpan413/FSMoE) over the grid
of issue 42 and store its answers as data (tests/data/fsmoe_tool_degrees.json), for
tests/test_fsmoe_tool_agreement.py and benchmarks/fsmoe_tool_agreement.py.

The tool is not part of moeflow: take its file from a checkout, run it outside the repository, e.g.

    git --git-dir=<clone>/.git show <commit>:tools/optim.py > /tmp/fsmoe-tool/optim.py
    .venv/bin/python scripts/fsmoe_tool_grid.py --tool-dir /tmp/fsmoe-tool --commit <commit> \\
        --profile docs/results/2026-11-26-fsmoe-tool-agreement.profile.json \\
        --out tests/data/fsmoe_tool_degrees.json

Each case calls the tool's own entry point ``get_optimal_degree`` (what its command line runs) with
its example's factor, ESP, MP, heads, layers and t_others, and parses what it prints; the t_gar per
layer that its backward degrees were solved with comes from the same construction (``tool_t_gar``,
not printed by the tool). Constant sets:
``published`` (the α-β its command line hard-codes), ``fsmoe_a`` (FSMoE Fig. 5 Testbed A, as the
``fsmoe_a`` preset converts them) and ``machine`` (``--profile``: a ``moeflow profile`` of this
machine), all in the tool's units and order (ms; a2a, ag, gemm, rs, ar). For the published set a few
cases also run the tool's command line itself, which must print the same.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import io
import itertools
import json
import platform
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import scipy

from moeflow.perf.costmodel import CostModel
from moeflow.perf.pipeline_inputs import PipelineFits, PipelineWorkload

REPOSITORY = "https://github.com/xpan413/FSMoE"
EXAMPLE = {"factor": 2.4, "esp": 8, "mp_size": 8, "heads": 32, "layers": 2, "others_ms": 1.3}
"""The tool's command-line defaults (its example: Mixtral-8x7B on 8-GPU nodes)."""
GRID = {
    "batch": [1, 2, 4, 8],
    "seq": [512, 1024, 2048],
    "d_model": [1024, 2048, 4096],
    "hidden_scale": [4.0, 3.5],
    "gemms": [2, 3],
}
PUBLISHED = {
    "alpha_ms": [0.23515350484, 0.0549, 0.591943532, 0.0688, 0.34099276392],
    "beta_ms": [1.8543323833e-06, 6.72388e-07, 5.6847387697e-11, 6.70433e-07, 3.4950701465e-06],
}
CLI_CHECKS = [(4, 1024, 4096, 14336, 3), (1, 512, 2048, 8192, 2), (2, 1024, 1024, 4096, 3)]


def git_blob_sha1(path: Path) -> str:
    """The id git gives the file's content (``git hash-object``): names the exact version run."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def grid_cases() -> list[tuple[int, int, int, int, int]]:
    return [(b, s, m, int(scale * m), n) for b, s, m, scale, n in itertools.product(*GRID.values())]


def parse(out: str) -> tuple[int, list[int]]:
    forward = int(re.search(r"forward degree:(\d+)", out).group(1))
    backward = json.loads(re.search(r"back degrees per layer:(\[[^\]]*\])", out).group(1))
    return forward, [int(d) for d in backward]


def run_tool(optim, case: tuple[int, ...], alpha: list[float], beta: list[float]) -> tuple[int, list[int]]:
    b, s, m, h, n = case
    e = EXAMPLE
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):  # the tool mutates its α/β lists: pass copies
        optim.get_optimal_degree(
            b, s, m, h, e["heads"], e["layers"], e["others_ms"], e["esp"], e["mp_size"], list(alpha), list(beta),
            e["factor"], n,
        )  # fmt: skip
    return parse(buf.getvalue())


def tool_t_gar(optim, case: tuple[int, ...], alpha: list[float], beta: list[float]) -> tuple[list[int], list[float]]:
    """The t_gar (ms) the tool's ``Optimizer.run`` hands ``optimize_degree`` for each MoE layer (its
    last layer: none, 0), with the backward degrees that run prints: built as ``get_optimal_degree``
    builds it."""
    b, s, m, h, n = case
    e, f = EXAMPLE, EXAMPLE["factor"]
    obj = optim.Optimizer(
        alpha=list(alpha), beta=list(beta), l=e["layers"], others=e["others_ms"],
        a=[f * b * s * m / e["esp"], f * b * s * m, f * b * s * m * h / e["esp"] * n, f * b * s * m],
    )  # fmt: skip
    moe_elements, _, degrees = obj.run(b, s, m, h, e["heads"], mp_size=e["mp_size"], att_type=0)
    return [int(d) for d in degrees] + [int(obj.d1)], [float(obj.gar_time(x)) for x in moe_elements] + [0.0]


def constant_sets(profile: Path) -> dict[str, dict]:
    # the conversion moeflow tune --cost-model applies (for ops with a fit the workload is unused)
    w = PipelineWorkload(4, 1024, 4096, 14336, 3, EXAMPLE["factor"], EXAMPLE["esp"], 2, EXAMPLE["others_ms"])
    sets = {"published": {"description": "the α-β the tool's command line hard-codes", **PUBLISHED}}
    for name, source, text in (
        ("fsmoe_a", "fsmoe_a", "FSMoE Fig. 5 (a, b), Testbed A, as moeflow's fsmoe_a preset converts them"),
        ("machine", str(profile), f"moeflow profile of this machine ({profile})"),
    ):
        fits = PipelineFits.from_cost_model(CostModel.resolve(source), w)
        sets[name] = {"description": text, "alpha_ms": list(fits.alpha_ms), "beta_ms": list(fits.beta_ms)}
    return sets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool-dir", type=Path, required=True, help="directory holding the tool's optim.py")
    parser.add_argument("--commit", required=True, help="the FSMoE commit optim.py was taken from")
    parser.add_argument("--profile", type=Path, required=True, help="moeflow profile JSON of this machine")
    parser.add_argument("--out", type=Path, default=Path("tests/data/fsmoe_tool_degrees.json"))
    args = parser.parse_args(argv)
    tool = (args.tool_dir / "optim.py").resolve()
    sys.path.insert(0, str(tool.parent))
    import optim  # the authors' tool, outside this repository

    cli = []
    for case in CLI_CHECKS:
        b, s, m, h, n = case
        flags = ["--B", b, "--L", s, "--M", m, "--H", h, "--number_gemm", n]
        argv_ = [str(x) for x in flags]
        out = subprocess.run([sys.executable, str(tool), *argv_], capture_output=True, text=True, check=True)
        got = parse(out.stdout)
        if got != run_tool(optim, case, PUBLISHED["alpha_ms"], PUBLISHED["beta_ms"]):
            raise SystemExit(f"the tool's command line and get_optimal_degree differ on {case}: {got}")
        cli.append(
            {"command": " ".join(["python optim.py", *argv_]), "stdout": " / ".join(out.stdout.split("\n")).strip(" /")}
        )
    sets = constant_sets(args.profile)
    for name, consts in sets.items():
        rows = []
        for case in grid_cases():
            forward, backward = run_tool(optim, case, consts["alpha_ms"], consts["beta_ms"])
            again, t_gar = tool_t_gar(optim, case, consts["alpha_ms"], consts["beta_ms"])
            if again != backward:
                raise SystemExit(f"{name} {case}: Optimizer.run gives {again}, get_optimal_degree {backward}")
            rows.append([*case, forward, backward, [round(t, 9) for t in t_gar]])
        consts["cases"] = rows
        print(f"{name}: {len(rows)} cases", flush=True)
    data = {
        "source": {
            "repository": REPOSITORY,
            "commit": args.commit,
            "path": "tools/optim.py",
            "blob_sha1": git_blob_sha1(tool),
            "entry_point": "get_optimal_degree (prints 'forward degree' and 'back degrees per layer')",
            "command": "python scripts/fsmoe_tool_grid.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "generated": datetime.date.today().isoformat(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "scipy": scipy.__version__,
            "cli_checks": cli,
        },
        "example": EXAMPLE,
        "grid": GRID,
        "columns": ["batch", "seq", "d_model", "d_hidden", "gemms", "forward", "backward", "t_gar_ms"],
        "sets": sets,
    }
    rows = {name: consts.pop("cases") for name, consts in sets.items()}
    for name in sets:
        sets[name]["cases"] = f"@cases:{name}@"
    text = json.dumps(data, indent=1, ensure_ascii=False)
    for name, cases in rows.items():  # one case per line: small and diffable
        lines = ",\n   ".join(json.dumps(row) for row in cases)
        text = text.replace(f'"@cases:{name}@"', f"[\n   {lines}\n  ]")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
