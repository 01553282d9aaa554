"""What a replay's plans cost per (iteration, layer), under every schedule (`moeflow simulate`'s
second half, on one expert-parallel group's cost model).

Per layer: the block as the schedule predicts it (`Schedule.predict`, with the dispatcher pricing each
token exchange), the count exchange before the dispatch (`CostModel.count_exchange_time`), the copies
the planner asked for (`planning.copies_time_IL`: materialize in forward, reduce-to-owner in backward,
and the re-gather before the backward of a planner that `rematerializes`), FSSDP's re-sharding after
the iteration's last layer, and the dense part of the block (`nonmoe_forward_s`, backward 2×).

Copies travel ahead of their layer in two ways. The block-wise prefetch (`prefetch`, Pro-Prophet §V
Eq. 8, `prophet_model.overlapped_copies`): a layer after the first that runs the placement planned
ahead hides its copies behind the block before, expert compute and dense part, as a GPU's copy
engines do. Hecate's overlap (`overlap_attention`, §3.2 / §4.2, `attention_overlap`): the spAG
instances and the spRS behind the attention windows alone.

Shape suffixes: I iterations, L layers, W ranks of the expert-parallel group, E experts.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moeflow.core.registry import LayerContext
from moeflow.perf.costmodel import CostModel
from moeflow.sim.attention_overlap import attention_overlapped_copies
from moeflow.sim.planning import Plans, copies_time_IL
from moeflow.strategies import DISPATCHERS, SCHEDULES
from moeflow.strategies.planners.base import PrefetchWindow
from moeflow.strategies.planners.prophet_model import overlapped_copies
from moeflow.strategies.schedules.base import StepLoad

LAYER_TERMS = ("total", "compute", "a2a", "other", "exposed", "overlapped")
LAYER_TERMS += ("lat_comp", "lat_comm", "tokens", "replicated")
"""The per-layer arrays `GroupPricing.layers` gives for each schedule, every one `[I, L]`."""


class GroupPricing:
    """Prices plans on one cost model (the whole cluster, or one EP group of a data-parallel mesh)."""

    def __init__(self, cost_model: CostModel, layer: Any, schedules: Any, E: int, I: int, L: int) -> None:
        self.cm, self.layer, self.E = cost_model, layer, E
        self.ctx = LayerContext(E, layer.top_k, layer.shape, cost_model)
        self.built = {s: SCHEDULES.build(s, self.ctx, layer.options.get("schedule")) for s in schedules}
        self.dispatcher = DISPATCHERS.build(layer.dispatch, self.ctx, layer.options.get("dispatch"))
        for schedule in self.built.values():
            schedule.check_dispatcher(self.dispatcher)
        self.t_counts = cost_model.count_exchange_time(E)
        self.param_bytes = layer.shape.param_bytes(cost_model.bytes_per_element)
        self.nonmoe_IL = np.full((I, L), 3.0 * layer.nonmoe_forward_s)

    @property
    def window(self) -> PrefetchWindow | None:
        """How planners that plan ahead are told their copies travel ahead (None: they do not)."""
        if self.layer.prefetch or self.layer.overlap_attention:
            # Hecate's overlap hides copies behind the attention alone (`attention_overlap`).
            return PrefetchWindow(self.layer.nonmoe_forward_s, 1.0, experts_hide=not self.layer.overlap_attention)
        return None

    def copies_IL(self, plans: Plans, lat_comp_IL: np.ndarray) -> np.ndarray:
        """What the plans' copies put on the critical path per (iteration, layer) (module docstring)."""
        cm, layer, param_bytes = self.cm, self.layer, self.param_bytes
        _, _, holders, owners, _, planned_IL, regather, _ = plans
        trans_IL, agg_IL = copies_time_IL(cm, param_bytes, holders, owners)
        if layer.overlap_attention:
            return attention_overlapped_copies(trans_IL, agg_IL, layer.nonmoe_forward_s, regather, planned_IL)
        copies_IL = trans_IL + agg_IL
        if planned_IL.any():
            # Pro-Prophet Eq. 8: a layer that runs the placement planned ahead (every layer after
            # the first) has its copies prefetched in the block before, as `strategies.prefetch` sends
            # them; a GPU's copy engines hide them behind the whole window (hidden share 1).
            sent_IL = copies_time_IL(cm, param_bytes, holders, owners, tree=False)
            hidden_IL = overlapped_copies(sent_IL[0], sent_IL[1], lat_comp_IL, layer.nonmoe_forward_s)
            copies_IL = np.where(planned_IL, hidden_IL, copies_IL)
        return copies_IL + (trans_IL if regather else 0.0)  # the re-gather before the backward

    def layers(self, plans: Plans) -> dict[str, dict[str, np.ndarray]]:
        """Schedule -> `LAYER_TERMS` -> `[I, L]` seconds (tokens and copies: counts)."""
        cm, layer, nonmoe_IL = self.cm, self.layer, self.nonmoe_IL
        send, computed, holders = plans.send, plans.computed, plans.holders
        W = cm.topology.num_devices
        # The workload's Lat_comp and Lat_comm (FasterMoE §3.3), whatever the schedule: the roofline's R_CC.
        lat_comp_IL = cm.compute_time(computed, layer.shape)
        other_IL = self.t_counts + self.copies_IL(plans, lat_comp_IL)
        other_IL[:, -1] += plans.reshard_I  # moving shards (FSSDP), after the iteration's last layer
        step = StepLoad(send, computed, layer.shape, cm.topology.node_of)
        bytes_WW = send * (1.0 - np.eye(W)) * layer.shape.d_model * cm.bytes_per_element
        lat_comm_IL = self.dispatcher.price(cm, bytes_WW)  # one exchange (the combine costs the same)
        common = {
            "lat_comp": lat_comp_IL,
            "lat_comm": lat_comm_IL,
            "tokens": computed.sum(axis=(-2, -1)).astype(np.float64),
            "replicated": (holders.sum(axis=(-2, -1)) - self.E).astype(np.float64),
        }
        out = {}
        for name, schedule in self.built.items():
            block = schedule.predict(step, cm, self.dispatcher)
            total_IL = block.total_s + other_IL + nonmoe_IL
            exposed_IL = total_IL - nonmoe_IL - block.compute_s
            out[name] = {
                "total": total_IL,
                "compute": np.broadcast_to(block.compute_s, total_IL.shape).astype(np.float64),
                "a2a": np.broadcast_to(block.comm_s, total_IL.shape).astype(np.float64),
                "other": other_IL.copy(),
                "exposed": exposed_IL,
                "overlapped": np.maximum(block.comm_s + other_IL - exposed_IL, 0.0),
                **common,
            }
        return out
