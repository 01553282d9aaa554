"""`moeflow generate`: sample text from a training run's checkpoint (one process, CPU or GPU).

moeflow generate --run runs/default --prompt "def " --length 300 --temperature 0.8 --top-k 40
moeflow generate --run runs/default --checkpoint runs/default/checkpoints/step_00000100 --json

The text is printed as it is sampled, in the run's tokens (`data.tokenizer`: bytes, or its BPE).
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
    parser.add_argument("--length", type=int, default=300, metavar="N", help="tokens to generate (bytes by default)")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 = greedy")
    parser.add_argument("--top-k", type=int, default=40, metavar="K", help="sample among the K most likely tokens")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--json", action="store_true", help="print {step, prompt, text} as JSON")


def run(args) -> int:
    from moeflow.training.generate import load_model, run_tokenizer, sample
    from moeflow.training.tokenizer import TextStream

    model, step = load_model(args.run, args.checkpoint)
    tokenizer = run_tokenizer(args.run)
    prompt_ids = [int(t) for t in tokenizer.encode(args.prompt.encode())] or [int(t) for t in tokenizer.encode(b"\n")]
    tokens = sample(model, prompt_ids, args.length, args.temperature, args.top_k, args.seed)
    stream = TextStream(tokenizer)
    if args.json:
        generated = [int(t) for t in tokens]
        print(json.dumps({"step": step, "prompt": args.prompt, "text": args.prompt + tokenizer.decode(generated)}))
        return 0
    print(f"# {args.run}, checkpoint step {step}", file=sys.stderr)
    pending = args.prompt  # shown with the first token: notices of the first forward come before the text
    for token in tokens:  # the text as it is sampled
        sys.stdout.write(pending + stream.push(token))
        sys.stdout.flush()
        pending = ""
    sys.stdout.write(pending + stream.finish() + "\n")
    return 0
