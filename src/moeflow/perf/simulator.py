"""Cluster-scale replay of routing traces through the cost model (``moeflow simulate``).

For every (iteration, layer) of a trace and every strategy, the simulator asks the strategy's
planner for a ``Placement`` (FasterMoE shadowing, Pro-Prophet, Hecate add theirs through the same
``moeflow.strategies.planners.get_planner`` interface), turns the flow into a per-pair send matrix and per-device
compute loads (``moeflow.core.placement.dispatch_counts``: local holder first, then same node, then
remote), and prices one training step of the layer with ``CostModel``:

* compute: ``3·Lat_comp`` (forward + 2× backward, FasterMoE Eq. 1);
* all-to-all: dispatch + combine in forward and backward = 4 all-to-all-v (FasterMoE §3.3);
* other comm: the count exchange before the dispatch, plus materialize / reduce-to-owner of
  experts the planner replicated (Hecate §3, Pro-Prophet Trans/Agg, FasterMoE Eq. 8).

Schedules: ``sync`` (nothing overlaps: every comm second is exposed) and ``pairwise``
(FasterMoE §4.2 smart schedule: n groups, step s exchanges with group ``(g−s) mod n``; ``C_s``
overlaps ``S_{s+1}`` and ``R_{s−1}`` which share one communication stream), so the simulator
reproduces the bound ``(comm + comp) / max(comm, comp)`` of §4.2.

Adding a strategy is one entry in ``STRATEGIES`` (its planner name). Strategies whose placement
never changes (``ep``) also give a vectorised ``fast_send`` so that a 64×64×1000 replay is a few
numpy calls.

Shape suffixes: I iterations, L layers, W ranks, E experts; ``...`` = (I, L).

    moeflow simulate --cluster trevor --trace zipf --iterations 1000 --d-model 1024 --d-hidden 4096
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moeflow.perf.costmodel import CostModel
from moeflow.perf.traces import Trace
from moeflow.strategies.planners.shadow import expert_param_count

SCHEDULES = ("sync", "pairwise")
"""How communication and computation are ordered (DESIGN.md §2 'schedule')."""


@dataclass
class ModelConfig:
    """The MoE layer the trace is replayed through."""

    d_model: int
    """Model (token) dimension d."""
    d_hidden: int
    """Expert hidden dimension h."""
    expert: str = "ffn"
    """``ffn`` (4·d·h FLOPs/token) or ``swiglu`` (6·d·h)."""
    nonmoe_forward_s: float = 0.0
    """Forward time of the dense part of one block (attention etc.), added per layer; backward = 2×."""

    def __post_init__(self) -> None:
        for name in ("d_model", "d_hidden"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}={v!r}: must be a positive int")
        if self.expert not in ("ffn", "swiglu"):
            raise ValueError(f"expert={self.expert!r}: expected 'ffn' or 'swiglu'")
        if self.nonmoe_forward_s < 0:
            raise ValueError(f"nonmoe_forward_s={self.nonmoe_forward_s!r}: must be >= 0")


def _ep_fast_send(flow_ILWE: np.ndarray, world_size: int) -> np.ndarray:
    """Plain expert parallelism: rank r owns experts [r·E_local, (r+1)·E_local) (DESIGN.md §3.1),
    so the tokens i sends to j are the sum of its flow over j's experts."""
    I, L, W, E = flow_ILWE.shape
    return flow_ILWE.reshape(I, L, W, world_size, E // world_size).sum(-1)


@dataclass(frozen=True)
class Strategy:
    """One way of placing experts, as the simulator sees it."""

    name: str
    """User-facing name (``--strategy``)."""
    planner: str
    """Name for ``moeflow.strategies.planners.get_planner``."""
    fast_send: Callable[[np.ndarray, int], np.ndarray] | None = None
    """Vectorised flow [I,L,W,E] -> send [I,L,W,W] for strategies with a fixed owner-only placement."""
    description: str = ""
    """One line for ``--help`` and reports."""
    routing: Callable[[np.ndarray, CostModel, ModelConfig, int], np.ndarray] | None = None
    """For strategies that change routing (TA-MoE): the flow they would produce from the trace's
    (flow [I,L,W,E], cost model, model, top_k) -> flow [I,L,W,E]."""


def _ta_moe_routing(flow_ILWE: np.ndarray, cost_model: CostModel, model: ModelConfig, top_k: int) -> np.ndarray:
    """TA-MoE (SPEC §2): every rank sends its S tokens' k choices in the target pattern ĉ that the
    loss steers the gate to (the best case of the loss: dispatch exactly on target)."""
    from moeflow.routing.ta_moe import flow_from_target, target_dispatch_pattern

    I, L, W, E = flow_ILWE.shape
    out = np.empty_like(flow_ILWE)
    targets: dict[int, np.ndarray] = {}
    for i in range(I):
        for layer in range(L):
            tokens = int(flow_ILWE[i, layer].sum() // (W * top_k))  # S: tokens per rank
            if tokens not in targets:
                targets[tokens] = target_dispatch_pattern(cost_model, E, top_k, max(tokens, 1), model.d_model)
            out[i, layer] = flow_from_target(targets[tokens], tokens)
    return out


STRATEGIES: dict[str, Strategy] = {
    "ep": Strategy("ep", "ep", _ep_fast_send, "synchronous expert parallelism, owners only"),
    "shadow": Strategy("shadow", "shadow", None, "FasterMoE dynamic shadowing (planner per iteration and layer)"),
    "shadow_greedy": Strategy("shadow_greedy", "shadow_greedy", None, "FasterMoE shadowing, Algorithm 1 as published"),
    "ta_moe": Strategy(
        "ta_moe", "ep", _ep_fast_send, "TA-MoE: routing on the topology's target pattern", _ta_moe_routing
    ),
}
"""Registry: one entry per strategy (Pro-Prophet, Hecate add theirs here)."""


@dataclass
class Breakdown:
    """Per-iteration times (seconds, summed over layers) of one (strategy, schedule)."""

    strategy: str
    schedule: str
    total_I: np.ndarray
    compute_I: np.ndarray
    a2a_I: np.ndarray
    other_comm_I: np.ndarray
    exposed_comm_I: np.ndarray
    overlapped_comm_I: np.ndarray
    layer_compute_fwd_IL: np.ndarray = field(repr=False)
    """FasterMoE Lat_comp (forward, slowest device) per layer, for the roofline."""
    layer_a2a_IL: np.ndarray = field(repr=False)
    """Mean time of one all-to-all (Lat_comm) per layer, for the roofline."""
    layer_total_IL: np.ndarray = field(repr=False)
    tokens_IL: np.ndarray = field(repr=False)
    """Assignments computed in the layer (Σ_w B_w)."""
    replicated_IL: np.ndarray = field(repr=False)
    """Expert copies beyond the owners (0 for ep)."""

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"strategy": self.strategy, "schedule": self.schedule}
        for key in ("total", "compute", "a2a", "other_comm", "exposed_comm", "overlapped_comm"):
            arr = getattr(self, f"{key}_I")
            out[f"{key}_s"] = float(arr.mean())
        out["total_p50_s"] = float(np.percentile(self.total_I, 50))
        out["total_p95_s"] = float(np.percentile(self.total_I, 95))
        out["replicated_experts_per_layer"] = float(self.replicated_IL.mean())
        return out


def _plan_generic(
    strategy: Strategy,
    flow_ILWE: np.ndarray,
    cost_model: CostModel,
    model: ModelConfig,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Loop over (iteration, layer) through the planner interface; returns send [I,L,W,W],
    expert-local token counts [I,L,W,E] (tokens device w computes for expert e), holders [I,L,E,W]
    and owners [E]."""
    from moeflow.core.placement import Placement, dispatch_counts
    from moeflow.strategies.planners import PlannerContext, get_planner

    I, L, W, E = flow_ILWE.shape
    planner = get_planner(strategy.planner, PlannerContext(E, model.d_model, model.d_hidden, model.expert))
    base = Placement.expert_parallel(E, W)
    node_of = cost_model.topology.node_of
    send = np.zeros((I, L, W, W), dtype=np.int64)
    computed = np.zeros((I, L, W, E), dtype=np.int64)
    holders = np.zeros((I, L, E, W), dtype=bool)
    for i in range(I):
        for layer in range(L):
            placement = planner(flow_ILWE[i, layer], base, cost_model)
            dc_WEW = dispatch_counts(flow_ILWE[i, layer], placement, node_of)
            send[i, layer] = dc_WEW.sum(axis=1)
            computed[i, layer] = dc_WEW.sum(axis=0).T
            holders[i, layer] = placement.holders_EW
    return send, computed, holders, np.asarray(base.owner_E)


def _copies_time_IL(
    cost_model: CostModel, param_bytes: float, holders_ILEW: np.ndarray, owner_E: np.ndarray
) -> np.ndarray:
    """Materialize in forward plus reduce-to-owner in backward, as the sparse collectives run them,
    per (iteration, layer); placements repeat across iterations, so each distinct one is priced once."""
    memo: dict[bytes, float] = {}
    out = np.zeros(holders_ILEW.shape[:2])
    for index in np.ndindex(*out.shape):
        holders_EW = holders_ILEW[index]
        key = holders_EW.tobytes()
        if key not in memo:
            memo[key] = cost_model.copies_time(param_bytes, holders_EW, owner_E, "materialize")
            memo[key] += cost_model.copies_time(param_bytes, holders_EW, owner_E, "reduce")
        out[index] = memo[key]
    return out


def _pairwise_steps(
    cost_model: CostModel, send_b: np.ndarray, computed_t: np.ndarray, group_size: int
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """FasterMoE §4.2 steps: n = W/G groups; in step s group g sends to group (g − s) mod n
    (SPEC §1.3). Returns per step the send time S_s, the return time R_s (same bytes, reversed)
    and the tokens each device computes in that step ``[..., W]``."""
    W = send_b.shape[-1]
    n, G = W // group_size, group_size
    lead = send_b.shape[:-2]
    send_P = send_b.reshape(*lead, W * W)
    comp_P = np.asarray(computed_t, dtype=np.float64).reshape(*lead, W * W)
    dst = np.repeat(np.arange(W), G)  # pairs ordered by destination, G sources each
    S, R, tokens = [], [], []
    for s in range(n):
        src_group = (dst // G + s) % n
        src = src_group * G + np.tile(np.arange(G), W)
        fwd, back = src * W + dst, dst * W + src
        S.append(cost_model.a2a_time_pairs(send_P[..., fwd], fwd))
        R.append(cost_model.a2a_time_pairs(send_P[..., fwd], back))
        tokens.append(comp_P[..., fwd].reshape(*lead, W, G).sum(-1))
    return S, R, tokens


def _pipeline(S: list[np.ndarray], R: list[np.ndarray], C: list[np.ndarray]) -> np.ndarray:
    """S_0, then per step s: C_s overlapped with S_{s+1} and R_{s−1} (which share one
    communication stream), then R_{n−1} (FasterMoE §4.2)."""
    n = len(S)
    t = S[0] + R[-1]
    for s in range(n):
        comm = (S[s + 1] if s + 1 < n else 0.0) + (R[s - 1] if s > 0 else 0.0)
        t = t + np.maximum(C[s], comm)
    return t


def simulate(
    trace: Trace,
    cost_model: CostModel,
    model: ModelConfig,
    strategies: Sequence[str] = ("ep",),
    schedules: Sequence[str] = ("sync",),
    pairwise_group_size: int = 1,
) -> list[Breakdown]:
    """Replay ``trace``; one ``Breakdown`` per (strategy, schedule). See the module docstring."""
    traced = trace.flow_ILWE
    I, L, W, E = traced.shape
    if cost_model.topology.num_devices != W:
        raise ValueError(f"trace world_size={W}: the cluster has {cost_model.topology.num_devices} devices")
    if E % W:
        raise ValueError(f"trace num_experts={E}: must be a multiple of world_size={W}")
    for s in strategies:
        if s not in STRATEGIES:
            raise ValueError(f"strategy={s!r}: expected one of {sorted(STRATEGIES)}")
    for s in schedules:
        if s not in SCHEDULES:
            raise ValueError(f"schedule={s!r}: expected one of {list(SCHEDULES)}")
    if pairwise_group_size < 1 or W % pairwise_group_size:
        raise ValueError(f"pairwise_group_size={pairwise_group_size!r}: must divide world_size={W}")
    tok_bytes = model.d_model * cost_model.bytes_per_element
    gemms = 2 if model.expert == "ffn" else 3
    # The count exchange before every dispatch: E int64 counts from every rank to every rank.
    count_bytes_WW = np.full((W, W), 8.0 * E / W)
    np.fill_diagonal(count_bytes_WW, 0.0)
    t_counts = float(cost_model.a2a_time(count_bytes_WW))
    param_bytes = expert_param_count(model.d_model, model.d_hidden, model.expert) * cost_model.bytes_per_element
    nonmoe_IL = np.full((I, L), 3.0 * model.nonmoe_forward_s)

    results = []
    for name in strategies:
        strat = STRATEGIES[name]
        flow = (
            traced
            if strat.routing is None
            else strat.routing(traced, cost_model, model, int(trace.meta.get("top_k", 2)))
        )
        if strat.fast_send is not None:
            send = strat.fast_send(flow, W)
            tokens_W = send.sum(axis=-2)
            E_local = E // W
            # α of a fitted GEMM model is paid once per expert GEMM that has tokens.
            calls_ILW = (flow.sum(axis=2).reshape(I, L, W, E_local) > 0).sum(-1) * gemms
            holders = None
            other_IL = np.full((I, L), t_counts)
            replicated_IL = np.zeros((I, L))
            computed_t = send  # each destination computes exactly what it receives
        else:
            send, computed_WE, holders, owner = _plan_generic(strat, flow, cost_model, model)
            tokens_W = computed_WE.sum(axis=-1)
            calls_ILW = (computed_WE > 0).sum(-1) * gemms
            copies_IL = _copies_time_IL(cost_model, param_bytes, holders, owner)
            other_IL = t_counts + copies_IL
            replicated_IL = holders.sum(axis=(-2, -1)) - E
            computed_t = send.astype(np.float64)
            # tokens a rank computes locally for a replicated expert are on the diagonal already
        send_b = send.astype(np.float64) * tok_bytes
        comp_fwd_IL = cost_model.layer_compute_time(
            tokens_W, model.d_model, model.d_hidden, model.expert, gemm_calls=calls_ILW
        )
        dispatch_IL = cost_model.a2a_time(send_b)
        combine_IL = cost_model.a2a_time(np.swapaxes(send_b, -1, -2))
        a2a_IL = 2 * (dispatch_IL + combine_IL)
        for schedule in schedules:
            if schedule == "sync":
                compute_IL = 3 * comp_fwd_IL
                total_IL = compute_IL + a2a_IL + other_IL + nonmoe_IL
                exposed_IL = a2a_IL + other_IL
            else:
                calls = gemms * (E // W)  # every local expert may get tokens in every step
                S, R, tokens = _pairwise_steps(cost_model, send_b, computed_t, pairwise_group_size)
                d, h = model.d_model, model.d_hidden
                c_fwd = [cost_model.layer_compute_time(t, d, h, model.expert, gemm_calls=calls) for t in tokens]
                # Backward mirrors forward with twice the compute per step (SPEC §1.1: input and
                # weight gradient GEMMs for every forward GEMM).
                c_bwd = [cost_model.layer_compute_time(t, d, 2 * h, model.expert, gemm_calls=2 * calls) for t in tokens]
                fwd, bwd = _pipeline(S, R, c_fwd), _pipeline(S, R, c_bwd)
                c_sum, comm_sum = sum(c_fwd), sum(S) + sum(R)
                compute_IL = 3 * c_sum
                total_IL = fwd + bwd + other_IL + nonmoe_IL
                a2a_IL = 2 * comm_sum
                exposed_IL = total_IL - nonmoe_IL - compute_IL
            overlapped_IL = np.maximum(a2a_IL + other_IL - exposed_IL, 0.0)
            results.append(
                Breakdown(
                    name,
                    schedule,
                    total_IL.sum(1),
                    compute_IL.sum(1),
                    a2a_IL.sum(1),
                    other_IL.sum(1),
                    exposed_IL.sum(1),
                    overlapped_IL.sum(1),
                    comp_fwd_IL,
                    (dispatch_IL + combine_IL) / 2,
                    total_IL,
                    tokens_W.sum(-1).astype(np.float64),
                    replicated_IL.astype(np.float64),
                )
            )
    return results


def speedup_bound(comm_s: Any, comp_s: Any) -> np.ndarray:
    """FasterMoE §4.2: the best any overlap of comm and comp can do, ``(comm+comp)/max(comm,comp)``."""
    comm, comp = np.asarray(comm_s, dtype=np.float64), np.asarray(comp_s, dtype=np.float64)
    return (comm + comp) / np.maximum(np.maximum(comm, comp), 1e-300)


def format_table(results: Sequence[Breakdown]) -> str:
    """Fixed-width table of the mean per-iteration breakdown (milliseconds)."""
    head = (
        f"{'strategy':<10}{'schedule':<10}{'total':>10}{'compute':>10}{'a2a':>10}{'other':>10}"
        f"{'exposed':>10}{'overlap':>10}{'p95':>10}"
    )
    lines = [head + "   (ms per iteration)"]
    for r in results:
        s = r.summary()
        lines.append(
            f"{r.strategy:<10}{r.schedule:<10}"
            + "".join(
                f"{1e3 * s[k]:>10.3f}"
                for k in (
                    "total_s",
                    "compute_s",
                    "a2a_s",
                    "other_comm_s",
                    "exposed_comm_s",
                    "overlapped_comm_s",
                    "total_p95_s",
                )
            )
        )
    return "\n".join(lines)


# ---- command-line plumbing shared by `moeflow simulate` and `moeflow roofline` ---------------------
def add_workload_arguments(parser: Any) -> None:
    """Arguments that describe a workload: cluster, trace, model, strategies, schedules."""
    parser.add_argument(
        "--cluster",
        default="johnny",
        help="topology preset (johnny, trevor, fsmoe_a, fsmoe_b, hecate_a, hecate_b, prophet_hpwnv, "
        "prophet_hpnv, prophet_lpwnv) or a `moeflow profile` JSON",
    )
    parser.add_argument(
        "--trace",
        default="zipf",
        help="uniform | zipf | drift (synthetic), smartmoe (../shared trace) or a .npz path",
    )
    parser.add_argument("--iterations", type=int, default=100, help="synthetic: iterations")
    parser.add_argument("--layers", type=int, default=1, help="synthetic: MoE layers")
    parser.add_argument("--experts", type=int, default=None, help="synthetic: experts (default 2 per device)")
    parser.add_argument("--tokens-per-rank", type=int, default=4096, help="synthetic: tokens per rank")
    parser.add_argument("--top-k", type=int, default=2, help="synthetic: experts per token")
    parser.add_argument("--skew", type=float, default=1.2, help="zipf: exponent s")
    parser.add_argument("--seed", type=int, default=0, help="synthetic: RNG seed")
    parser.add_argument("--d-model", type=int, default=None, help="model dim (default: trace meta or 1024)")
    parser.add_argument("--d-hidden", type=int, default=None, help="expert hidden dim (default: trace meta or 4·d)")
    parser.add_argument("--expert", choices=("ffn", "swiglu"), default="ffn")
    parser.add_argument("--strategy", default=None, help=f"comma list (default all: {','.join(STRATEGIES)})")
    parser.add_argument("--schedule", default="sync,pairwise", help=f"comma list of {','.join(SCHEDULES)}")
    parser.add_argument("--group-size", type=int, default=1, help="pairwise: workers per group (FasterMoE §4.2)")
    parser.add_argument("--gemm-flops", type=float, default=None, help="override P, FLOP/s per device")


def _resolve_trace_path(value: str) -> Any:
    from pathlib import Path

    from moeflow.perf.traces import SMARTMOE_TRACE

    if value != "smartmoe":
        return Path(value)
    repo_root = Path(__file__).resolve().parents[3]
    for candidate in (repo_root / SMARTMOE_TRACE, Path.cwd() / SMARTMOE_TRACE):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"--trace=smartmoe: {SMARTMOE_TRACE} not found next to the repository")


def workload_from_args(args: Any) -> tuple[Trace, CostModel, ModelConfig, list[str], list[str]]:
    from moeflow.perf.traces import SYNTHETIC, load_trace, synthetic_trace

    cost_model = CostModel.resolve(args.cluster, args.gemm_flops)
    W = cost_model.topology.num_devices
    if args.trace in SYNTHETIC:
        experts = args.experts if args.experts is not None else 2 * W
        trace = synthetic_trace(
            args.trace,
            args.iterations,
            args.layers,
            W,
            experts,
            args.tokens_per_rank,
            args.top_k,
            skew=args.skew,
            seed=args.seed,
        )
    else:
        trace = load_trace(_resolve_trace_path(args.trace))
    d_model = args.d_model or int(trace.meta.get("d_model") or 1024)
    d_hidden = args.d_hidden or int(trace.meta.get("d_hidden") or 4 * d_model)
    model = ModelConfig(d_model, d_hidden, args.expert)
    strategies = [s.strip() for s in (args.strategy or ",".join(STRATEGIES)).split(",") if s.strip()]
    schedules = [s.strip() for s in args.schedule.split(",") if s.strip()]
    for s in strategies:
        if s not in STRATEGIES:
            raise ValueError(f"--strategy={s!r}: expected one of {sorted(STRATEGIES)}")
    for s in schedules:
        if s not in SCHEDULES:
            raise ValueError(f"--schedule={s!r}: expected one of {list(SCHEDULES)}")
    if trace.world_size != W:
        raise ValueError(
            f"--trace={args.trace!r} has world_size={trace.world_size}, --cluster={args.cluster!r} has "
            f"{W} devices: pick a cluster of the trace's size (johnny has 16)"
        )
    return trace, cost_model, model, strategies, schedules
