"""Ctrl-C and SIGTERM during `moeflow train`: finish the step, checkpoint, say how to continue.

The first SIGINT or SIGTERM asks every rank to stop after its current step: the ranks agree on it
(a MAX all-reduce of one flag after every step, so no rank waits in a collective the others left),
write a checkpoint of that step and return; the command prints the `--resume` command and exits
with 130. A second signal, at least `SAME_SIGNAL_S` later, stops at once (the newest complete
checkpoint stays intact: checkpoints are atomic).

A terminal's Ctrl-C reaches the launcher and every rank at once, and the launcher also passes each
signal on to the ranks (a `kill` of the launcher alone reaches them that way), so a rank counts
every signal within `SAME_SIGNAL_S` of the first as the same request. torch's elastic agent, which
starts the ranks, would otherwise stop them on the first signal: `launch_local(...,
ranks_handle_interrupts=True)` leaves SIGINT/SIGTERM to `launcher_signals` (torch's
`LaunchConfig.signals_to_handle`). Under an outer torchrun, torchrun's agent passes the signal on
and stops the ranks after its shutdown timeout (`TORCHELASTIC_SHUTDOWN_TIMEOUT`, 30 s).

    with launcher_signals():          # the process that starts the ranks
        launch_local(worker, ..., ranks_handle_interrupts=True)
    stop = StopRequest(in_process=False).install()   # every rank, first thing
    if stop.agreed(distributed, device): ...          # after each step
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

SAME_SIGNAL_S = 1.0
"""Signals this close to the first are the same request (the terminal's and the launcher's copy)."""

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """This rank's view of a stop request (module docstring)."""

    def __init__(self, in_process: bool, say: bool = True) -> None:
        self.in_process = in_process
        """True when this process is the command itself (one process): a second signal raises
        KeyboardInterrupt for the command to report; else the rank ends by the signal."""
        self.say = say
        self.first_at: float | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.first_at is not None

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
            if self.say:
                print(
                    f"\nmoeflow: {signal.Signals(signum).name}: finishing this step on every rank, then a checkpoint "
                    f"(Ctrl-C again to stop at once)",
                    file=sys.stderr,
                    flush=True,
                )
            return
        if now - self.first_at < SAME_SIGNAL_S:
            return  # the same request, delivered twice
        self.uninstall()
        if self.in_process:
            raise KeyboardInterrupt
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # a rank ends at once, by the signal

    def agreed(self, distributed: bool, device: torch.device) -> bool:
        """Collective when `distributed`: whether any rank was asked to stop."""
        if not distributed:
            return self.requested
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


@contextlib.contextmanager
def launcher_signals() -> Iterator[None]:
    """In the process that starts local ranks: pass SIGINT/SIGTERM on to them (each rank decides,
    `StopRequest`) instead of letting the elastic agent stop them; a second signal, later than
    `SAME_SIGNAL_S`, raises KeyboardInterrupt here (the agent then stops the ranks)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    first: list[float] = []

    def handle(signum: int, frame: Any) -> None:
        now = time.monotonic()
        if first and now - first[0] >= SAME_SIGNAL_S:
            raise KeyboardInterrupt
        if not first:
            first.append(now)
        for child in multiprocessing.active_children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signum)

    previous = {sig: signal.signal(sig, handle) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
