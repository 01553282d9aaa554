"""Fault injection for the fault-tolerance tests and `benchmarks/recovery.py` (never set in real runs).

`MOEFLOW_FAULT` is a comma list of `KIND@STEP[:RANK]`, read once per optimizer step by the trainer:

    kill@5:1   rank 1 SIGKILLs itself at the start of step 5 (first attempt only: a restarted
               group runs on, as after a real crash)
    stop@3:1   rank 1 SIGSTOPs itself at the start of step 3 (first attempt only): its peers'
               collectives time out (`train.collective_timeout_s`)
    nan@4      every rank's loss of step 4 becomes NaN (every attempt)
"""

from __future__ import annotations

import os
import signal

from moeflow.core.launch import restart_count

ENV = "MOEFLOW_FAULT"
KINDS = ("kill", "stop", "nan")


def parse(text: str) -> list[tuple[str, int, int | None]]:
    """`KIND@STEP[:RANK]` items → (kind, step, rank or None)."""
    faults = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        kind, _, rest = item.partition("@")
        step, _, rank = rest.partition(":")
        if kind not in KINDS or not step.isdigit() or (rank and not rank.isdigit()):
            raise ValueError(f"{ENV}={text!r}: expected items KIND@STEP[:RANK] with KIND in {list(KINDS)}")
        faults.append((kind, int(step), int(rank) if rank else None))
    return faults


def before_step(step: int, rank: int) -> bool:
    """Act on the faults of `step` for `rank`; returns whether this step's loss is to be NaN."""
    text = os.environ.get(ENV)
    if not text:
        return False
    nan = False
    for kind, at, who in parse(text):
        if at != step or (who is not None and who != rank):
            continue
        if kind == "nan":
            nan = True
        elif restart_count() == 0:
            os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
    return nan
