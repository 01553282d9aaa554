"""`moeflow generate`: sample text from a training run's checkpoint (one process, CPU or GPU).

moeflow generate --run runs/default --prompt "def " --length 300 --temperature 0.8 --top-k 40
moeflow generate --run runs/default --checkpoint runs/default/checkpoints/step_00000100 --json
"""

from __future__ import annotations

import json
import sys

HELP = "sample text from a trained run's checkpoint"


def add_arguments(parser) -> None:
    parser.add_argument(
        "--run",
        default="runs/default",
        metavar="DIR",
        help="run folder written by `moeflow train` (default: %(default)s)",
    )
    parser.add_argument("--checkpoint", metavar="DIR", help="a checkpoint folder (default: the run's newest)")
    parser.add_argument("--prompt", default="def ", help="text to continue (default: %(default)r)")
    parser.add_argument("--length", type=int, default=300, metavar="N", help="bytes to generate")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 = greedy")
    parser.add_argument("--top-k", type=int, default=40, metavar="K", help="sample among the K most likely bytes")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--json", action="store_true", help="print {step, prompt, text} as JSON")


def run(args) -> int:
    from moeflow.training.generate import generate, load_model

    model, step = load_model(args.run, args.checkpoint)
    out = generate(model, args.prompt.encode(), args.length, args.temperature, args.top_k, args.seed)
    text = out.decode("utf-8", errors="replace")
    if args.json:
        print(json.dumps({"step": step, "prompt": args.prompt, "text": text}))
    else:
        print(f"# {args.run}, checkpoint step {step}", file=sys.stderr)
        print(text)
    return 0
