"""`moeflow advise` against measured runs on this machine (docs/advise.md, "Checked against a run").

1. Plain EP (`configs/tiny.toml`, 2 ranks) trains `--steps` steps with `--record-routing`: the load.
2. `moeflow advise --cluster this --nproc 2 --config configs/tiny.toml --trace <that routing.npz>`
   ranks every strategy × schedule on this machine's measured cost model.
3. The winner, the runner-up of another strategy and plain EP train the same steps, in rounds
   (A B C, A B C, ...: machine noise meets them alike); a step's time is the median of the per-step
   `train_time_s` differences after `--warmup` steps.

Predicted and measured speedups over plain EP are compared (the prediction covers the MoE layers and
an estimate of the attention; the measured step also has embeddings, the head, the loss and AdamW).

    .venv/bin/python benchmarks/advise_check.py --steps 40 --rounds 2 --out results/advise_check.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOEFLOW = str(Path(sys.executable).parent / "moeflow")


def _train(out: Path, steps: int, sets: list[str], record: bool = False) -> list[dict]:
    argv = [MOEFLOW, "train", "--config", "configs/tiny.toml", "--nproc", "2", "--steps", str(steps)]
    argv += [
        "--out",
        str(out),
        "--overwrite",
        "--set",
        "train.eval_every=0",
        "--set",
        f"train.checkpoint_every={steps}",
    ]
    argv += [arg for s in sets for arg in ("--set", s)] + (["--record-routing"] if record else [])
    print(" ".join(argv[1:]), flush=True)
    done = subprocess.run(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"{out} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _step_s(records: list[dict], warmup: int) -> float:
    times = [r["train_time_s"] for r in records]
    return statistics.median(b - a for a, b in zip(times[warmup:], times[warmup + 1 :]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="results/advise_check.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="advise_check_"))
    _train(work / "record", args.steps, [], record=True)
    trace = work / "record" / "routing.npz"
    cmd = [MOEFLOW, "advise", "--nproc", "2", "--config", "configs/tiny.toml", "--trace", str(trace), "--json"]
    print(" ".join(cmd[1:]), flush=True)
    advice = json.loads(subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout)
    ranked = advice["candidates"]
    winner = ranked[0]
    other = next(c for c in ranked if c["strategy"] != winner["strategy"] and c["strategy"] != "ep")
    ep = next(c for c in ranked if (c["strategy"], c["schedule"]) == ("ep", "sync"))
    chosen = [ep, winner, other]
    measured: dict[str, list[float]] = {f"{c['strategy']}/{c['schedule']}": [] for c in chosen}
    for r in range(args.rounds):
        for c in chosen:
            label = f"{c['strategy']}/{c['schedule']}"
            sets = [f"moe.strategy={c['strategy']}", f"moe.schedule={c['schedule']}"]
            records = _train(work / f"{label.replace('/', '_')}_{r}", args.steps, sets)
            measured[label].append(_step_s(records, args.warmup))
    ep_s = statistics.median(measured["ep/sync"])
    rows = []
    for c in chosen:
        label = f"{c['strategy']}/{c['schedule']}"
        step = statistics.median(measured[label])
        rows.append(
            {
                "candidate": label,
                "rank": ranked.index(c) + 1,
                "predicted_step_s": c["step_s"],
                "predicted_speedup_vs_ep": c["speedup_vs_ep"],
                "measured_step_s": step,
                "measured_step_s_per_round": measured[label],
                "measured_speedup_vs_ep": ep_s / step,
            }
        )
    result = {
        "command": "benchmarks/advise_check.py " + " ".join(sys.argv[1:]),
        "advise_command": " ".join(cmd[1:]).replace(str(trace), "<recorded routing.npz>"),
        "cost_model": advice["cost_model"],
        "load_imbalance": advice["load_imbalance"],
        "winner_command": advice["winner_command"],
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for row in rows:
        print(
            f"{row['candidate']:<20} rank {row['rank']:>2}  predicted {1e3 * row['predicted_step_s']:8.1f} ms "
            f"({row['predicted_speedup_vs_ep']:.2f}x)  measured {1e3 * row['measured_step_s']:8.1f} ms "
            f"({row['measured_speedup_vs_ep']:.2f}x)"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
