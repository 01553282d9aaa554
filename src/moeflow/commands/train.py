"""`moeflow train`: train the MoE-GPT (by default on the embedded corpus) on one or more processes.

moeflow train --config configs/tiny.toml --nproc 2 --out runs/default
moeflow train --config configs/tiny.toml --set moe.top_k=1 --steps 50 --record-routing
moeflow train --out runs/default --resume --steps 400          # continue (config.toml of the run)
moeflow train --nproc 4 --max-restarts 3 --set train.collective_timeout_s=120   # heal after a crash
torchrun --nproc-per-node 8 -m moeflow.cli train --config configs/small.toml --out runs/small
"""

from __future__ import annotations

import json
import sys

HELP = "train the MoE-GPT on the embedded corpus (or --data) with expert parallelism"


def add_arguments(parser) -> None:
    parser.add_argument("--config", metavar="FILE.toml", help="TOML config (see configs/); default: built-in")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set moe.top_k=1 (repeatable)",
    )
    parser.add_argument(
        "--nproc", type=int, metavar="N", help="local processes (expert-parallel ranks); default 1, or torchrun's ranks"
    )
    parser.add_argument("--steps", type=int, metavar="N", help="total optimizer steps (train.steps)")
    parser.add_argument("--out", default="runs/default", metavar="DIR", help="run folder (default: %(default)s)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
    parser.add_argument(
        "--overwrite", action="store_true", help="start afresh in --out, replacing the run it holds (else an error)"
    )
    parser.add_argument("--data", metavar="PATH", help="train on this text file or folder (data.path)")
    parser.add_argument(
        "--cost-model",
        metavar="PRESET|PROFILE.json",
        help="network/GEMM cost model of the cluster (moe.cost_model) for the strategies that price placements "
        "(moe.strategy=shadow, prophet, eplb, fssdp, auto), schedule=auto, gate=hierarchical, balance=ta_moe; "
        "default: this machine's, measured at start-up (a few seconds) and cached",
    )
    parser.add_argument(
        "--record-routing",
        action="store_true",
        help="write every step's routing flow matrices to DIR/routing.npz (docs/traces.md)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        metavar="N",
        help="when a process dies, restart the group from the newest checkpoint up to N times (train.max_restarts)",
    )
    parser.add_argument("--json", action="store_true", help="print the final summary as JSON")


def run(args) -> int:
    from pathlib import Path

    from moeflow.training.checkpoint import latest_checkpoint
    from moeflow.training.config_files import load_config
    from moeflow.training.entry import launch
    from moeflow.training.run_dir import format_summary

    out = Path(args.out)
    overrides = list(args.overrides)
    overrides += [f"train.steps={args.steps}"] if args.steps is not None else []
    overrides += [f"data.path={args.data}"] if args.data is not None else []
    overrides += [f"moe.cost_model={args.cost_model}"] if args.cost_model is not None else []
    overrides += ["train.record_routing=true"] if args.record_routing else []
    overrides += [f"train.max_restarts={args.max_restarts}"] if args.max_restarts is not None else []
    config_path = args.config
    if args.resume and config_path is None and (out / "config.toml").is_file():
        config_path = out / "config.toml"  # continue with the run's own resolved config
    cfg = load_config(config_path, overrides)
    resume_command = f"moeflow train --out {out} --resume" + (f" --nproc {args.nproc}" if args.nproc else "")
    try:
        summary = launch(cfg, out, args.resume, args.nproc, overwrite=args.overwrite)
    except KeyboardInterrupt:  # a second Ctrl-C: stopped at once
        newest = latest_checkpoint(out / "checkpoints")
        kept = f"the newest checkpoint is {newest}" if newest is not None else "no checkpoint was written yet"
        print(f"\nmoeflow train: stopped at once; {kept} (continue with: {resume_command})", file=sys.stderr)
        return 130
    if summary is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    summary["resume_command"] = resume_command
    if "error" in summary:
        # Found by the training processes (non-finite loss, checkpoint mismatch): one line, like bad input.
        print(f"moeflow train: error: {summary['error']}", file=sys.stderr)
        return 1
    print(json.dumps(summary) if args.json else format_summary(summary))
    return 130 if summary.get("interrupted") else 0
