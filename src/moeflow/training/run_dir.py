"""The run folder (docs/training.md): what `moeflow train --out DIR` writes there, and how a fresh run,
a resumed run and the final summary treat it.

    DIR/config.toml  metrics.jsonl  routing.npz  checkpoints/step_N/  *.png
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from moeflow.training import checkpoint

METRICS_FILE = "metrics.jsonl"
TRACE_FILE = "routing.npz"


def truncate_metrics(path: Path, last_step: int) -> int:
    """Drop records after `last_step` (written by a run that died after its last checkpoint);
    returns how many steps past it had been recorded (the steps a crash lost)."""
    if not path.exists():
        return 0
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    kept, newest = [], last_step
    for ln in lines:
        try:
            step = json.loads(ln)["step"]
        except (json.JSONDecodeError, KeyError):
            break  # a torn last line from a killed writer
        if step <= last_step:
            kept.append(ln)
        newest = max(newest, step)
    path.write_text("".join(k + "\n" for k in kept))
    return newest - last_step


def clear_run(out: Path) -> None:
    """A fresh (not resumed) run replaces the files of an earlier run in the same folder."""
    old = [out / METRICS_FILE, out / TRACE_FILE, out / "checkpoints"]
    if any(p.exists() for p in old):
        print(
            f"note: starting a fresh run in {out} (replacing the previous run there; --resume continues it instead)",
            flush=True,
        )
    for p in old:
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)


def format_summary(summary: dict[str, Any]) -> str:
    """The lines printed at the end of `moeflow train`: what happened and where the results are."""
    out = Path(summary["out"])
    lines = [f"trained steps {summary['first_step']} -> {summary['last_step']} on {summary['corpus']}"]
    if summary.get("restarts"):
        lines.append(f"recovered from {summary['restarts']} failure(s), {summary['steps_lost']} step(s) recomputed")
    if summary.get("skipped_steps"):
        lines.append(f"skipped {summary['skipped_steps']} step(s) with a non-finite loss or gradient")
    if "first_loss" in summary:
        val = summary.get("val_loss")
        lines.append(
            f"loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}"
            + (f" (validation {val:.3f})" if val is not None else "")
        )
    lines.append(f"results in {out}/:")
    lines.append(f"  config.toml, {METRICS_FILE}" + (f", {TRACE_FILE}" if (out / TRACE_FILE).exists() else ""))
    lines += [f"  {Path(p).name}" for p in summary.get("plots", [])]
    newest = checkpoint.latest_checkpoint(out / "checkpoints")
    if newest is not None:
        lines.append(f"  checkpoints/{newest.name}  (moeflow train --out {out} --resume; moeflow generate --run {out})")
    return "\n".join(lines)
