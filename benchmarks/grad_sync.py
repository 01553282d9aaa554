"""train.grad_sync on 2 gloo processes: step time of `ddp` and `fsmoe` buckets relative to
`after_backward`, and the time waited for outstanding all-reduces after the backward
(docs/training.md, docs/fsmoe.md). Same seed; modes interleaved over the repetitions.

    .venv/bin/python benchmarks/grad_sync.py --out results/grad_sync.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = ("after_backward", "ddp", "fsmoe")
SHAPE = [
    "model.n_layers=4",
    "model.d_model=128",
    "model.n_heads=4",
    "model.seq_len=64",
    "model.d_ff=256",
    "moe.d_hidden=256",
    "data.max_bytes=300000",
    "train.global_batch_size=8",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "train.grad_bucket_mb=0.25",
]


def _run(mode: str, steps: int, out: Path) -> dict:
    argv = ["train", "--nproc", "2", "--steps", str(steps), "--out", str(out), "--cost-model", "fsmoe_a", "--json"]
    for item in [*SHAPE, f"train.grad_sync={mode}"]:
        argv += ["--set", item]
    code = "import sys; from moeflow import cli; sys.exit(cli.main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tps = [r["tokens_per_s"] for r in records[1:]]  # step 1 warms up
    return {"tokens_per_s": statistics.median(tps), "wait_s": summary.get("grad_sync_wait_s", 0.0), **summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("results/grad_sync.json"))
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for mode in MODES:
                runs[mode].append(_run(mode, args.steps, Path(tmp) / f"{mode}_{rep}"))
    base = statistics.median(r["tokens_per_s"] for r in runs["after_backward"])
    result = {
        "steps": args.steps,
        "reps": args.reps,
        "shape": SHAPE,
        "modes": {
            m: {
                "step_time_ratio_vs_after_backward": base / statistics.median(r["tokens_per_s"] for r in rs),
                "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                "median_wait_s_per_step": statistics.median(r["wait_s"] for r in rs) / args.steps,
                "bucket_bytes": rs[0].get("grad_bucket_bytes"),
            }
            for m, rs in runs.items()
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
