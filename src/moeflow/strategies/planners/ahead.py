"""Plans made ahead, off the critical path.

A planner that plans iteration j+1 from the flows of iterations ≤ j (Pro-Prophet's Plan, Hecate's
sparse materialization, EPLB) does not need the result before iteration j+1 starts. So the search
runs on one background thread per process while the layer exchanges and computes (gloo, torch and
numpy release the GIL while they wait or compute: Pro-Prophet §V overlaps Plan with the
all-to-all), and the next call collects it. Every input of the search is captured when it is
submitted — never read from the planner while it runs — so every rank computes the same plan
whenever its thread gets to it.

The searches are Python (numpy on small arrays): running beside other Python of the main thread,
they take the GIL from it in 5 ms slices. A caller with more Python on the critical path after
its planners' calls (the `auto` arbiter pricing every proposal) opens `searches_deferred()`: the
searches submitted inside start when it ends, in an order the caller may choose (`auto` puts first
those it will price at its next call).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, NamedTuple

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_LOCAL = threading.local()  # .deferred: the PlanAheads whose searches wait for the block's end


def planning_pool() -> ThreadPoolExecutor:
    """The process's one planning thread, shared by every planner of every layer (searches queue
    in submission order)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeflow-plan")
        return _POOL


@contextmanager
def searches_deferred() -> Iterator[list]:
    """Searches submitted inside the block start when it ends (module docstring), in the order of
    the list it yields (the `PlanAhead`s submitted; the caller may reorder it in place); nests."""
    outer = getattr(_LOCAL, "deferred", None)
    if outer is not None:
        yield outer
        return
    _LOCAL.deferred = []
    try:
        yield _LOCAL.deferred
    finally:
        pending, _LOCAL.deferred = _LOCAL.deferred, None
        for plan in pending:
            plan.start()


class _Search(NamedTuple):
    search: Callable[..., Any]
    args: tuple


class PlanAhead:
    """The next plan of a planner: a value, or the future of one (resolved at first use).
    `background=False` runs each search inline (the same values; for tests and debugging)."""

    def __init__(self, background: bool = True) -> None:
        self.background = background
        self._plan: Any = None

    def submit(self, search: Callable[..., Any], *args: Any) -> None:
        """Start `search(*args)` (at the end of an open `searches_deferred()`); `args` are what it
        runs on (captured now)."""
        if not self.background:
            self._plan = search(*args)
            return
        self._plan = _Search(search, args)
        deferred = getattr(_LOCAL, "deferred", None)
        if deferred is None:
            self.start()
        else:
            deferred.append(self)

    def start(self) -> None:
        """Hand a submitted search to the planning thread (no-op once started or done)."""
        if isinstance(self._plan, _Search):
            self._plan = planning_pool().submit(self._plan.search, *self._plan.args)

    def set(self, plan: Any) -> None:
        self._plan = plan

    def result(self) -> Any:
        """The plan (None before the first), waiting for its search if it is still running (running
        it here if it has not started)."""
        if isinstance(self._plan, _Search):
            self._plan = self._plan.search(*self._plan.args)
        if isinstance(self._plan, Future):
            self._plan = self._plan.result()
        return self._plan

    def __getstate__(self) -> dict:
        """Copies (deepcopy, pickling in checkpoints) carry the finished plan, never the future."""
        self.result()
        return dict(self.__dict__)
