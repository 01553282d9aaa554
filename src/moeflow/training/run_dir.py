"""The run folder (docs/training.md): what `moeflow train --out DIR` writes there, and how a fresh run,
a resumed run and the final summary treat it.

    DIR/config.toml  metrics.jsonl  routing.npz  checkpoints/step_N/  *.png
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, NamedTuple

from moeflow.training import checkpoint
from moeflow.training.strategy_report import format_strategy

METRICS_FILE = "metrics.jsonl"
TRACE_FILE = "routing.npz"


class Truncated(NamedTuple):
    steps_lost: int
    """Steps recorded past the checkpoint (recomputed now), plus those that earlier failures lost
    and whose records are dropped now (a second failure before the next checkpoint)."""
    last_written_s: float | None
    """Unix time of the newest record (the last sign of life of the failed run), if it has one."""


def truncate_metrics(path: Path, last_step: int) -> Truncated:
    """Drop records after `last_step` (written by a run that died after its last checkpoint)."""
    if not path.exists():
        return Truncated(0, None)
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    kept, newest, carried, written = [], last_step, 0, None
    for ln in lines:
        try:
            rec = json.loads(ln)
            step = rec["step"]
        except (json.JSONDecodeError, KeyError):
            break  # a torn last line from a killed writer
        if step <= last_step:
            kept.append(ln)
        else:
            carried += rec.get("steps_lost", 0)
        newest, written = max(newest, step), rec.get("unix_time_s", written)
    path.write_text("".join(k + "\n" for k in kept))
    return Truncated(newest - last_step + carried, written)


def recovery_totals(path: Path) -> dict[str, Any]:
    """`restarts`, `steps_lost` and `recovery_s` (failure → training again, summed) of the run,
    from the records that restarted groups wrote first."""
    restarts, lost, seconds = 0, 0, 0.0
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line) if line.strip() else {}
            restarts = max(restarts, rec.get("restart", 0))
            lost, seconds = lost + rec.get("steps_lost", 0), seconds + (rec.get("recovery_s") or 0.0)
    return {"restarts": restarts, "steps_lost": lost, "recovery_s": seconds}


def check_fresh(out: Path) -> None:
    """A fresh run never replaces an earlier one by surprise: a folder holding a run's metrics or
    checkpoints needs `--resume` (continue it) or `--overwrite` (replace it)."""
    held = [p.name for p in (out / METRICS_FILE, out / "checkpoints") if p.exists()]
    if held:
        newest = checkpoint.latest_checkpoint(out / "checkpoints")
        what = f"checkpoints/{newest.name}" if newest is not None else " and ".join(held)
        raise ValueError(
            f"--out {str(out)!r} holds a run ({what}): continue it with --resume, or replace it with "
            f"--overwrite (or choose another --out)"
        )


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
        lines.append(
            f"recovered from {summary['restarts']} failure(s) in {summary['recovery_s']:.1f} s, "
            f"{summary['steps_lost']} step(s) recomputed"
        )
    if summary.get("skipped_steps"):
        lines.append(f"skipped {summary['skipped_steps']} step(s) with a non-finite loss or gradient")
    lines += format_strategy(summary.get("strategy") or {})
    if "first_loss" in summary:
        val = summary.get("val_loss")
        lines.append(
            f"loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}"
            + (f" (validation {val:.3f})" if val is not None else "")
        )
    lines.append(f"results in {out}/:")
    kept = [name for name in (TRACE_FILE, "cost_model.json", "tokenizer.json") if (out / name).exists()]
    lines.append(", ".join(["  config.toml", METRICS_FILE, *kept]))
    lines += [f"  {Path(p).name}" for p in summary.get("plots", [])]
    newest = checkpoint.latest_checkpoint(out / "checkpoints")
    if newest is not None:
        lines.append(f"  checkpoints/{newest.name}  (moeflow train --out {out} --resume; moeflow generate --run {out})")
    if summary.get("interrupted"):
        lines.append(f"interrupted at step {summary['last_step']}: continue with  {summary['resume_command']}")
    return "\n".join(lines)
