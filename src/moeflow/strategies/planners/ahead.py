"""Plans made ahead, off the critical path.

A planner that plans iteration j+1 from the flows of iterations ≤ j (Pro-Prophet's Plan, Hecate's
sparse materialization, EPLB) does not need the result before iteration j+1 starts. So the search
runs on one background thread per process while the layer exchanges and computes (gloo, torch and
numpy release the GIL while they wait or compute: Pro-Prophet §V overlaps Plan with the
all-to-all), and the next call collects it. Every input of the search is captured when it is
submitted — never read from the planner while it runs — so every rank computes the same plan
whenever its thread gets to it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def planning_pool() -> ThreadPoolExecutor:
    """The process's one planning thread, shared by every planner of every layer (searches queue
    in submission order)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeflow-plan")
        return _POOL


class PlanAhead:
    """The next plan of a planner: a value, or the future of one (resolved at first use).
    `background=False` runs each search inline (the same values; for tests and debugging)."""

    def __init__(self, background: bool = True) -> None:
        self.background = background
        self._plan: Any = None

    def submit(self, search: Callable[..., Any], *args: Any) -> None:
        """Start `search(*args)` on the planning thread; `args` are what it runs on (captured now)."""
        self._plan = planning_pool().submit(search, *args) if self.background else search(*args)

    def set(self, plan: Any) -> None:
        self._plan = plan

    def promise(self) -> Future:
        """A future a job on the planning thread resolves with the next plan (readers wait for it)."""
        self._plan = Future()
        return self._plan

    def keeps(self, promise: Future) -> bool:
        """Whether the plan is still `promise` (its job made no other)."""
        return self._plan is promise

    def snapshot(self) -> PlanAhead:
        """The plan as it stands now (a value, or the future of the search submitted last), kept
        apart from later `submit`/`set`: a job queued behind that search may read it."""
        copy = PlanAhead(self.background)
        copy._plan = self._plan
        return copy

    def result(self) -> Any:
        """The plan (None before the first), waiting for its search if it is still running."""
        if isinstance(self._plan, Future):
            self._plan = self._plan.result()
        return self._plan

    def __getstate__(self) -> dict:
        """Copies (deepcopy, pickling in checkpoints) carry the finished plan, never the future."""
        self.result()
        return dict(self.__dict__)
