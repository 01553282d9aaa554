"""Time to recover from a killed worker, and the steps lost, with `moeflow train --max-restarts`.

    .venv/bin/python benchmarks/recovery.py --out results/recovery.json

For 2 and 4 processes: a clean run and a run whose rank 1 SIGKILLs itself at the start of step
`--kill-at` (`MOEFLOW_FAULT`, first attempt only), both on the tiny config with a checkpoint every
`--checkpoint-every` steps, alternated `--repeats` times.

- `recovery_s` (measured by the run itself, `metrics.jsonl`): from the last record of the killed
  group (step kill_at - 1, written just before the kill) to the restarted group starting its first
  step — detecting the death, stopping the group, starting new processes, rejoining, building the
  model and loading the checkpoint.
- `steps_lost`: steps done again — those recorded past the checkpoint and the one killed.
- `extra_wall_s`: the faulted run's wall time minus the clean run's (recovery plus recomputation),
  a cross-check.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MOEFLOW = str(Path(sys.executable).with_name("moeflow"))
TINY = [
    "model.n_layers=2",
    "model.d_model=32",
    "model.n_heads=2",
    "model.seq_len=32",
    "model.d_ff=64",
    "moe.d_hidden=64",
    "moe.num_experts=4",
    "data.max_bytes=300000",
    "train.global_batch_size=8",
    "train.eval_every=0",
]


def train(out: Path, nproc: int, steps: int, every: int, fault: str | None) -> tuple[float, dict]:
    argv = [MOEFLOW, "train", "--nproc", str(nproc), "--steps", str(steps), "--out", str(out), "--json"]
    argv += ["--max-restarts", "1"]
    for item in [*TINY, f"train.checkpoint_every={every}"]:
        argv += ["--set", item]
    env = dict(os.environ, **({"MOEFLOW_FAULT": fault} if fault else {}))
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return time.perf_counter() - start, json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/recovery.json")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kill-at", type=int, default=13)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--nprocs", type=int, nargs="+", default=[2, 4], metavar="N", help="process counts")
    args = parser.parse_args()
    result = {"command": " ".join(["python", *sys.argv]), "steps": args.steps, "kill_at": args.kill_at, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in args.nprocs:
            rows = []
            for r in range(args.repeats):
                clean_s, clean = train(Path(tmp) / f"c{nproc}{r}", nproc, args.steps, args.checkpoint_every, None)
                fault = f"kill@{args.kill_at}:1"
                faulted_s, faulted = train(Path(tmp) / f"f{nproc}{r}", nproc, args.steps, args.checkpoint_every, fault)
                rows.append(
                    {
                        "clean_s": clean_s,
                        "faulted_s": faulted_s,
                        "extra_wall_s": faulted_s - clean_s,
                        "restarts": faulted["restarts"],
                        "steps_lost": faulted["steps_lost"] + 1,  # recorded past the checkpoint + the killed one
                        "recovery_s": faulted["recovery_s"],
                        "load_avg_1min": os.getloadavg()[0],  # other work on the machine skews both runs
                    }
                )
            result["runs"][nproc] = rows
            rec = [row["recovery_s"] for row in rows]
            print(
                f"{nproc} processes: recovery {np.mean(rec):.1f} s ({min(rec):.1f}-{max(rec):.1f}), "
                f"steps lost {rows[0]['steps_lost']}, clean run {np.mean([x['clean_s'] for x in rows]):.1f} s, "
                f"faulted run {np.mean([x['faulted_s'] for x in rows]):.1f} s",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
