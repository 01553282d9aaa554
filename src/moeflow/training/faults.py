"""Fault injection for the fault-tolerance tests and `benchmarks/recovery.py` (never set in real runs).

`MOEFLOW_FAULT` is a comma list of `KIND@STEP[:RANK][+SECONDS]`, read in one place: the trainer,
once per optimizer step, after the step's forward pass and before its loss is reduced over ranks.

    kill@5:1      rank 1 SIGKILLs itself in step 5 (first attempt only: a restarted group runs
                  on, as after a real crash)
    stop@3:1      rank 1 SIGSTOPs itself in step 3 (first attempt only): its peers' collectives
                  time out (`train.collective_timeout_s`)
    stop@3:1+12   the same, and a helper SIGCONTs it 12 s later (a stall that ends; a process that
                  stays stopped is SIGKILLed by torch's launcher 30 s after the run failed)
    nan@4         every rank's loss of step 4 becomes NaN (every attempt); nan@4:1 rank 1's only
"""

from __future__ import annotations

import os
import signal
import subprocess

from moeflow.core.launch import restart_count

ENV = "MOEFLOW_FAULT"
KINDS = ("kill", "stop", "nan")


def parse(text: str) -> list[tuple[str, int, int | None, float | None]]:
    """`KIND@STEP[:RANK][+SECONDS]` items → (kind, step, rank or None, stall seconds or None)."""
    faults = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        kind, _, rest = item.partition("@")
        rest, _, seconds = rest.partition("+")
        step, _, rank = rest.partition(":")
        ok = kind in KINDS and step.isdigit() and (not rank or rank.isdigit())
        if not ok or (seconds and (kind != "stop" or not seconds.replace(".", "", 1).isdigit())):
            raise ValueError(
                f"{ENV}={text!r}: expected items KIND@STEP[:RANK] with KIND in {list(KINDS)}, "
                f"and +SECONDS only after stop"
            )
        faults.append((kind, int(step), int(rank) if rank else None, float(seconds) if seconds else None))
    return faults


def before_step(step: int, rank: int) -> bool:
    """Act on the faults of `step` for `rank`; returns whether this step's loss is to be NaN."""
    text = os.environ.get(ENV)
    if not text:
        return False
    nan = False
    for kind, at, who, seconds in parse(text):
        if at != step or (who is not None and who != rank):
            continue
        if kind == "nan":
            nan = True
        elif restart_count() == 0:
            if seconds is not None:  # a stopped process cannot wake itself
                wake = f"sleep {seconds:g}; kill -CONT {os.getpid()}"
                subprocess.Popen(["/bin/sh", "-c", wake], start_new_session=True)
            os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
    return nan
