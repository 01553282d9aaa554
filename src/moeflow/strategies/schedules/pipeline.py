"""`schedule="pipeline"`: FSMoE's pipelined block (FSMoE §3–§4, Fig. 6, Algorithm 1).

The dispatch → experts → combine block is split into r chunks. Every destination's piece of the
sent rows is split into r contiguous parts (`chunk_bounds`: part c of a piece of n rows is
``[n·c // r, n·(c+1) // r)``, so any r ≥ 1 works, with empty parts where r > n); chunk c is part c
of every piece. Per chunk: an asynchronous all-to-all out (D_c), the held experts on the chunk's
rows (E_c, with per-source per-expert counts derived from ``counts_SJ`` and the same boundaries,
`chunk_counts`, identical on sender and receiver) and an asynchronous all-to-all back (C_c). The
order posted is D_0, D_1, E_0, C_0, D_2, E_1, C_1, …: E_c overlaps D_{c+1} and C_{c−1} (Fig. 6).
FSMoE's intra-node ESP all-gather / reduce-scatter per chunk are not built here (``_intra_node``
marks where they go); with them absent, Eq. 1's per-chunk times and the §4.2 case formulas reduce
to ``max(2·t_a2a,r + r·t_exp,r, 2r·t_a2a,r)`` (Cases 2 and 3 with t_ag = t_rs = 0).

Backward (§4.4) has its own degree r_b. The block is one autograd Function: its forward keeps each
chunk's expert graph (detached chunk inputs), its backward runs its own chunk loop — the output
gradients re-chunked into r_b parts per piece and sent to the experts asynchronously; as soon as
the gradient rows of a forward chunk have all arrived its expert backward runs
(``torch.autograd.grad`` over that chunk's graph only, stopping at the edges where it meets what
was built before it: parameters, materialized copies); as soon as the input-gradient rows of a
backward chunk are all computed they are sent back asynchronously. After the last chunk the
gradients summed at those edges go on once (`_boundary`), so copies' reductions and parameter
accumulation run once per block, as in `sync`. "Arrived" and "computed" are decided on the global
boundaries (every pair of ranks), so every rank posts its collectives in the same order.

Hooks run once per block at their points: ``before_dispatch`` / ``after_combine`` on the whole
block; ``after_dispatch`` / ``before_combine`` on chunk 0's rows (the whole received block never
exists at once), their forward effects there, their backward (e.g. the prefetch's marks) at the
start of the expert backward and after its last chunk; the other chunks take chunk 0's dtype
(deviation: the interior hooks must be identities up to the wire dtype, as every hook of moeflow
is). Double backward is not supported.

Shape suffixes: A rows this rank sends (ordered by destination, then expert), R rows received
(by source, then expert), D d_model, S source ranks, J experts held by this rank, W ranks,
E experts; ``...`` = batch dims of a simulation. Chunks have no letter (`counts_by_chunk`, `chunk_edges`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd.graph import GradientEdge, get_gradient_edge

from moeflow.core.exchange import ExchangeBlock
from moeflow.perf.pipeline_degree import candidate_degrees, find_degree, priced_time
from moeflow.strategies.schedules.base import PredictedBlock, Schedule, StepLoad
from moeflow.strategies.schedules.pipeline_pricing import agree_over_esp, pass_models, scalar_model
from moeflow.strategies.schedules.sync import SyncSchedule

log = logging.getLogger(__name__)

SNAPS = ("powers", "divisors")


def _degree_value(name: str, value: Any) -> int | str | None:
    if value is None or value == "auto":
        return value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: expected an integer >= 1 or 'auto'")
    return value


@dataclass(frozen=True)
class PipelineOptions:
    """Options of `schedule="pipeline"` (`--set moe.schedule_options.<key>=...`)."""

    degree: int | str = 2
    """r, chunks of the block (forward and backward); ``"auto"``: FSMoE Algorithm 1 on the layer's
    cost model (needs one), chosen at the first forward."""
    forward_degree: int | str | None = None
    """Overrides ``degree`` for the forward."""
    backward_degree: int | str | None = None
    """Overrides ``degree`` for the backward (§4.4: it may differ)."""
    snap: str = "powers"
    """Candidates of ``auto``: ``powers`` ({1, 2, 4, 8}, FSMoE's tool) or ``divisors`` (every
    divisor of the largest piece one rank sends another)."""

    def __post_init__(self) -> None:
        if self.degree is None:
            raise ValueError("degree=None: expected an integer >= 1 or 'auto'")
        for name in ("degree", "forward_degree", "backward_degree"):
            object.__setattr__(self, name, _degree_value(name, getattr(self, name)))
        if self.snap not in SNAPS:
            raise ValueError(f"snap={self.snap!r}: expected one of {list(SNAPS)}")

    @property
    def forward(self) -> int | str:
        return self.forward_degree if self.forward_degree is not None else self.degree

    @property
    def backward(self) -> int | str:
        return self.backward_degree if self.backward_degree is not None else self.degree


# ---- chunk boundaries (pure) ---------------------------------------------------------------------
def chunk_bounds(rows: Any, degree: int) -> np.ndarray:
    """``[..., r + 1]`` offsets of the r contiguous parts of pieces of ``rows`` ``[...]``."""
    rows = np.asarray(rows, dtype=np.int64)
    c = np.arange(degree + 1, dtype=np.int64)
    return rows[..., None] * c // degree


def chunk_counts(counts_SJ: np.ndarray, degree: int) -> np.ndarray:
    """``[r, S, J]``: rows of chunk c that source s sends for held expert j. Source s's piece holds
    its rows for expert 0, 1, … in order; chunk c takes ``chunk_bounds`` part c of that piece."""
    counts_SJ = np.asarray(counts_SJ, dtype=np.int64)
    start_SJ = np.cumsum(counts_SJ, axis=1) - counts_SJ
    end_SJ = start_SJ + counts_SJ
    chunk_edges = chunk_bounds(counts_SJ.sum(1), degree)
    lo = chunk_edges[:, :-1].T[:, :, None]  # [chunk, S, 1]
    hi = chunk_edges[:, 1:].T[:, :, None]
    return np.clip(np.minimum(hi, end_SJ[None]) - np.maximum(lo, start_SJ[None]), 0, None)


def _positions(pieces: list[int], degree: int) -> list[torch.Tensor]:
    """Row positions of chunk c in a buffer of consecutive pieces (concatenated part c of each)."""
    offsets = np.concatenate([[0], np.cumsum(pieces)]).astype(np.int64)
    bounds = chunk_bounds(pieces, degree)
    return [
        torch.from_numpy(
            np.concatenate(
                [np.arange(o + b[c], o + b[c + 1]) for o, b in zip(offsets, bounds)] + [np.zeros(0, np.int64)]
            )
        )
        for c in range(degree)
    ]


def _boundary(y: torch.Tensor, first_seq: int, skip) -> dict[tuple[int, int], GradientEdge]:
    """The edges where a chunk's expert graph meets what was built before it (parameters,
    materialized weights): nodes created before the chunk's compute (lower sequence numbers) or
    leaves' accumulators; `skip`: the chunk input's own accumulator."""
    edges: dict[tuple[int, int], GradientEdge] = {}
    stack, seen = [y.grad_fn], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for nxt, nr in node.next_functions:
            if nxt is None or nxt is skip:
                continue
            if type(nxt).__name__ == "AccumulateGrad" or nxt._sequence_nr() < first_seq:
                edges[(id(nxt), nr)] = GradientEdge(nxt, nr)
            else:
                stack.append(nxt)
    return edges


def _covered(done_edges: np.ndarray, need_edges: np.ndarray, done: int, need: int) -> bool:
    """Whether `done` parts of one chunking cover `need` parts of another on every pair."""
    return bool(np.all(done_edges[:, done] >= need_edges[:, need]))


# ---- execution -----------------------------------------------------------------------------------
class _Plan:
    """Everything one block's forward and backward loops need (global boundaries included)."""

    def __init__(self, block: ExchangeBlock, r_f: int, r_b: int) -> None:
        self.block, self.r_f, self.r_b, self.group = block, r_f, r_b, block.group
        send, recv = block.send_splits, block.recv_splits
        self.send_f, self.recv_f = _positions(send, r_f), _positions(recv, r_f)
        self.send_b, self.recv_b = _positions(send, r_b), _positions(recv, r_b)
        self.counts_by_chunk = chunk_counts(block.counts_SJ, r_f)
        pairs = np.asarray(block.send_WW, dtype=np.int64).reshape(-1)
        self.bounds_f, self.bounds_b = chunk_bounds(pairs, r_f), chunk_bounds(pairs, r_b)
        self.rows_A, self.rows_R = int(sum(send)), int(sum(recv))
        self.graphs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.side: dict[str, torch.Tensor] = {}
        self.hook_dtype: dict[str, torch.dtype] = {}

    def splits(self, pieces: list[int], degree: int, c: int) -> list[int]:
        b = chunk_bounds(pieces, degree)
        return (b[:, c + 1] - b[:, c]).tolist()

    def _hook(self, point: str, x_c: torch.Tensor, c: int, keep_graph: bool) -> torch.Tensor:
        """The layer's hooks at `point` once per block: on chunk 0 (on a detached copy, so its marks
        sit in a side graph that the backward loop runs once, at the point's place); the other
        chunks take chunk 0's dtype (the hooks are identities up to the wire dtype)."""
        if c:
            return x_c.detach().to(self.hook_dtype[point])
        probe = x_c.detach().requires_grad_(keep_graph)
        with torch.enable_grad() if keep_graph else torch.no_grad():
            out = self.block.hooks(point, probe)
        self.hook_dtype[point] = out.dtype
        if keep_graph and out.requires_grad:
            self.side[point] = out
        return out.detach()

    def _run_side(self, point: str) -> None:
        """Fire the backward of the hooks at `point` (e.g. the prefetch's marks), once."""
        out = self.side.pop(point, None)
        if out is not None:
            torch.autograd.backward(out, torch.zeros_like(out))

    def post(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int]):
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        work = dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=self.group, async_op=True)
        return out, work, x

    def forward(self, x_sent_AD: torch.Tensor, keep_graph: bool) -> torch.Tensor:
        block, r = self.block, self.r_f
        send, recv = block.send_splits, block.recv_splits

        def dispatch(c):
            return self.post(x_sent_AD[self.send_f[c]], self.splits(send, r, c), self.splits(recv, r, c))

        pending_d, pending_c = dispatch(0), []
        for c in range(r):
            x_c, work, _ = pending_d
            if c + 1 < r:
                pending_d = dispatch(c + 1)  # D_{c+1} in flight while E_c computes
            work.wait()
            # _intra_node: FSMoE's ESP all-gather of chunk c would run here (not built).
            x_c = self._hook("after_dispatch", x_c, c, keep_graph)
            with torch.enable_grad() if keep_graph else torch.no_grad():
                x_c = x_c.detach().requires_grad_(keep_graph)
                first = x_c.view_as(x_c).grad_fn if keep_graph else None  # nodes from here on: the chunk's
                y_c = block.compute(x_c, self.counts_by_chunk[c])
            if keep_graph:
                edges = _boundary(y_c, first._sequence_nr(), get_gradient_edge(x_c).node) if y_c.requires_grad else []
                self.graphs.append((x_c, y_c, edges))
            y_c = self._hook("before_combine", y_c, c, keep_graph)
            # _intra_node: FSMoE's ESP reduce-scatter of chunk c would run here (not built).
            pending_c.append(self.post(y_c, self.splits(recv, r, c), self.splits(send, r, c)))
        y_back_AD = None
        for c, (out, work, _) in enumerate(pending_c):
            work.wait()
            if y_back_AD is None:
                y_back_AD = out.new_empty((self.rows_A, *out.shape[1:]))
            y_back_AD[self.send_f[c]] = out
        return y_back_AD

    def backward(self, grad_AD: torch.Tensor) -> torch.Tensor:
        block, r_f, r_b = self.block, self.r_f, self.r_b
        send, recv = block.send_splits, block.recv_splits
        graphs, self.graphs = self.graphs, []

        def to_experts(b):
            return self.post(grad_AD[self.send_b[b]], self.splits(send, r_b, b), self.splits(recv, r_b, b))

        grad_y_RD = grad_AD.new_zeros((self.rows_R, *grad_AD.shape[1:]))
        grad_x_RD = None
        grad_x_AD = None
        returns, done_f, sent_b = [], 0, 0
        boundary: dict[tuple[int, int], tuple[GradientEdge, torch.Tensor | None]] = {}
        self._run_side("before_combine")  # the gradient reaches the experts' outputs
        pending = to_experts(0)
        for b in range(r_b):
            out, work, _ = pending
            if b + 1 < r_b:
                pending = to_experts(b + 1)
            work.wait()
            grad_y_RD[self.recv_b[b]] = out
            # Expert backward of every forward chunk whose gradient rows have all arrived.
            while done_f < r_f and _covered(self.bounds_b, self.bounds_f, b + 1, done_f + 1):
                x_c, y_c, edges = graphs[done_f]
                g_c = grad_y_RD[self.recv_f[done_f]].to(y_c.dtype)
                gx = None
                if y_c.requires_grad:
                    grads = torch.autograd.grad(y_c, [x_c, *edges.values()], g_c, allow_unused=True)
                    gx = grads[0]
                    for key, edge, g in zip(edges, edges.values(), grads[1:]):
                        if g is not None:
                            total = boundary.get(key, (edge, None))[1]
                            boundary[key] = (edge, g if total is None else total + g)
                gx = gx if gx is not None else torch.zeros_like(x_c)
                if grad_x_RD is None:
                    grad_x_RD = gx.new_zeros((self.rows_R, *gx.shape[1:]))
                grad_x_RD[self.recv_f[done_f]] = gx
                done_f += 1
                if done_f == r_f:  # every chunk's expert backward done: what lies before the
                    # experts (parameters, materialized copies and their collectives) once, summed.
                    if boundary:
                        torch.autograd.backward([e for e, _ in boundary.values()], [g for _, g in boundary.values()])
                    self._run_side("after_dispatch")
            # Input gradients back for every backward chunk whose rows are all computed.
            while sent_b < r_b and _covered(self.bounds_f, self.bounds_b, done_f, sent_b + 1):
                rows = grad_x_RD[self.recv_b[sent_b]]
                returns.append(self.post(rows, self.splits(recv, r_b, sent_b), self.splits(send, r_b, sent_b)))
                sent_b += 1
        for b, (out, work, _) in enumerate(returns):
            work.wait()
            if grad_x_AD is None:
                grad_x_AD = out.new_empty((self.rows_A, *out.shape[1:]))
            grad_x_AD[self.send_b[b]] = out
        return grad_x_AD


class _PipelinedBlock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_sent_AD, _anchor, plan: _Plan):
        ctx.plan = plan
        ctx.x_dtype = x_sent_AD.dtype
        return plan.forward(x_sent_AD, keep_graph=True)

    @staticmethod
    def backward(ctx, grad_AD):
        grad_x_AD = ctx.plan.backward(grad_AD.contiguous())
        return grad_x_AD.to(ctx.x_dtype), None, None


def pipelined_block(block: ExchangeBlock, r_f: int, r_b: int) -> torch.Tensor:
    """The block in r_f forward chunks and r_b backward chunks (module docstring); returns the
    outputs of this rank's sent rows in send order, as the synchronous combine does."""
    x_sent_AD = block.hooks("before_dispatch", block.x_sent_AD)
    plan = _Plan(block, r_f, r_b)
    if not torch.is_grad_enabled():
        return block.hooks("after_combine", plan.forward(x_sent_AD, keep_graph=False))
    # The anchor makes the Function part of the graph even when the rows need no gradient (the
    # experts' parameters still do).
    anchor = torch.empty(0, requires_grad=True)
    return block.hooks("after_combine", _PipelinedBlock.apply(x_sent_AD, anchor, plan))


# ---- the schedule --------------------------------------------------------------------------------
class PipelineSchedule(Schedule):
    """FSMoE's pipelined block as a `schedule` axis object (module docstring)."""

    def __init__(self, options: PipelineOptions | None = None, cost_model: Any = None, expert: Any = None) -> None:
        self.options = options or PipelineOptions()
        self.cost_model, self.expert = cost_model, expert
        if "auto" in (self.options.forward, self.options.backward) and cost_model is None:
            raise ValueError(
                "schedule='pipeline' with degree='auto' needs a cost model (--cost-model or "
                "MoELayer(..., cost_model=...)); got cost_model=None"
            )
        self.degrees: tuple[int, int] | None = None
        """(forward, backward) degrees that ran (set at the first forward)."""

    def choice(self) -> str | None:
        return None if self.degrees is None else f"pipeline(r_f={self.degrees[0]},r_b={self.degrees[1]})"

    def runs_with(self, dispatcher: Any) -> bool:
        return dispatcher.name == "a2a"

    def check_dispatcher(self, dispatcher: Any) -> None:
        if not self.runs_with(dispatcher):
            raise ValueError(
                "schedule='pipeline' chunks one all-to-all per chunk and runs with dispatch='a2a' only "
                f"(got dispatch={dispatcher.name!r})"
            )

    def candidates(self, send_WW: np.ndarray) -> tuple[int, ...]:
        return candidate_degrees(self.options.snap, max(1, int(np.max(send_WW))))

    def choose(self, block: ExchangeBlock) -> tuple[int, int]:
        """The forward and backward degrees; ``auto``: Algorithm 1 (``find_degree``) on this block's
        global load, so every rank of the expert-parallel group chooses the same; under expert
        sharding the ESP group agrees (`agree_over_esp`)."""
        fwd, bwd = self.options.forward, self.options.backward
        if "auto" not in (fwd, bwd):
            return int(fwd), int(bwd)
        W, devices = len(block.send_WW), self.cost_model.topology.num_devices
        if devices != W:
            raise ValueError(
                f"schedule='pipeline' degree='auto': the cost model {self.cost_model.name!r} describes {devices} "
                f"devices but the expert-parallel group has {W}; give a cost model of this group "
                "(moeflow profile) or a fixed degree"
            )
        if block.plan_SEW is not None:
            step = StepLoad.of_plan(block.plan_SEW, self.expert, block.node_of)
        else:  # one expert column per rank: rows each rank receives
            step = StepLoad(block.send_WW, block.send_WW.sum(0)[:, None], self.expert, block.node_of)
        models = pass_models(step, self.cost_model, block.dispatcher)
        cands = self.candidates(block.send_WW)
        picked = [find_degree(scalar_model(m), 0.0, cands) for m in models]
        picked = agree_over_esp(picked, block.esp_group)
        return int(picked[0] if fwd == "auto" else fwd), int(picked[1] if bwd == "auto" else bwd)

    def execute(self, block: ExchangeBlock) -> torch.Tensor:
        if block.group is None:  # one process: nothing to overlap
            return SyncSchedule().execute(block)
        if self.degrees is None:
            self.degrees = self.choose(block)
            if "auto" in (self.options.forward, self.options.backward):
                log.info("schedule=pipeline: degree auto chose forward %d, backward %d", *self.degrees)
        return pipelined_block(block, *self.degrees)

    def predict(self, step: StepLoad, cost_model: Any, dispatcher: Any) -> PredictedBlock:
        """FSMoE Eq. 1 per chunk and the §4.2 case formulas (``pipeline_degree.priced_time``, ESP
        absent) forward and backward (§4.4, experts doubled); ``auto``: the cheapest candidate
        degree per pass (Algorithm 1's snapped choice, the priced time being convex in r)."""
        models = pass_models(step, cost_model, dispatcher)
        send = np.asarray(step.send_tokens_WW)
        total = 0.0
        for model, degree in zip(models, (self.options.forward, self.options.backward)):
            degrees = self.candidates(send) if degree == "auto" else (degree,)
            times = np.stack([priced_time(model, float(r), 0.0) for r in degrees])
            total = total + times.min(axis=0) / 1e3
        a2a = models[0].alpha_ms[0] + models[0].volume_ms[0]
        exp = models[0].alpha_ms[3] + models[0].volume_ms[3]
        return PredictedBlock(np.asarray(total), 3 * exp / 1e3, 4 * a2a / 1e3)
