"""What one forward of a MoE layer leaves behind: `LayerStats`, a base class of
`moeflow.layer.MoELayer`, kept apart from the step sequence because none of it decides the forward.

`_record` keeps, per forward, how to build its `MoEStats` (`stats`, built when first read: most
steps never read it) and, in training, adds the step's expert choices for the balance update
(`moeflow.layer_routing.LayerRouting`). `_remote_nodes_per_token` counts on the rows' device the
other nodes a token's rows go to (DeepSeek-V3 §3.2.2's per-token cross-node traffic), read when the
stats are read, so that the forward never waits for the device for a statistic.

It reads from the layer: `node_of`, `dispatch_dtype`, `d_model`, `planner`, `strategy`, `schedule`,
`axes`, `held_bytes`, `training`, `balance`, and writes `_stats`, `_choices_WE`, `_forwards`.

Shape suffixes: A assignments (kept, this rank), W ranks in the expert-parallel group, E experts,
S source ranks.
"""

from __future__ import annotations

import functools

import torch

from moeflow.core import dispatch
from moeflow.core.experts import host_to_device
from moeflow.core.hooks import WIRE_DTYPES
from moeflow.core.stats import MoEStats
from moeflow.routing.gates import Routing


class LayerStats:
    """The statistics of `MoELayer`'s forwards (module docstring)."""

    def _remote_nodes_per_token(self, routing: Routing, dest_A: torch.Tensor, me: int) -> torch.Tensor | float:
        """`MoEStats.remote_nodes_per_token`: distinct other nodes the rows of a token go to, averaged
        (`dispatch.remote_nodes_per_token`: on the device, read when the stats are read)."""
        if self.node_of is None or routing.token_A is None or routing.num_tokens == 0:
            return 0.0
        node_W = host_to_device(list(self.node_of), torch.int64, dest_A.device)
        nodes = max(self.node_of) + 1
        return dispatch.remote_nodes_per_token(
            routing.token_A, node_W[dest_A], self.node_of[me], routing.num_tokens, nodes
        )

    def _record(self, block, flow_WE, choices_WE, plan_SEW, placement, dropped, redirected, me, remote_nodes) -> None:
        """`stats` of this forward (built when read); in training, the expert choices for the step's
        balance update."""
        wire = WIRE_DTYPES[self.dispatch_dtype] if self.dispatch_dtype else block.x_sent_AD.dtype
        self._stats = functools.partial(
            MoEStats.of_forward,
            flow_WE,
            choices_WE,
            plan_SEW,
            block.send_WW[me],  # rows sent to each rank (`block.send_splits`)
            me,
            wire.itemsize * self.d_model,  # bytes of a row on the wire
            self.node_of,
            dropped=dropped,
            placement=placement,
            redirected=redirected,
            remote_nodes_per_token=remote_nodes,
            strategy=self.planner.choice() or self.strategy,
            schedule=self.schedule.choice() or self.axes["schedule"],
            materialized_bytes=self.held_bytes[0],
            held_bytes=self.held_bytes[1],
        )
        if self.training and self.balance.observes:
            choices = torch.from_numpy(choices_WE).to(torch.float64)  # `stats.choices`, a copy
            self._choices_WE = choices if self._choices_WE is None else self._choices_WE + choices
            self._forwards += 1

    @property
    def stats(self) -> MoEStats | None:
        """`MoEStats` of the last forward (None before one), built from its counts and plan when
        first read: most steps never read it, and building it costs as much as a few ops."""
        if isinstance(self._stats, functools.partial):  # the last forward's, not built yet
            self._stats = self._stats()
        return self._stats
