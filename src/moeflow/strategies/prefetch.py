"""Block-wise prefetch of expert copies (Pro-Prophet §V, Algorithm 2), for any planner that plans
ahead (`Planner.plans_ahead`: `next_placement()`, `use_prefetch(window)`).

A *block* is a MoE layer and the dense layers that follow it. Because layer i+1's placement is
known before it runs, its copies (Trans: owner → holders) travel during block i's forward compute,
and its gradient sums (Agg: holders → owner) during block i's backward compute, instead of on the
critical path of layer i+1. Each is split in two parts, by columns of the flat per-expert messages,
so that neither competes with block i's all-to-alls (Algorithm 2):

    forward  of block i:  A2A | EFC_i ∥ SubTrans1_{i+1} | A2A | FNEC_i ∥ SubTrans2_{i+1}
    backward of block i:  BNEC_i ∥ SubAgg1_{i+1} | A2A | BEC_i ∥ SubAgg2_{i+1} | A2A

The split gives each part its share of the compute it hides behind, from measured times (EFC vs
FNEC forward, BNEC vs BEC backward): timers at the four marks below, agreed across the group (an
all-reduce of the maxima after steps 1, 2, 4, 8, …, so that every rank splits every message
alike; 0.5 before). The same all-reduce agrees, per layer, the share of those windows that really
hid copies — 1 − (time waited on the copies) / (the cost model's time for them) — and hands it and
the dense time to the layer's planner (`use_prefetch(PrefetchWindow)`), which prices copies with
them (Eq. 8). The first MoE layer has no block before it: its copies run in its own forward. The
layer takes its prefetched copies through the hook's `wrap_copies`.

Mechanism: `BlockPrefetch` is a `MoEHook` (FSMoE §3.1) on every MoE layer; at the layer's start,
after its dispatch, before its combine and at its end it returns the tensor through `core.hooks.Mark`, an
identity whose forward and backward run the actions of that point. Partial replica sets travel
along their copy trees (`placement.copy_tree`; `batch_isend_irecv`, one tag per layer, direction,
part and stage; a part's second stage — relays forwarding, or summing before they send on — is
posted when waiting on the part finds its first arrived), experts held everywhere as one
asynchronous broadcast (forward) / reduce (backward) per owner — a pipelined ring on NCCL;
the received parameters enter autograd through `_Prefetched`, whose backward hands the copies'
gradients to Agg and returns the owned experts' own gradients; the owners add the received sums
into `.grad` when Agg completes. Numbers equal those of the unscheduled layer (tested).

No chunk pipeline here (Hecate §4.1's, which `materialize` runs with `copy_chunks`, `core.copy_rounds`):
a relay's second stage is posted by the compute thread, and only at the marks, so it cannot forward
piece j when it lands while piece j + 1 comes in — posted together, the pieces would share the
links as one message does. Each part's stages go whole, and are priced so (`copies_time(tree=False)`);
the two parts already let the first part's second stage run before the second part is posted.

Call `finish()` after backward (`all_reduce_gradients` does) so that every Agg has landed before
gradients are reduced or the optimizer steps.

Shape suffixes: J experts held by this rank, Y copies received, P flattened parameters of one expert.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from moeflow.core.expert_shape import ExpertShape
from moeflow.core.hooks import Mark, MoEHook
from moeflow.core.placement import Placement
from moeflow.core.sparse_collectives import (
    add_flat_rows,
    flat_layout,
    held_from_flat,
    prefetch_transfers,
    split_held_gradients,
)
from moeflow.strategies.planners.base import PrefetchWindow

TAG_BASE = 1 << 27
"""Message tags of prefetched copies start here (the pairwise schedule's stay below 2²⁶)."""


class _TwoParts:
    """Messages split in two column parts, each posted once, asynchronously — point-to-point along
    the copy trees for partial replica sets (two stages: a relay forwards, or sums, what the first
    brought), one collective per owner for experts held everywhere (a pipelined ring on NCCL,
    FasterMoE Eq. 8); waiting on a part posts it first if it was not (so a rank never waits on what
    it has not sent), then runs its second stage. Every rank posts in the same order."""

    STAGES = 2

    def __init__(self, group, tag: int, width: int, split: float) -> None:
        self.group, self.tag = group, tag
        self.cut = int(round(split * width))
        self.widths = (self.cut, width - self.cut)
        self.works: list[list | None] = [None, None]
        self.stage = [0, 0]
        self.exposed_s = 0.0  # time the compute thread waited on these messages

    def columns(self, part: int) -> slice:
        return slice(0, self.cut) if part == 0 else slice(self.cut, None)

    def messages(self, part: int, stage: int) -> tuple[list, list]:
        """(sends, recvs) of `part` at `stage`: lists of (peer, tensor)."""
        raise NotImplementedError

    def between(self, part: int) -> None:
        """After the first stage of `part` arrived, before the second is posted."""

    def collectives(self, part: int) -> list:
        """Asynchronous collectives of `part`: callables that launch one and return its work."""
        raise NotImplementedError

    def post(self, part: int) -> None:
        if self.works[part] is not None:
            return
        if self.widths[part] == 0:  # nothing in this part (a split of 0 or 1): no empty messages
            self.works[part], self.stage[part] = [], self.STAGES
            return
        self._post_stage(part, 0)

    def _post_stage(self, part: int, stage: int) -> None:
        sends, recvs = self.messages(part, stage)
        g, tag = self.group, self.tag + part + 4 * stage
        ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(g, p), g, tag) for p, t in sends]
        ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(g, p), g, tag) for p, t in recvs]
        works = dist.batch_isend_irecv(ops) if ops else []
        self.works[part] = works + ([launch() for launch in self.collectives(part)] if stage == 0 else [])
        self.stage[part] = stage

    def wait(self, part: int) -> None:
        self.post(part)
        start = time.perf_counter()
        while True:
            for work in self.works[part]:
                work.wait()
            if self.stage[part] + 1 >= self.STAGES:
                break
            self.between(part)
            self._post_stage(part, self.stage[part] + 1)
        self.exposed_s += time.perf_counter() - start
        self.works[part], self.stage[part] = [], self.STAGES

    def wait_all(self) -> None:
        self.wait(0)
        self.wait(1)


class _Trans(_TwoParts):
    """Copies of one layer's experts for one placement, in flight (forward)."""

    def __init__(self, layer, placement: Placement, split: float, tag: int) -> None:
        self.layer, self.placement = layer, placement
        self.plan = prefetch_transfers(placement, dist.get_rank(layer.group), layer.node_of)
        weights = layer.experts.weights()
        held_J = np.flatnonzero(placement.holders_EW[:, self.plan.me])
        self.layout = flat_layout(weights, self.plan, layer.experts.expert_ids, held_J)
        width = sum(self.layout.widths)
        super().__init__(layer.group, tag, width, split)
        self.sent_YP = self.layout.flat_sent(list(weights.values()))
        self.recv = [self.sent_YP.new_empty((len(self.plan.received), w)) for w in self.widths]

    def bundle(self, b: int, part: int) -> torch.Tensor:
        """Columns of `part` of bundle b's rows `[len(experts), ·]`: the owner's, or as received."""
        plan = self.plan
        if plan.bundles[b].owner != plan.me:
            return self.recv[part][plan.rows(b)]
        index, layout = self.layout.sent_index, self.layout
        return self.sent_YP[[index[r] for r in layout.rows(plan.bundles[b].experts)]][:, self.columns(part)]

    def messages(self, part: int, stage: int) -> tuple[list, list]:
        plan, me = self.plan, self.plan.me
        edges = plan.stages[stage]  # stage 1: relays forward what stage 0 brought
        sends = [(dst, self.bundle(b, part).contiguous()) for b, src, dst in edges if src == me]
        recvs = [(src, self.recv[part][plan.rows(b)]) for b, src, dst in edges if dst == me]
        return sends, recvs

    def collectives(self, part: int) -> list:
        plan = self.plan
        launches = []
        for b in plan.collective:
            buf = self.bundle(b, part).contiguous()
            src = dist.get_global_rank(self.group, plan.bundles[b].owner)
            launches.append(lambda buf=buf, src=src: dist.broadcast(buf, src=src, group=self.group, async_op=True))
        return launches

    def weights(self, prefetch: BlockPrefetch, index: int) -> dict[str, torch.Tensor]:
        """Wait for both parts and return the held experts' weights, differentiable (`_Prefetched`)."""
        self.wait_all()
        weights = self.layer.experts.weights()
        held = _Prefetched.apply(self, torch.cat(self.recv, dim=1), prefetch, index, *weights.values())
        return dict(zip(weights, held))


class _Prefetched(torch.autograd.Function):
    """forward: the held experts' weights from the owned rows and the prefetched copies; backward:
    the owned rows' gradients now, the copies' gradients handed to Agg (`BlockPrefetch`)."""

    @staticmethod
    def forward(ctx, trans, recv_YP, prefetch, index, *local_params):
        ctx.trans, ctx.prefetch, ctx.index = trans, prefetch, index
        ctx.shapes = [p.shape for p in local_params]
        return held_from_flat(trans.layout, list(local_params), recv_YP)

    @staticmethod
    def backward(ctx, *grad_held):
        grads, grad_YP = split_held_gradients(ctx.trans.layout, ctx.shapes, grad_held)
        ctx.prefetch.start_agg(ctx.index, ctx.trans, grad_YP)
        return (None, None, None, None, *grads)


class _Agg(_TwoParts):
    """Gradient sums of one layer's copies back to their owners, in flight (backward): the trees'
    stages reversed — holders to their relay, which sums (its own rows, then each holder's in edge
    order), then relays and the owner's node-mates to the owner."""

    def __init__(self, trans: _Trans, grad_YP: torch.Tensor, split: float) -> None:
        super().__init__(trans.group, trans.tag + 2, grad_YP.shape[1], split)
        self.trans, self.grad_YP = trans, grad_YP
        plan, me = trans.plan, trans.plan.me
        cols = (self.columns(0), self.columns(1))

        def buffers(edges):
            return [
                [(b, grad_YP.new_empty((len(plan.bundles[b].experts), w))) for b, src, dst in edges if src == me]
                for w in self.widths
            ]

        self.inbox = buffers(plan.stages[1])  # at a relay, from its node's holders
        self.incoming = buffers(plan.stages[0])  # at the owner, from its node-mates and the relays
        self.rows: list[dict[int, torch.Tensor]] = [
            {b: grad_YP[plan.rows(b), c] for b in range(len(plan.bundles)) if plan.bundles[b].owner != me} for c in cols
        ]
        # Per bundle held everywhere: this rank's gradients of it, summed at the owner.
        self.partial = {
            b: [
                grad_YP.new_zeros((len(plan.bundles[b].experts), w))
                if plan.bundles[b].owner == plan.me
                else grad_YP[plan.rows(b), c].clone()
                for w, c in zip(self.widths, cols)
            ]
            for b in plan.collective
        }

    def messages(self, part: int, stage: int) -> tuple[list, list]:
        plan, me = self.trans.plan, self.trans.plan.me
        edges = plan.stages[1 - stage]  # the trees' stages reversed
        boxes = self.inbox if stage == 0 else self.incoming
        sends = [(src, self.rows[part][b].contiguous()) for b, src, dst in edges if dst == me]
        recvs = [(dst, buf) for (b, src, dst), (_, buf) in zip([e for e in edges if e[1] == me], boxes[part])]
        return sends, recvs

    def between(self, part: int) -> None:
        for b, buf in self.inbox[part]:  # a relay adds its node's holders' gradients to its own
            self.rows[part][b] = self.rows[part][b] + buf

    def collectives(self, part: int) -> list:
        launches = []
        for b, bufs in self.partial.items():
            dst = dist.get_global_rank(self.group, self.trans.plan.bundles[b].owner)
            launches.append(
                lambda buf=bufs[part], dst=dst: dist.reduce(
                    buf, dst=dst, op=dist.ReduceOp.SUM, group=self.group, async_op=True
                )
            )
        return launches

    def finish(self) -> None:
        """Wait for both parts and add the received sums into the owners' `.grad` (each owned
        bundle's node-mates and relays in edge order, then its reduce)."""
        self.wait_all()
        plan, layout = self.trans.plan, self.trans.layout
        owned = plan.owned
        if not owned:
            return
        params = list(self.trans.layer.experts.weights().values())
        for p in params:
            if p.grad is None:  # only copies' gradients reached this parameter (no owned tokens)
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        for (b, first), (_, second) in zip(*self.incoming):
            add_flat_rows(grads, layout, layout.rows(plan.bundles[b].experts), torch.cat([first, second], dim=1))
        for b in owned:
            if b in self.partial:
                rows = layout.rows(plan.bundles[b].experts)
                add_flat_rows(grads, layout, rows, torch.cat(self.partial[b], dim=1))


class BlockPrefetch(MoEHook):
    """Algorithm 2 over `layers` (the model's MoE layers in forward order); see the module docstring.

    prefetch = BlockPrefetch([block.ffn for block in model.blocks])
    loss.backward(); prefetch.finish(); optimizer.step()
    """

    once_per_block = True
    """Under a schedule that exchanges in pieces (`pairwise`), the marks sit at the first piece's
    arrival and the last piece's compute (`core.hooks`, "Pieces")."""
    replayable = False  # its copies travel once per forward (full activation checkpointing: refused)

    def __init__(self, layers: Sequence) -> None:
        self.layers = list(layers)
        self.steps = 0
        self.split_forward = np.full(len(self.layers), 0.5)  # EFC_i share of block i's forward compute
        self.split_backward = np.full(len(self.layers), 0.5)  # BNEC_i share of its backward compute
        self.measured = np.zeros((len(self.layers), 4))  # EFC, FNEC, BNEC, BEC per block (seconds)
        # Per layer since the last calibration: waited on its prefetched copies, and their price.
        self.exposed_s = np.zeros(len(self.layers))
        self.predicted_s = np.zeros(len(self.layers))
        self.hidden_share = np.zeros(len(self.layers))
        self._stamps: dict[tuple[int, str], float] = {}
        self._trans: dict[int, _Trans] = {}
        self._agg: dict[int, _Agg] = {}
        self._index = {id(layer): i for i, layer in enumerate(self.layers)}
        for i, layer in enumerate(self.layers):
            if any(isinstance(h, BlockPrefetch) for h in layer.hooks):
                raise ValueError(f"layers[{i}] already has a BlockPrefetch")
            layer.hooks.append(self)
            if i > 0:
                layer.planner.use_prefetch(PrefetchWindow())  # its planner prices copies as hidden (Eq. 8)

    # ---- which layers prefetch -------------------------------------------------------------------
    def _ahead(self, i: int) -> Placement | None:
        """Layer i's next placement if it has copies to prefetch (None: nothing to do ahead)."""
        if not 0 < i < len(self.layers):
            return None
        layer = self.layers[i]
        if layer.group is None or layer.cluster_mismatch or not layer.planner.plans_ahead:
            return None
        placement = layer.planner.next_placement()
        return None if placement is None or placement.is_owners_only() else placement

    def wrap_copies(self, layer, gather):
        """The layer's held weights: those prefetched for its placement, else `gather`'s (sent now)."""
        index = self._index[id(layer)]

        def held(placement: Placement, held_J: np.ndarray) -> dict[str, torch.Tensor]:
            trans = self._trans.pop(index, None)
            if trans is None:
                return gather(placement, held_J)
            if trans.placement != placement:  # the plan changed under it: drain the messages, run sync
                trans.wait_all()
                self.exposed_s[index] += trans.exposed_s
                return gather(placement, held_J)
            weights = trans.weights(self, index)
            self.exposed_s[index] += trans.exposed_s
            return weights

        return held

    @staticmethod
    def _copies_price(layer, placement: Placement) -> float:
        """The cost model's time of one direction of the layer's copies, as sent here."""
        cm = layer.cost_model
        if cm is None or layer.cluster_mismatch:
            return 0.0
        size = ExpertShape(layer.d_model, layer.d_hidden, layer.experts.kind).param_bytes(cm.bytes_per_element)
        return cm.copies_time(size, placement.holders_EW, placement.owner_E, "materialize", tree=False)

    # ---- the four marks of layer i -----------------------------------------------------------------
    def _mark(self, layer, x: torch.Tensor, point: str) -> torch.Tensor:
        i = self._index[id(layer)]
        return Mark.apply(x, lambda: self._forward_point(i, point), lambda: self._backward_point(i, point))

    def before_moe_start(self, layer, x):
        return self._mark(layer, x, "start")

    def after_dispatch(self, layer, x):
        return self._mark(layer, x, "dispatched")

    def before_combine(self, layer, y):
        return self._mark(layer, y, "computed")

    def before_moe_end(self, layer, y):
        return self._mark(layer, y, "end")

    def _forward_point(self, i: int, point: str) -> None:
        self._stamps[("f", point, i)] = time.perf_counter()
        if point == "dispatched":  # SubTrans1_{i+1} ∥ EFC_i
            placement = self._ahead(i + 1)
            if placement is not None and (i + 1) not in self._trans:
                tag = TAG_BASE + 8 * (i + 1)
                self._trans[i + 1] = _Trans(self.layers[i + 1], placement, self.split_forward[i], tag)
                self._trans[i + 1].post(0)
                self.predicted_s[i + 1] += 2 * self._copies_price(self.layers[i + 1], placement)
        elif point == "computed" and (i + 1) in self._trans:
            self._trans[i + 1].wait(0)
        elif point == "end" and (i + 1) in self._trans:  # SubTrans2_{i+1} ∥ FNEC_i
            self._trans[i + 1].post(1)

    def _backward_point(self, i: int, point: str) -> None:
        self._stamps[("b", point, i)] = time.perf_counter()
        agg = self._agg.get(i + 1)
        if point == "start" and i in self._agg:  # layer i's backward is over: SubAgg1_i ∥ BNEC_{i-1}
            self._agg[i].post(0)
        elif point == "end" and agg is not None:
            agg.wait(0)
        elif point == "computed" and agg is not None:  # SubAgg2_{i+1} ∥ BEC_i
            agg.post(1)
        elif point == "dispatched" and agg is not None:
            self._finish_agg(i + 1)

    def _finish_agg(self, index: int) -> None:
        agg = self._agg.pop(index)
        agg.finish()
        self.exposed_s[index] += agg.exposed_s

    def start_agg(self, index: int, trans: _Trans, grad_YP: torch.Tensor) -> None:
        self._agg[index] = _Agg(trans, grad_YP, self.split_backward[index - 1])

    # ---- once per step -----------------------------------------------------------------------------
    def finish(self) -> None:
        """After backward: land every Agg still in flight; after steps 1, 2, 4, 8, ... agree across
        the group what was measured (module docstring): the split points, and for each planner the
        non-MoE time and the share of the windows that hid copies."""
        for index in sorted(self._agg):
            self._finish_agg(index)
        self.steps += 1
        self._measure()
        if self.steps & (self.steps - 1) == 0:  # a power of two: ever rarer, one small all-reduce
            self._calibrate()

    def _measure(self) -> None:
        s = self._stamps

        def span(a, b) -> float:
            return s[a] - s[b] if a in s and b in s else 0.0

        for i in range(len(self.layers) - 1):
            self.measured[i] = [
                span(("f", "computed", i), ("f", "dispatched", i)),  # EFC_i
                span(("f", "start", i + 1), ("f", "end", i)),  # FNEC_i
                span(("b", "end", i), ("b", "start", i + 1)),  # BNEC_i
                span(("b", "dispatched", i), ("b", "computed", i)),  # BEC_i
            ]
        self._stamps.clear()

    def _calibrate(self) -> None:
        values = np.concatenate([self.measured, self.exposed_s[:, None], self.predicted_s[:, None]], axis=1)
        agreed = torch.from_numpy(values)
        # The expert-parallel groups, then their data-parallel replicas (which plan alike).
        found = [layer.group for layer in self.layers] + [layer.replica_group for layer in self.layers]
        groups = {id(group): group for group in found if group is not None}
        for group in groups.values():
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        m, exposed, predicted = agreed[:, :4].numpy(), agreed[:, 4].numpy(), agreed[:, 5].numpy()
        with np.errstate(invalid="ignore", divide="ignore"):
            self.split_forward = np.nan_to_num(m[:, 0] / (m[:, 0] + m[:, 1]), nan=0.5)
            self.split_backward = np.nan_to_num(m[:, 2] / (m[:, 2] + m[:, 3]), nan=0.5)
            measured_share = np.clip(1.0 - exposed / predicted, 0.0, 1.0)
        # Layers whose copies were priced and sent since the last time: what they hid.
        self.hidden_share = np.where(predicted > 0, measured_share, self.hidden_share)
        self.exposed_s[:], self.predicted_s[:] = 0.0, 0.0
        for i, layer in enumerate(self.layers[1:], start=1):  # T_FNEC of Eq. 8, and what hid copies
            layer.planner.use_prefetch(PrefetchWindow(float(m[i - 1, 1]), float(self.hidden_share[i])))
