"""`moeflow` command line: one sub-command per module in `moeflow.commands`.

Each command module defines `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`.
Heavy imports live inside `run` so that `moeflow --help` stays fast.

    moeflow train --nproc 2 --out runs/demo
    moeflow bench --json
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

# name -> module; the order is the order of `moeflow --help` (README, "Command line").
COMMANDS = {
    "train": "moeflow.commands.train",
    "generate": "moeflow.commands.generate",
    "bench": "moeflow.commands.bench",
    "profile": "moeflow.commands.profile",
    "simulate": "moeflow.commands.simulate",
    "advise": "moeflow.commands.advise",
    "tune": "moeflow.commands.tune",
    "roofline": "moeflow.commands.roofline",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moeflow", description="Mixture-of-Experts training for skewed loads and uneven networks."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        cmd = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def _one_line(message, category, filename, lineno, line=None) -> str:
    return f"{category.__name__}: {message}\n"


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = _one_line  # notices (e.g. a cost model of another size) in one line
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        # Bad input: one line naming the culprit, no traceback.
        print(f"moeflow {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
