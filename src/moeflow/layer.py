"""`MoELayer`: the step sequence and its hook points; no algorithm lives here.

Forward (docs/architecture.md): gate → capacity → count exchange → plan → materialize → order →
schedule(dispatch → experts → combine) → un-order (weighted sum). Backward mirrors it through
autograd. FSMoE §3.1's six hooks sit at the named points. Each step that varies is an object of
one axis, chosen by name from its registry (`gate`, `balance`: `moeflow.routing`; `strategy`,
`schedule`, `dispatch`: `moeflow.strategies`), with options of its own. With `group=None` the
dispatcher is local (W = 1) and every step runs unchanged — gates and planners never branch on
"is distributed".

Shape suffixes: T tokens on this rank, D d_model, E experts, A assignments (kept, this rank),
R rows received by this rank, W ranks in the expert-parallel group, J experts held (computed) by
this rank this iteration, S source ranks.

    layer = MoELayer(d_model=512, d_hidden=1024, num_experts=8, top_k=2)
    y = layer(x); loss = task_loss(y) + layer.aux_loss

Shared experts (`num_shared_experts`, DeepSeek-MoE) are one dense MLP beside the routed experts,
computed on every token and added to the routed output; they never enter the steps above.

Two parts of the layer are base classes, each in its own module: the gate call, `aux_loss` and the
once-per-step balance update (`moeflow.layer_routing.LayerRouting`), and the experts this rank
computes in a forward — the copies' gather, the compute the schedule runs, their release after the
combine (`moeflow.layer_held.HeldExperts`). What a forward reports (`stats`, built when read) and
the choices it leaves for the balance update come from `moeflow.layer_stats.LayerStats`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from moeflow.core import dispatch
from moeflow.core.checks import check_layer_input, finite_number, positive_int
from moeflow.core.exchange import ExchangeBlock
from moeflow.core.expert_shape import ExpertShape
from moeflow.core.experts import GroupedExperts, shared_experts_of
from moeflow.core.hooks import MoEHook, layer_hooks, run_hooks
from moeflow.core.placement import Placement, dispatch_counts
from moeflow.core.registry import LayerContext
from moeflow.core.replay import RECOMPUTE_MODES, Decision, replay_state
from moeflow.core.stats import MoEStats
from moeflow.layer_held import HeldExperts
from moeflow.layer_routing import LayerRouting
from moeflow.layer_stats import LayerStats
from moeflow.routing import BALANCES, GATES, check_balance_fits_gate, default_balance, routing_kind
from moeflow.strategies import DISPATCHERS, PLANNERS, SCHEDULES
from moeflow.strategies.planners.base import as_planner
from moeflow.strategies.planners.ep import plan_ep
from moeflow.strategies.timing import LayerTimer


def _no_hooks(point: str, t: torch.Tensor, first: bool = True, last: bool = True) -> torch.Tensor:
    """`ExchangeBlock.hooks` of a layer without hooks: the tensor as it is."""
    return t


class ClusterMismatchWarning(UserWarning):
    """The layer's cost model describes another number of devices than its group: it runs without it."""


AXES = {"gate": GATES, "balance": BALANCES, "strategy": PLANNERS, "schedule": SCHEDULES, "dispatch": DISPATCHERS}
"""The axes of a MoE layer and the registry of names of each (docs/architecture.md)."""


class MoELayer(LayerRouting, HeldExperts, LayerStats, nn.Module):
    """A Mixture-of-Experts FFN layer (docs/architecture.md).

    Args:
        d_model, d_hidden: model and expert hidden sizes.
        num_experts, top_k: experts in the layer and experts chosen per token (1 <= k <= E).
        gate: a name of `moeflow.routing.GATES` (`topk`, `switch`, `noisy_topk`, `hierarchical`,
            `sigmoid`, `xmoe`, `expert_choice`, `soft`) or a gate module returning `Routing`.
        expert: `ffn` (GELU, with biases), `swiglu` (no biases) or `clamped_swiglu` (GPT-OSS: biases,
            clamped SwiGLU; `expert_options={"alpha": 1.702, "limit": 7.0}`).
        expert_options: options of the expert kind (`core.expert_shape.EXPERT_KINDS`).
        num_shared_experts, shared_d_hidden: shared experts (DeepSeek-MoE; DeepSeek-V3 §2.1.2): one
            dense MLP of the routed experts' kind, hidden width `shared_d_hidden` (default
            `num_shared_experts · d_hidden`), on every token, added to the routed output; its
            parameters are dense (never planned, copied or dispatched).
        shared_experts: a module `[T, D] → [T, D]` to use as the shared experts instead (a converted
            Hugging Face block's own shared MLP); not with `num_shared_experts`.
        capacity_factor: None = dropless; c > 0 keeps at most ceil(c·k·T/E) assignments per expert
            and rank, first choices before second, then earlier tokens (token choice); expert choice
            takes C = ceil(c·k·T/E) tokens per expert (c = 1 when None); slots never drop.
        group: expert-parallel process group (None: single process); see `to_expert_parallel`.
        strategy: a name of `moeflow.strategies.PLANNERS` (`ep`, `shadow`, `prophet`, `eplb`, `fssdp`,
            `auto`, ...) or a callable `(flow_WE, placement, cost_model) -> Placement`.
        schedule: a name of `moeflow.strategies.SCHEDULES` (`sync`, `pairwise`, `pipeline`, `auto`)
            or a `Schedule`.
        dispatch: a name of `moeflow.strategies.DISPATCHERS` (`a2a`, `hierarchical`) or a dispatcher object.
        balance: a name of `moeflow.routing.BALANCES` (`gshard`, `sequence`, `aux_free`, `ta_moe`, `none`) or a
            balance module; None: the gate's default (`gshard` for token choice, `none` for expert
            choice and slots); `balance_weight` scales its loss (0 turns the term off). `sequence`
            takes the sequences from the input's shape `[..., S, D]`.
        z_loss_weight: weight of the router z-loss (0 = off).
        gate_options, balance_options, strategy_options, schedule_options, dispatch_options: options
            of the component chosen by name on that axis (a mapping, validated against the
            component's options dataclass; e.g. `schedule_options={"group_size": 2}`).
        hooks: `MoEHook`s overriding any of FSMoE's six hook points, or wrapping the copies or the
            expert compute (`moeflow.core.hooks`).
        dispatch_dtype: send the dispatched rows and expert outputs in this precision (`bfloat16`,
            `float16`, `float8_e4m3fn` on nccl) and restore the compute dtype on arrival, forward
            and backward (built-in hooks, `core.hooks.wire_hooks`); changes the numbers by the
            rounding of what is sent. None: rows travel in the compute dtype.
        check_finite: raise on NaN/Inf in the input or the routing scores.
        node_of: node index of every EP rank (dispatch prefers holders on the same node; copies of
            experts held everywhere travel a two-level tree across nodes); defaults to the cost
            model's topology.
        copy_chunks: column pieces of each copy-tree message (`core.copy_rounds`, Hecate §4.1), as
            the planners price them; None: the cost model's (else 1). Same numbers for any value.
        cost_model: `moeflow.perf.costmodel.CostModel` of the run's cluster, for planners and
            topology-aware objectives. It describes the cluster, never the model: where the
            expert-parallel group has another size (a single process sampling from a trained run, a
            resume on another process count) the layer says so once and runs without it — planners
            as `ep`, topology-aware gates and balance terms as their topology-free forms.
    """

    _mismatch_said = False  # `_notice_mismatch` said it

    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        num_experts: int,
        top_k: int = 2,
        gate: str | nn.Module = "topk",
        expert: str = "ffn",
        capacity_factor: float | None = None,
        group: dist.ProcessGroup | None = None,
        strategy: Any = "ep",
        schedule: Any = "sync",
        dispatch: Any = "a2a",
        balance: str | nn.Module | None = None,
        balance_weight: float = 0.01,
        z_loss_weight: float = 0.0,
        hooks: Sequence[MoEHook] | None = None,
        dispatch_dtype: str | None = None,
        check_finite: bool = False,
        node_of: Sequence[int] | None = None,
        copy_chunks: int | None = None,
        cost_model: Any = None,
        expert_options: Mapping[str, Any] | None = None,
        num_shared_experts: int = 0,
        shared_d_hidden: int | None = None,
        shared_experts: nn.Module | None = None,
        gate_options: Mapping[str, Any] | None = None,
        balance_options: Mapping[str, Any] | None = None,
        strategy_options: Mapping[str, Any] | None = None,
        schedule_options: Mapping[str, Any] | None = None,
        dispatch_options: Mapping[str, Any] | None = None,
    ) -> None:
        # Long: one checked argument per shape, axis and option (the class docstring lists them).
        super().__init__()
        self.d_model = positive_int("d_model", d_model)
        self.d_hidden = positive_int("d_hidden", d_hidden)
        self.num_experts = positive_int("num_experts", num_experts)
        self.top_k = positive_int("top_k", top_k)
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        if capacity_factor is not None:
            finite_number("capacity_factor", capacity_factor, low=0.0, low_open=True)
        self.capacity_factor = capacity_factor
        self.balance_weight = finite_number("balance_weight", balance_weight, low=0.0)
        self.z_loss_weight = finite_number("z_loss_weight", z_loss_weight, low=0.0)
        self.check_finite = check_finite
        default_chunks = 1 if cost_model is None else cost_model.copy_chunks
        self.copy_chunks = positive_int("copy_chunks", default_chunks if copy_chunks is None else copy_chunks)
        if copy_chunks is not None and cost_model is not None:  # its planners price the trees as they run
            cost_model = cost_model.with_copy_chunks(self.copy_chunks)
        shape = ExpertShape(d_model, d_hidden, expert)
        ctx = LayerContext(num_experts, top_k, shape, cost_model, self.balance_weight, capacity_factor)
        if capacity_factor is not None and routing_kind(gate) == "soft":
            raise ValueError(f"capacity_factor={capacity_factor} with gate='soft': slots never drop (use None)")
        balance = default_balance(gate) if balance is None else balance
        check_balance_fits_gate(balance, gate)
        self._build_axes(
            ctx,
            gate=(gate, gate_options),
            balance=(balance, balance_options),
            strategy=(strategy, strategy_options),
            schedule=(schedule, schedule_options),
            dispatch=(dispatch, dispatch_options),
        )
        self.experts = GroupedExperts(num_experts, d_model, d_hidden, kind=expert, options=expert_options)
        self.shared_experts = shared_experts_of(
            num_shared_experts,
            shared_d_hidden,
            shared_experts,
            self.d_model,
            self.d_hidden,
            self.experts.kind,
            expert_options,
        )
        self.hooks = layer_hooks(hooks, dispatch_dtype)
        observers = [c for c in (self.planner, self.schedule) if c.observes_time]
        if observers:  # what `auto` learns from (`strategies.timing`): first, its copies' span outermost
            self.hooks.insert(0, LayerTimer(observers))
        self.dispatch_dtype = dispatch_dtype
        self.cost_model = cost_model
        self._node_of_arg = None if node_of is None else list(node_of)
        self._calls = 0  # forward calls: part of the pairwise schedule's message tags
        self._choices_WE: torch.Tensor | None = None  # the step's expert choices, for balance.observe
        self._forwards = 0
        self.aux_loss = torch.zeros(())
        self._stats: MoEStats | functools.partial | None = None  # `stats`, or how to build it
        self.held_bytes = (0, 0)  # (when built, after the forward) of this forward's held weights
        self.group: dist.ProcessGroup | None = None
        self.esp_group: dist.ProcessGroup | None = None  # expert sharding (core.expert_sharding)
        self.replica_group: dist.ProcessGroup | None = None  # the same experts, other tokens (expert DP)
        self.balance_group: dist.ProcessGroup | None = None  # the same experts: replicas × ESP members
        self.recompute = "none"  # activation checkpointing of this layer (`set_recompute`)
        self._bind(Placement.expert_parallel(num_experts, 1))
        if group is not None:
            self.to_expert_parallel(group)

    def _build_axes(self, ctx: LayerContext, **axes: tuple[Any, Any]) -> None:
        """One component per axis, by name from its registry (with its options) or as an object."""
        built = {axis: AXES[axis].build(value, ctx, options) for axis, (value, options) in axes.items()}
        self.gate, self.balance, self.planner = built["gate"], built["balance"], as_planner(built["strategy"])
        self.schedule, self.dispatcher = built["schedule"], built["dispatch"]
        self.schedule.check_dispatcher(self.dispatcher)
        self.axes = {axis: v if isinstance(v, str) else type(v).__name__ for axis, (v, _) in axes.items()}
        if self.planner.needs_cost_model and ctx.cost_model is None:
            raise ValueError(f"strategy={self.axes['strategy']!r} needs cost_model= (a moeflow CostModel)")

    @property
    def strategy(self) -> str:
        return self.axes["strategy"]

    # ---- parallelism -------------------------------------------------------------------------
    def to_expert_parallel(
        self,
        group: dist.ProcessGroup | None,
        replicas: dist.ProcessGroup | None = None,
        balance: dist.ProcessGroup | None = None,
    ) -> MoELayer:
        """Keep only this rank's experts `[r·E_local, (r+1)·E_local)` of the group; returns self.

        Build the layer with the same seed on every rank first (or on the meta device, then
        initialise it by global expert id: `moeflow.training.init`): the kept slices then form
        exactly the single-process layer's experts. `replicas`: the ranks holding the same experts
        with other tokens (expert data parallelism, `ParallelLayout.expert_dp_group`) — planners
        plan on the mean of their flows, so every replica takes the same decisions and keeps the
        same planner state. `balance`: the ranks whose expert choices balance state sums
        (`ParallelLayout.balance_group`: replicas × ESP members; default: `replicas`).
        """
        world = dispatch.group_size(group)
        if self.num_experts % world:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by the EP size {world}")
        if self.experts.num_local != self.num_experts:
            raise ValueError("to_expert_parallel: this layer is already sharded")
        if self._node_of_arg is not None and len(self._node_of_arg) != world:
            raise ValueError(f"node_of has {len(self._node_of_arg)} entries, expected the EP size {world}")
        local = self.num_experts // world
        fp8 = (self.dispatch_dtype or "").startswith("float8")
        if fp8 and group is not None and dist.get_backend(group) != "nccl":
            raise ValueError(
                f"dispatch_dtype={self.dispatch_dtype!r} needs the nccl backend (gloo moves no float8): "
                f"use 'bfloat16' or 'float16'"
            )
        me = dispatch.group_rank(group)
        self.experts.shard_(range(me * local, (me + 1) * local))
        self.group = group
        self.replica_group = replicas if dispatch.group_size(replicas) > 1 else None
        self.balance_group = balance if balance is not None else self.replica_group
        self._bind(Placement.expert_parallel(self.num_experts, world))
        return self

    def set_recompute(self, mode: str) -> None:
        """Activation checkpointing of this layer (docs/parallel.md): `none`; `selective`: the
        experts' FFN on the received rows is recomputed in backward (its input, the exchanged
        rows, is kept); `full`: the enclosing block is recomputed (`torch.utils.checkpoint`) and
        this layer replays its first pass's routing check, flows, plan and message tags
        (`core.replay`) — no re-planning, no second record of stats, balance choices or planner
        history — while its exchanges run again, in the same order on every rank."""
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"recompute={mode!r} must be one of {', '.join(RECOMPUTE_MODES)}")
        if mode == "full":
            observers = [c for c in (self.planner, self.schedule) if c.observes_time]
            if observers or any(not hook.replayable for hook in self.hooks):
                what = self.axes["strategy"] if self.planner.observes_time else self.axes["schedule"]
                raise ValueError(
                    f"activation_checkpointing='full' with {what!r} or the block-wise prefetch: they measure or "
                    f"send ahead each forward, which recomputation would repeat; use 'selective'"
                )
        self.recompute = mode

    def rebind(self, placement: Placement) -> None:
        """Adopt new owners once `core.resharding` has moved the shards (Hecate §4.3)."""
        if placement.world_size != self.placement.world_size:
            raise ValueError(f"rebind: {placement} has another group size than {self.placement}")
        self._bind(placement)
        if not self.cluster_mismatch:
            self.planner.owners_changed(placement, self.cost_model)  # re-plan what it had planned ahead

    def _bind(self, placement: Placement) -> None:
        """Set the owners and decide whether the cost model describes this group (as many devices as
        the group has ranks)."""
        self.placement = placement
        self._layout = None  # `_routing_layout`, built again for these owners
        world = placement.world_size
        devices = None if self.cost_model is None else self.cost_model.topology.num_devices
        self.cluster_mismatch = devices is not None and devices != world
        topology_node_of = (
            None if self.cost_model is None or self.cluster_mismatch else self.cost_model.topology.node_of
        )
        self.node_of = self._node_of_arg if self._node_of_arg is not None else topology_node_of

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_layer_input(x, self.d_model, self.check_finite)
        if self.cluster_mismatch:
            self._notice_mismatch()
        x_TD = run_hooks(self.hooks, "before_moe_start", self, x.reshape(-1, self.d_model))
        me = dispatch.group_rank(self.group)
        routing = self._route(x_TD, me, x.shape[-2] if x.dim() > 2 else None)
        choices_E = routing.expert_counts(self.num_experts)
        routing, dropped = routing.within_capacity(self.capacity_factor, self.num_experts, self.top_k)
        expert_A = routing.expert_A

        mode, tape = replay_state()
        if mode == "replay":  # recomputation under activation checkpointing: the first pass's decisions
            decision = tape.take(self, expert_A)
            flow_WE, choices_WE, placement, plan_SEW = decision.flow_WE, None, decision.placement, decision.plan_SEW
            call_id, counts_E = decision.call_id, decision.balance_counts_E
        else:
            # Count exchange → global flow (and choices before capacity) → plan, the same on every rank.
            # (Both rows whenever capacity may drop, on every rank alike: the gather's size must agree.)
            may_drop = self.capacity_factor is not None
            # Dropless, the routing is the one before capacity: its count is `choices_E`, not recounted.
            counts = [routing.expert_counts(self.num_experts)] + ([choices_E] if may_drop else [])
            rows = dispatch.exchange_counts(counts, self.group)
            flow_WE, choices_WE = rows[0], rows[1] if may_drop else rows[0]
            counts_E = self._balance_counts(choices_WE)
            placement = self._plan(self._replicas_flow(flow_WE, x_TD.device))
            plan_SEW = self._dispatch_plan(flow_WE, placement)
            self._calls += 1
            call_id = self._calls
            if mode == "record":
                decision = Decision(expert_A.detach().clone(), flow_WE, placement, plan_SEW, call_id, counts_E)
                tape.put(self, decision)
        self.aux_loss = self._aux(routing, me, counts_E)

        # Order: sort assignments by (destination, expert); the dispatch plan picks the holder.
        if self.placement.world_size == 1:  # one rank: every destination is this one, the key is the expert
            key_A, remote_nodes = expert_A, 0.0  # (no other node either)
        else:
            dest_A = dispatch.assignment_destinations(expert_A, plan_SEW[me])
            remote_nodes = self._remote_nodes_per_token(routing, dest_A, me)
            key_A = dest_A * self.num_experts + expert_A
        order_A = torch.sort(key_A, stable=True).indices
        compute, weights_J = self._compute_held(placement, me)
        block = ExchangeBlock(
            x_sent_AD=routing.rows(x_TD, order_A),
            send_WW=plan_SEW.sum(1),
            me=me,
            counts_SJ=plan_SEW[:, placement.holders_EW[:, me], me],
            compute=compute,
            group=self.group,
            node_of=self.node_of,
            dispatcher=self.dispatcher,
            hooks=self._block_hooks if self.hooks else _no_hooks,
            call_id=call_id,
            plan_SEW=plan_SEW,
            esp_group=self.esp_group,
        )
        y_back_AD = self.schedule.execute(block)

        # Un-order: each token's output from its rows (weighted sum, or the mix of the slots); dropped
        # assignments add zero. It accumulates in the input's dtype (fp32 under autocast; a bf16
        # model sums k bf16 terms, as Hugging Face's and MegaBlocks' combines do).
        y_TD = routing.combine(y_back_AD.to(x.dtype), order_A, x_TD.shape[0])
        y_TD = self._release_copies(y_TD, placement, me, weights_J)
        y_TD = run_hooks(self.hooks, "before_moe_end", self, y_TD)
        if self.shared_experts is not None:  # dense, on every token: added to the routed output
            y_TD = y_TD + self.shared_experts(x_TD)
        if mode != "replay":  # recomputation never records stats or balance choices a second time
            self._record(block, flow_WE, choices_WE, plan_SEW, placement, dropped, routing.redirected, me, remote_nodes)
        return y_TD.reshape(x.shape)

    def _block_hooks(self, point: str, t: torch.Tensor, first: bool = True, last: bool = True) -> torch.Tensor:
        """The layer's hooks at a point of the exchange block (`ExchangeBlock.hooks`)."""
        return run_hooks(self.hooks, point, self, t, first, last)

    def _replicas_flow(self, flow_WE: np.ndarray, device: torch.device) -> np.ndarray:
        """What the planner plans on: this EP group's flow, or with data-parallel replicas (the
        same experts, other tokens) the mean of their flows in whole tokens — one small all-reduce —
        so that every replica takes the same decision (and keeps the same history) while each
        dispatches its own tokens under it. Whole counts, as the count exchange gives them: what a
        dispatch sends and the planners price, and what their compiled pricing and exact windows
        take. Planners that ignore the flow (`reads_flow=False`) get it as is."""
        if self.replica_group is None or not self.planner.reads_flow or self.cluster_mismatch:
            return flow_WE
        flow = torch.as_tensor(flow_WE, dtype=torch.float64, device=device)
        dist.all_reduce(flow, group=self.replica_group)
        return np.rint((flow / dist.get_world_size(self.replica_group)).cpu().numpy()).astype(np.int64)

    def _plan(self, flow_WE: np.ndarray) -> Placement:
        """The planner's placement for this flow (plain EP where the cost model is another cluster's)."""
        if self.cluster_mismatch:
            return plan_ep(flow_WE, self.placement)
        return self.planner(flow_WE, self.placement, self.cost_model)

    def _dispatch_plan(self, flow_WE: np.ndarray, placement: Placement) -> np.ndarray:
        """`plan_SEW` (`core.placement.dispatch_counts`). One process holds every expert and keeps
        every row: the plan is its flow, `[1, E, 1]` — what `dispatch_counts` builds, without the
        checks, the zeros and the scatter it spends on a general group every forward."""
        if placement.world_size == 1:
            return flow_WE[:, :, None].copy()
        return dispatch_counts(flow_WE, placement, self.node_of)

    def _notice_mismatch(self) -> None:
        """Say once per layer (not per step) that the cost model is unused; the layers of a model say it
        in the same forward, which Python's warnings filter shows once."""
        if self._mismatch_said:
            return
        self._mismatch_said = True
        warnings.warn(
            f"moeflow: the cost model {self.cost_model.name!r} describes {self.cost_model.topology.num_devices} "
            f"devices but this expert-parallel group has {self.placement.world_size}: running without it "
            f"(strategy as 'ep', topology-aware gate and balance terms in their topology-free form)",
            ClusterMismatchWarning,
            stacklevel=3,
        )

    # ---- helpers -----------------------------------------------------------------------------
    def extra_repr(self) -> str:
        axes = ", ".join(f"{axis}={name!r}" for axis, name in self.axes.items())
        shared = "" if self.shared_experts is None else f", shared={type(self.shared_experts).__name__}"
        return (
            f"d_model={self.d_model}, d_hidden={self.d_hidden}, num_experts={self.num_experts}, "
            f"top_k={self.top_k}, capacity_factor={self.capacity_factor}, {axes}{shared}"
        )
