"""The `strategy` axis: what a planner is, what it can do, and the skeleton of one that plans ahead.

A planner is a pure function of numbers: `planner(flow_WE, placement, cost_model) -> Placement` —
the global flow of this iteration (every rank has it after the count exchange), the current owners,
the run's cost model — returning where every expert is materialized. The layer, the simulator and
the benchmarks call it the same way, on every rank with the same numbers, so every rank computes
the same plan without talking.

What else a planner can do is declared on its class and read as such (never probed):

- `needs_cost_model`: it prices placements (built only with a cost model).
- `plans_ahead`: the next call's placement is known before that call, from the flows seen so far
  (Pro-Prophet §IV-C, Hecate §4.2, EPLB): `next_placement()`, `observe(flow)`, and
  `use_prefetch(window)` from the block-wise prefetch that sends it ahead.
- `observes_time`: it learns from the layer's measured times (`strategy="auto"`): `observe_time`.
- `reshards_owners`: it moves whole expert shards every `reshard_interval` optimizer steps (Hecate
  §4.3, Algorithm 2): `expert_load()`, `owners_changed(placement, cost_model)`.
- `rematerializes`: copies are freed after their forward use and gathered again for backward.
- `reads_flow`: its placement depends on the flow (off for plain EP): with data-parallel replicas of
  the experts the layer then plans on the mean of the replicas' flows, so that they decide alike.

`choice()` names the planner whose placement ran (a composite's, `auto`'s); None: the planner itself.

Shape suffixes: W ranks of the expert-parallel group, E experts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from moeflow.core.placement import Placement
from moeflow.strategies.planners.ahead import PlanAhead
from moeflow.strategies.planners.prophet_model import Pricing


@dataclass(frozen=True)
class PrefetchWindow:
    """What the block-wise prefetch measured of the compute that hides a layer's copies (Pro-Prophet
    Eq. 8), handed to a planner that plans ahead (`Planner.use_prefetch`)."""

    nonmoe_forward_s: float = 0.0
    """T_FNEC: forward time of the dense part of the block before (its backward: twice)."""
    hidden_share: float = 0.0
    """Share of the compute windows that really hid copies (0 until measured; 1: Eq. 8 as printed)."""
    experts_hide: bool = True
    """The experts' compute is part of the windows (Eq. 8); False: the dense part alone (Hecate §3.2,
    the simulator's `--overlap-attention`)."""


class Planner:
    """Base of every planner (module docstring): capabilities off, their methods no-ops."""

    name: ClassVar[str] = "planner"
    needs_cost_model: ClassVar[bool] = False
    plans_ahead: ClassVar[bool] = False
    observes_time: ClassVar[bool] = False
    reshards_owners: ClassVar[bool] = False
    reads_flow: ClassVar[bool] = True
    rematerializes: bool = False
    reshard_interval: int = 0
    """Optimizer steps between re-shardings (`reshards_owners`; 0: never)."""

    def __call__(self, flow_WE: np.ndarray, placement: Placement, cost_model: Any = None) -> Placement:
        raise NotImplementedError

    def choice(self) -> str | None:
        return None

    def hold(self, flow_WE: np.ndarray, placement: Placement, cost_model: Any = None) -> Placement:
        """This call's placement without starting a search for the next (the flow recorded); a
        planner that decides on the current flow decides as when called."""
        return self(flow_WE, placement, cost_model)

    def current(self, flow_WE: np.ndarray, placement: Placement, cost_model: Any = None) -> Placement:
        """This call's placement, nothing recorded: a composite records the flow and starts the
        next search after its own work (`record`; `strategy="auto"`, on the planning thread). A
        planner that decides on the current flow decides as when called."""
        return self(flow_WE, placement, cost_model)

    def defer(self) -> Any:
        """After `current`: until `record` runs (a composite's job on the planning thread), readers
        of the next call's plan wait for it. Returns what `record` needs to settle it (None: nothing
        to wait for)."""
        return None

    def record(
        self, flow_WE: np.ndarray, placement: Placement, cost_model: Any, search: bool, deferred: Any = None
    ) -> None:
        """After `current`: record the call's flow and, with `search`, plan the next call's
        placement here, on the calling thread (a composite's job on the planning thread); then
        settle what `defer` returned."""

    def on_pricer(self, pricer: Any, flow_WE: np.ndarray, placement: Placement, cost_model: Any = None) -> Placement:
        """This call's placement, priced on `pricer` where the planner prices placements on this
        flow: a `perf.everywhere_pricing.EverywherePricer` a composite built on this flow and the
        placement's owners and prices its proposals on too (`strategy="auto"`: one pricer a call).
        Default: as when called."""
        del pricer
        return self(flow_WE, placement, cost_model)

    # ---- plans_ahead ---------------------------------------------------------------------------------
    def next_placement(self) -> Placement | None:
        """The placement the next call will run (None: not known yet)."""
        return None

    def observe(self, flow_WE: np.ndarray) -> None:
        """Record a call's flow without planning (a composite that does not ask it this call)."""

    def plan_next(self, placement: Placement, cost_model: Any, inline: bool = False) -> None:
        """Start the search for the next call's placement (after `hold`; `inline`: run it here)."""

    def planned(self) -> PlanAhead | None:
        """The next call's plan `(placement, decision)` as it stands — its value, or the future of the
        search just started — for a job queued behind that search on the planning thread (it never
        reads the planner); None where the planner does not plan ahead."""
        return None

    def use_prefetch(self, window: PrefetchWindow | None) -> None:
        """The block-wise prefetch sends this planner's next placements ahead (None: it does not)."""

    # ---- observes_time -------------------------------------------------------------------------------
    def observe_time(self, samples: list) -> None:
        """The layer's measured forwards, oldest first (`strategies.timing.Sample`)."""

    # ---- reshards_owners -----------------------------------------------------------------------------
    def expert_load(self) -> np.ndarray | None:
        """Estimated tokens per expert `[E]`, for re-sharding (None: nothing seen yet)."""
        return None

    def owners_changed(self, placement: Placement, cost_model: Any) -> None:
        """The shards moved (`core.resharding`): re-plan on the new owners."""


class FunctionPlanner(Planner):
    """A plain function `(flow_WE, placement, cost_model) -> Placement` as a planner."""

    def __init__(self, plan: Callable[..., Placement]) -> None:
        self.plan = plan

    def __call__(self, flow_WE: np.ndarray, placement: Placement, cost_model: Any = None) -> Placement:
        return self.plan(flow_WE, placement, cost_model)


def as_planner(value: Planner | Callable[..., Placement]) -> Planner:
    """`value` as a `Planner` (a plain callable is wrapped)."""
    if isinstance(value, Planner):
        return value
    if not callable(value):
        raise TypeError(f"strategy={value!r}: expected a name, a Planner or a callable returning a Placement")
    return FunctionPlanner(value)


class PlanAheadPlanner(Planner):
    """Iteration j runs on the placement planned from the flows of iterations < j: Pro-Prophet's
    Plan, Hecate's sparse materialization, EPLB. The search for the next placement is a pure
    function of captured inputs (`search`), run on the planning thread while the layer exchanges
    and computes (`planners.ahead`); a wrong prediction costs time, never correctness — the layer
    runs the planned placement on the real flow."""

    needs_cost_model = True
    plans_ahead = True

    def __init__(self, window: int, background: bool = True) -> None:
        self.history: deque[np.ndarray] = deque(maxlen=window)
        self._whole: deque[bool] = deque(maxlen=window)
        """Whether each flow of the window is whole counts (a mean of data-parallel replicas' flows may not be)."""
        self._sum_WE: np.ndarray | None = None
        """The window's sum while every flow in it is whole counts (None: not kept, or to be summed again)."""
        self.prefetch: PrefetchWindow | None = None
        """Set by the block-wise prefetch: copies are priced as it hides them (Eq. 8)."""
        self.last: Any = None
        """The decision behind the running placement (each planner's own record)."""
        self.next_plan = PlanAhead(background)  # (placement, decision), planned off the critical path
        self.running: Placement | None = None
        """The placement of the last call."""

    def search(self, flow_WE: np.ndarray, placement: Placement, cost_model: Any) -> tuple[Callable, tuple]:
        """The search for the next placement and its inputs, read from the planner now: a function
        `(*inputs) -> (Placement, decision)` that never reads the planner while it runs."""
        raise NotImplementedError

    def estimate(self) -> np.ndarray:
        """The next iteration's flow: the mean of the window. Counts are whole numbers in float64,
        so the running sum `observe` keeps is exact and its mean the window's to the bit; a window
        holding a fractional flow is averaged whole (`np.mean` of the stack)."""
        if not all(self._whole):
            return np.mean(np.stack(self.history), axis=0)
        if self._sum_WE is None:
            self._sum_WE = np.sum(np.stack(self.history), axis=0)
        return self._sum_WE / len(self.history)

    def pricing(self) -> Pricing:
        """How its searches price copies: hidden by the prefetch's measured window (Eq. 8), or in full."""
        if self.prefetch is None:
            return Pricing()
        window = self.prefetch
        return Pricing(True, window.nonmoe_forward_s, window.hidden_share, window.experts_hide)

    def adjust(self, flow_WE: np.ndarray, planned: Placement, cost_model: Any) -> Placement:
        """The planned placement, seen against the real flow before it runs (default: as planned)."""
        return planned

    def plan_next(self, placement: Placement, cost_model: Any, inline: bool = False) -> None:
        """Start the search for the next call's placement (default: every call, on the estimate) on
        the planning thread, or with `inline` run it here."""
        search, inputs = self.search(self.estimate(), placement, cost_model)
        if inline:
            self.next_plan.set(search(*inputs))
        else:
            self.next_plan.submit(search, *inputs)

    def use_prefetch(self, window: PrefetchWindow | None) -> None:
        self.prefetch = window

    def observe(self, flow_WE: np.ndarray) -> None:
        """Add a flow to the window and to its running sum (one add and one subtract a call, where
        stacking the window costs `window` passes over W·E)."""
        raw = np.asarray(flow_WE)
        flow = raw.astype(np.float64, copy=False)
        whole = raw.dtype.kind in "iub" or bool(np.array_equal(flow, np.rint(flow)))
        if self._sum_WE is not None and len(self.history) == self.history.maxlen:
            self._sum_WE -= self.history[0]  # the oldest leaves the window
        self.history.append(flow)
        self._whole.append(whole)
        if not whole:
            self._sum_WE = None
        elif self._sum_WE is not None:
            self._sum_WE += flow

    def planned(self) -> PlanAhead:
        return self.next_plan.snapshot()

    def next_placement(self) -> Placement | None:
        plan = self.next_plan.result()
        if plan is None:
            return None
        placement, self.last = plan
        return placement

    def __call__(self, flow_WE: np.ndarray, placement: Placement, cost_model: Any = None) -> Placement:
        return self._run(flow_WE, placement, cost_model, search=True)

    def hold(self, flow_WE: np.ndarray, placement: Placement, cost_model: Any = None) -> Placement:
        """This call's placement, the flow recorded, and the same plan standing for the next call
        (no search started)."""
        return self._run(flow_WE, placement, cost_model, search=False)

    def current(self, flow_WE: np.ndarray, placement: Placement, cost_model: Any = None) -> Placement:
        """This call's placement — the plan standing, seen against the real flow (`adjust`) — and
        the same plan standing for the next call; the flow is not recorded (`record`)."""
        if cost_model is None:
            raise ValueError(f"strategy={self.name!r} needs cost_model= (a moeflow.perf.costmodel.CostModel)")
        planned = self.next_placement()
        if planned is None or not np.array_equal(planned.owner_E, placement.owner_E):
            planned = Placement.owners_only(placement.owner_E, placement.world_size)  # first call, or re-sharded
        self.running = self.adjust(flow_WE, planned, cost_model)
        self.next_plan.set((planned, self.last))
        return self.running

    def defer(self) -> tuple:
        standing = self.next_plan.result()
        return standing, self.next_plan.promise()

    def record(
        self, flow_WE: np.ndarray, placement: Placement, cost_model: Any, search: bool, deferred: Any = None
    ) -> None:
        try:
            self.observe(flow_WE)
            if search:
                self.plan_next(placement, cost_model, inline=True)
        except BaseException as error:  # the plan's readers learn why
            if deferred is not None:
                deferred[1].set_exception(error)
            raise
        if deferred is not None:  # the plan made, or the one standing
            standing, promise = deferred
            plan = standing if self.next_plan.keeps(promise) else self.next_plan.result()
            self.next_plan.set(plan)
            promise.set_result(plan)

    def _run(self, flow_WE: np.ndarray, placement: Placement, cost_model: Any, search: bool) -> Placement:
        running = self.current(flow_WE, placement, cost_model)
        self.observe(flow_WE)
        if search:
            self.plan_next(placement, cost_model)
        return running
